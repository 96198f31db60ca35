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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from modules import jobs


class Workbench:
    """A loaded model and the lifecycle steps around it."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        models_dir: str | Path | None = None,
        loras_dir: str | Path | None = None,
        user_data_dir: str | Path | None = None,
        options: dict[str, Any] | None = None,
        progress: bool = False,
    ) -> None:
        """Load ``model``: a path (file or HF folder), a name in the models folder, or a Hub ``ORG/NAME``; ``None``
        takes the model already loaded, as it is.

        ``options`` are load settings (``loader``, ``n_ctx``, ``load_in_4bit`` ...) that win over the smart config.

        Settings: where nothing has set the hub up yet (a plain script), it is set up from user_data/settings.yaml,
        the environment and the folders given here (a model path's folder is the models folder). Where something
        has (a running textgen, a CLI, a script that called ``shared.init``), its settings are kept as they are: a
        folder given here that differs from them is refused, and a model path must lie in its models folder.
        Loading replaces the loaded model, as the Model tab's Load does.
        """
        from modules import models, shared

        self.progress = progress
        self.requested = dict(options or {})
        if not shared.initialized:
            model = self._init_hub(model, models_dir, loras_dir, user_data_dir)
        else:
            self._check_folders(models_dir=models_dir, lora_dir=loras_dir, user_data_dir=user_data_dir)
        if model is None:
            if shared.model is None or shared.model_name is None:
                from modules.errors import ModelNotLoaded

                raise ModelNotLoaded('No model is loaded: name one, Workbench("path-or-repo")')
            self.name, self.backend = shared.model_name, shared.model
            self.plan: dict[str, Any] = {"source": "the model was already loaded"}
        else:
            name = self._model_name(model)
            if not (shared.models_dir() / name).exists():
                name = self._download(name)
            self.name = name
            self.plan = self._smart_plan(shared.models_dir() / name)
            overrides = {**(self.plan.get("options") or {}), **self.requested}
            self.backend = models.load_model(name, overrides or None)
        loaded = getattr(self.backend, "path", None)
        self.path = Path(loaded) if loaded else shared.models_dir() / self.name
        self.measured = self._measured(self.name)
        self.history: list[dict[str, Any]] = []
        self.last_lora: Path | None = None
        self.last_merge: Path | None = None
        self.last_export: Path | None = None

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _init_hub(
        model: str | Path | None, models_dir: str | Path | None, loras_dir: str | Path | None,
        user_data_dir: str | Path | None,
    ) -> str | Path | None:  # fmt: skip
        """Set the hub up as a script's: settings.yaml, the environment, these folders; returns the model's name."""
        from modules import shared
        from modules.settings import load_settings

        if model is not None:
            path = Path(model).expanduser()
            if models_dir is None and path.exists():
                models_dir, model = path.resolve().parent, path.name
        flags: list[str] = []
        for flag, value in (("--model-dir", models_dir), ("--lora-dir", loras_dir), ("--user-data-dir", user_data_dir)):
            if value is not None:
                flags += [flag, str(value)]
        shared.init(load_settings(flags, env=dict(os.environ)))
        return model

    @staticmethod
    def _check_folders(**folders: str | Path | None) -> None:
        """Refuse a folder that differs from the settings the process has (they are not ours to change)."""
        from modules import shared
        from modules.errors import InvalidRequest
        from modules.paths import resolve

        for key, value in folders.items():
            if value is None:
                continue
            have = resolve(getattr(shared.settings, key))
            if os.path.abspath(resolve(Path(value).expanduser())) != os.path.abspath(have):
                raise InvalidRequest(
                    f"this process already has its settings ({key} {have}); a Workbench uses them as they are: "
                    f"leave {key} out, or run the script in a process of its own",
                    key,
                )

    @staticmethod
    def _model_name(model: str | Path) -> str:
        """The name in the models folder for a name, a Hub ``ORG/NAME`` or a path (one in the models folder)."""
        from modules import shared
        from modules.errors import InvalidRequest

        path = Path(model).expanduser()
        if not path.exists() or (not path.is_absolute() and (shared.models_dir() / path).exists()):
            return str(model)
        root = shared.models_dir()
        for inside, folder in (
            (Path(os.path.abspath(path)), Path(os.path.abspath(root))),
            (path.resolve(), root.resolve()),
        ):
            if inside.is_relative_to(folder) and inside != folder:
                return inside.relative_to(folder).as_posix()
        raise InvalidRequest(
            f"{path} is outside the models folder ({root}) of this process, whose settings a Workbench keeps: "
            "put the model (or a link to it) in that folder, or run the script in a process of its own",
            "model",
        )

    def _download(self, name: str) -> str:
        """``ORG/NAME`` not in the models folder: the download job (its bar closed however it ends)."""
        from modules.lifecycle import load_hooks

        if not self.progress:
            return load_hooks.ensure_local(name)
        report, close = jobs.tqdm_reporter(f"download {name}", unit="B", unit_scale=True)
        try:  # in the caller's thread: Ctrl+C stops waiting at once (the shared download job goes on)
            return load_hooks.ensure_local(name, report)
        finally:
            close()

    @staticmethod
    def _measured(name: str) -> Any:
        """The memory the load of ``name`` measurably took (the load path measures it), if that was the last load."""
        try:
            from modules.lifecycle import memory
        except ImportError:
            return None
        last = memory.last_load
        return last if last is not None and last.model == name else None

    def _run(self, title: str, fn: Any, args: Any, unit: str = "it") -> Any:
        """``fn(args, report, cancel)`` as the CLIs run it: a tqdm bar when ``progress`` (closed however the step
        ends), Ctrl+C stopping the step at its next check (then KeyboardInterrupt)."""
        return jobs.run_foreground(title, lambda report, cancel: fn(args, report, cancel), unit=unit,
                                   progress=self.progress)  # fmt: skip

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

        args = TrainingArgs(model=str(self._hf_folder()), dataset=dataset, name=name, **fields)
        with datasets.allow_paths():  # this call may name any file its user can read; the server's requests may not
            summary: dict[str, Any] = self._run(f"finetune {name}", train, args, unit="step")
        from modules import shared

        self.last_lora = shared.loras_dir() / name
        return summary

    def merge(self, lora: str | Path | None = None, output: str | Path | None = None, overwrite: bool = False) -> Path:
        """Merge ``lora`` (default: the last fine-tune) into this model in 16 bit; returns the merged folder (an
        existing one is refused unless ``overwrite``)."""
        from modules import shared
        from modules.lifecycle.merge import MergeArgs, merge

        adapter = Path(lora) if lora is not None else self.last_lora
        if adapter is None:
            from modules.errors import InvalidRequest

            raise InvalidRequest("no adapter: pass lora= or run finetune() first", "lora")
        if not adapter.is_absolute() and not adapter.exists():
            adapter = shared.loras_dir() / adapter
        out = Path(output) if output else shared.models_dir() / f"{Path(self.path).name}-{adapter.name}-merged"
        args = MergeArgs(self.path, adapter, out, overwrite=overwrite)
        self.last_merge = self._run(f"merge {adapter.name}", merge, args)
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
        """What is loaded and how, as the backend says (not as asked), and what the steps produced.

        ``loader``, ``context_length``, ``parallel``, ``dtype``, ``quantization``, ``device`` and ``stats`` come from
        the loaded backend; ``loras`` are the adapters applied to it; ``memory`` is what its load measurably took;
        ``requested`` is this Workbench's ``options`` (what was asked), ``plan`` the smart config's advice.
        """
        from modules import shared

        backend = self.backend
        extra = backend.metadata.extra
        loaded = shared.model is backend
        measured = self.measured
        memory = None
        if measured is not None:
            mib = 2**20
            memory = {
                "ram_increase_mib": round(measured.rss_increase / mib, 1),
                "gpu_increase_mib": round(measured.gpu_increase / mib, 1),
                "estimated_ram_mib": round(measured.estimate.ram / mib, 1) if measured.estimate else None,
                "text": measured.text(),
            }
        return {
            "model": self.name,
            "path": str(self.path),
            "loaded": loaded,  # False once another model replaced it (the Model tab, another Workbench)
            "loader": backend.loader_name,
            "backend": type(backend).__name__,
            "architecture": backend.metadata.architecture,
            "context_length": backend.context_length,
            "trained_context_length": backend.metadata.context_length,
            "parallel": backend.max_parallel,
            "dtype": extra.get("dtype"),
            "quantization": extra.get("quantization") or extra.get("quantized"),
            "device": extra.get("device"),
            "description": extra.get("description"),
            "loras": list(shared.loras) if loaded else [],
            "stats": backend.stats() if loaded else {},
            "memory": memory,
            "requested": dict(self.requested),
            "plan": self.plan,
            "last_lora": str(self.last_lora) if self.last_lora else None,
            "last_merge": str(self.last_merge) if self.last_merge else None,
            "last_export": str(self.last_export) if self.last_export else None,
            "fidelity": getattr(getattr(self, "last_export_result", None), "fidelity", None),
        }

    def close(self) -> None:
        """Unload this Workbench's model, if it is still the loaded one (another model loaded since stays)."""
        from modules import models, shared

        with shared.model_lock:
            if shared.model is self.backend:
                models.unload_model()
