"""The `pagedserve` command line: flags, their environment variables, and refusals."""

import pytest

from common import cli


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


@pytest.mark.parametrize("argv, message", [
    (["serve", "--role", "router"], "--role router needs --workers"),
])
def test_serve_refuses_what_it_cannot_do(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert message in capsys.readouterr().err


def test_worker_module_refuses_an_invalid_environment_variable_naming_it(monkeypatch, capsys):
    from worker import server

    monkeypatch.setenv("PAGEDSERVE_MAX_NUM_SEQS", "lots")
    with pytest.raises(SystemExit):
        server.main([])
    assert "PAGEDSERVE_MAX_NUM_SEQS='lots' is invalid" in capsys.readouterr().err
