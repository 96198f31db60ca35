"""The Backend interface every loader implements, and the records it yields."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import queue
import sys
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from modules.errors import BackendUnavailable, NotSupported
from modules.generation.params import GenerationParams

# Parameters the pipeline itself applies, whatever the backend.
PIPELINE_PARAMS = frozenset({"max_new_tokens", "stop", "skip_special_tokens"})


@dataclass
class TopLogprob:
    """One candidate token at a step, with its log probability."""

    token_id: int
    piece: bytes
    logprob: float


@dataclass
class TokenEvent:
    """One generated token. ``piece`` is raw bytes: a character may span several tokens.

    A pure end marker (no token) has ``token_id == -1``.
    """

    token_id: int
    piece: bytes
    logprob: float | None = None
    top_logprobs: list[TopLogprob] | None = None
    finish_reason: str | None = None  # set on the last event: "stop" (EOS), "length", "cancelled", "context"
    speculation: tuple[int, int] | None = None  # on the last event: (draft tokens, confirmed), when drafting ran


@dataclass(eq=False)
class TokenSink:
    """Where a backend delivers an asynchronous consumer's events: ``(tag, event)`` into an asyncio queue.

    Events for sinks in the same event loop are handed over with one wake-up per scheduler step.
    """

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[Any, TokenEvent | BaseException]]
    tag: Any = None


def deliver(batch: list[tuple[TokenSink, TokenEvent | BaseException]]) -> None:
    """Hand events to their sinks, one ``call_soon_threadsafe`` per event loop (safe from any thread)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[TokenSink, TokenEvent | BaseException]]] = {}
    for sink, event in batch:
        by_loop.setdefault(sink.loop, []).append((sink, event))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: its consumers are gone
            loop.call_soon_threadsafe(_dispatch, items)


def pump(events: Iterator[TokenEvent], sink: TokenSink, name: str) -> None:
    """Hand a token stream to ``sink`` from a thread of its own (for backends without a scheduler)."""

    def run() -> None:
        try:
            for event in events:
                deliver([(sink, event)])
        except BaseException as exc:  # the consumer sees the failure as an error item
            deliver([(sink, exc)])

    threading.Thread(target=run, name=name, daemon=True).start()


def drain(
    out: queue.SimpleQueue[TokenEvent | BaseException],
    cancel: threading.Event,
    scheduler: threading.Condition,
    alive: Callable[[], bool] | None = None,
    name: str = "the scheduler",
) -> Iterator[TokenEvent]:
    """A scheduler's events for one request, read from ``out`` until the one with a finish reason (an exception put
    there is raised). However it ends (finished, failed, or the consumer stopped reading) the request is cancelled
    and ``scheduler`` woken, so its slot is freed at the next step. ``alive``: checked while nothing comes."""
    try:
        while True:
            try:
                item = out.get(timeout=0.5)
            except queue.Empty:
                if alive is not None and not alive():
                    raise RuntimeError(f"{name} stopped") from None
                continue
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason:
                return
    finally:
        cancel.set()
        with scheduler:
            scheduler.notify_all()


def package_installed(package: str) -> bool:
    """True when ``import package`` would find it (or it is imported already)."""
    if sys.modules.get(package) is not None:
        return True
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a dotted name whose parent is missing, or a broken package
        return False


def _dispatch(items: list[tuple[TokenSink, TokenEvent | BaseException]]) -> None:
    for sink, event in items:
        sink.queue.put_nowait((sink.tag, event))


class QueuePlace:
    """A stream's place in a backend's bounded queue, given back exactly once.

    The backend counts the place in (or raises QueueFull) under its own lock when the request arrives; the
    stream calls :meth:`release` when it gets the model or ends, and :meth:`guard` makes a stream that is
    dropped before it ever runs (so its ``finally`` never runs) give its place back as well.
    """

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release
        self._lock = threading.Lock()

    def release(self) -> None:
        """Give the place back (once; later calls do nothing)."""
        with self._lock:
            release, self._release = self._release, None
        if release is not None:
            release()

    def guard(self, stream: Iterator[TokenEvent]) -> Iterator[TokenEvent]:
        """Return ``stream``, releasing the place when it is garbage-collected if nothing released it before."""
        weakref.finalize(stream, self.release)
        return stream


@dataclass
class ModelMetadata:
    """What the model file says about itself."""

    name: str = ""
    architecture: str = ""
    context_length: int | None = None  # trained context
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    add_bos_token: bool = True
    sampling: dict[str, Any] = field(default_factory=dict)  # the model's recommended GenerationParams values
    extra: dict[str, Any] = field(default_factory=dict)


