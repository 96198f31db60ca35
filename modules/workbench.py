"""One object for scripts: ``Workbench("path-or-repo")`` loads a model, then chats, fine-tunes, merges, exports,
evaluates, pushes and reports, each by calling the same function the UI and the CLIs call. It holds no logic of
its own beyond remembering what the last step produced (the adapter, the merged folder, the exported file).

    wb = Workbench("models/SmolLM2-135M-Instruct")
    print(wb.chat("What is the capital of France?", max_new_tokens=16))
    gguf = wb.export("gguf", quant="Q4_K_M")
    print(wb.report())

See docs/python-api.md for a complete script.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from modules import jobs


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class Workbench:
    """A loaded model and the lifecycle steps around it."""

    def __init__(
        self,
        model: str | Path,
        *,
        models_dir: str | Path | None = None,
        loras_dir: str | Path | None = None,
        user_data_dir: str | Path | None = None,
        options: dict[str, Any] | None = None,
        progress: bool = False,
    ) -> None:
        """Load ``model``: a path (file or HF folder), a name in the models folder, or a Hub ``ORG/NAME``.

        ``options`` are load settings (``loader``, ``n_ctx``, ``load_in_4bit`` ...) that win over the smart config.
        """
        from modules import models, shared
        from modules.settings import load_settings

        self.progress = progress
        path = Path(model).expanduser()
        if models_dir is None and path.exists():
            models_dir, name = path.resolve().parent, path.name
        else:
            name = str(model)
        flags: list[str] = []
        for flag, value in (("--model-dir", models_dir), ("--lora-dir", loras_dir), ("--user-data-dir", user_data_dir)):
            if value is not None:
                flags += [flag, str(value)]
        shared.init(load_settings(flags, env=dict(os.environ)))
        if not (shared.models_dir() / name).exists():
            from modules.lifecycle import load_hooks

            name = load_hooks.ensure_local(name, self._reporter("download"))
        self.name = name
        self.plan = self._smart_plan(shared.models_dir() / name)
        overrides = {**(self.plan.get("options") or {}), **(options or {})}
        self.backend = models.load_model(name, overrides or None)
        loaded = getattr(self.backend, "path", None)
        self.path = Path(loaded) if loaded else shared.models_dir() / name
        self.history: list[dict[str, Any]] = []
        self.last_lora: Path | None = None
        self.last_merge: Path | None = None
        self.last_export: Path | None = None

    # ------------------------------------------------------------------ helpers
    def _reporter(self, title: str) -> jobs.Reporter:
        if not self.progress:
            return _noop
        report, _close = jobs.tqdm_reporter(title)
        return report

    def _run(self, title: str, fn: Any, args: Any) -> Any:
        return fn(args, self._reporter(title), threading.Event())

    @staticmethod
    def _smart_plan(path: Path) -> dict[str, Any]:
        """The smart config's load options and reasons (empty when the planner is not installed)."""
        try:
            from modules.lifecycle import analyzer, hardware, smart_config
        except ImportError:
            return {"source": "defaults (the smart config is not available)"}
        plan = smart_config.make_plan(analyzer.analyze(str(path)), hardware.detect()).to_dict()
        return {"source": "smart config", **plan}

    def _hf_folder(self) -> Path:
        folder = self.last_merge or self.path
        if not (Path(folder) / "config.json").is_file():
            from modules.errors import InvalidRequest

            raise InvalidRequest(f"{Path(folder).name} is not a Hugging Face folder; this step needs one", "model")
        return Path(folder)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt: str, stream: bool = False, **params: Any) -> str | Iterator[str]:
        """A raw completion (the Notebook tab's path); ``stream=True`` yields pieces of text as they come."""
        from modules.generation import pipeline
        from modules.generation.params import GenerationParams

        generation = GenerationParams.from_dict(params)
        if stream:
            return (delta.text for delta in pipeline.generate_reply(prompt, generation, is_chat=False))
        return pipeline.generate_text(prompt, generation, is_chat=False)[0]

    def chat(self, message: str, stream: bool = False, system: str | None = None, **params: Any) -> str | Iterator[str]:
        """One chat turn in instruct mode with the model's template (the Chat tab's path); the history is kept in
        ``self.history``. ``stream=True`` yields the new text as it comes."""
        from modules.chat import engine
        from modules.generation.params import GenerationParams

        generation = GenerationParams.from_dict(params)
        updates = engine.send(self.history, message, generation, system=system)

        def pieces() -> Iterator[str]:
            seen = ""
            for update in updates:
                self.history = update.history
                last = update.history[-1]
                if last["role"] == "assistant":
                    text = str(last["content"])
                    yield text[len(seen) :]
                    seen = text

        return pieces() if stream else "".join(pieces())

    # ------------------------------------------------------------------ lifecycle
    def finetune(self, dataset: str, name: str, **fields: Any) -> dict[str, Any]:
        """Train a LoRA on this model (the Training tab's ``train``); fields are TrainingArgs'."""
        from modules.training import datasets
        from modules.training.args import TrainingArgs
        from modules.training.run import train

        datasets.ALLOW_PATHS = True  # a script may name any file its user can read

        args = TrainingArgs(model=str(self._hf_folder()), dataset=dataset, name=name, **fields)
        summary: dict[str, Any] = self._run(f"finetune {name}", train, args)
        from modules import shared

        self.last_lora = shared.loras_dir() / name
        return summary

    def merge(self, lora: str | Path | None = None, output: str | Path | None = None) -> Path:
        """Merge ``lora`` (default: the last fine-tune) into this model in 16 bit; returns the merged folder."""
        from modules import shared
        from modules.lifecycle.merge import MergeArgs, merge

        adapter = Path(lora) if lora is not None else self.last_lora
        if adapter is None:
            from modules.errors import InvalidRequest

            raise InvalidRequest("no adapter: pass lora= or run finetune() first", "lora")
        if not adapter.is_absolute() and not adapter.exists():
            adapter = shared.loras_dir() / adapter
        out = Path(output) if output else shared.models_dir() / f"{Path(self.path).name}-{adapter.name}-merged"
        self.last_merge = self._run(f"merge {adapter.name}", merge, MergeArgs(self.path, adapter, out))
        return self.last_merge

    def export(self, format: str = "gguf", quant: str = "Q4_K_M", output: str | Path | None = None,
               **options: Any) -> Path:  # fmt: skip
        """Export the merged model (or this one) with the fidelity check; returns the file or folder written.

        A GGUF goes into its own folder (``NAME-gguf/NAME.QUANT.gguf``), ready for :meth:`push`."""
        from modules.lifecycle.export import ExportArgs, export

        gguf_in = format == "gguf" and self.last_merge is None and Path(self.path).suffix == ".gguf"
        source = Path(self.path) if gguf_in else self._hf_folder()  # a loaded GGUF is requantized
        if output is None and format == "gguf":
            stem = source.stem if source.is_file() else source.name
            output = source.parent / f"{stem}-gguf" / f"{stem}.{quant.upper()}.gguf"
        args = ExportArgs(Path(source), format, quant, Path(output) if output else None, **options)
        result = self._run(f"export {quant}", export, args)
        self.last_export = Path(result.output)
        self.last_export_result = result
        return self.last_export

    def evaluate(self, text: str | None = None) -> dict[str, Any]:
        """Perplexity of the exported GGUF (or this model's, if it is one) on a text, default the shipped one."""
        from modules.lifecycle import fidelity

        target = self.last_export if self.last_export and self.last_export.suffix == ".gguf" else Path(self.path)
        if target.suffix != ".gguf":
            from modules.errors import InvalidRequest

            raise InvalidRequest("evaluate() measures a GGUF: export one first", "model")
        backend = fidelity.load_gguf(target)
        try:
            source = text if text is not None else fidelity.FIDELITY_TEXT.read_text(encoding="utf-8")
            ids = list(backend.encode(source, add_special=True))[: fidelity.TEXT_TOKENS]
            rows = fidelity.logprob_rows(backend, ids)
        finally:
            backend.unload()
        return {"model": str(target), "tokens": len(ids), "perplexity": fidelity.perplexity(rows, ids)}

    def push(self, repo: str, private: bool | None = True, folder: str | Path | None = None, **options: Any) -> dict:
        """Upload the last export (a GGUF file alone, or a folder's files) or ``folder`` with a model card; ``private``
        is honoured."""
        from modules.lifecycle.publish import PushArgs, push

        target = Path(folder) if folder else (self.last_export or self.last_merge)
        if target is None:
            from modules.errors import InvalidRequest

            raise InvalidRequest("nothing to push: export() or merge() first, or pass folder=", "folder")
        result: dict[str, Any] = self._run(f"push {repo}", push, PushArgs(target, repo, private, **options))
        return result

    def report(self) -> dict[str, Any]:
        """What is loaded and how, as the backend says (not as asked), and what the steps produced."""
        from modules import shared

        backend = self.backend
        return {
            "model": self.name,
            "path": str(self.path),
            "loader": shared.model_options.get("loader"),
            "backend": type(backend).__name__,
            "options": {k: v for k, v in shared.model_options.items() if k != "loader"},
            "context_length": backend.context_length,
            "parallel": backend.max_parallel,
            "loras": list(shared.loras),
            "plan": self.plan,
            "last_lora": str(self.last_lora) if self.last_lora else None,
            "last_merge": str(self.last_merge) if self.last_merge else None,
            "last_export": str(self.last_export) if self.last_export else None,
            "fidelity": getattr(getattr(self, "last_export_result", None), "fidelity", None),
        }

    def close(self) -> None:
        """Unload the model."""
        from modules import models

        models.unload_model()
