"""The protobuf contract: generated code works, protos compile cleanly and are fully documented."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from common import pb
from common.pb import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

PROTO_ROOT = Path(__file__).resolve().parent.parent / "protos"
PROTO_FILES = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*.proto"))


@pytest.fixture(scope="module")
def protoc_run(tmp_path_factory):
    """protoc over every .proto, keeping source info (comments) in the descriptor set."""
    out = tmp_path_factory.mktemp("descriptors") / "all.pb"
    result = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"--proto_path={PROTO_ROOT}",
         "--include_source_info", f"--descriptor_set_out={out}", *PROTO_FILES],
        capture_output=True, text=True)
    files = descriptor_pb2.FileDescriptorSet()
    if result.returncode == 0:
        files.ParseFromString(out.read_bytes())
    return result, files


def test_generated_modules_expose_services():
    assert generation_pb2_grpc.GenerationStub and generation_pb2_grpc.GenerationServicer
    assert worker_pb2_grpc.WorkerStub and worker_pb2_grpc.WorkerServicer
    assert worker_pb2.Submit.DESCRIPTOR.fields_by_name["params"].message_type is \
        generation_pb2.SamplingParameters.DESCRIPTOR


def test_generate_request_round_trips():
    request = generation_pb2.GenerateRequest(
        request_id="r1", priority=-2, include_stop_str_in_output=True,
        chat=generation_pb2.ChatMessages(messages=[
            generation_pb2.ChatMessage(role="user", content="Hi ✓")]),
        params=generation_pb2.SamplingParameters(
            n=2, temperature=0.0, max_tokens=7, seed=2**63 - 1, stop=["\n\n"],
            stop_token_ids=[2], logprobs=0))
    parsed = generation_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert parsed == request
    assert parsed.WhichOneof("input") == "chat"
    assert parsed.chat.messages[0].content == "Hi ✓"


def test_explicit_zero_is_distinguishable_from_unset():
    params = generation_pb2.SamplingParameters.FromString(
        generation_pb2.SamplingParameters(temperature=0.0, logprobs=0).SerializeToString())
    assert params.HasField("temperature") and params.temperature == 0.0
    assert params.HasField("logprobs")
    assert not params.HasField("top_p") and not params.HasField("max_tokens")
    assert not generation_pb2.GenerateRequest().HasField("skip_special_tokens")


def test_worker_session_messages_round_trip():
    submit = worker_pb2.RouterMessage(submit=worker_pb2.Submit(
        request_id="r1/0", prompt_token_ids=[1, 2, 3], output_token_ids=[4],
        params=generation_pb2.SamplingParameters(max_tokens=5),
        trace_context={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}))
    step = worker_pb2.WorkerMessage(step=worker_pb2.StepOutput(step_index=9, deltas=[
        worker_pb2.RequestDelta(request_id="r1/0", new_token_ids=[5], num_prompt_tokens=3,
                                finish_reason=worker_pb2.FINISH_REASON_LENGTH,
                                logprobs=[worker_pb2.TokenLogprobs(
                                    logprob=-0.5, top_token_ids=[5, 6],
                                    top_logprobs=[-0.5, -1.5])])]))
    event = worker_pb2.WorkerMessage(event=worker_pb2.Event(
        request_id="r1/0", kind=worker_pb2.EVENT_KIND_PREEMPTED,
        mode=worker_pb2.PREEMPTION_MODE_RECOMPUTE))
    for message in (submit, step, event):
        assert type(message).FromString(message.SerializeToString()) == message
    assert submit.WhichOneof("kind") == "submit" and event.WhichOneof("kind") == "event"


def test_protos_compile_without_warnings(protoc_run):
    result, files = protoc_run
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == ""
    assert {f.name for f in files.file} == set(PROTO_FILES)


def test_every_proto_declares_a_go_package_under_its_own_path(protoc_run):
    """protoc-gen-go refuses a file without go_package; each names an import path that mirrors
    the file's folder under pagedserve/gen/go, and a package name after its proto package."""
    _, files = protoc_run
    assert {f.name for f in files.file} == set(PROTO_FILES)
    for file in files.file:
        assert file.options.HasField("go_package"), f"{file.name} declares no go_package"
        import_path, _, go_name = file.options.go_package.partition(";")
        assert import_path == "pagedserve/gen/go/" + file.name.rpartition("/")[0], file.name
        *_, parent, version = file.package.split(".")
        assert go_name == parent + version, file.name  # pagedservev1, workerv1


def _declarations(file: descriptor_pb2.FileDescriptorProto):
    """(source path, name) of every service, method, message, field, oneof, enum and value.

    Source paths index the descriptor's fields, as SourceCodeInfo.Location.path does. Synthetic
    declarations (map entries, the oneofs behind proto3 `optional`) have no source of their own.
    """
    def enums(enum_types, path, scope):
        for i, enum in enumerate(enum_types):
            yield (*path, i), scope + enum.name
            for j, value in enumerate(enum.value):
                yield (*path, i, 2, j), f"{scope}{enum.name}.{value.name}"

    def messages(message_types, path, scope):
        for i, message in enumerate(message_types):
            if message.options.map_entry:
                continue
            name = scope + message.name
            yield (*path, i), name
            for j, field in enumerate(message.field):
                yield (*path, i, 2, j), f"{name}.{field.name}"
            synthetic = {f.oneof_index for f in message.field if f.proto3_optional}
            for k, oneof in enumerate(message.oneof_decl):
                if k not in synthetic:
                    yield (*path, i, 8, k), f"{name}.{oneof.name}"
            yield from messages(message.nested_type, (*path, i, 3), name + ".")
            yield from enums(message.enum_type, (*path, i, 4), name + ".")

    yield from messages(file.message_type, (4,), "")
    yield from enums(file.enum_type, (5,), "")
    for i, service in enumerate(file.service):
        yield (6, i), service.name
        for j, method in enumerate(service.method):
            yield (6, i, 2, j), f"{service.name}.{method.name}"


def test_every_declaration_has_a_leading_comment(protoc_run):
    _, files = protoc_run
    undocumented, checked = [], 0
    for file in files.file:
        comments = {tuple(loc.path): loc.leading_comments.strip()
                    for loc in file.source_code_info.location}
        for path, name in _declarations(file):
            checked += 1
            if not comments.get(path):
                undocumented.append(f"{file.name}: {name}")
    assert checked > 150  # the walk really covered both files
    assert not undocumented, "missing leading comments:\n" + "\n".join(undocumented)


def test_generated_code_is_rebuilt_only_when_a_proto_changes(tmp_path, monkeypatch):
    protos, out = tmp_path / "protos", tmp_path / "generated"
    shutil.copytree(PROTO_ROOT, protos)
    compiled = []
    real_compile = pb._compile
    monkeypatch.setattr(pb, "_compile", lambda *args: compiled.append(1) or real_compile(*args))

    pb.ensure_generated(protos, out)
    pb.ensure_generated(protos, out)
    assert len(compiled) == 1

    proto = protos / "pagedserve" / "v1" / "generation.proto"
    proto.write_text(proto.read_text() + "\n// An edit.\n")
    pb.ensure_generated(protos, out)
    assert len(compiled) == 2
    assert (out / "pagedserve" / "FINGERPRINT").read_text() == pb.fingerprint(protos)
    assert (out / "pagedserve" / "worker" / "v1" / "worker_pb2_grpc.py").is_file()
    assert [p.name for p in out.iterdir()] == ["pagedserve"]  # no staging left behind
