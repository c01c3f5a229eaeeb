"""The error a request ends with when it reaches the client as a gRPC status."""

from __future__ import annotations

import math

import grpc


# A message travels in a gRPC trailer, which clients refuse past 8 KiB or so (the call then
# fails RESOURCE_EXHAUSTED, as if the server were overloaded): one that quotes a large input
# (a schema, a grammar, a list of ids) is cut to this many characters.
MAX_MESSAGE_CHARS = 1000


def bounded(message: str) -> str:
    """`message`, cut to MAX_MESSAGE_CHARS with a note of how much was left out."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS} more characters)"


class ApiError(Exception):
    """Ends the call with `code` and a message that says what was wrong and what is allowed."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 retry_after_s: float | None = None, *, field: str | None = None) -> None:
        message = bounded(message)
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