class Backend(ABC):
    """A loaded model that can tokenize and generate. One instance per loaded model."""

    loader_name: ClassVar[str] = ""
    # Capability flags; nothing outside a backend checks class names.
    supports_lora: ClassVar[bool] = False
    supports_grammar: ClassVar[bool] = False
    supports_logprobs: ClassVar[bool] = False
    supports_embeddings: ClassVar[bool] = False
    supports_vision: ClassVar[bool] = False
    supports_logits_processors: ClassVar[bool] = False  # Python logits processors from extensions (torch)
    # Settings fields this loader reads (the UI shows only these).
    option_names: ClassVar[tuple[str, ...]] = ()
    # GenerationParams fields this backend honours; a request setting another one away from its default is refused.
    supported_params: ClassVar[frozenset[str]] = frozenset()
    # Python packages the loader imports; the default :meth:`check` refuses a load while one is missing.
    required_packages: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.metadata = ModelMetadata()
        self.path: Path | None = None
        self.max_parallel = 1

    @classmethod
    def check(cls, path: Path, options: dict[str, Any]) -> None:
        """Refuse, in milliseconds and before the current model is unloaded, a load that cannot succeed here.

        Raise BackendUnavailable (this machine cannot run the loader: a package or CUDA is missing) or
        ModelLoadError (this model cannot be loaded: a missing, truncated or corrupt file, a bad option), with a
        message that says what to do. Never load weights. This default checks :attr:`required_packages`;
        backends add checks of their files and hardware (and call this one).
        """
        missing = [name for name in cls.required_packages if not package_installed(name)]
        if missing:
            raise BackendUnavailable(
                f"the {cls.loader_name or cls.__name__} loader needs the Python package"
                f"{'s' if len(missing) > 1 else ''} {', '.join(repr(m) for m in missing)}, which "
                f"{'are' if len(missing) > 1 else 'is'} not installed: pip install {' '.join(missing)}"
            )

    @classmethod
    @abstractmethod
    def load(cls, path: Path, options: dict[str, Any]) -> Backend:
        """Load the model at ``path``; raise ModelLoadError with a clear message on failure."""

    @abstractmethod
    def unload(self) -> None:
        """Free the model's memory; the instance is unusable afterwards."""

    @abstractmethod
    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Tokenize; ``add_special`` adds BOS where the model wants one."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Detokenize."""

    @abstractmethod
    def token_piece(self, token_id: int) -> bytes:
        """The raw bytes of one token."""

    @property
    @abstractmethod
    def context_length(self) -> int:
        """Tokens one sequence can hold (prompt plus reply)."""

    @abstractmethod
    def generate(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        cancel: threading.Event,
        extra: dict[str, Any] | None = None,
    ) -> Iterator[TokenEvent]:
        """Stream tokens until EOS, ``max_new_tokens``, the context end, or ``cancel`` is set.

        The last event carries ``finish_reason``. Raises QueueFull (or a refusal) before streaming.
        ``extra`` may hold ``prompt_text`` (the prompt as text), ``model_inputs`` (from encode_multimodal) and
        ``logits_processors`` (the extensions' processors, for a backend that ``supports_logits_processors``).
        """

    def encode_multimodal(self, prompt: str, images: list[Any]) -> tuple[list[int], dict[str, Any]]:
        """Token ids of a prompt with images, and the model inputs the images become (vision backends)."""
        raise NotSupported(f"the {self.loader_name} backend cannot see images")

    def submit(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        cancel: threading.Event,
        sink: TokenSink,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Start a generation whose events go to ``sink`` (for asyncio consumers).

        Raises like :meth:`generate` before anything runs. This default runs :meth:`generate` in a thread;
        backends with a scheduler deliver from it directly.
        """
        pump(self.generate(prompt_ids, params, cancel, extra), sink, f"{self.loader_name}-stream")

    def embed(self, texts: list[str]) -> list[list[float]]:
        """One embedding vector per text."""
        raise NotSupported(f"the {self.loader_name} backend cannot compute embeddings")

    def load_lora(self, path: Path, scale: float = 1.0) -> None:
        """Apply a LoRA adapter."""
        raise NotSupported(f"the {self.loader_name} backend cannot load LoRA adapters")

    def unload_lora(self, path: Path | None = None) -> None:
        """Remove one adapter, or all of them."""
        raise NotSupported(f"the {self.loader_name} backend cannot load LoRA adapters")

    def set_loras(self, adapters: list[tuple[Path, float]]) -> None:
        """Replace the applied adapters with ``adapters`` (path, scale); an empty list removes them all.

        This default unloads then loads one by one; backends that can refuse or apply the whole change at once
        (so a generation never runs with half of it) override it.
        """
        self.unload_lora(None)
        for path, scale in adapters:
            self.load_lora(path, scale)

    def score(self, prompt_ids: list[int], top: int = 0) -> list[tuple[float | None, list[tuple[int, float]]]]:
        """For each prompt token, its log probability given the tokens before it and the ``top`` alternatives.

        The first token has no context: ``(None, [])``.
        """
        raise NotSupported(f"the {self.loader_name} backend cannot score prompts")

    def next_token_logprobs(self, prompt_ids: list[int], top: int) -> list[tuple[int, float]]:
        """The ``top`` most likely next tokens after the prompt, with log probabilities (raw model output)."""
        raise NotSupported(f"the {self.loader_name} backend cannot return logits")

    def fim_tokens(self) -> tuple[int, int, int] | None:
        """(prefix, suffix, middle) token ids for fill-in-the-middle, or None when the model has none."""
        return None

    def served_models(self) -> list[str]:
        """Other model names this backend answers for (a remote engine's list); empty for local models."""
        return []

    def stats(self) -> dict[str, Any]:
        """Scheduler statistics (busy slots, queue depth, cache hits); empty when not applicable."""
        return {}

    def unsupported_params(self, params: GenerationParams) -> list[str]:
        """Fields set away from their default that this backend would ignore."""
        handled = self.supported_params | PIPELINE_PARAMS
        return [name for name in params.non_default() if name not in handled]
