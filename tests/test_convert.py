"""common.convert: protobuf messages to the engine's records."""

import pytest
from google.protobuf import struct_pb2

from common.convert import MAX_EXTRA_ARGS_DEPTH, json_depth, sampling_params_from_proto
from common.pb import generation_pb2 as pb
from common.pb import worker_pb2
from common.sampling_params import InvalidRequest


def test_extra_args_arrive_as_the_json_object_they_hold():
    params = pb.SamplingParameters()
    params.extra_args.update({"length_scale": 2, "names": ["a", None], "nested": {"on": True}})
    assert sampling_params_from_proto(params).extra_args == {
        "length_scale": 2.0, "names": ["a", None], "nested": {"on": True}}


@pytest.mark.parametrize("where", ["top", "nested", "listed"])
def test_an_extra_args_value_with_no_kind_set_is_refused_naming_its_path(where):
    """What protobufjs sends for `{x: {number_value: 1}}`: a Value with none of its fields."""
    params = pb.SamplingParameters()
    empty = struct_pb2.Value()
    if where == "top":
        params.extra_args.fields["x"].CopyFrom(empty)
        path = "extra_args.x"
    elif where == "nested":
        params.extra_args.fields["x"].struct_value.fields["y"].CopyFrom(empty)
        path = "extra_args.x.y"
    else:
        params.extra_args.fields["x"].list_value.values.add().number_value = 1
        params.extra_args.fields["x"].list_value.values.add()
        path = r"extra_args.x\[1\]"
    with pytest.raises(InvalidRequest, match=rf"^{path} has no value set: a google.protobuf.Value needs one of") \
            as refused:
        sampling_params_from_proto(params)
    assert refused.value.field == "extra_args"


def test_a_json_object_constraint_set_to_false_is_refused_as_meaningless():
    params = pb.SamplingParameters(structured_output=pb.StructuredOutput(json_object=False))
    with pytest.raises(InvalidRequest, match=r"^structured_output.json_object is false, which constrains nothing"):
        sampling_params_from_proto(params)


def nested(depth: int) -> dict:
    """`{"a": {"a": ... 1}}`, `depth` objects deep."""
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def test_json_depth_counts_objects_and_lists_without_recursing():
    assert (json_depth(1), json_depth({"a": [1, {}]}), json_depth(nested(5000))) == (0, 3, 5000)


def test_extra_args_nested_past_the_limit_are_refused_naming_the_field():
    params = pb.SamplingParameters()
    params.extra_args.update(nested(MAX_EXTRA_ARGS_DEPTH + 1))
    with pytest.raises(InvalidRequest, match=f"^extra_args nests objects and lists more than "
                                             f"{MAX_EXTRA_ARGS_DEPTH} deep") as refused:
        sampling_params_from_proto(params)
    assert refused.value.field == "extra_args"


def test_extra_args_at_the_limit_survive_the_worker_protocol():
    """The worker reads them inside its stream's message; one it could not parse would end the
    router's session with it, and every request on it."""
    submit = worker_pb2.RouterMessage(submit=worker_pb2.Submit(request_id="r"))
    submit.submit.params.extra_args.update(nested(MAX_EXTRA_ARGS_DEPTH))
    read = worker_pb2.RouterMessage.FromString(submit.SerializeToString())
    assert sampling_params_from_proto(read.submit.params).extra_args == nested(MAX_EXTRA_ARGS_DEPTH)
