"""Helpers for the tests/test_sampling_*.py suites: a Generate client that speaks every sampling
field (via the shared wire conversion), and transformers references."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from grpc import aio

from proto.pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.engine.sampling.logprobs import TokenLogprobs
from shared.engine.sampling.sampling_params import SamplingParams
from shared.serving.wire import (
    logprob_from_proto,
    prompt_logprobs_from_proto,
    sampling_to_proto,
)
from tests.engine_helpers import _hf_model


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str = ""
    text: str = ""


async def pd_generate(
    target: str,
    prompt: list[int],
    params: SamplingParams,
    *,
    timeout: float = 120.0,
    request_id: str = "",
) -> list[Completion]:
    """One Generate call collected per completion index."""
    request = generation_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=generation_pb2.TokenIds(ids=prompt),
        sampling=sampling_to_proto(params),
    )
    out: dict[int, Completion] = {}
    async with aio.insecure_channel(target) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=timeout)
        async for msg in call:
            c = out.setdefault(msg.index, Completion())
            c.token_ids.extend(msg.token_ids)
            c.text += msg.text
            c.logprobs.extend(logprob_from_proto(m) for m in msg.logprobs)
            if msg.prompt_logprobs:
                c.prompt_logprobs = prompt_logprobs_from_proto(msg.prompt_logprobs)
            if msg.finish_reason:
                c.finish_reason = generation_pb2.FinishReason.Name(msg.finish_reason)
    return [out[i] for i in sorted(out)]


def hf_log_softmax(path: Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax of its fp32 logits at every position: [len, vocab]."""
    model = _hf_model(str(path))
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_logprobs_match(
    lps: list[TokenLogprobs], reference: torch.Tensor, positions: list[int], k: int
) -> None:
    """Each entry's logprob equals reference[position, token] within 1e-4, and its top-k list
    is the reference's top-k, in order."""
    assert len(lps) == len(positions)
    for lp, pos in zip(lps, positions, strict=True):
        assert abs(reference[pos, lp.token_id].item() - lp.logprob) < 1e-4, (pos, lp)
        want = reference[pos].topk(k) if k else None
        got_ids = [t for t, _ in lp.top]
        if want is None:
            assert got_ids == []
            continue
        assert got_ids == want.indices.tolist(), (pos, got_ids, want.indices.tolist())
        for (_, v), w in zip(lp.top, want.values.tolist(), strict=True):
            assert abs(v - w) < 1e-4


def same_logprobs(a: list[TokenLogprobs], b: list[TokenLogprobs], tol: float = 1e-5) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.token_id != y.token_id or abs(x.logprob - y.logprob) > tol:
            return False
        if [t for t, _ in x.top] != [t for t, _ in y.top]:
            return False
        if any(abs(u - v) > tol for (_, u), (_, v) in zip(x.top, y.top, strict=True)):
            return False
    return True
