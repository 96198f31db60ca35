"""The garbage collection between two models (``load_hooks.settle``): an unloaded model's cyclic garbage is freed,
what was alive at a settle is left out of later collections, and an unload takes it back and frees what died since
(at most once a minute)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from modules import models, shared
from modules.lifecycle import load_hooks
from tests.conftest import DEFAULT_MODEL


class Cyclic:
    """Something only the garbage collector frees, as a model's objects often are."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    """Python's own collections off, so that only the settles free anything; everything taken back after."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def test_an_unloaded_models_cycles_are_freed_and_what_lived_before_is_frozen(no_automatic_gc: None) -> None:
    long_lived = Cyclic()
    load_hooks.settle(unloaded=False)  # a load with no model before
    assert gc.get_freeze_count() > 0
    model = weakref.ref(Cyclic())  # made after the settle, as a model is: garbage at once
    load_hooks.settle(unloaded=False)
    assert model() is None  # walked, freed
    alive_then = weakref.ref(long_lived)
    del long_lived  # garbage now, but frozen at the settle: a collection that does not take it back leaves it
    gc.collect()
    assert alive_then() is not None
    load_hooks.settle(unloaded=False)
    assert alive_then() is not None


def test_an_unload_takes_back_what_was_frozen_at_most_once_a_minute(
    no_automatic_gc: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = Cyclic()
    load_hooks.settle(unloaded=False)
    monkeypatch.setattr(load_hooks, "_last_full", -load_hooks.FULL_EVERY)  # the last full walk was long ago
    freed_first = weakref.ref(first)
    del first
    load_hooks.settle()  # an unload: takes everything back and walks it
    assert freed_first() is None
    second = Cyclic()
    load_hooks.settle(unloaded=False)
    freed_second = weakref.ref(second)
    del second
    load_hooks.settle()  # within the minute: only what came since is walked
    assert freed_second() is not None
    monkeypatch.setattr(load_hooks, "_last_full", -load_hooks.FULL_EVERY)
    load_hooks.settle()
    assert freed_second() is None


def test_unloading_the_real_model_frees_it(with_default_model: Path, no_automatic_gc: None) -> None:
    models.load_model(DEFAULT_MODEL)
    backend = weakref.ref(shared.model)
    assert backend() is not None
    models.load_model(DEFAULT_MODEL)  # the old one unloaded first, then the new one loaded
    assert backend() is None
    again = weakref.ref(shared.model)
    assert models.unload_model() is True and models.unload_model() is False
    assert again() is None


def test_unloading_a_transformers_model_frees_its_cycles(tiny: Path, no_automatic_gc: None) -> None:
    models.load_model("tiny-llama")
    backend = weakref.ref(shared.model)
    models.load_model("tiny-llama")  # only the settle of the unload frees the old one: its objects hold each other
    assert backend() is None
    again = weakref.ref(shared.model)
    assert models.unload_model() is True and models.unload_model() is False
    assert again() is None
