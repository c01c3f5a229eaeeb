"""Conversions between protobuf messages and the engine's records, shared by router and worker."""

import math
from collections.abc import Iterator

from google.protobuf import json_format, struct_pb2

from common.pb import worker_pb2
from common.sampling_params import InvalidRequest, SamplingParams, StructuredOutput

# The worker protocol's preemption modes by the names the engine, its flags and the metrics
# labels use: the one table both sides translate with.
PREEMPTION_MODES = {"swap": worker_pb2.PREEMPTION_MODE_SWAP,
                    "recompute": worker_pb2.PREEMPTION_MODE_RECOMPUTE}
PREEMPTION_MODE_NAMES = {mode: name for name, mode in PREEMPTION_MODES.items()}
DEFAULT_MAX_TOKENS = SamplingParams.max_tokens  # a SamplingParameters without max_tokens


def submit_tokens(msg: worker_pb2.Submit, max_model_len: int) -> int:
    """What a Submit will hold once taken (the sequence's max_len), from the message alone: what
    a worker counts in LoadReport.tokens_in_flight the moment it reads it."""
    max_tokens = msg.params.max_tokens if msg.params.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    return min(len(msg.prompt_token_ids) + max_tokens, max_model_len)


def _f32(x: float) -> float:
    """A proto float as the decimal the client most likely wrote (0.7, not 0.699999988)."""
    return float(f"{x:.7g}")


def sampling_params_from_proto(p) -> SamplingParams:
    """`pagedserve.v1.SamplingParameters` -> SamplingParams, unset fields at their defaults.
    Validation is left to `SamplingParams.validate`, so messages name the field."""
    return SamplingParams(
        n=p.n if p.HasField("n") else 1,
        temperature=_f32(p.temperature) if p.HasField("temperature") else 1.0,
        top_p=_f32(p.top_p) if p.HasField("top_p") else 1.0,
        top_k=p.top_k if p.HasField("top_k") else -1,
        min_p=_f32(p.min_p),
        presence_penalty=_f32(p.presence_penalty),
        frequency_penalty=_f32(p.frequency_penalty),
        repetition_penalty=_f32(p.repetition_penalty) if p.HasField("repetition_penalty") else 1.0,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens if p.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        min_tokens=p.min_tokens,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        structured_output=structured_output_from_proto(p.structured_output)
        if p.HasField("structured_output") else None,
        logit_bias={token: _f32(bias) for token, bias in p.logit_bias.items()},
        allowed_token_ids=list(p.allowed_token_ids),
        bad_words=list(p.bad_words),
        logits_processors=list(p.logits_processors),
        extra_args=struct_to_dict(p.extra_args, "extra_args") if p.HasField("extra_args") else {},
    )


# How deep extra_args may nest objects and lists. The worker reads them inside its stream's
# message, and protobuf refuses a message nested past 100 levels (each JSON level is two or three
# of its own): a deeper value would not fail its request but end the router's whole session
# with the worker, and every request on it.
MAX_EXTRA_ARGS_DEPTH = 16


def json_depth(value) -> int:
    """How deeply a JSON value nests objects and lists (a scalar 0, `{"a": [1]}` 2), without
    recursion: the value may be nested past Python's recursion limit."""
    deepest, pending = 0, [(value, 0)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, dict):
            value = value.values()
        elif not isinstance(value, list):
            continue
        deepest = max(deepest, depth + 1)
        pending += [(inner, depth + 1) for inner in value]
    return deepest


def struct_to_dict(struct: struct_pb2.Struct, name: str) -> dict:
    """A `google.protobuf.Struct` as the JSON object it holds. A Value with no kind set is
    refused (InvalidRequest naming it), not read as null: it is what a client sends that wrote
    the Value's fields under names its library does not know (protobufjs takes only
    `numberValue`, not `number_value`), and the argument would otherwise vanish silently."""
    for path, value, depth in _values(struct, name):
        if depth > MAX_EXTRA_ARGS_DEPTH:
            raise InvalidRequest(f"{name} nests objects and lists more than {MAX_EXTRA_ARGS_DEPTH} deep "
                                 f"(at {path})", name)
        kind = value.WhichOneof("kind")
        if kind is None:
            raise InvalidRequest(f"{path} has no value set: a google.protobuf.Value needs one of null_value, "
                                 f"number_value, string_value, bool_value, struct_value or list_value", name)
        if kind == "number_value" and not math.isfinite(value.number_value):
            raise InvalidRequest(f"{path} is {value.number_value}, which JSON cannot hold: numbers must be finite",
                                 name)
    return json_format.MessageToDict(struct)


def _values(struct: struct_pb2.Struct, path: str) -> Iterator[tuple[str, struct_pb2.Value, int]]:
    """Every Value inside `struct`, nested ones too, with its path (`extra_args.a.b[2]`) and the
    number of objects and lists around it (1 for the struct's own fields)."""
    pending = [(f"{path}.{key}", value, 1) for key, value in struct.fields.items()]
    while pending:
        path, value, depth = pending.pop()
        yield path, value, depth
        kind = value.WhichOneof("kind")
        if kind == "struct_value":
            pending += [(f"{path}.{key}", inner, depth + 1) for key, inner in value.struct_value.fields.items()]
        elif kind == "list_value":
            pending += [(f"{path}[{i}]", inner, depth + 1) for i, inner in enumerate(value.list_value.values)]


def structured_output_from_proto(s) -> StructuredOutput:
    """`pagedserve.v1.StructuredOutput` -> StructuredOutput; no kind set gives kind "" (refused
    by validation, naming the kinds)."""
    kind = s.WhichOneof("kind") or ""
    if kind == "json_object" and not s.json_object:
        # Would read as "constrain to an object": say so rather than constrain a client that
        # meant the opposite.
        raise InvalidRequest("structured_output.json_object is false, which constrains nothing: set it to "
                             "true for a JSON object, or leave structured_output unset", "structured_output")
    if kind == "choice":
        return StructuredOutput(kind, tuple(s.choice.values))
    return StructuredOutput(kind, None if kind in ("json_object", "") else getattr(s, kind))
