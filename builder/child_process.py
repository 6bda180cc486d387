"""A build step in a fresh interpreter of its own, for the memory it gives back when it ends.

A tensor-parallel build traces one step graph per rank. Built one after the other in one process, the ranks did not
add up (each model is deleted before the next), but the process kept much of what a rank's export had used (glibc's
arenas, torch.export's caches): the fp32 default model's two-rank build peaked at 1,634 MiB against 1,389 MiB for
the single-rank build. A process per rank hands all of it back, so the build's peak is its largest rank's.

The child is `python -c` importing this module, not multiprocessing's spawn: spawn re-imports the caller's
`__main__`, which breaks scripts that call `build_engine` without a main guard. Parent and child talk over a socket
pair through multiprocessing's `Connection`: the child sends its log lines as they come, then its result or the
exception it raised (re-raised here as the same type, so the command line reports it as it would any other).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

CHILD = "import sys; from builder.child_process import main; main(sys.argv[1:])"
PR_SET_PDEATHSIG = 1  # prctl's: the child is killed when the build's process ends


class ChildProcessFailed(RuntimeError):
    """The child ended without a result (killed, out of memory, or an exception that could not be sent back)."""


def run_in_child_process(function: Callable[..., Any], args: tuple, log: Callable[[str], None], what: str) -> Any:
    """`function(*args, log=...)` in a fresh interpreter: its log lines reach `log` as it runs; its return value is
    returned and its exception raised here. `function` must be importable by module and name, `args` picklable.
    `what` names the step in the error of a child that ends without a result."""
    ours, theirs = socket.socketpair()
    # importable whether or not the package is installed: the directory that holds `builder`
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    with theirs:
        process = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": path},
        )
    connection = Connection(ours.detach())
    try:
        connection.send((function.__module__, function.__qualname__, args))
        while True:
            try:
                kind, payload = connection.recv()
            except EOFError:
                status = process.wait()
                cause = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
                hint = " (out of memory?)" if status == -signal.SIGKILL else ""
                raise ChildProcessFailed(f"{what} ended without a result: {cause}{hint}") from None
            if kind == "log":
                log(payload)
            elif kind == "error":
                raise payload
            else:
                return payload
    finally:
        connection.close()
        if process.poll() is None:  # the parent gave up on it (an error, Ctrl-C): it must not go on alone
            process.kill()
        process.wait()


def serve_one_call(connection: Connection) -> None:
    """The child: runs the one call it is sent and sends back its log lines and its outcome."""
    with contextlib.suppress(OSError, AttributeError):  # glibc on Linux
        ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    module, name, args = connection.recv()
    function = getattr(importlib.import_module(module), name)
    try:
        connection.send(("result", function(*args, log=lambda line: connection.send(("log", line)))))
    except Exception as err:  # noqa: BLE001 - the parent raises it
        connection.send(("error", err if _round_trips(err) else ChildProcessFailed(f"{type(err).__name__}: {err}")))


def _round_trips(err: Exception) -> bool:
    """Whether the parent can unpickle this exception (one whose constructor takes other arguments than it keeps
    cannot be)."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - any failure means: send a plain one instead
        return False
    return True


def main(argv: list[str]) -> None:
    """The child's entry (CHILD): `FD`, the child's end of the socket pair."""
    serve_one_call(Connection(int(argv[0])))
