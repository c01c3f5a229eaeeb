"""Progress of long work: a bar on a terminal, a log line every tenth elsewhere."""

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger("pagedserve.progress")


def progress(items: Iterable[T], total: int, desc: str) -> Iterator[T]:
    on_terminal = sys.stderr.isatty()
    start, next_report = time.monotonic(), 0.1
    for done, item in enumerate(items, 1):
        yield item
        fraction = done / max(total, 1)
        if on_terminal:
            bar = "#" * int(30 * fraction)
            sys.stderr.write(f"\r{desc} [{bar:<30}] {done}/{total}")
            if done == total:
                sys.stderr.write(f" {time.monotonic() - start:.1f}s\n")
        elif fraction >= next_report or done == total:
            log.info("%s: %d/%d (%.0f%%) after %.1fs", desc, done, total, 100 * fraction,
                     time.monotonic() - start)
            next_report = fraction + 0.1
