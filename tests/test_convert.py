"""common.convert: protobuf messages to the engine's records."""

import pytest
from google.protobuf import struct_pb2

from common.convert import sampling_params_from_proto
from common.pb import generation_pb2 as pb
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
