"""A helper process that is a fresh Python interpreter, talking to its parent over a socket pair.

Used where work must run apart from the caller's process: a tensor-parallel build's ranks (for the memory they hand
back when they end) and the server's grammar compiles (which must be killable). The child is `python -c PROGRAM`,
PROGRAM importing the module that serves it, not a fork (a server has threads) nor multiprocessing's spawn, which
imports the caller's `__main__` again, so a script without a main guard would start itself. The socket pair carries
multiprocessing's `Connection` (pickled messages); each caller keeps its own protocol over it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

PR_SET_PDEATHSIG = 1  # prctl's

# the directory that holds the packages: the child imports them whether or not they are installed
PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


def start_child_interpreter(program: str, args: list[str]) -> tuple[subprocess.Popen, Connection]:
    """Starts `python -c program FD *args`, FD the child's end of the socket pair -> (the process, our end)."""
    ours, theirs = socket.socketpair()
    path = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
    with theirs:
        process = subprocess.Popen(
            [sys.executable, "-c", program, str(theirs.fileno()), *args],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": path},
        )
    return process, Connection(ours.detach())


def die_with_parent() -> ctypes.CDLL | None:
    """In the child: be killed when the parent ends (strictly: when the parent's thread that started it does), so
    that no child outlives the process it works for. -> glibc, for further settings, or None where there is none."""
    with contextlib.suppress(OSError, AttributeError):  # glibc on Linux
        libc = ctypes.CDLL("libc.so.6")
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        return libc
    return None
