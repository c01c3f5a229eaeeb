"""worker.step_log: one JSON line per engine step, saying what the step computed."""

import io
import json
import time

import pytest

from common.sampling_params import SamplingParams
from worker.step_log import STEP_LOG_ENV, StepLog


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _step(engine, log: StepLog) -> None:
    started = time.monotonic()
    engine.step()
    sched = engine.scheduler
    log.record(started, time.monotonic() - started, engine.last_plan, len(sched.running),
               len(sched.waiting), len(sched.swapped))


def _lines(log: StepLog) -> list[dict]:
    return [json.loads(line) for line in log.file.getvalue().splitlines()]


def test_a_prompt_chunk_is_logged_as_prefill_and_each_later_token_as_a_decode(make_engine):
    engine, log = make_engine(max_num_batched_tokens=8), StepLog(io.StringIO())
    engine.add_request("a", list(range(10, 22)), _greedy(3))
    while engine.has_unfinished():
        _step(engine, log)
    computing = [s for s in _lines(log) if s["prefill_seqs"] or s["decodes"]]
    assert [(s["prefill_tokens"], s["decodes"]) for s in computing] == [(8, 0), (4, 0), (0, 1), (0, 1)]
    # A decode attends to the prompt and every token before it, its own included.
    assert [s["decode_context"] for s in computing[2:]] == [13, 14]


def test_a_step_with_a_prompt_beside_a_decode_counts_both_and_the_queues(make_engine):
    engine, log = make_engine(), StepLog(io.StringIO())
    engine.add_request("a", [5, 6, 7], _greedy(4))
    _step(engine, log)                      # "a"'s prompt
    _step(engine, log)                      # its first decode
    engine.add_request("b", [8, 9, 10, 11, 12], _greedy(2))
    _step(engine, log)
    mixed = _lines(log)[-1]
    assert (mixed["prefill_seqs"], mixed["prefill_tokens"], mixed["decodes"]) == (1, 5, 1)
    assert (mixed["running"], mixed["waiting"], mixed["max_context"]) == (2, 0, 5)
    assert mixed["ms"] > 0


def test_the_log_is_off_without_the_setting(monkeypatch):
    monkeypatch.delenv(STEP_LOG_ENV, raising=False)
    assert StepLog.from_env() is None


def test_a_path_that_cannot_be_opened_is_refused_naming_the_setting(monkeypatch, tmp_path):
    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path / "missing-dir" / "steps.jsonl"))
    with pytest.raises(ValueError, match=f"{STEP_LOG_ENV}=.*missing-dir.*cannot open it"):
        StepLog.from_env()
