"""common.reflection: server reflection on both protocol versions, on a real grpc.aio server."""

import asyncio

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from common.grpc_server import create_server, listen
from common.pb import generation_pb2
from common.reflection import enable_reflection, pool_of

GENERATION = "pagedserve.v1.Generation"


def ask(version: str, request: reflection_pb2.ServerReflectionRequest
        ) -> reflection_pb2.ServerReflectionResponse:
    """One reflection request to a server reflecting Generation, on `version`'s method path
    (the messages of both versions are the same on the wire)."""
    async def scenario():
        server = create_server([])
        enable_reflection(server, (GENERATION,),
                          pool_of((generation_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR)))
        port = listen(server, "127.0.0.1", 0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.stream_stream(
                    f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                    request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                    response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)()
                await call.write(request)
                await call.done_writing()
                return [response async for response in call][0]
        finally:
            await server.stop(None)
    return asyncio.run(scenario())


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_both_versions_list_the_services_and_reflection_itself(version):
    response = ask(version, reflection_pb2.ServerReflectionRequest(list_services=""))
    assert {s.name for s in response.list_services_response.service} == {
        GENERATION, "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_both_versions_describe_a_served_symbol(version):
    response = ask(version, reflection_pb2.ServerReflectionRequest(file_containing_symbol=GENERATION))
    assert response.HasField("file_descriptor_response")


def test_the_v1_service_itself_resolves_to_its_renamed_file():
    response = ask("v1", reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="grpc.reflection.v1.ServerReflection"))
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in response.file_descriptor_response.file_descriptor_proto]
    assert [(f.name, f.package) for f in files] == [("grpc/reflection/v1/reflection.proto",
                                                      "grpc.reflection.v1")]


def test_a_symbol_not_in_the_pool_is_not_found():
    response = ask("v1", reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="pagedserve.worker.v1.Worker"))
    assert response.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
