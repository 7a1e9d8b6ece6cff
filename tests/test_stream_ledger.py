"""The proxy's ledger of a Generate stream (pdserve/stream_resume.py): which streams it may
resume, the continuation it asks for, and how a resumed call's messages reach the client."""

from __future__ import annotations

from pdserve.stream_resume import GenerateLedger
from proto.pdserve.v1 import generation_pb2

FINISHED = generation_pb2.FINISH_REASON_LENGTH


def _request(**sampling: object) -> bytes:
    request = generation_pb2.GenerateRequest(text="Hello", sampling=sampling)  # type: ignore[arg-type]
    return request.SerializeToString()


def _response(tokens: list[int], rid: str = "", **final: object) -> bytes:
    return generation_pb2.GenerateResponse(
        request_id=rid,
        token_ids=tokens,
        **final,  # type: ignore[arg-type]
    ).SerializeToString()


def test_a_resumed_stream_keeps_its_id_and_counts_the_whole_answer() -> None:
    ledger = GenerateLedger(_request(max_tokens=10, seed=7, prompt_logprobs=1))
    first = _response([5, 6], rid="node-a-1")
    assert ledger.record(first) == first  # before any resume: byte for byte
    assert ledger.record(_response([7], rid="node-a-1")) is not None
    assert ledger.resumable
    again = generation_pb2.GenerateRequest.FromString(ledger.continuation())
    assert list(again.continuation.ids) == [5, 6, 7]
    assert again.request_id == "node-a-1"  # the survivor answers under the client's id
    assert again.sampling.max_tokens == 10 and again.sampling.seed == 7  # the node subtracts
    assert not again.sampling.HasField("prompt_logprobs")  # the first message had them
    usage = generation_pb2.Usage(prompt_tokens=2 + 3, completion_tokens=7, cached_tokens=5)
    last = ledger.record(_response([8] * 7, rid="node-b-9", finish_reason=FINISHED, usage=usage))
    msg = generation_pb2.GenerateResponse.FromString(last)
    assert msg.request_id == "node-a-1"
    assert (msg.usage.prompt_tokens, msg.usage.completion_tokens) == (2, 10)
    assert msg.usage.cached_tokens == 2  # never more than the prompt
    assert not ledger.resumable  # finished


def test_what_is_not_resumed() -> None:
    assert not GenerateLedger(_request(max_tokens=8, n=2)).resumable
    # a grammar's state is rebuilt from the tokens sent (continued_tokens): structured resumes
    structured = {"kind": generation_pb2.STRUCTURED_KIND_JSON_OBJECT}
    assert GenerateLedger(_request(max_tokens=8, structured=structured)).resumable
    full = GenerateLedger(_request(max_tokens=2))
    full.record(_response([1, 2]))
    assert not full.resumable  # nothing left to generate


def test_a_second_resume_sends_everything_sent_so_far() -> None:
    own = generation_pb2.GenerateRequest(text="Hi", sampling={"max_tokens": 20})  # type: ignore[arg-type]
    own.continuation.ids.extend([1])  # the client continues an answer itself
    ledger = GenerateLedger(own.SerializeToString())
    ledger.record(_response([2, 3], rid="r"))
    ledger.continuation()
    ledger.record(_response([4], rid="other"))
    again = generation_pb2.GenerateRequest.FromString(ledger.continuation())
    assert list(again.continuation.ids) == [1, 2, 3, 4]
    assert ledger.resumes == 2
