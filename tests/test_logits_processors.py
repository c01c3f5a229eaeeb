"""Custom logits processors (worker.logits_processors): loading, selection per request, the
shipped dynamic-temperature example, and refusals."""

from __future__ import annotations

import textwrap

import pytest
import torch

from common.sampling_params import InvalidRequest, SamplingParams
from worker.length_temperature import LengthTemperature
from worker.logits_processors import LogitsProcessor, ProcessorBatch, load_processors
from worker.sampler import SamplingBatch, SamplingRow, sample

CPU = torch.device("cpu")
V = 8
ROW = [0.0, 3.0, 1.0, 2.9, -1.0, 0.5, 2.0, 0.1]
LENGTH_TEMPERATURE = "worker.length_temperature:LengthTemperature"


class ForceZero(LogitsProcessor):
    """Makes token 0 the likeliest, and keeps what it was given for the test to read."""
    name = "force_zero"

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__(vocab_size, device)
        self.seen: list[ProcessorBatch] = []

    def apply(self, logits: torch.Tensor, batch: ProcessorBatch) -> torch.Tensor:
        self.seen.append(batch)
        logits[:, 0] = 100.0
        return logits


def draws(rows: list[tuple[SamplingParams, int]], processors: dict[str, LogitsProcessor], seed: int = 0,
          output_len: int = 0) -> list[int]:
    """One draw for each (params, prompt length) row from ROW's logits, all with `seed`."""
    sampling_rows = [SamplingRow(p, seed, prompt_len + output_len, [0] * prompt_len, prompt_len, [])
                     for p, prompt_len in rows]
    batch = SamplingBatch.build(sampling_rows, V, CPU, processors=processors)
    return sample(torch.tensor([ROW] * len(rows)), batch).read().token_ids


def test_a_processor_changes_only_the_rows_that_selected_it_and_learns_their_lengths_and_args():
    force = ForceZero(V, CPU)
    chosen = SamplingParams(temperature=0, logits_processors=["force_zero"], extra_args={"k": 1.0})
    plain = SamplingParams(temperature=0)
    assert draws([(chosen, 5), (plain, 6), (chosen, 7)], {"force_zero": force}, output_len=2) == [0, 1, 0]
    [batch] = force.seen
    assert batch.prompt_lens.tolist() == [5, 7] and batch.output_lens.tolist() == [2, 2]
    assert batch.extra_args == [{"k": 1.0}, {"k": 1.0}]


def test_length_temperature_samples_at_temperature_times_one_plus_input_length_over_1000():
    processors = {"length_temperature": LengthTemperature(V, CPU)}
    scaled = SamplingParams(temperature=0.5, logits_processors=["length_temperature"])
    # 1000 prompt tokens double the temperature: 0.5 becomes 1.0 (exactly, in binary).
    got = [draws([(scaled, 1000)], processors, seed)[0] for seed in range(200)]
    expected = [draws([(SamplingParams(temperature=1.0), 1000)], {}, seed)[0] for seed in range(200)]
    unscaled = [draws([(SamplingParams(temperature=0.5), 1000)], {}, seed)[0] for seed in range(200)]
    assert got == expected != unscaled


def test_length_temperature_leaves_greedy_requests_greedy():
    processors = {"length_temperature": LengthTemperature(V, CPU)}
    greedy = SamplingParams(temperature=0, logits_processors=["length_temperature"])
    assert draws([(greedy, 3000)], processors) == [1]


def test_length_temperature_takes_its_scale_from_extra_args(make_engine, smollm_tokenizer):
    engine = make_engine(logits_processors=(LENGTH_TEMPERATURE,))
    prompt = smollm_tokenizer.encode("Once upon a time, in a small village by the sea,", add_special_tokens=False)
    # Scale: the prompt's length, which doubles the temperature (as a 1000-token prompt would).
    scaled = SamplingParams(temperature=0.6, seed=7, max_tokens=12, logits_processors=["length_temperature"],
                            extra_args={"length_scale": len(prompt)})

    def tokens(params: SamplingParams) -> list[int]:
        engine.add_request("r", prompt, params)
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() for t in o.new_token_ids]
        return out
    got = tokens(scaled)
    assert got == tokens(SamplingParams(temperature=1.2, seed=7, max_tokens=12))
    assert got != tokens(SamplingParams(temperature=0.6, seed=7, max_tokens=12))


def test_a_processor_the_worker_did_not_load_is_refused_naming_it(make_engine):
    engine = make_engine(logits_processors=(LENGTH_TEMPERATURE,))
    with pytest.raises(InvalidRequest, match=r"^logits_processors: 'nope' is not loaded .*length_temperature"):
        engine.add_request("r", [1, 2, 3], SamplingParams(logits_processors=["nope"]))
    assert not engine.has_unfinished()


def test_arguments_a_processor_refuses_are_refused_naming_extra_args(make_engine):
    engine = make_engine(logits_processors=(LENGTH_TEMPERATURE,))
    with pytest.raises(InvalidRequest, match=r"^extra_args: length_scale=-1 must be a positive number") as refused:
        engine.add_request("r", [1, 2, 3], SamplingParams(logits_processors=["length_temperature"],
                                                          extra_args={"length_scale": -1}))
    assert refused.value.field == "extra_args"


def test_a_processor_loads_from_a_plugin_packages_entry_point(tmp_path, monkeypatch):
    (tmp_path / "halving_plugin.py").write_text(textwrap.dedent("""
        from worker.logits_processors import LogitsProcessor

        class Halve(LogitsProcessor):
            name = "halve"

            def apply(self, logits, batch):
                return logits / 2
    """))
    metadata = tmp_path / "halving_plugin-1.0.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: halving-plugin\nVersion: 1.0\n")
    (metadata / "entry_points.txt").write_text("[pagedserve.logits_processors]\nhalve = halving_plugin:Halve\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    [(name, processor)] = load_processors(["halve"], V, CPU).items()
    assert name == "halve" and type(processor).__name__ == "Halve"


@pytest.mark.parametrize("spec,problem", [
    ("no_such_entry_point", "neither module:Class nor an entry point"),
    ("worker.length_temperature:Missing", "does not load"),
    ("worker.length_temperature:DEFAULT_SCALE", "is not a subclass"),
    (f"{__name__}:LogitsProcessor", "has no name"),
])
def test_a_spec_that_names_no_processor_does_not_load_and_says_why(spec, problem):
    with pytest.raises(ValueError, match=problem):
        load_processors([spec], V, CPU)
