"""router.errors: the messages a call ends with."""

import grpc

from router.errors import MAX_MESSAGE_CHARS, ApiError, bounded, refusal_code


def test_a_message_within_the_limit_is_kept_whole():
    message = "x" * MAX_MESSAGE_CHARS
    assert bounded(message) == message


def test_a_longer_message_is_cut_saying_how_much_was_left_out():
    cut = bounded("y" * (MAX_MESSAGE_CHARS + 123))
    assert cut == "y" * MAX_MESSAGE_CHARS + "... (123 more characters)"


def test_an_api_error_carries_its_message_cut():
    error = ApiError(grpc.StatusCode.INVALID_ARGUMENT, "z" * 50_000)
    assert error.message.endswith("(49000 more characters)") and str(error) == error.message


def test_a_worker_refusal_takes_the_status_it_names():
    assert refusal_code(grpc.StatusCode.NOT_FOUND.value[0]) == grpc.StatusCode.NOT_FOUND
    assert refusal_code(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_worker_refusal_naming_no_status_is_invalid_argument():
    for unnamed in (0, 99, -1):     # unset, OK, numbers gRPC does not define
        assert refusal_code(unnamed) == grpc.StatusCode.INVALID_ARGUMENT
