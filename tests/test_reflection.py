"""gRPC server reflection as `grpc.reflection.v1` (what grpcurl and current clients ask first)
and as `grpc.reflection.v1alpha`, on a node's real gRPC server.

The v1 client is written from the protocol, not from the server's code: requests are encoded
by hand (ServerReflectionRequest: list_services = 7, file_containing_symbol = 4) and answers are
read with messages built from a v1 descriptor in a pool of the test's own.
"""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from proto.pdserve.v1 import generation_pb2
from shared.serving.grpc_server import create_grpc_server
from shared.serving.reflection import register_v1_descriptor

V1_METHOD = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
GENERATION = "pdserve.v1.Generation"


def _string_field(number: int, text: str) -> bytes:
    data = text.encode()
    return bytes([number << 3 | 2, len(data)]) + data


def _v1_response_class() -> type:
    pool = descriptor_pool.DescriptorPool()  # the test's own, not the server's
    register_v1_descriptor(pool)
    found = pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse")
    return message_factory.GetMessageClass(found)


async def _ask_v1(port: int, requests: list[bytes]) -> list[bytes]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(V1_METHOD)(iter(requests), timeout=10)
        return [answer async for answer in call]


def test_reflection_v1_and_v1alpha_describe_the_services() -> None:
    async def main() -> None:
        server, _, port = create_grpc_server([GENERATION], lambda s: None, "127.0.0.1", 0)
        await server.start()
        try:
            answers = await _ask_v1(
                port,
                [
                    _string_field(7, "*"),  # list_services
                    _string_field(4, GENERATION),  # file_containing_symbol
                    _string_field(4, "grpc.reflection.v1.ServerReflection"),
                    _string_field(4, "no.such.Symbol"),
                ],
            )
            response = _v1_response_class()
            listed, generation, itself, missing = (response.FromString(a) for a in answers)
            names = {s.name for s in listed.list_services_response.service}
            assert names >= {
                GENERATION,
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection",
            }
            files = [
                descriptor_pb2.FileDescriptorProto.FromString(raw)
                for raw in generation.file_descriptor_response.file_descriptor_proto
            ]
            assert files[0].name == generation_pb2.DESCRIPTOR.name
            assert "Generation" in [s.name for s in files[0].service]
            v1 = descriptor_pb2.FileDescriptorProto.FromString(
                itself.file_descriptor_response.file_descriptor_proto[0]
            )
            assert v1.package == "grpc.reflection.v1" and v1.service[0].name == "ServerReflection"
            assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_reflection_v1alpha_still_served() -> None:
    def describe(port: int) -> list[str]:
        """grpcio-reflection's own client (synchronous, v1alpha), off the server's loop."""
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
            return [m.name for m in pool.FindServiceByName(GENERATION).methods]

    async def main() -> None:
        server, _, port = create_grpc_server([GENERATION], lambda s: None, "127.0.0.1", 0)
        await server.start()
        try:
            assert "Generate" in await asyncio.to_thread(describe, port)
        finally:
            await server.stop(0)

    asyncio.run(main())
