"""The error a request ends with when it reaches the client as a gRPC status."""

from __future__ import annotations

import math

import grpc


class ApiError(Exception):
    """Ends the call with `code` and a message that says what was wrong and what is allowed."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 retry_after_s: float | None = None, *, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        # The request field it is about, as a path in the gRPC request ("params.max_tokens",
        # "chat.messages[2].role"): the message starts with it. HTTP renames it (its param).
        self.field = field

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """"retry-after" in whole seconds (rounded up) when the client should come back later."""
        if self.retry_after_s is None:
            return ()
        return (("retry-after", str(math.ceil(self.retry_after_s))),)


def invalid_argument(message: str, field: str | None = None) -> ApiError:
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, field=field)


def unavailable(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.UNAVAILABLE, message)
