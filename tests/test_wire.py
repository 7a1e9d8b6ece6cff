"""The one wire conversion and the one request validation (shared/serving/wire.py)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from pdserve.client import build_generate_request, generate
from proto.pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.engine.sampling.sampling_params import SamplingParams
from shared.serving.limits import MAX_REQUEST_ID_CHARS
from shared.serving.wire import (
    WireError,
    check_request_id,
    sampling_from_proto,
    sampling_to_proto,
    validate_request,
)
from tests.engine_helpers import hf_greedy
from tests.support.cluster import pd_cluster

VOCAB = 1000


def test_sampling_round_trips_and_wire_zero_top_p_is_off() -> None:
    params = SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.25, top_k=3, seed=9, stop=("a", "bc")
    )
    assert sampling_from_proto(sampling_to_proto(params)) == params
    unset = generation_pb2.SamplingParams(max_tokens=2)
    back = sampling_from_proto(unset)
    assert back.top_p == 1.0 and back.seed is None and back.stop == ()
    assert back.lora_adapter is None  # the wire's "" is the base model
    assert sampling_from_proto(unset, seed=5).seed == 5
    adapted = SamplingParams(max_tokens=3, lora_adapter="sql")
    assert sampling_from_proto(sampling_to_proto(adapted)) == adapted


@pytest.mark.parametrize("name", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_must_be_finite(name: str, value: float) -> None:
    params = SamplingParams(**{name: value})  # type: ignore[arg-type]
    with pytest.raises(WireError) as err:
        validate_request("", params, VOCAB)
    assert err.value.field == f"sampling.{name}"
    assert f"sampling.{name}" in str(err.value)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(top_k=VOCAB + 1), "sampling.top_k"),
        (SamplingParams(temperature=1e-40), "sampling.temperature"),  # overflows the logits
        (SamplingParams(temperature=9e-6), "sampling.temperature"),
        (SamplingParams(seed=2**64), "sampling.seed"),
        (SamplingParams(seed=-1), "sampling.seed"),
        (SamplingParams(max_tokens=0), "sampling.max_tokens"),
        (SamplingParams(stop=("",)), "sampling.stop"),
        (SamplingParams(stop=("x" * 257,)), "sampling.stop"),
        (SamplingParams(stop=tuple("abcdefghijklmnopq")), "sampling.stop"),
    ],
)
def test_sampling_bounds_name_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(WireError) as err:
        validate_request("ok", params, VOCAB)
    assert err.value.field == field


def test_sampling_at_the_bounds_is_accepted() -> None:
    validate_request("", SamplingParams(top_k=VOCAB, seed=2**64 - 1, temperature=1e-5), VOCAB)
    validate_request("x" * MAX_REQUEST_ID_CHARS, SamplingParams(stop=("s" * 256,) * 16), VOCAB)


@pytest.mark.parametrize(
    "request_id",
    ["x" * (MAX_REQUEST_ID_CHARS + 1), "a\nforged log line", "tab\there", "caf\u00e9", "\x7f"],
)
def test_request_id_is_bounded_printable_ascii(request_id: str) -> None:
    with pytest.raises(WireError) as err:
        check_request_id(request_id)
    assert err.value.field == "request_id"
    assert len(str(err.value)) < 200  # never echoes a huge id back


def test_client_takes_sampling_params_or_its_fields() -> None:
    params = SamplingParams(max_tokens=3, stop=("end",), seed=4)
    a = build_generate_request([1, 2], params, "r")
    assert a.sampling == sampling_to_proto(params) and a.request_id == "r"
    with pytest.raises(TypeError):
        asyncio.run(generate("127.0.0.1:1", [1], params, max_tokens=2))


BAD_REQUESTS = [
    ({"temperature": math.inf}, "sampling.temperature"),
    ({"temperature": math.nan}, "sampling.temperature"),
    ({"top_p": math.nan}, "sampling.top_p"),
    ({"top_p": -math.inf}, "sampling.top_p"),
    ({"top_k": 10**6}, "sampling.top_k"),
]


def test_grpc_rejects_out_of_bounds_requests_naming_the_field(
    checkpoint: Callable[..., Path],
) -> None:
    path = checkpoint("llama")

    async def body() -> None:
        async with pd_cluster(path) as c, grpc.aio.insecure_channel(c.targets[0]) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)

            async def status(request: generation_pb2.GenerateRequest) -> grpc.aio.AioRpcError:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(request, timeout=30):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
                return err.value

            for fields, name in BAD_REQUESTS:
                sampling = generation_pb2.SamplingParams(max_tokens=2, **fields)
                request = generation_pb2.GenerateRequest(
                    token_ids=generation_pb2.TokenIds(ids=[5, 6]), sampling=sampling
                )
                assert name in (await status(request)).details()
            huge_id = generation_pb2.GenerateRequest(
                request_id="r" * 100_000,
                token_ids=generation_pb2.TokenIds(ids=[5, 6]),
                sampling=generation_pb2.SamplingParams(max_tokens=2),
            )
            err = await status(huge_id)
            assert "request_id" in err.details() and len(err.details()) < 200
            # bytes that are no GenerateRequest at all: the caller's fault, not INTERNAL
            call = ch.unary_stream("/pdserve.v1.Generation/Generate")
            for junk in (b"\xff\xff\xff\x0f garbage", b"\x12\x02\xc3\x28"):  # bad UTF-8
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in call(junk):
                        pass
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "GenerateRequest" in e.value.details()
            ok = await generate(c.targets[0], [5, 6, 7], SamplingParams(max_tokens=3))
            assert ok.token_ids == hf_greedy(path, [5, 6, 7], 3)
            await c.assert_idle_and_conserved()

    asyncio.run(body())
