"""The `pagedserve` command line: flags, their environment variables, and refusals; how
`serve` starts up (real processes): taken ports, bad settings, and the worker of --role all."""

import argparse
import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from launcher import cli
from common.pb import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from worker_process import REPO, free_port, module_command

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
# A log line of start-up progress: "2026-12-01 11:43:53,310 INFO pagedserve.worker ...".
PROGRESS_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ INFO pagedserve\.")


def parse_serve(argv, monkeypatch, **env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = cli._serve_parser()
    return parser.parse_args(argv)


def test_environment_variable_sets_a_flag_and_the_command_line_wins(monkeypatch):
    args = parse_serve([], monkeypatch, PAGEDSERVE_MAX_QUEUE_LEN="7",
                       PAGEDSERVE_MIGRATE_ON_PREEMPTION="false",
                       PAGEDSERVE_WORKERS="a:1,b:2")
    assert (args.max_queue_len, args.migrate_on_preemption, args.workers) == (
        7, False, ["a:1", "b:2"])
    assert parse_serve(["--max-queue-len", "9"], monkeypatch).max_queue_len == 9


def test_priority_preemption_is_on_by_default_and_its_flags_reach_the_router(monkeypatch):
    from router.preemption import PreemptionConfig

    def preemption(*flags):
        args = parse_serve(["--role", "router", "--workers", "a:1", *flags], monkeypatch)
        return cli._router_config(args, args.workers).preemption
    assert preemption() == PreemptionConfig(enabled=True, min_run_s=1.0)
    assert preemption("--no-preempt-for-priority", "--preemption-min-run", "2.5") == (
        PreemptionConfig(enabled=False, min_run_s=2.5))


def test_invalid_environment_variable_is_refused_naming_it(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse_serve([], monkeypatch, PAGEDSERVE_OVERCOMMIT="lots")
    assert "PAGEDSERVE_OVERCOMMIT='lots' is invalid" in capsys.readouterr().err


def test_help_names_each_flags_environment_variable(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name in ("PAGEDSERVE_MAX_CONCURRENT_REQUESTS", "PAGEDSERVE_WORKER_PORT",
                 "PAGEDSERVE_MAX_NUM_SEQS", "PAGEDSERVE_LOG_FORMAT"):
        assert f"[env {name}]" in help_text


def test_help_gives_the_step_budget_of_each_device_not_a_default_of_none(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "default 4096 on a GPU, 2048 on the CPU" in help_text
    assert "(default: None)" not in help_text
    assert "(default: 256)" in help_text        # given defaults are still shown (--max-num-seqs)


ROUTER_WITHOUT_TORCH = """
import contextlib, io, sys
from launcher import cli
with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
    cli.main(["serve", "--help"])
args = cli._serve_parser().parse_args(["--role", "router", "--workers", "127.0.0.1:1"])
cli._router_config(args, args.workers)
import router.server
print(sorted(name for name in sys.modules if name == "torch" or name.startswith("torch.")))
"""


def test_a_router_needs_no_torch():
    """`serve --help` and everything `--role router` runs import no torch: a router image needs
    none, and starts in a fraction of the time."""
    result = subprocess.run([sys.executable, "-c", ROUTER_WITHOUT_TORCH], env=ENV, cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.parametrize("argv, message", [
    (["serve", "--role", "router"], "--role router needs --workers"),
    (["serve", "--port", "70000"], "--port 70000 is not a port: it takes 0 to 65535"),
    (["serve", "--http-port", "-2"], "--http-port -2 is not a port: it takes 0 to 65535 (0: any free port; -1: off)"),
    (["serve", "--metrics-port", "-1"], "--metrics-port -1 is not a port"),
    (["serve", "--overcommit", "nan"], "--overcommit nan must be above 0"),
    (["serve", "--overcommit", "0"], "--overcommit 0 must be above 0"),
    (["serve", "--max-concurrent-requests", "0"], "--max-concurrent-requests 0 must be at least 1"),
    (["serve", "--max-queue-len", "-1"], "--max-queue-len -1 must be at least 0"),
    (["serve", "--max-queue-wait", "-1"], "--max-queue-wait -1 must be at least 0 seconds"),
    (["serve", "--worker-timeout", "inf"], "--worker-timeout inf must be above 0 seconds"),
])
def test_serve_refuses_what_it_cannot_do(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--seed", "-5"], "--seed -5: out of range; it takes 0 to 18446744073709551615"),
    (["--max-tokens", "99999999999"], "--max-tokens 99999999999: out of range; it takes -2147483648 to 2147483647"),
])
def test_complete_refuses_a_number_its_request_cannot_hold_as_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["complete", "Hi", "--address", "127.0.0.1:1", *argv])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_an_engine_flag_of_several_values_reaches_the_worker_of_serve_all_whole(monkeypatch):
    specs = ["worker.length_temperature:LengthTemperature", "plugin:Other"]
    env = cli._engine_env(parse_serve(["--logits-processors", *specs], monkeypatch))
    worker = parse_serve(["--role", "worker"], monkeypatch,
                         PAGEDSERVE_LOGITS_PROCESSORS=env["PAGEDSERVE_LOGITS_PROCESSORS"])
    assert worker.logits_processors == specs


def test_lora_modules_reach_the_worker_of_serve_all_whole(monkeypatch):
    env = cli._engine_env(parse_serve(["--lora-modules", "sql=/a/sql", "poet=/a/poet"], monkeypatch))
    worker = parse_serve(["--role", "worker"], monkeypatch, PAGEDSERVE_LORA_MODULES=env["PAGEDSERVE_LORA_MODULES"])
    assert worker.lora_modules == [("sql", "/a/sql"), ("poet", "/a/poet")]


def test_an_invalid_engine_environment_variable_is_refused_naming_it(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse_serve(["--role", "worker"], monkeypatch, PAGEDSERVE_MAX_NUM_SEQS="lots")
    assert "PAGEDSERVE_MAX_NUM_SEQS='lots' is invalid" in capsys.readouterr().err


# ------------------------------------------------------------------------------ start-up, real processes

def run_to_end(module: str, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """Runs `python -m module args` until it exits (within timeout_s); its output as text."""
    return subprocess.run(module_command(module, *args), cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=timeout_s)


def serve_args(role: str, **ports: int) -> list[str]:
    """`serve --role role` on loopback with a small KV pool; every port free unless given
    (as keywords: http_port=... for --http-port)."""
    flags = {"--port": free_port(), "--http-port": free_port(), "--metrics-port": free_port(),
             "--worker-port": free_port(),
             **{"--" + name.replace("_", "-"): port for name, port in ports.items()}}
    args = ["serve", "--role", role, "--host", "127.0.0.1", "--num-blocks", "128"]
    if role == "router":
        args += ["--workers", f"127.0.0.1:{free_port()}"]
    return args + [str(part) for flag, port in flags.items() for part in (flag, port)]


@pytest.fixture
def taken_port():
    """A loopback port another server listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("role, flag", [
    ("all", "port"), ("all", "http_port"), ("all", "worker_port"), ("worker", "worker_port"),
    ("router", "port"), ("router", "http_port"),
])
def test_serve_refuses_a_taken_port_at_once_in_one_line_naming_its_flag(role, flag, taken_port):
    result = run_to_end("launcher.cli", *serve_args(role, **{flag: taken_port}))
    assert result.returncode != 0
    assert result.stderr.splitlines() == [  # nothing else: no model was loaded, no traceback
        f"pagedserve: --{flag.replace('_', '-')} {taken_port} is already in use (another server "
        "is listening there); choose another port"]


@pytest.mark.slow
def test_serve_refuses_one_port_given_to_two_flags():
    port = free_port()
    result = run_to_end("launcher.cli", *serve_args("router", port=port, http_port=port))
    assert result.returncode != 0
    assert result.stderr.splitlines() == [
        f"pagedserve: --http-port {port} is also --port; give each its own port"]


@pytest.mark.slow
@pytest.mark.parametrize("role", ["worker", "all"])
@pytest.mark.parametrize("flags, message", [
    (["--model", "/no/such/model"], "model path '/no/such/model' does not exist"),
    (["--block-size", "-16"], "block_size=-16 must be one of 8, 16, 32, 64, 128"),
    (["--max-model-len", "-1"], "max_model_len=-1 must be >= 1"),
    (["--swap-space", "-1"], "swap_space_gb=-1.0 must be >= 0"),
    (["--model", "DAMAGED"], "damaged.gguf is not a valid GGUF file"),
], ids=["missing model", "negative block size", "negative context", "negative swap space", "damaged gguf"])
def test_start_up_error_is_one_line_without_traceback(role, flags, message, tmp_path):
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    flags = [str(damaged) if flag == "DAMAGED" else flag for flag in flags]
    result = run_to_end("launcher.cli", *serve_args(role), *flags)
    assert result.returncode != 0
    # Besides the INFO lines start-up shows its progress with, one line: with --role all the
    # worker's, said once.
    [line] = [line for line in result.stderr.splitlines() if not PROGRESS_LINE.match(line)]
    assert line.startswith("pagedserve: ")
    assert message in line


@pytest.mark.slow
def test_a_bug_at_start_up_keeps_its_traceback():
    # The entry point runs with a run_worker that fails as a bug would.
    launcher = ("import sys, launcher.cli, worker.server\n"
                "def bug(*args, **kwargs):\n"
                "    raise RuntimeError('a bug')\n"
                "worker.server.run_worker = bug\n"
                "sys.exit(launcher.cli.main())\n")
    args = ["serve", "--role", "worker", "--host", "127.0.0.1", "--worker-port", "0", "--metrics-port", "0"]
    result = subprocess.run([sys.executable, "-c", launcher, *args], cwd=REPO, env=ENV,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "RuntimeError: a bug" in result.stderr


class StrangerWorker(worker_pb2_grpc.WorkerServicer):
    """Another process's worker, as far as Info tells; counts the sessions opened with it."""

    def __init__(self) -> None:
        self.sessions = 0

    def Info(self, request, context):
        return worker_pb2.InfoResponse(worker_id="stranger")

    def Session(self, request_iterator, context):
        self.sessions += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "a stranger")


@contextlib.contextmanager
def stranger_serving_on(port: int):
    """A gRPC server that says SERVING on port and is no worker of the test's: its servicer."""
    stranger = StrangerWorker()
    server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
    worker_pb2_grpc.add_WorkerServicer_to_server(stranger, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()
    try:
        yield stranger
    finally:
        server.stop(0)


class Serve:
    """`pagedserve args` as a process; its output (stderr too, and its worker's) is read as it
    comes on a thread of its own, so that the pipe never fills."""

    def __init__(self, args: list[str]) -> None:
        self.process = subprocess.Popen(module_command("launcher.cli", *args), cwd=REPO, env=ENV,
                                        text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self._new_line = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._new_line:
                self.lines.append(line.rstrip("\n"))
                self._new_line.notify_all()

    def wait_for(self, text: str, timeout_s: float) -> None:
        """Returns once a line of the output holds text; fails after timeout_s."""
        with self._new_line:
            if not self._new_line.wait_for(lambda: any(text in line for line in self.lines),
                                           timeout_s):
                raise AssertionError(f"no {text!r} within {timeout_s} s in:\n" + "\n".join(self.lines))

    def exit_code(self, timeout_s: float) -> int:
        """Waits until the process has exited and its output is read; its exit code."""
        code = self.process.wait(timeout=timeout_s)
        self._reader.join(timeout_s)
        return code

    def end(self) -> None:
        """Stops the process (the router, then its worker), killing it if it takes too long."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout=60)
        finally:
            self.process.kill()
            self.process.wait()


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="finds the worker in /proc")
def test_serve_all_never_serves_through_a_worker_it_did_not_start():
    worker_port = free_port()
    serve = Serve(serve_args("all", worker_port=worker_port))
    try:
        # serve found the port free and started its worker; then a stranger takes the port.
        eventually(lambda: children(serve.process.pid), 60, "the worker process")
        with stranger_serving_on(worker_port) as stranger:
            assert serve.exit_code(60) != 0
        assert stranger.sessions == 0
        # Whichever saw the stranger first says so: serve (by the worker id) or its worker.
        assert serve.lines[-1] in (
            f"pagedserve: a worker this process did not start (stranger) answers at "
            f"127.0.0.1:{worker_port}; choose another --worker-port",
            f"pagedserve: --worker-port {worker_port} is already in use (another server is "
            "listening there); choose another port")
    finally:
        serve.end()


@pytest.mark.slow
def test_serve_all_logs_its_worker_in_the_format_asked_for():
    """--log-format and --log-level reach the worker that `serve --role all` starts."""
    import json

    serve = Serve(serve_args("all") + ["--log-format", "json"])
    try:
        serve.wait_for('"logger": "pagedserve.worker"', 120)
        entry = json.loads(next(line for line in serve.lines if '"logger": "pagedserve.worker"' in line))
        assert entry["level"] == "INFO" and entry["msg"]
    finally:
        serve.end()


def children(pid: int) -> set[int]:
    """The processes whose parent is pid."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue    # not a process, or one that ended meanwhile
        if parent == pid:
            found.add(int(entry))
    return found


def is_a_worker(pid: int) -> bool:
    """Whether process pid runs (still) and is a worker."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"--role\0worker" in cmdline.read()
    except OSError:
        return False


def kill_if_a_worker(pid: int) -> None:
    if is_a_worker(pid):
        os.kill(pid, signal.SIGKILL)


def router_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


def eventually(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="finds the worker in /proc")
def test_serve_all_restarts_a_worker_that_dies_and_serves_again():
    port = free_port()
    address = f"127.0.0.1:{port}"
    serve = Serve(serve_args("all", port=port, http_port=-1, metrics_port=0))
    workers: set[int] = set()
    try:
        serve.wait_for("pagedserve is serving", 120)
        workers = children(serve.process.pid)
        [first] = workers
        os.kill(first, signal.SIGKILL)
        serve.wait_for("pagedserve: the worker exited with code -9; restarting it", 30)
        eventually(lambda: children(serve.process.pid) - {first}, 30, "a new worker")
        workers = children(serve.process.pid)
        eventually(lambda: router_serving(address), 120, "the router serving again")
        request = generation_pb2.GenerateRequest(
            text="The capital of France is",
            params=generation_pb2.SamplingParameters(max_tokens=4, temperature=0, ignore_eos=True))
        with grpc.insecure_channel(address) as channel:
            responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30))
        assert responses[-1].usage.completion_tokens == 4
    finally:
        serve.end()
        for pid in workers:
            kill_if_a_worker(pid)   # one its serve could not stop outlives it


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="finds the worker in /proc")
def test_serve_all_stopped_while_its_worker_loads_stops_the_worker():
    serve = Serve(serve_args("all"))
    workers: set[int] = set()
    try:
        eventually(lambda: children(serve.process.pid), 60, "the worker process")
        workers = children(serve.process.pid)
        serve.process.send_signal(signal.SIGTERM)
        assert serve.exit_code(60) == 0
        assert not any(is_a_worker(pid) for pid in workers)
    finally:
        serve.end()
        for pid in workers:
            kill_if_a_worker(pid)


def test_serve_all_gives_up_on_a_worker_that_keeps_failing(capsys):
    worker = cli._SupervisedWorker(argparse.Namespace(worker_port=free_port()))

    async def failing_start() -> bool:
        worker.process = await asyncio.create_subprocess_exec(sys.executable, "-c",
                                                              "raise SystemExit(3)")
        return False

    async def scenario() -> int:
        await failing_start()
        worker.start = failing_start
        return await asyncio.wait_for(worker.supervise(), 60)

    assert asyncio.run(scenario()) == 1
    lines = capsys.readouterr().err.splitlines()
    restarts = ["pagedserve: the worker exited with code 3; restarting it"] * cli.MAX_WORKER_RESTARTS
    assert lines == [*restarts, f"pagedserve: the worker exited with code 3: "
                                f"{cli.MAX_WORKER_RESTARTS + 1} failures within "
                                f"{cli.RESTART_WINDOW_S:g} s; giving up"]
