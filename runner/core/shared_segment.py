"""The shared memory through which the ranks of a tensor-parallel engine on one host exchange their collectives'
data (plugins/collectives.c), and its handing to the engine's kernel library in a rank's process."""

from __future__ import annotations

import ctypes
import os
import tempfile
from pathlib import Path

# A rank waits this long for the others at a collective before it gives up (a hung rank): between two collectives
# a rank computes one layer's share, far less than this even for a long prompt chunk.
DEFAULT_TIMEOUT_S = 10.0


class SharedSegment:
    """The shared memory the ranks of one host exchange their collectives' data through, handed to the kernel
    library of this process (`library`: the engine's, the very file onnxruntime loads, so both see one copy of
    it). Rank 0 creates it (`create`) and removes its name as soon as every rank has attached (`unlink`), so
    nothing is left behind however the processes end."""

    def __init__(self, library: Path, path: Path, rank: int, ranks: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.path = path
        self.library = ctypes.CDLL(str(library))
        self.library.llm_tp_attach.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
        error = self.library.llm_tp_attach(str(path).encode(), rank, ranks, int(timeout_s * 1000))
        if error:
            raise OSError(-error, f"cannot attach the tensor-parallel segment {path}: {os.strerror(-error)}")

    @staticmethod
    def create(library: Path, ranks: int) -> Path:
        """A new zeroed segment for `ranks` ranks, in /dev/shm where it exists; its path."""
        lib = ctypes.CDLL(str(library))
        lib.llm_tp_segment_bytes.restype = ctypes.c_size_t
        size = lib.llm_tp_segment_bytes(ranks)
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        handle, name = tempfile.mkstemp(prefix="llm-engine-tp-", dir=directory)
        os.ftruncate(handle, size)
        os.close(handle)
        return Path(name)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def times(self) -> tuple[float, float]:
        """Seconds this process's rank spent in collectives, and of those waiting for the other ranks."""
        times = (ctypes.c_int64 * 2)()
        self.library.llm_tp_times(times)
        return times[0] / 1e9, times[1] / 1e9

    def aborted(self) -> bool:
        """Whether a collective gave up (a rank gone or hung) or a rank marked the group failed."""
        return bool(self.library.llm_tp_aborted())

    def abort(self) -> None:
        """Every rank's current and future collective fails at once (a rank died, or the group shuts down)."""
        self.library.llm_tp_abort()
