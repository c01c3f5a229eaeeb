"""The gRPC entrance: pagedserve.v1.Generation on grpc.aio, over the transport-neutral
`GenerationService` (as `router.openai_api` is the HTTP one).

Requests are parsed by this adapter's own deserializers: protobuf refuses a string field that
holds invalid UTF-8, and gRPC reports a failed parse as INTERNAL; this answers
INVALID_ARGUMENT naming the field instead. Messages over the server's receive limit never get
here: gRPC itself answers RESOURCE_EXHAUSTED. An ApiError ends the call with its status code
and message, "retry-after" trailing metadata (whole seconds) when the client should come back
later, and a "request-id" trailer naming the request as the logs do.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message

from common import tracing
from common.pb import generation_pb2 as pb
from router.errors import ApiError, invalid_argument
from router.requests import request_id_problem
from router.service import GenerationService
from router.wire import find_invalid_utf8

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# The request span's attributes of the call (OpenTelemetry's RPC server conventions).
GENERATE_CALL = {"rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": "Generate"}


@dataclass(frozen=True)
class _Unparsable:
    """What the deserializer hands the handler instead of a request it could not parse."""

    problem: str


def _parser(message_type: type[Message]) -> Callable[[bytes], Message | _Unparsable]:
    def parse(data: bytes) -> Message | _Unparsable:
        try:
            return message_type.FromString(data)
        except DecodeError as error:
            field = find_invalid_utf8(message_type.DESCRIPTOR, data)
            if field is not None:
                return _Unparsable(f"{field} is not valid UTF-8: string fields must hold "
                                   "UTF-8 text")
            return _Unparsable(f"the request is not a valid {message_type.DESCRIPTOR.full_name}:"
                               f" {error}")
    return parse


def _request_id(request: pb.GenerateRequest | _Unparsable) -> str:
    return "" if isinstance(request, _Unparsable) else request.request_id


async def _abort(context: grpc.aio.ServicerContext, error: ApiError, request_id: str = "") -> None:
    """Ends the call with `error`; its "request-id" trailer names the request as the logs do
    (when the id is ASCII, as gRPC metadata must be)."""
    trailers = error.trailing_metadata
    # A refused id is not sent back: echoing a 66 KB one hung a grpc-js connection.
    if request_id and request_id.isascii() and request_id_problem(request_id) is None:
        trailers += (("request-id", request_id),)
    await context.abort(error.code, error.message, trailing_metadata=trailers)


class GrpcApi:
    """The Generation service's methods, each calling the GenerationService."""

    def __init__(self, service: GenerationService) -> None:
        self.service = service

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        """The service's methods with their lenient deserializers, for add_generic_rpc_handlers."""
        def method(kind, behaviour, request_type: type[Message], response_type: type[Message]):
            return kind(behaviour, request_deserializer=_parser(request_type),
                        response_serializer=response_type.SerializeToString)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Generate": method(grpc.unary_stream_rpc_method_handler, self.generate,
                               pb.GenerateRequest, pb.GenerateResponse),
            "Tokenize": method(grpc.unary_unary_rpc_method_handler, _unary(self.service.tokenize),
                               pb.TokenizeRequest, pb.TokenizeResponse),
            "Detokenize": method(grpc.unary_unary_rpc_method_handler, _unary(self.service.detokenize),
                                 pb.DetokenizeRequest, pb.DetokenizeResponse),
            "ModelInfo": method(grpc.unary_unary_rpc_method_handler, _unary(self.service.model_info),
                                pb.ModelInfoRequest, pb.ModelInfoResponse),
            "LoadLoRAAdapter": method(grpc.unary_unary_rpc_method_handler,
                                      _unary(self.service.load_lora_adapter),
                                      pb.LoadLoRAAdapterRequest, pb.LoadLoRAAdapterResponse),
            "UnloadLoRAAdapter": method(grpc.unary_unary_rpc_method_handler,
                                        _unary(self.service.unload_lora_adapter),
                                        pb.UnloadLoRAAdapterRequest, pb.UnloadLoRAAdapterResponse),
        })

    async def generate(self, request: pb.GenerateRequest | _Unparsable,
                       context: grpc.aio.ServicerContext) -> None:
        """The gRPC method: `stream`'s responses written to the call, its errors turned into
        statuses. Written here, not yielded to grpc: a shutdown's cancellation that lands while a
        response is being written then ends the call here too, saying why (yielded, it landed in
        grpc's own loop, and the call lived on until the server's stop ended it with "Cancelling
        all calls")."""
        try:
            if isinstance(request, _Unparsable):
                self.service.reject("invalid", "", request.problem)
                raise invalid_argument(request.problem)
            parent = tracing.extract(context.invocation_metadata()) if tracing.enabled() else None
            # aclosing: if the call ends at a yield, the inner stream is closed now, not whenever
            # it is garbage-collected, so its worker-side abort and release happen at once.
            async with contextlib.aclosing(self.service.stream(request, parent, GENERATE_CALL)) as responses:
                async for response in responses:
                    await context.write(response)
        except ApiError as error:
            await _abort(context, error, _request_id(request))
        except asyncio.CancelledError:
            if (error := self.service.shutting_down()) is None:
                raise
            await _abort(context, error, _request_id(request))


def _unary(method: Callable[[Message], Awaitable[Message]]):
    """Wraps a unary method: unparsable requests and ApiErrors become their status codes."""
    async def handle(request: Message | _Unparsable, context: grpc.aio.ServicerContext):
        try:
            if isinstance(request, _Unparsable):
                raise invalid_argument(request.problem)
            return await method(request)
        except ApiError as error:
            await _abort(context, error)
    return handle
