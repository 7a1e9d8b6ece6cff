"""gRPC server reflection, as `grpc.reflection.v1` (what grpcurl and current clients ask for
first) and as `grpc.reflection.v1alpha` (older clients).

grpcio-reflection (1.85) serves v1alpha only. v1 is the same protocol under another package:
the same messages with the same field numbers, so the library's servicer answers a v1 stream
byte for byte, served here under the v1 method name. The v1 file descriptor is the v1alpha one
renamed into the v1 package and added to the pool, so that a client can also describe the v1
service itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc import aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_SERVICE = reflection.SERVICE_NAME
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"


def enable_reflection(services: Sequence[str], server: aio.Server) -> None:
    """Reflection v1 and v1alpha for `services` (both reflection services listed too)."""
    register_v1_descriptor()
    names = [*services, V1_SERVICE, V1ALPHA_SERVICE]
    reflection.enable_server_reflection(names, server)
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": handler}),)
    )


def register_v1_descriptor(pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """grpc/reflection/v1/reflection.proto in `pool` (the default one), once."""
    pool = pool or descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.ClearField("options")  # v1alpha's java/go package names
    new = f".{V1_PACKAGE}."
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # message fields only; scalars have none
                field.type_name = field.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    pool.AddSerializedFile(proto.SerializeToString())
