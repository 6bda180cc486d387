"""Peak RSS as benchmarks read it: a worker process reports its own peak, not the peak of the process that
started it (getrusage's ru_maxrss carries the parent's over fork + exec)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from engines.resources import peak_rss_mb


def test_a_worker_reports_its_own_peak_not_its_parents():
    ballast = np.ones(400 * 2**20 // 8)  # 400 MiB touched in this (parent) process
    assert peak_rss_mb() >= 400
    child = subprocess.run(
        [sys.executable, "-c", "from engines.resources import peak_rss_mb; print(peak_rss_mb())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert float(child.stdout) < 200, child.stdout  # a bare interpreter: tens of MiB
    del ballast
