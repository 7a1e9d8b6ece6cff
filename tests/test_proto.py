"""The wire contract: committed stubs match the .proto files, and field numbers never drift."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from proto.pdserve.v1 import (
    encoder_pb2,
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_committed_stubs_match_regeneration() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "proto" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, (
        "committed stubs differ from a fresh protoc run; run `python proto/generate.py`\n"
        + result.stdout[-4000:]
        + result.stderr[-2000:]
    )


_T = FieldDescriptor
# message -> {field name: (number, type, repeated)}; these numbers are the wire contract.
EXPECTED_FIELDS: dict[str, dict[str, tuple[int, int, bool]]] = {
    "GenerateRequest": {
        "request_id": (1, _T.TYPE_STRING, False),
        "text": (2, _T.TYPE_STRING, False),
        "token_ids": (3, _T.TYPE_MESSAGE, False),
        "sampling": (4, _T.TYPE_MESSAGE, False),
        "priority": (5, _T.TYPE_INT32, False),
        "ttft_slo_ms": (6, _T.TYPE_UINT32, False),
        "itl_slo_ms": (7, _T.TYPE_UINT32, False),
        "continuation": (8, _T.TYPE_MESSAGE, False),
        "images": (9, _T.TYPE_MESSAGE, True),
    },
    "ImageInput": {
        "data": (1, _T.TYPE_BYTES, False),
        "url": (2, _T.TYPE_STRING, False),
    },
    "TokenIds": {"ids": (1, _T.TYPE_UINT32, True)},
    "SamplingParams": {
        "max_tokens": (1, _T.TYPE_UINT32, False),
        "temperature": (2, _T.TYPE_FLOAT, False),
        "top_p": (3, _T.TYPE_FLOAT, False),
        "top_k": (4, _T.TYPE_UINT32, False),
        "seed": (5, _T.TYPE_UINT64, False),
        "stop": (6, _T.TYPE_STRING, True),
        "ignore_eos": (7, _T.TYPE_BOOL, False),
        "logprobs": (8, _T.TYPE_UINT32, False),
        "prompt_logprobs": (9, _T.TYPE_UINT32, False),
        "repetition_penalty": (10, _T.TYPE_FLOAT, False),
        "presence_penalty": (11, _T.TYPE_FLOAT, False),
        "frequency_penalty": (12, _T.TYPE_FLOAT, False),
        "logit_bias": (13, _T.TYPE_MESSAGE, True),
        "min_tokens": (14, _T.TYPE_UINT32, False),
        "stop_token_ids": (15, _T.TYPE_UINT32, True),
        "n": (16, _T.TYPE_UINT32, False),
        "min_p": (17, _T.TYPE_FLOAT, False),
        "include_stop_str_in_output": (18, _T.TYPE_BOOL, False),
        "structured": (19, _T.TYPE_MESSAGE, False),
        "output_index_offset": (20, _T.TYPE_UINT32, False),
        "lora_adapter": (21, _T.TYPE_STRING, False),
        "continued_tokens": (22, _T.TYPE_UINT32, False),
    },
    "StructuredOutput": {
        "kind": (1, _T.TYPE_ENUM, False),
        "spec": (2, _T.TYPE_STRING, False),
    },
    "TopLogprob": {
        "token_id": (1, _T.TYPE_UINT32, False),
        "logprob": (2, _T.TYPE_FLOAT, False),
    },
    "TokenLogprob": {
        "token_id": (1, _T.TYPE_UINT32, False),
        "logprob": (2, _T.TYPE_FLOAT, False),
        "top_logprobs": (3, _T.TYPE_MESSAGE, True),
    },
    "GenerateResponse": {
        "request_id": (1, _T.TYPE_STRING, False),
        "token_ids": (2, _T.TYPE_UINT32, True),
        "text": (3, _T.TYPE_STRING, False),
        "finish_reason": (4, _T.TYPE_ENUM, False),
        "usage": (5, _T.TYPE_MESSAGE, False),
        "timing": (6, _T.TYPE_MESSAGE, False),
        "logprobs": (7, _T.TYPE_MESSAGE, True),
        "prompt_logprobs": (8, _T.TYPE_MESSAGE, True),
        "index": (9, _T.TYPE_UINT32, False),
    },
    "Usage": {
        "prompt_tokens": (1, _T.TYPE_UINT32, False),
        "completion_tokens": (2, _T.TYPE_UINT32, False),
        "cached_tokens": (3, _T.TYPE_UINT32, False),
    },
    "Timing": {
        "queue_seconds": (1, _T.TYPE_DOUBLE, False),
        "prefill_seconds": (2, _T.TYPE_DOUBLE, False),
        "kv_transfer_seconds": (3, _T.TYPE_DOUBLE, False),
        "time_to_first_token_seconds": (4, _T.TYPE_DOUBLE, False),
        "e2e_seconds": (5, _T.TYPE_DOUBLE, False),
    },
    "GetModelInfoRequest": {},
    "ModelInfo": {
        "name": (1, _T.TYPE_STRING, False),
        "architecture": (2, _T.TYPE_STRING, False),
        "vocab_size": (3, _T.TYPE_UINT32, False),
        "max_context": (4, _T.TYPE_UINT32, False),
        "block_size": (5, _T.TYPE_UINT32, False),
        "node_role": (6, _T.TYPE_ENUM, False),
        "kv_layout": (7, _T.TYPE_MESSAGE, False),
        "num_kv_blocks": (8, _T.TYPE_UINT32, False),
        "num_offload_blocks": (9, _T.TYPE_UINT32, False),
        "instance_id": (10, _T.TYPE_UINT64, False),
        "lora_adapters": (11, _T.TYPE_STRING, True),
        "image_placeholder": (12, _T.TYPE_STRING, False),
    },
    "KvLayoutInfo": {
        "num_layers": (1, _T.TYPE_UINT32, False),
        "num_kv_heads": (2, _T.TYPE_UINT32, False),
        "head_dim": (3, _T.TYPE_UINT32, False),
        "block_size": (4, _T.TYPE_UINT32, False),
        "dtype": (5, _T.TYPE_STRING, False),
        "fingerprint": (6, _T.TYPE_STRING, False),
    },
    "KvDestination": {
        "ucx_address": (1, _T.TYPE_STRING, False),
        "transfer_id": (2, _T.TYPE_UINT64, False),
        "transfer_token": (3, _T.TYPE_BYTES, False),
        "block_ids": (4, _T.TYPE_UINT32, True),
        "first_block_index": (5, _T.TYPE_UINT32, False),
        "layout_fingerprint": (6, _T.TYPE_STRING, False),
        "skipped_blocks": (7, _T.TYPE_UINT32, True),
        "prefill_instance_id": (8, _T.TYPE_UINT64, False),
        "decode_instance_id": (9, _T.TYPE_UINT64, False),
    },
    "PrefillRequest": {
        "request_id": (1, _T.TYPE_STRING, False),
        "prompt_token_ids": (2, _T.TYPE_UINT32, True),
        "sampling": (3, _T.TYPE_MESSAGE, False),
        "seed": (4, _T.TYPE_UINT64, False),
        "destination": (5, _T.TYPE_MESSAGE, False),
        "layerwise": (6, _T.TYPE_BOOL, False),
        "deadline_unix": (7, _T.TYPE_DOUBLE, False),
        "images": (8, _T.TYPE_MESSAGE, True),
    },
    "PromptImage": {
        "rgb": (1, _T.TYPE_BYTES, False),
        "height": (2, _T.TYPE_UINT32, False),
        "width": (3, _T.TYPE_UINT32, False),
    },
    "TransferStats": {
        "bytes_sent": (1, _T.TYPE_UINT64, False),
        "messages": (2, _T.TYPE_UINT32, False),
        "queue_seconds": (3, _T.TYPE_DOUBLE, False),
        "prefill_seconds": (4, _T.TYPE_DOUBLE, False),
        "transfer_tail_seconds": (5, _T.TYPE_DOUBLE, False),
        "first_layer_sent_unix": (6, _T.TYPE_DOUBLE, False),
        "last_layer_computed_unix": (7, _T.TYPE_DOUBLE, False),
        "last_byte_sent_unix": (8, _T.TYPE_DOUBLE, False),
    },
    "PrefillResponse": {
        "request_id": (1, _T.TYPE_STRING, False),
        "first_token_id": (2, _T.TYPE_UINT32, False),
        "cached_tokens": (3, _T.TYPE_UINT32, False),
        "stats": (4, _T.TYPE_MESSAGE, False),
        "first_token_logprobs": (5, _T.TYPE_MESSAGE, False),
        "prompt_logprobs": (6, _T.TYPE_MESSAGE, True),
        "choice_first_token_ids": (7, _T.TYPE_UINT32, True),
        "choice_first_token_logprobs": (8, _T.TYPE_MESSAGE, True),
        "instance_id": (9, _T.TYPE_UINT64, False),
        "mrope_delta": (10, _T.TYPE_SINT64, False),
    },
    "CancelPrefillRequest": {"request_id": (1, _T.TYPE_STRING, False)},
    "CancelPrefillResponse": {"found": (1, _T.TYPE_BOOL, False)},
    "LoadLoraAdapterRequest": {
        "lora_name": (1, _T.TYPE_STRING, False),
        "lora_path": (2, _T.TYPE_STRING, False),
    },
    "UnloadLoraAdapterRequest": {"lora_name": (1, _T.TYPE_STRING, False)},
    "LoraAdaptersResponse": {"lora_adapters": (1, _T.TYPE_STRING, True)},
    "EncodeRequest": {
        "request_id": (1, _T.TYPE_STRING, False),
        "images": (2, _T.TYPE_MESSAGE, True),
        "destination": (3, _T.TYPE_MESSAGE, False),
        "landing_block_rows": (4, _T.TYPE_UINT32, False),
    },
    "Embeddings": {
        "data": (1, _T.TYPE_BYTES, False),
        "tokens": (2, _T.TYPE_UINT32, False),
        "hidden_size": (3, _T.TYPE_UINT32, False),
    },
    "EncodeResponse": {
        "embeddings": (1, _T.TYPE_MESSAGE, True),
        "cached": (2, _T.TYPE_UINT32, False),
        "pushed": (3, _T.TYPE_BOOL, False),
    },
}

EXPECTED_ENUMS: dict[str, dict[str, int]] = {
    "FinishReason": {
        "FINISH_REASON_UNSPECIFIED": 0,
        "FINISH_REASON_LENGTH": 1,
        "FINISH_REASON_STOP": 2,
        "FINISH_REASON_ABORTED": 3,
    },
    "NodeRole": {
        "NODE_ROLE_UNSPECIFIED": 0,
        "NODE_ROLE_PREFILL": 1,
        "NODE_ROLE_DECODE": 2,
        "NODE_ROLE_COLOCATED": 3,
    },
    "StructuredKind": {
        "STRUCTURED_KIND_UNSPECIFIED": 0,
        "STRUCTURED_KIND_JSON_SCHEMA": 1,
        "STRUCTURED_KIND_JSON_OBJECT": 2,
        "STRUCTURED_KIND_REGEX": 3,
        "STRUCTURED_KIND_CHOICE": 4,
        "STRUCTURED_KIND_GRAMMAR": 5,
    },
}

# service -> {method: (input, output, server_streaming)}
EXPECTED_SERVICES: dict[str, dict[str, tuple[str, str, bool]]] = {
    "Generation": {
        "Generate": ("GenerateRequest", "GenerateResponse", True),
        "GetModelInfo": ("GetModelInfoRequest", "ModelInfo", False),
    },
    "Prefill": {
        "Prefill": ("PrefillRequest", "PrefillResponse", False),
        "CancelPrefill": ("CancelPrefillRequest", "CancelPrefillResponse", False),
        "GetModelInfo": ("GetModelInfoRequest", "ModelInfo", False),
        "LoadLoraAdapter": ("LoadLoraAdapterRequest", "LoraAdaptersResponse", False),
        "UnloadLoraAdapter": ("UnloadLoraAdapterRequest", "LoraAdaptersResponse", False),
    },
}


def _message_descriptor(name: str) -> Descriptor:
    for module in (generation_pb2, prefill_pb2, encoder_pb2):
        if name in module.DESCRIPTOR.message_types_by_name:
            return module.DESCRIPTOR.message_types_by_name[name]
    raise KeyError(name)


@pytest.mark.parametrize("message", sorted(EXPECTED_FIELDS))
def test_field_numbers_are_the_contract(message: str) -> None:
    descriptor = _message_descriptor(message)
    assert descriptor.full_name == f"pdserve.v1.{message}"
    actual = {f.name: (f.number, f.type, f.is_repeated) for f in descriptor.fields}
    assert actual == EXPECTED_FIELDS[message]


def test_package_enums_and_oneofs() -> None:
    assert generation_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert prefill_pb2.DESCRIPTOR.package == "pdserve.v1"
    for enum, values in EXPECTED_ENUMS.items():
        descriptor = generation_pb2.DESCRIPTOR.enum_types_by_name[enum]
        assert {v.name: v.number for v in descriptor.values} == values
    prompt = generation_pb2.GenerateRequest.DESCRIPTOR.oneofs_by_name["prompt"]
    assert [f.name for f in prompt.fields] == ["text", "token_ids"]
    # `optional` seed: presence is tracked, so "seed 0" differs from "no seed".
    assert generation_pb2.SamplingParams.DESCRIPTOR.fields_by_name["seed"].has_presence


def test_services() -> None:
    for module in (generation_pb2, prefill_pb2):
        for name, service in module.DESCRIPTOR.services_by_name.items():
            methods = {
                m.name: (m.input_type.name, m.output_type.name, m.server_streaming)
                for m in service.methods
            }
            assert not any(m.client_streaming for m in service.methods)
            assert methods == EXPECTED_SERVICES[name], name
    assert set(generation_pb2.DESCRIPTOR.services_by_name) == {"Generation"}
    assert set(prefill_pb2.DESCRIPTOR.services_by_name) == {"Prefill"}
    # The generated gRPC modules expose what the servers and clients use.
    assert callable(generation_pb2_grpc.add_GenerationServicer_to_server)
    assert callable(prefill_pb2_grpc.add_PrefillServicer_to_server)
    assert callable(generation_pb2_grpc.GenerationStub)
    assert callable(prefill_pb2_grpc.PrefillStub)


def test_generate_messages_round_trip() -> None:
    request = generation_pb2.GenerateRequest(
        request_id="r-1",
        token_ids=generation_pb2.TokenIds(ids=[1, 2, 2**32 - 1]),
        sampling=generation_pb2.SamplingParams(
            max_tokens=32,
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            seed=0,
            stop=["\n\n", "</s>"],
            ignore_eos=True,
        ),
    )
    decoded = generation_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert decoded == request
    assert decoded.WhichOneof("prompt") == "token_ids"
    assert list(decoded.token_ids.ids) == [1, 2, 2**32 - 1]
    assert decoded.sampling.HasField("seed") and decoded.sampling.seed == 0
    assert decoded.sampling.temperature == pytest.approx(0.5)

    # Setting text switches the oneof away from token_ids.
    decoded.text = "hello"
    assert decoded.WhichOneof("prompt") == "text"
    assert not decoded.HasField("token_ids")

    bare = generation_pb2.GenerateRequest.FromString(
        generation_pb2.GenerateRequest(text="hi").SerializeToString()
    )
    assert bare.WhichOneof("prompt") == "text"
    assert not bare.sampling.HasField("seed")  # unset optional seed stays unset on the wire

    response = generation_pb2.GenerateResponse(
        request_id="r-1",
        token_ids=[5, 6],
        text="ab",
        finish_reason=generation_pb2.FINISH_REASON_STOP,
        usage=generation_pb2.Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1),
        timing=generation_pb2.Timing(
            queue_seconds=0.001,
            prefill_seconds=0.02,
            kv_transfer_seconds=0.003,
            time_to_first_token_seconds=0.025,
            e2e_seconds=0.1,
        ),
    )
    assert generation_pb2.GenerateResponse.FromString(response.SerializeToString()) == response
    assert generation_pb2.FinishReason.Name(response.finish_reason) == "FINISH_REASON_STOP"
    # A mid-stream message: no finish reason, no usage.
    partial = generation_pb2.GenerateResponse(request_id="r-1", token_ids=[5], text="a")
    assert partial.finish_reason == generation_pb2.FINISH_REASON_UNSPECIFIED
    assert not partial.HasField("usage")


def test_prefill_messages_round_trip() -> None:
    request = prefill_pb2.PrefillRequest(
        request_id="r-2",
        prompt_token_ids=list(range(40)),
        sampling=generation_pb2.SamplingParams(max_tokens=8),
        seed=2**64 - 1,
        destination=prefill_pb2.KvDestination(
            ucx_address="10.0.0.2:13337",
            transfer_id=2**63,
            transfer_token=b"\x00\xffsecret",
            block_ids=[7, 3, 9],
            first_block_index=1,
            layout_fingerprint="0123456789abcdef",
        ),
        layerwise=True,
        deadline_unix=1_700_000_000.25,
    )
    assert prefill_pb2.PrefillRequest.FromString(request.SerializeToString()) == request

    response = prefill_pb2.PrefillResponse(
        request_id="r-2",
        first_token_id=42,
        cached_tokens=16,
        stats=prefill_pb2.TransferStats(
            bytes_sent=1 << 40,
            messages=33,
            queue_seconds=0.5,
            prefill_seconds=0.25,
            transfer_tail_seconds=0.001,
            first_layer_sent_unix=1_700_000_000.0,
            last_layer_computed_unix=1_700_000_000.2,
            last_byte_sent_unix=1_700_000_000.201,
        ),
    )
    assert prefill_pb2.PrefillResponse.FromString(response.SerializeToString()) == response

    info = generation_pb2.ModelInfo(
        name="tiny",
        architecture="LlamaForCausalLM",
        vocab_size=32000,
        max_context=4096,
        block_size=16,
        node_role=generation_pb2.NODE_ROLE_PREFILL,
        kv_layout=generation_pb2.KvLayoutInfo(
            num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16"
        ),
    )
    assert generation_pb2.ModelInfo.FromString(info.SerializeToString()) == info
    cancel = prefill_pb2.CancelPrefillResponse(found=True)
    assert prefill_pb2.CancelPrefillResponse.FromString(cancel.SerializeToString()).found
