"""gRPC server reflection as both `grpc.reflection.v1` and `grpc.reflection.v1alpha`.

grpcio-reflection ships only v1alpha, and newer clients (grpcurl 1.9+, Postman, grpcui) ask for
v1 first. The two protocols are the same messages under another package name, so one servicer
answers both: v1 calls are read and written with the v1alpha message classes (the bytes on the
wire are identical), and a v1 copy of the reflection file, renamed, is added to the pool
reflection describes, so `grpc.reflection.v1.ServerReflection` resolves too.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA = reflection_pb2.DESCRIPTOR.package          # grpc.reflection.v1alpha
V1 = "grpc.reflection.v1"
SERVICE_NAMES = (f"{V1}.ServerReflection", reflection.SERVICE_NAME)


def v1_file() -> descriptor_pb2.FileDescriptorProto:
    """The v1alpha reflection file renamed to v1: its package and every type it refers to."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = "grpc/reflection/v1/reflection.proto"     # its name in grpc/grpc-proto
    proto.package = V1
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):     # set only on message and enum fields
                field.type_name = field.type_name.replace(f".{V1ALPHA}.", f".{V1}.")
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(f".{V1ALPHA}.", f".{V1}.")
        method.output_type = method.output_type.replace(f".{V1ALPHA}.", f".{V1}.")
    return proto


def pool_of(files: Sequence) -> descriptor_pool.DescriptorPool:
    """A pool holding `files` (generated file descriptors) with the files they import,
    reflection in both versions, and nothing else: reflection describes what is in it."""
    pool, added = descriptor_pool.DescriptorPool(), set()

    def add(file) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:    # a file is added after those it imports
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
        added.add(file.name)

    for file in (*files, reflection_pb2.DESCRIPTOR):
        add(file)
    pool.Add(v1_file())
    return pool


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str],
                      pool: descriptor_pool.DescriptorPool) -> None:
    """Reflection of `service_names` (and of itself) on `server`, on both protocol versions."""
    servicer = reflection.aio.ReflectionServicer((*service_names, *SERVICE_NAMES), pool=pool)
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    for name in SERVICE_NAMES:
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": method}),))
