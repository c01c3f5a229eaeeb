"""bench/report.py: the benchmarks' JSON becomes a BENCHMARKS.md section with honest verdicts."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from report import section  # noqa: E402

GPU = {"date": "2026-11-29", "gpu": "NVIDIA H200", "torch": "2.11", "commit": "abc1234",
       "copy_bytes_per_s": 4.2e12, "w2_roofline_tokens_per_s": 263.0, "w2_fraction_of_roofline": 0.81,
       "engine": {"weight_bytes": 16.06e9,
                  "w1": {"output_tokens_per_s": 10_400.0, "seconds": 12.6, "steps": 290},
                  "w2": {"decode_tokens_per_s": 214.0, "output_tokens_per_s": 210.0},
                  "w4": {"paged_bytes": 38e9, "tokens": 289_108, "padded_to_longest_bytes": 69e9,
                         "padded_to_max_model_len_bytes": 137e9, "ratio": 1.81, "ratio_vs_max_model_len": 3.6}},
       "transformers": {"w2": {"output_tokens_per_s": 12.8}, "w1_subset": {"output_tokens_per_s": 320.0}}}
ROUTER = {"date": "2026-11-29", "commit": "abc1234",
          "w1": {"output_tokens_per_s": 8_000.0},
          "w3": [{"rate": 32, "requests": 1900, "mean_input_tokens": 200, "mean_output_tokens": 180,
                  "output_tokens_per_s": 5200.0, "ttft_s": {"p50": 0.059, "p99": 0.8},
                  "tpot_s": {"p50": 0.0113, "p99": 0.02}}]}


def row(text: str, starts: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(starts))


def test_targets_met_and_missed_are_called_so_with_the_shortfall():
    text = section(GPU, ROUTER, "bash bench/h200.sh")
    assert "**met**" in row(text, "| W1 offline") and "32.5×" in row(text, "| W1 offline")
    assert "missed by 7%" in row(text, "| W2 batch-1")
    assert "77% of the engine-level figure" in row(text, "| W1 through") and "missed" in row(text, "| W1 through")
    assert "TTFT p50 59 ms" in row(text, "| W3 at 32") and "**met**" in row(text, "| W3 at 32")
    assert text.startswith("## 2026-11-29") and "Commit `abc1234`" in text


def test_kernel_compiles_during_a_measured_phase_are_reported():
    router = {**ROUTER, "w3": [{**ROUTER["w3"][0], "kernels_compiled": ["_decode_kernel", "_reduce_kernel"]}]}
    assert ("2 kernel compiles during it (_decode_kernel, _reduce_kernel)"
            in row(section(GPU, router, "x"), "| W3 at 32"))
    assert "compile" not in row(section(GPU, ROUTER, "x"), "| W3 at 32")


def test_commit_named_by_the_caller_wins_over_the_checkout(monkeypatch):
    from report import current_commit
    monkeypatch.setenv("PAGEDSERVE_COMMIT", "feed123")
    assert current_commit() == "feed123"
