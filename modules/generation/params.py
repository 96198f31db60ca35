"""GenerationParams: every sampler and generation limit, with defaults, ranges and validation.

The API request, the UI parameters tab and presets all convert to this one dataclass. Adding a sampler
means adding one field here (with its metadata) and one processor in each backend that supports it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import random
from dataclasses import dataclass, field
from typing import Any

from modules.errors import InvalidRequest


def _f(default: Any, doc: str, group: str, ge: float | None = None, le: float | None = None, **kw: Any) -> Any:
    meta = {"doc": doc, "group": group, "ge": ge, "le": le}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass
class GenerationParams:
    """How to sample one reply. Defaults leave the model's distribution untouched."""

    # --- limits ---
    max_new_tokens: int = _f(512, "Most tokens to generate.", "limits", ge=1)
    stop: list[str] = _f([], "Strings that end the reply; they are not included in it.", "limits")
    ban_eos: bool = _f(False, "Never end on the end-of-sequence token.", "limits")
    min_tokens: int = _f(0, "Do not end before this many new tokens (0: off).", "limits", ge=0)
    skip_special_tokens: bool = _f(True, "Leave special tokens out of the text.", "limits")
    seed: int = _f(-1, "Random seed; -1 picks one. The same seed and request give the same output.", "limits")
    # --- temperature ---
    temperature: float = _f(
        1.0, "Randomness; 0 always takes the most likely token (greedy).", "temperature", ge=0, le=5
    )
    dynatemp_range: float = _f(
        0.0, "Dynamic temperature: vary temperature by up to this much with the entropy (0: off).", "temperature", ge=0
    )
    dynatemp_exponent: float = _f(1.0, "Dynamic temperature exponent.", "temperature", ge=0)
    temperature_last: bool = _f(
        False, "Apply temperature after the truncation samplers instead of before.", "temperature"
    )
    # --- truncation ---
    top_k: int = _f(0, "Keep the k most likely tokens (0: off).", "truncation", ge=0)
    top_p: float = _f(
        1.0, "Keep the smallest set of tokens whose probabilities add up to p (1: off).", "truncation", ge=0, le=1
    )
    min_p: float = _f(0.0, "Drop tokens less likely than min_p times the top token (0: off).", "truncation", ge=0, le=1)
    typical_p: float = _f(1.0, "Locally typical sampling (1: off).", "truncation", ge=0, le=1)
    top_a: float = _f(
        0.0, "Drop tokens below top_a times the square of the top probability (0: off).", "truncation", ge=0
    )
    tfs: float = _f(1.0, "Tail-free sampling (1: off).", "truncation", ge=0, le=1)
    epsilon_cutoff: float = _f(
        0.0, "Drop tokens below this probability, in units of 1e-4 (0: off).", "truncation", ge=0, le=9
    )
    eta_cutoff: float = _f(0.0, "Eta sampling cutoff, in units of 1e-4 (0: off).", "truncation", ge=0, le=20)
    xtc_threshold: float = _f(
        0.1,
        "XTC: tokens above this probability may be excluded. Above 0.5 at most one token can pass it, so "
        "llama.cpp switches XTC off there (the torch backends then never exclude anything either).",
        "truncation",
        ge=0,
        le=1,
    )
    xtc_probability: float = _f(
        0.0, "XTC: chance of excluding the top choices at a step (0: off).", "truncation", ge=0, le=1
    )
    # --- penalties ---
    repetition_penalty: float = _f(
        1.0, "Divide the logits of tokens already seen by this (1: off).", "penalties", ge=0.01
    )
    repetition_penalty_range: int = _f(
        1024, "How many of the last tokens the penalties look at (0: the whole context).", "penalties", ge=0
    )
    presence_penalty: float = _f(0.0, "Subtract this from the logits of tokens already seen.", "penalties", ge=-2, le=2)
    frequency_penalty: float = _f(0.0, "Subtract this times each token's count so far.", "penalties", ge=-2, le=2)
    no_repeat_ngram_size: int = _f(0, "Never repeat an n-gram of this size (0: off).", "penalties", ge=0)
    dry_multiplier: float = _f(0.0, "DRY: strength of the penalty on repeated sequences (0: off).", "penalties", ge=0)
    dry_base: float = _f(1.75, "DRY: growth of the penalty with the repeated length.", "penalties", ge=1)
    dry_allowed_length: int = _f(2, "DRY: repeats up to this length are free.", "penalties", ge=1)
    dry_sequence_breakers: list[str] = _f(
        ["\n", ":", '"', "*"], "DRY: strings that break a repeated sequence.", "penalties"
    )
    # --- mirostat ---
    mirostat_mode: int = _f(
        0, "Mirostat: 0 off, 1 v1, 2 v2 (replaces the truncation samplers).", "mirostat", ge=0, le=2
    )
    mirostat_tau: float = _f(5.0, "Mirostat target surprise.", "mirostat", ge=0)
    mirostat_eta: float = _f(0.1, "Mirostat learning rate.", "mirostat", ge=0)
    # --- constraints and output ---
    logit_bias: dict[int, float] = _f({}, "Add a bias to token ids' logits (-100 bans, +100 forces).", "constraints")
    grammar: str = _f("", "GBNF grammar the output must follow.", "constraints")
    json_schema: dict[str, Any] | None = _f(None, "JSON schema the output must validate against.", "constraints")
    regex: str = _f("", "Regular expression the output must match (torch backends).", "constraints")
    logprobs: bool = _f(False, "Return the log probability of each generated token.", "output")
    top_logprobs: int = _f(0, "Also return this many most likely alternatives per token.", "output", ge=0, le=20)

    # ---- helpers ----
    @classmethod
    def field_names(cls) -> list[str]:
        """Names of every parameter, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def field_info(cls) -> dict[str, dataclasses.Field[Any]]:
        """The dataclass fields by name (their metadata holds doc, group, ge, le)."""
        return {f.name: f for f in dataclasses.fields(cls)}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every field's default value (a fresh copy)."""
        return copy.deepcopy(_default_values())

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, strict: bool = True) -> GenerationParams:
        """Build and validate; unknown keys raise InvalidRequest when ``strict``."""
        known = cls.field_info()
        unknown = [k for k in values if k not in known]
        if unknown and strict:
            raise InvalidRequest(f"unknown generation parameter {unknown[0]!r}", param=unknown[0])
        params = cls(**{k: v for k, v in values.items() if k in known})
        params.validate()
        return params

    def replace(self, **changes: Any) -> GenerationParams:
        """A validated copy with some fields changed."""
        new = dataclasses.replace(self, **changes)
        new.validate()
        return new

    def non_default(self) -> dict[str, Any]:
        """Only the fields whose value differs from the default."""
        defaults = _default_values()
        return {k: v for k, v in dataclasses.asdict(self).items() if v != defaults[k]}

    def validate(self) -> None:
        """Coerce types and check ranges; raise InvalidRequest naming the field."""
        for name, f in self.field_info().items():
            value = getattr(self, name)
            value = _coerce(name, value, _default_values()[name])
            ge, le = f.metadata.get("ge"), f.metadata.get("le")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if ge is not None and value < ge:
                    raise InvalidRequest(f"{name} must be >= {ge}, got {value}", param=name)
                if le is not None and value > le:
                    raise InvalidRequest(f"{name} must be <= {le}, got {value}", param=name)
            object.__setattr__(self, name, value)
        if self.seed < -1:
            raise InvalidRequest("seed must be -1 (random) or a non-negative integer", param="seed")

    def resolved_seed(self) -> int:
        """The seed to use: the given one, or a fresh random one for -1."""
        return self.seed if self.seed >= 0 else random.randrange(2**31)

    @property
    def greedy(self) -> bool:
        """True when sampling is deterministic (temperature 0)."""
        return self.temperature <= 0


@functools.cache
def _default_values() -> dict[str, Any]:
    return dataclasses.asdict(GenerationParams())


def _coerce(name: str, value: Any, default: Any) -> Any:
    try:
        if isinstance(default, bool):
            if isinstance(value, str):
                return value.strip().lower() in ("1", "true", "yes", "on")
            return bool(value)
        if isinstance(default, int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("not an integer")
            return int(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise ValueError("not a number")
            return float(value)
        if isinstance(default, str):
            if not isinstance(value, str):
                raise ValueError("not a string")
            return value
        if name == "stop":
            if value is None:
                return []
            if isinstance(value, str):
                return [value]
            if not all(isinstance(s, str) for s in value):
                raise ValueError("not a list of strings")
            return [s for s in value if s]
        if name == "dry_sequence_breakers":
            if isinstance(value, str):
                return [value]
            return [str(s) for s in value]
        if name == "logit_bias":
            if value is None:
                return {}
            return {int(k): float(v) for k, v in dict(value).items()}
        if name == "json_schema":
            if value is not None and not isinstance(value, dict):
                raise ValueError("not a JSON object")
            return value
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"{name}: invalid value {value!r} ({exc})", param=name) from exc
    return value
