"""The machine a benchmark ran on: CPU model and measured memory bandwidth (decode at batch 1 is bound by it)."""

from __future__ import annotations

import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_bandwidth_gbs(threads: int, megabytes: int = 256, repeats: int = 10) -> float:
    """STREAM triad a = b + 3c over three float32 arrays far larger than the caches, split over `threads`
    threads: bytes moved (3 per element) / the best time. numpy has no fused triad, so each thread runs the two
    passes over cache-sized blocks (the temporary stays in cache; main memory sees the three streams only)."""
    n = megabytes * 2**20 // 4
    block = 1 << 20
    rng = np.random.default_rng(0)
    a = np.zeros(n, np.float32)  # zeros, not empty: the first timed pass must not pay page faults
    b, c = rng.random(n, np.float32), rng.random(n, np.float32)
    bounds = np.linspace(0, n, threads + 1).astype(int)

    def triad(part: int) -> None:
        scratch = np.empty(block, np.float32)
        for start in range(bounds[part], bounds[part + 1], block):
            end = min(start + block, bounds[part + 1])
            scaled = scratch[: end - start]
            np.multiply(c[start:end], 3.0, out=scaled)
            np.add(b[start:end], scaled, out=a[start:end])

    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(triad, range(threads)))
            best = min(best, time.perf_counter() - start)
    return 3 * n * 4 / best / 1e9
