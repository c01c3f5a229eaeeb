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


# gRPC status codes by number, as a worker's Event.status_code carries them.
_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def refusal_code(number: int) -> grpc.StatusCode:
    """The status a client sees for a worker's refusal (Event.status_code): the code it names,
    INVALID_ARGUMENT where it names none (0), OK or a number gRPC does not define."""
    code = _STATUS_BY_NUMBER.get(number, grpc.StatusCode.INVALID_ARGUMENT)
    return grpc.StatusCode.INVALID_ARGUMENT if code == grpc.StatusCode.OK else code


def invalid_argument(message: str, field: str | None = None) -> ApiError:
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, field=field)


def unavailable(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.UNAVAILABLE, message)
