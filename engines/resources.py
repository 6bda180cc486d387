"""Process memory, measured the same way by the builder's report and the runner's benchmarks."""

from __future__ import annotations

import resource
from pathlib import Path


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB.

    Linux's VmHWM, which starts afresh at exec; getrusage's ru_maxrss does not, so a benchmark worker started by a
    large parent would report the parent's peak. Falls back to ru_maxrss where there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def children_peak_rss_mb() -> float:
    """The largest peak resident memory, in MiB, of this process's children that have ended (and been waited for)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
