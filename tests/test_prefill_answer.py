"""A prefill node answers a pushed request without waiting for its release.

The release (the engine unpins and forgets the request: `ContextPushed`) runs between two engine
steps; on a busy prefill node the next step is a whole prefill of other prompts, which the first
token used to wait out (a P/D TTFT p90 of 1.23 s at 2 req/s of 1k-token prompts on the medium
model fell to 1.00 s, the unaccounted part of TTFT from 200 ms to 10 ms mean). Here the release
command is held back, as a long step would hold it: the request must still complete, and every
block comes back once the release runs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.client import generate
from shared.engine.commands import ContextPushed
from tests.engine_helpers import random_prompts, single_torch_thread
from tests.support.cluster import pd_cluster

PROMPT = random_prompts(1, 256, min_len=200, max_len=200, seed=913)[0]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


def test_answer_and_first_token_do_not_wait_for_the_release() -> None:
    async def body() -> None:
        async with pd_cluster("tiny") as c:
            thread = c.prefills[0].thread
            gate, held = threading.Event(), []
            call = thread.call

            async def slow_release(command: Any) -> Any:
                if isinstance(command, ContextPushed):
                    held.append(command.request_id)
                    await asyncio.to_thread(gate.wait, 120)
                return await call(command)

            thread.call = slow_release  # type: ignore[method-assign]
            try:
                done = await asyncio.wait_for(
                    generate(c.targets[0], PROMPT, max_tokens=4, ignore_eos=True, timeout=60), 60
                )
                assert len(done.token_ids) == 4
                assert held, "the release ran before the answer: nothing was held back"
                assert not gate.is_set()
            finally:
                gate.set()
                thread.call = call  # type: ignore[method-assign]
            await c.assert_idle_and_conserved()

    asyncio.run(body())
