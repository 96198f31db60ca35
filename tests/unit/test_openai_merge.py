"""The API's merge of running generations: what has arrived when the consumer gets to it is one delta per choice."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from extensions.openai.core import Item, Running, merge
from modules.generation.params import GenerationParams
from modules.generation.pipeline import DeltaBuilder, Prepared
from modules.loaders.base import TokenEvent
from tests.conftest import run_async


def running(choices: int, stop: list[str] | None = None) -> Running:
    run = Running(queue=asyncio.Queue())
    for _ in range(choices):
        prepared = Prepared(prompt_ids=[1], params=GenerationParams(stop=stop or []), started=time.perf_counter())
        run.builders.append(DeltaBuilder(prepared))
        run.cancels.append(threading.Event())
    return run


def token(i: int, text: str) -> TokenEvent:
    return TokenEvent(token_id=i, piece=text.encode(), logprob=-0.5)


async def collect(run: Running) -> list[Item]:
    return [item async for item in merge(run)]


def test_tokens_that_arrived_together_make_one_delta_per_choice() -> None:
    async def go() -> list[Item]:
        run = running(2)
        for event in (token(5, "Hel"), token(6, "lo"), token(7, "a"), token(8, " wor")):
            run.queue.put_nowait((0 if event.token_id != 7 else 1, event))
        run.queue.put_nowait((1, TokenEvent(-1, b"", finish_reason="stop")))
        run.queue.put_nowait((0, TokenEvent(-1, b"", finish_reason="length")))
        return await collect(run)

    items: Any = run_async(go, timeout=30)
    assert [(i.index, i.delta.text if i.delta else None) for i in items] == [(0, "Hello wor"), (1, "a")]
    first = items[0].delta
    assert first is not None and [t.token_id for t in first.tokens] == [5, 6, 8]
    assert first.stats is not None and first.stats.new_tokens == 3 and first.stats.finish_reason == "length"


def test_tokens_that_come_apart_stay_apart_and_a_stop_string_across_them_ends_the_choice() -> None:
    async def go() -> list[Item]:
        run = running(1, stop=["lo w"])
        out: list[Item] = []
        stream = merge(run)
        run.queue.put_nowait((0, token(5, "Hel")))
        out.append(await anext(stream))
        run.queue.put_nowait((0, token(6, "lo")))
        run.queue.put_nowait((0, token(7, " world")))
        out += [item async for item in stream]
        assert run.cancels[0].is_set()  # the slot is freed at once
        return out

    items: Any = run_async(go, timeout=30)
    assert [i.delta.text if i.delta else None for i in items] == ["He", "l"]  # "l" waited: it might begin "lo w"
    last = items[-1].delta
    assert last is not None and last.stats is not None and last.stats.stop_string == "lo w"


def test_an_error_comes_after_what_the_choice_made_before_it() -> None:
    async def go() -> list[Item]:
        run = running(1)
        run.queue.put_nowait((0, token(5, "partial")))
        run.queue.put_nowait((0, RuntimeError("generation failed")))
        return await collect(run)

    items: Any = run_async(go, timeout=30)
    assert items[0].delta is not None and items[0].delta.text == "partial"
    assert isinstance(items[1].error, RuntimeError) and len(items) == 2


def test_with_several_choices_an_error_comes_after_the_others_deltas_that_arrived_before_it() -> None:
    async def go() -> list[Item]:
        run = running(2)
        run.queue.put_nowait((1, token(5, "done")))
        run.queue.put_nowait((1, TokenEvent(-1, b"", finish_reason="stop")))
        run.queue.put_nowait((0, RuntimeError("generation failed")))
        return await collect(run)

    items: Any = run_async(go, timeout=30)
    assert items[0].index == 1 and items[0].delta is not None and items[0].delta.stats is not None
    assert items[1].index == 0 and isinstance(items[1].error, RuntimeError) and len(items) == 2
