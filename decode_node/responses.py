"""GenerateResponse messages built from the engine's token deltas (gRPC and HTTP alike)."""

from __future__ import annotations

import time

from decode_node.stream import Stream
from proto.pdserve.v1 import generation_pb2
from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import FinishReason
from shared.serving.wire import logprob_to_proto, prompt_logprobs_to_proto

_FINISH = {
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.ABORTED: generation_pb2.FINISH_REASON_ABORTED,
}


def generate_response(stream: Stream, delta: TokenDelta) -> generation_pb2.GenerateResponse:
    msg = generation_pb2.GenerateResponse(
        request_id=stream.request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        index=delta.index,
    )
    if delta.logprobs:
        msg.logprobs.extend(logprob_to_proto(lp) for lp in delta.logprobs)
    if delta.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(prompt_logprobs_to_proto(delta.prompt_logprobs))
    if delta.finish_reason is not None:
        msg.finish_reason = _FINISH[delta.finish_reason]
        msg.usage.CopyFrom(
            generation_pb2.Usage(
                prompt_tokens=stream.prompt_len,
                completion_tokens=stream.tokens_by_index.get(delta.index, 0),
                cached_tokens=stream.cached_tokens,
            )
        )
        ttft = (stream.first_token_at or time.monotonic()) - stream.admitted_at
        msg.timing.CopyFrom(
            generation_pb2.Timing(
                queue_seconds=stream.queue_seconds,
                prefill_seconds=stream.prefill_seconds,
                kv_transfer_seconds=stream.kv_transfer_seconds,
                time_to_first_token_seconds=ttft,
                e2e_seconds=time.monotonic() - stream.admitted_at,
            )
        )
    return msg
