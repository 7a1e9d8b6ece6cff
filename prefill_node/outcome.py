"""Each Prefill call counted once as it ends (shared/serving/request_outcomes.py): `pushed`,
`cancelled` (the decode node gave up, or its call went away), or the status it answered."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from proto.pdserve.v1 import prefill_pb2
from shared.serving.request_outcomes import CANCELLED, PUSHED, failed

Handler = Callable[[Any, prefill_pb2.PrefillRequest, Any], Awaitable[prefill_pb2.PrefillResponse]]


def counted_prefill(fn: Handler) -> Handler:
    """Wraps `PrefillNode.Prefill`, every exit of it (its early refusals included)."""

    @functools.wraps(fn)
    async def prefill(node, request: prefill_pb2.PrefillRequest, context) -> Any:
        outcome = CANCELLED
        try:
            response = await fn(node, request, context)
            outcome = PUSHED
            return response
        except asyncio.CancelledError:
            raise
        except BaseException:
            outcome = failed(context.code())  # set by context.abort before it raised
            raise
        finally:
            node.outcomes.count(outcome)

    return prefill
