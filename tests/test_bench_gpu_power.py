"""bench/gpu_power.py: nvidia-smi's samples summarised over the stretch of work they cover."""

import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from gpu_power import reason_names, summarize  # noqa: E402

START = datetime.datetime(2026, 12, 3, 19, 0, 0)
# timestamp, power.draw, power.limit, clocks.sm, clocks.mem, clocks_event_reasons.active
LINES = [
    "2026/12/03 18:59:59.950, 90.5, 700.00, 345, 3201, 0x0000000000000001",     # before: idle
    "2026/12/03 19:00:00.100, 640.2, 700.00, 1980, 3201, 0x0000000000000000",
    "2026/12/03 19:00:00.150, 699.8, 700.00, 1755, 3201, 0x0000000000000004",
    "2026/12/03 19:00:00.200, 700.1, 700.00, 1605, 3201, 0x0000000000000004",
    "2026/12/03 19:00:00.250, 612.0, 700.00, 1830, 3201, 0x0000000000000044",
    "2026/12/03 19:00:03.000, 80.0, 700.00, 345, 3201, 0x0000000000000001",     # after
    "2026/12/03 19:00:00.3",                                                    # cut short
]


def test_only_the_samples_inside_the_window_count():
    summary = summarize(LINES, START, START + datetime.timedelta(seconds=1))
    assert summary.samples == 4
    assert summary.mean_power_w == (640.2 + 699.8 + 700.1 + 612.0) / 4
    assert summary.max_power_w == 700.1 and summary.power_limit_w == 700.0
    assert summary.min_sm_mhz == 1605 and summary.mean_mem_mhz == 3201


def test_each_limiting_reason_is_named_with_the_share_of_samples_it_held_in():
    summary = summarize(LINES, START, START + datetime.timedelta(seconds=1))
    assert summary.reasons == {"hw_thermal_slowdown": 0.25, "sw_power_cap": 0.75}
    assert "sw_power_cap 75%" in summary.line()


def test_reason_bits_decode_to_nvidia_smis_names():
    assert reason_names(0x4) == ["sw_power_cap"]
    assert reason_names(0x81) == ["gpu_idle", "hw_power_brake_slowdown"]
    assert reason_names(0) == []


def test_a_window_without_samples_gives_nothing():
    assert summarize(LINES, START + datetime.timedelta(hours=1), START + datetime.timedelta(hours=2)) is None
