"""The router's API key (`--api-key`), the same on both transports: HTTP requests to /v1 paths
carry it as `Authorization: Bearer <key>`, gRPC calls to the public API (pagedserve.v1) as the
metadata `authorization: Bearer <key>`. Health and reflection stay open, for probes and grpcurl.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

UNAUTHENTICATED_GRPC = "missing or invalid API key: send the metadata 'authorization: Bearer <key>'"

# The handler constructors by (request streaming, response streaming): a refusal must take the
# shape of the method it stands in for.
_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def bearer_key_matches(authorization: str, api_key: str) -> bool:
    """Whether an Authorization value is "Bearer <api_key>": the scheme in any case (RFC 9110
    makes it case-insensitive), the key compared in constant time."""
    scheme, _, key = authorization.partition(" ")
    # surrogateescape: aiohttp decodes header bytes that are not UTF-8 that way.
    return scheme.lower() == "bearer" and hmac.compare_digest(
        key.strip().encode(errors="surrogateescape"), api_key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Answers calls to the methods of `package` with UNAUTHENTICATED unless their metadata
    holds `authorization: Bearer <api_key>`; the other services are left open."""

    def __init__(self, api_key: str, package: str) -> None:
        self._api_key = api_key
        self._prefix = f"/{package}."

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler  # an unknown method (UNIMPLEMENTED), or health and reflection: open
        if self._authorized(details.invocation_metadata):
            return handler
        return _refusal(handler)

    def _authorized(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> bool:
        value = dict(metadata or ()).get("authorization")
        return isinstance(value, str) and bearer_key_matches(value, self._api_key)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED. It takes
    the request as bytes: nothing of an unauthenticated call is parsed."""
    async def refuse(request, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_GRPC)
    return _HANDLER_KINDS[handler.request_streaming, handler.response_streaming](refuse)
