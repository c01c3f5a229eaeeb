"""bench/report.py: the benchmarks' JSON becomes a BENCHMARKS.md section with honest verdicts."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parent.parent / "bench" / "report.py"
sys.path.insert(0, str(REPORT.parent))

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


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false",
                           *args], cwd=tree, check=True, capture_output=True, text=True).stdout.strip()


def checkout_with_the_report(tree: Path) -> Path:
    """`tree` made a git checkout whose one commit holds bench/report.py."""
    (tree / "bench").mkdir(parents=True)
    shutil.copy(REPORT, tree / "bench" / "report.py")
    git(tree, "init", "-q")
    git(tree, "add", ".")
    git(tree, "commit", "-q", "-m", "first")
    return tree


def commit_named(tree: Path) -> str:
    """What current_commit() of the report.py in tree/bench gives, with no PAGEDSERVE_COMMIT."""
    env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_COMMIT"}
    return subprocess.run([sys.executable, "-c", "from report import current_commit; print(current_commit())"],
                          cwd=tree / "bench", env=env, check=True, capture_output=True, text=True).stdout.strip()


def test_a_clean_checkout_is_named_by_its_commit(tmp_path):
    tree = checkout_with_the_report(tmp_path / "repo")
    assert commit_named(tree) == git(tree, "rev-parse", "--short", "HEAD")


@pytest.mark.parametrize("change", ["edited", "untracked"])
def test_a_tree_that_differs_from_its_commit_is_named_dirty(tmp_path, change):
    tree = checkout_with_the_report(tmp_path / "repo")
    if change == "edited":
        (tree / "bench" / "report.py").write_text((tree / "bench" / "report.py").read_text() + "\n")
    else:
        (tree / "new.py").write_text("")
    assert commit_named(tree) == git(tree, "rev-parse", "--short", "HEAD") + "-dirty"


def test_a_copied_tree_inside_another_checkout_is_unknown_not_that_checkouts_commit(tmp_path):
    """The device machine runs a copy of the working tree without .git: a .git above it is
    another checkout's."""
    outer = checkout_with_the_report(tmp_path / "outer")
    copy = outer / "copy"
    (copy / "bench").mkdir(parents=True)
    shutil.copy(REPORT, copy / "bench" / "report.py")
    assert commit_named(copy) == "unknown"
