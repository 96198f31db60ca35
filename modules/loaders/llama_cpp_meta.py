"""What a loaded GGUF model says about itself, as the backend seam's :class:`ModelMetadata`."""

from __future__ import annotations

from pathlib import Path

from llama_cpp._internals import LlamaModel

from modules.loaders.base import ModelMetadata


def file_type(description: str) -> str | None:
    """The weights' type as llama.cpp names it ("Q4_1", "Q4_K - Medium", "BF16") from its model description
    ("llama 256M Q4_1": architecture, size, then the file type)."""
    parts = description.split(" ", 2)
    return parts[2] if len(parts) == 3 else None


def read_metadata(model: LlamaModel, path: Path, eog: list[int]) -> ModelMetadata:
    """Name, architecture, trained context, chat template, special tokens and size of a loaded model;
    ``eog`` are its end-of-generation token ids."""
    raw = model.metadata()
    n_vocab = model.n_vocab()
    bos, eos = model.token_bos(), model.token_eos()

    def text(token: int) -> str:
        return model.token_get_text(token) if 0 <= token < n_vocab else ""

    return ModelMetadata(
        name=raw.get("general.name", path.stem),
        architecture=raw.get("general.architecture", ""),
        context_length=model.n_ctx_train(),
        chat_template=raw.get("tokenizer.chat_template"),
        bos_token=text(bos),
        eos_token=text(eos),
        bos_token_id=bos if bos >= 0 else None,
        eos_token_ids=list(eog),
        add_bos_token=bool(model.add_bos_token()),
        extra={
            "description": model.desc(),
            "quantization": file_type(model.desc()),
            "parameters": model.n_params(),
            "size": model.size(),
            "n_vocab": n_vocab,
        },
    )
