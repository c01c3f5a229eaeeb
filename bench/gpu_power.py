"""The GPU's power draw, clocks and clock-limiting reasons over a stretch of work, sampled by
`nvidia-smi` every 50 ms: whether a kernel that streams weights is held back by the power limit
rather than by its own design (docs/BENCHMARKS.md, the one-row fusions).

    with PowerSampler() as sampler:
        start = datetime.datetime.now(); work(); end = datetime.datetime.now()
    print(sampler.summary(start, end))
"""

from __future__ import annotations

import datetime
import subprocess
import tempfile
from dataclasses import dataclass

FIELDS = "timestamp,power.draw,power.limit,clocks.sm,clocks.mem,clocks_event_reasons.active"
TIMESTAMP = "%Y/%m/%d %H:%M:%S.%f"
# nvidia-smi's clocks_event_reasons bits (its --help-query-gpu).
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
           0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}


@dataclass
class PowerSummary:
    samples: int
    mean_power_w: float
    max_power_w: float
    power_limit_w: float
    mean_sm_mhz: float
    min_sm_mhz: float
    mean_mem_mhz: float
    reasons: dict[str, float]       # each limiting reason: the share of samples it was active in

    def line(self) -> str:
        active = ", ".join(f"{name} {share:.0%}" for name, share in self.reasons.items()) or "none"
        return (f"power {self.mean_power_w:.0f} W (max {self.max_power_w:.0f}, limit {self.power_limit_w:.0f}), "
                f"SM clock {self.mean_sm_mhz:.0f} MHz (min {self.min_sm_mhz:.0f}), memory clock "
                f"{self.mean_mem_mhz:.0f} MHz, limiting reasons: {active} ({self.samples} samples)")


def reason_names(mask: int) -> list[str]:
    return [name for bit, name in REASONS.items() if mask & bit]


def summarize(lines: list[str], start: datetime.datetime, end: datetime.datetime) -> PowerSummary | None:
    """The samples (`FIELDS`, CSV without header or units) taken in [start, end]; None if none."""
    rows = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            when = datetime.datetime.strptime(parts[0], TIMESTAMP)
            values = [float(p) for p in parts[1:5]] + [int(parts[5], 16)]
        except (ValueError, IndexError):
            continue        # a partial last line, or a field this GPU reports as N/A
        if start <= when <= end:
            rows.append(values)
    if not rows:
        return None
    power, limit, sm, mem, masks = zip(*rows)
    counts: dict[str, int] = {}
    for mask in masks:
        for name in reason_names(mask):
            counts[name] = counts.get(name, 0) + 1
    return PowerSummary(len(rows), sum(power) / len(rows), max(power), max(limit), sum(sm) / len(rows), min(sm),
                        sum(mem) / len(rows), {name: n / len(rows) for name, n in sorted(counts.items())})


class PowerSampler:
    """Runs `nvidia-smi` sampling every `interval_ms` while the context is open."""

    def __init__(self, interval_ms: int = 50):
        self.interval_ms = interval_ms
        self.lines: list[str] = []      # the samples, once the context has closed

    def __enter__(self) -> "PowerSampler":
        self._log = tempfile.TemporaryFile("w+")
        self._process = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
                                          f"--loop-ms={self.interval_ms}"], stdout=self._log, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        self._process.terminate()
        self._process.wait()
        with self._log:
            self._log.seek(0)
            self.lines = self._log.read().splitlines()

    def summary(self, start: datetime.datetime, end: datetime.datetime) -> PowerSummary | None:
        return summarize(self.lines, start, end)
