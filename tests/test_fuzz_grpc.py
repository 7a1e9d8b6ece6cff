"""Generated GenerateRequests against a live decode node (1 prefill + 1 decode, tiny model).

Hypothesis builds arbitrary messages: extreme and out-of-range values, NaN and ±inf, huge ints,
arbitrary unicode, and raw wire bytes (truncated or mutated messages, invalid UTF-8 in string
fields, lone surrogates as a lax encoder writes them). Properties, after every example: the
status is one the API documents (never UNKNOWN or INTERNAL); a stream that succeeds is well
formed; every seat and block is back in its pool; the node still serves correct greedy output.
PDSERVE_FUZZ_EXAMPLES sets the example count (60 by default, so the suite stays fast; try 2000
for a longer run).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from proto.pdserve.v1 import generation_pb2, prefill_pb2
from tests.fuzz_loop import LiveCluster, text_with_a_lone_surrogate

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "60"))
# The Generate statuses proto/pdserve/v1/generation.proto documents for a healthy cluster
# (UNAVAILABLE / FAILED_PRECONDITION would mean a prefill node failed or disagreed: a bug here).
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
REQUEST_DEADLINE_S = 20.0
VOCAB = 512  # tests/checkpoints.py's llama
METHOD = "/pdserve.v1.Generation/Generate"
PREFILL = "/pdserve.v1.Prefill/Prefill"

U32 = st.integers(0, 2**32 - 1)
F32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
any_text = st.text(max_size=300)
MOSTLY = st.sampled_from([True] * 5 + [False])  # integers would favour 0 (hypothesis' bias)
printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=140)


@st.composite
def sampling(draw: st.DrawFn) -> generation_pb2.SamplingParams:
    msg = generation_pb2.SamplingParams(
        max_tokens=draw(st.one_of(st.integers(0, 12), U32)),
        temperature=draw(st.one_of(st.just(0.0), st.floats(0, 3, width=32), F32)),
        top_p=draw(st.one_of(st.just(0.0), st.floats(0, 1, width=32), F32)),
        top_k=draw(st.one_of(st.integers(0, 600), U32)),
        stop=draw(
            st.one_of(
                st.lists(st.text(min_size=1, max_size=4), max_size=3),
                st.lists(any_text, max_size=20),
            )
        ),
        ignore_eos=draw(st.booleans()),
    )
    if draw(st.booleans()):
        msg.seed = draw(st.integers(0, 2**64 - 1))
    return msg


@st.composite
def generate_requests(draw: st.DrawFn) -> generation_pb2.GenerateRequest:
    msg = generation_pb2.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), printable, any_text, st.text(min_size=129)))
    )
    prompt = draw(st.sampled_from(["none", "text", "ids"]))
    if prompt == "text":
        msg.text = draw(any_text)
    elif prompt == "ids":
        ids = st.one_of(st.integers(0, 511), st.integers(500, 520), U32)
        in_vocab = st.lists(st.integers(0, 511), min_size=1, max_size=64)
        msg.token_ids.ids.extend(draw(st.one_of(in_vocab, st.lists(ids, max_size=1100))))
    if draw(st.integers(0, 9)):  # mostly with sampling params; sometimes none at all
        msg.sampling.CopyFrom(draw(sampling()))
    return msg


@st.composite
def edge_requests(draw: st.DrawFn) -> generation_pb2.GenerateRequest:
    """Valid, but at the edges: subnormal and huge temperatures, tiny top_p, top_k = vocab,
    extreme seeds, 16 stop strings of 256 characters, 128-character ids, long prompts."""
    tiny = st.floats(min_value=0, max_value=2**-100, width=32, allow_subnormal=True)
    huge = st.floats(min_value=2.0**100, max_value=2.0**127, width=32)
    msg = generation_pb2.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), printable.filter(lambda s: len(s) <= 128)))
    )
    prompt = draw(st.lists(st.integers(0, 511), min_size=1, max_size=900))
    if draw(st.booleans()):
        msg.token_ids.ids.extend(prompt)
    else:
        msg.text = draw(st.text(min_size=1, max_size=400))
    msg.sampling.max_tokens = draw(st.integers(1, 16))
    msg.sampling.temperature = draw(st.one_of(st.just(0.0), tiny, huge, st.floats(0, 5, width=32)))
    msg.sampling.top_p = draw(st.one_of(st.just(1.0), tiny, st.floats(0, 1, width=32)))
    msg.sampling.top_k = draw(st.sampled_from([0, 1, 2, 511, 512]))
    msg.sampling.seed = draw(st.sampled_from([0, 1, 2**63, 2**64 - 1]))
    stops = st.text(min_size=1, max_size=256)
    msg.sampling.stop.extend(draw(st.lists(stops, max_size=16)))
    msg.sampling.ignore_eos = draw(st.booleans())
    if draw(st.integers(0, 2)) == 0:  # one bad field in an otherwise valid request
        spoil = draw(st.sampled_from(sorted(SPOILERS)))
        SPOILERS[spoil](msg, draw(st.sampled_from(BAD_VALUES[spoil])))
        event(f"spoiled {spoil}")
    return msg


INF = float("inf")
BAD_VALUES: dict[str, list[Any]] = {
    "temperature": [INF, -INF, float("nan"), 1e-40],
    "top_p": [INF, -INF, float("nan"), 1.5],
    "top_k": [VOCAB + 1, 2**32 - 1],
    "max_tokens": [0, 2**32 - 1],
    "request_id": ["r" * 129, "a\nb", "\x00", "\u00e9"],
    "stop": [[""], ["s" * 257], [f"s{i}" for i in range(17)]],
}


def _set_sampling(name: str) -> Any:
    return lambda msg, value: setattr(msg.sampling, name, value)


def _set_stop(msg: generation_pb2.GenerateRequest, value: list[str]) -> None:
    del msg.sampling.stop[:]
    msg.sampling.stop.extend(value)


SPOILERS: dict[str, Any] = {
    **{name: _set_sampling(name) for name in ("temperature", "top_p", "top_k", "max_tokens")},
    "request_id": lambda msg, value: setattr(msg, "request_id", value),
    "stop": _set_stop,
}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def wire_bytes(draw: st.DrawFn) -> bytes:
    """A serialized request, sent as is, truncated, with bytes overwritten, or with a string
    field (request_id, text, a stop string) carrying arbitrary bytes or a lone surrogate's
    bytes appended."""
    data = draw(st.one_of(generate_requests(), edge_requests())).SerializeToString()
    how = draw(st.sampled_from(["as_is", "as_is", "truncate", "mutate", "raw_string", "surrogate"]))
    if how == "truncate" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif how == "mutate" and data:
        buf = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            buf[draw(st.integers(0, len(buf) - 1))] = draw(st.integers(0, 255))
        data = bytes(buf)
    elif how in ("raw_string", "surrogate"):
        raw = draw(st.binary(max_size=64))
        if how == "surrogate":  # what a lax encoder writes for a lone surrogate (CESU-8)
            raw = draw(text_with_a_lone_surrogate()).encode("utf-8", "surrogatepass")
        field = draw(st.sampled_from([b"\x0a", b"\x12"]))  # request_id (1), text (2)
        if draw(st.booleans()):  # sampling (4) { stop (6) }
            inner = b"\x08\x02\x32" + _varint(len(raw)) + raw
            data += b"\x22" + _varint(len(inner)) + inner
        else:
            data += field + _varint(len(raw)) + raw
    event(how)
    return data


class Live(LiveCluster):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.channel = self.runner.run(self._open_channel())

    async def _open_channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.cluster.targets[0])

    async def send(
        self, data: bytes, target: str | None = None, method: str = METHOD
    ) -> tuple[grpc.StatusCode, list[Any]]:
        """Raw bytes to `method`: Generate on the decode node, or a unary call elsewhere.
        Returns the status and the responses (the status details when it is not OK)."""
        responses: list[Any] = []
        try:
            if method == METHOD:
                call = self.channel.unary_stream(
                    METHOD, response_deserializer=generation_pb2.GenerateResponse.FromString
                )(data, timeout=REQUEST_DEADLINE_S)
                async for response in call:
                    responses.append(response)
            else:
                async with grpc.aio.insecure_channel(target or "") as ch:
                    responses.append(await ch.unary_unary(method)(data, timeout=REQUEST_DEADLINE_S))
        except grpc.aio.AioRpcError as e:
            return e.code(), [e.details()]
        return grpc.StatusCode.OK, responses

    def close(self) -> None:
        self.runner.run(self.channel.close())
        super().close()


@pytest.fixture(scope="module")
def live(checkpoint: Any) -> Iterator[Live]:
    node = Live(checkpoint("llama"))
    yield node
    node.close()


def _check_stream(data: bytes, responses: list[Any]) -> None:
    """A successful stream: one final message, last, and no more tokens than asked for."""
    request = generation_pb2.GenerateRequest.FromString(data)
    assert responses, "OK with no message at all"
    finals = [r for r in responses if r.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED]
    assert len(finals) == 1 and finals[0] is responses[-1]
    tokens = sum(len(r.token_ids) for r in responses)
    assert tokens == finals[0].usage.completion_tokens <= request.sampling.max_tokens
    rid = request.request_id
    assert all(r.request_id == (rid or responses[0].request_id) for r in responses)


def _out_of_bounds(data: bytes) -> str | None:
    """The bounds table of docs/api.md, restated independently of shared/serving/wire.py: what a
    request that parses must be refused for (None: nothing here says it must be)."""
    try:
        r = generation_pb2.GenerateRequest.FromString(data)
    except DecodeError:
        return "unparsable"
    s = r.sampling
    if not all(math.isfinite(x) for x in (s.temperature, s.top_p)):
        return "non-finite float"
    if 0 < s.temperature < 1e-5:
        return "temperature so small that logits / temperature overflows"
    if len(r.request_id) > 128 or any(not " " <= c <= "~" for c in r.request_id):
        return "request_id"
    if s.top_k > VOCAB or s.max_tokens == 0 or r.WhichOneof("prompt") is None:
        return "top_k, max_tokens or prompt"
    return None


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=wire_bytes())
def test_generated_requests_get_documented_statuses_and_leave_nothing_behind(
    live: Live, data: bytes
) -> None:
    code, responses = live.runner.run(live.send(data))
    event(code.name)
    assert code in DOCUMENTED, f"{code.name} for {data!r}"
    reason = _out_of_bounds(data)
    if reason is not None:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{reason}: {code.name} for {data!r}"
    if code == grpc.StatusCode.OK:
        _check_stream(data, responses)
    live.runner.run(live.still_serving())


# ---- the prefill node's internal API: what a caller that is not a decode node could send ----
PREFILL_DOCUMENTED = DOCUMENTED | {
    grpc.StatusCode.UNAVAILABLE,  # the destination could not be reached
    grpc.StatusCode.FAILED_PRECONDITION,  # layout fingerprint mismatch
}


@st.composite
def prefill_requests(draw: st.DrawFn, receiver: str, fingerprint: str) -> bytes:
    """Mostly well-formed calls (so they reach the engine and the push), each field
    occasionally replaced by anything at all."""

    def mostly(good: Any, anything: st.SearchStrategy[Any]) -> Any:
        return good if draw(MOSTLY) else draw(anything)

    prompt = mostly(draw(st.lists(st.integers(0, 511), min_size=1, max_size=80)), st.lists(U32))
    blocks = -(-len(prompt) // 16)
    first = mostly(draw(st.integers(0, max(0, blocks - 1))), st.one_of(st.integers(0, 8), U32))
    count = mostly(max(0, blocks - first), st.integers(0, 12))
    bad_address = st.one_of(
        st.sampled_from(["", "nohost", ":1", "127.0.0.1:0", "127.0.0.1:70000", "[::1]:x"]),
        st.just("127.0.0.1:1"),  # nothing listens: connection refused
        any_text,
    )
    # the real KV listener, with a token it never issued: it must drop every message
    address = mostly(receiver, bad_address)
    rid = mostly(draw(printable.filter(lambda r: 0 < len(r) <= 128)), any_text)
    msg = prefill_pb2.PrefillRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        seed=draw(st.integers(0, 2**64 - 1)),
        layerwise=draw(st.booleans()),
        deadline_unix=draw(st.one_of(st.just(0.0), st.floats(allow_nan=True))),
        destination=prefill_pb2.KvDestination(
            ucx_address=address,
            transfer_id=draw(st.integers(0, 2**64 - 1)),
            transfer_token=mostly(draw(st.binary(min_size=16, max_size=16)), st.binary()),
            block_ids=draw(
                st.lists(st.one_of(st.integers(0, 1023), U32), min_size=count, max_size=count)
            ),
            first_block_index=first,
            layout_fingerprint=mostly(fingerprint, any_text),
            skipped_blocks=mostly([], st.lists(st.one_of(st.integers(0, 12), U32), max_size=8)),
        ),
    )
    if draw(MOSTLY):
        msg.sampling.CopyFrom(draw(sampling()))
    data = msg.SerializeToString()
    if not draw(MOSTLY) and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    return data


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_generated_prefill_calls_get_documented_statuses_and_leave_nothing_behind(
    live: Live, data: st.DataObject
) -> None:
    c = live.cluster
    request = data.draw(
        prefill_requests(c.decodes[0].receiver.address, c.prefills[0].layout.fingerprint())
    )
    code, out = live.runner.run(live.send(request, f"127.0.0.1:{c.prefills[0].port}", PREFILL))
    event(f"{code.name}: {str(out[0])[:24] if code != grpc.StatusCode.OK else ''}")
    assert code in PREFILL_DOCUMENTED, f"{code.name} for {request!r}"
    live.runner.run(live.still_serving())
