"""The machine the runner is on: CPU model and measured memory bandwidth (decode at batch 1 is bound by it, and
benchmarks report both), and the rows onnxruntime's fp32 matmul kernel computes per pass (what a verify call costs)."""

from __future__ import annotations

import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def cpuinfo_field(name: str) -> str | None:
    """The first value Linux's /proc/cpuinfo gives `name` (e.g. "model name", "flags"); None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU as results should name it: the model name, and what a generic name ("AMD EPYC" in a VM) hides and decode
    speed depends on: family and model (a Zen 3 and a Zen 5 EPYC share the name), the vector instructions
    onnxruntime's kernels choose between, the L3 size."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    try:
        l3 = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        l3 = None
    return describe_cpu(cpuinfo, l3) or platform.processor() or "unknown"


# the instruction sets onnxruntime's CPU kernels pick between, as Linux names them, best first
_VECTOR_ISAS = (
    ("amx_tile", "AMX"),
    ("avx512f", "AVX-512"),
    ("avx512_vnni", "AVX-512 VNNI"),
    ("avx_vnni", "AVX-VNNI"),
    ("avx2", "AVX2"),
    ("fma", "FMA"),
    ("sve", "SVE"),
    ("asimddp", "NEON dot product"),
    ("asimd", "NEON"),
)


def describe_cpu(cpuinfo: str, l3_size: str | None) -> str | None:
    """ "model name (family F model M; ISAs; L3 size)" from /proc/cpuinfo's text and sysfs' L3 size ("32768K")."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())  # the first CPU's
    model = fields.get("model name")
    if not model:
        return None
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    details = []
    if "cpu family" in fields and "model" in fields:
        details.append(f"family {fields['cpu family']} model {fields['model']}")
    isas = [label for flag, label in _VECTOR_ISAS if flag in flags]
    if isas:
        details.append(", ".join(isas))
    if l3_size:
        kib = int(l3_size.rstrip("K")) if l3_size.endswith("K") and l3_size[:-1].isdigit() else None
        details.append(f"L3 {kib // 1024} MiB" if kib and kib % 1024 == 0 else f"L3 {l3_size}")
    return f"{model} ({'; '.join(details)})" if details else model


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them; empty where /proc/cpuinfo is not there to read."""
    return set((cpuinfo_field("flags") or "").split())


def fp32_matmul_rows_per_pass(flags: set[str]) -> int | None:
    """Rows of the left matrix (tokens) that onnxruntime's x86-64 fp32 matmul kernel (MLAS SGEMM, FMA3 or AVX-512F)
    multiplies in one pass over the weights: 6 (the AVX-512F kernel takes 12 only when it has 12 or more; from 7 to 11
    it makes a 6-row pass and another). A 7th token costs a second pass (measured on AVX2 and AVX-512 CPUs:
    docs/measurements.md). None on other CPUs (not measured)."""
    return 6 if "avx512f" in flags or {"avx2", "fma"} <= flags else None


# Rows of the left matrix (tokens) our quantized matmul kernels' AVX2 tiles multiply against each unpacked chunk of
# weights (plugins/int4_matmul.c, ROW_TILE_AVX2): a 5th row makes a second pass. On a CPU without VNNI those rows' dot
# products, not the weight stream, set a verify call's cost (benchmarks/results/int4_zen3.md).
QUANTIZED_AVX2_ROWS_PER_PASS = 4


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
