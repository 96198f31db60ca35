"""Typed exceptions used inside textgen; the API maps them to OpenAI error objects, the UI to messages."""

from __future__ import annotations


class TextgenError(Exception):
    """Base class: every error a user may see, with a message that says what to do."""


class InvalidRequest(TextgenError):
    """A request or parameter value is wrong; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ModelNotLoaded(TextgenError):
    """No model is loaded (or one is still loading)."""

    def __init__(self, message: str = "No model is loaded. Load one in the Model tab or with --model.") -> None:
        super().__init__(message)


class ModelNotFound(TextgenError):
    """The named model is not in the models folder."""


class ModelLoadError(TextgenError):
    """A model exists but could not be loaded (corrupt, unsupported, out of memory)."""


class BackendUnavailable(TextgenError):
    """The chosen loader cannot run here (package missing, no CUDA)."""


class ContextOverflow(InvalidRequest):
    """The prompt does not fit in the model's context."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        super().__init__(
            f"This model's context holds {limit} tokens; the prompt has {prompt_tokens} tokens "
            "and leaves no room for a reply. Shorten the prompt or raise --n-ctx.",
            param="messages",
            code="context_length_exceeded",
        )
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class QueueFull(TextgenError):
    """Every slot is busy and the wait queue is full; try again later."""

    def __init__(self, retry_after: int = 1) -> None:
        super().__init__("The server is busy: all generation slots and the wait queue are full. Retry shortly.")
        self.retry_after = retry_after


class EngineUnavailable(TextgenError):
    """The engine behind the loaded model is not serving now (it died, or is being started again); a 503."""


class NotSupported(TextgenError):
    """The loaded backend cannot do what was asked (e.g. embeddings, grammar, LoRA)."""


class ExtensionFailed(TextgenError):
    """An extension raised while producing a reply; it has been switched off."""
