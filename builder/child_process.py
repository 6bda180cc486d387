"""A build step in a fresh interpreter of its own, for the memory it gives back when it ends.

A tensor-parallel build traces one step graph per rank. Built one after the other in one process, the ranks did not
add up (each model is deleted before the next), but the process kept much of what a rank's export had used (glibc's
arenas, torch.export's caches): the fp32 default model's two-rank build peaked at 1,634 MiB against 1,389 MiB for
the single-rank build. A process per rank hands all of it back, so the build's peak is its largest rank's.

The child is a fresh interpreter (engines/child_interpreter.py: not multiprocessing's spawn, which would re-import a
script that calls `build_engine` without a main guard). It sends its log lines as they come, then its result or the
exception it raised (re-raised here as the same type, so the command line reports it as it would any other).
"""

from __future__ import annotations

import importlib
import pickle
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from engines.child_interpreter import die_with_parent, start_child_interpreter

CHILD = "import sys; from builder.child_process import main; main(sys.argv[1:])"


class ChildProcessFailed(RuntimeError):
    """The child ended without a result (killed, out of memory, or an exception that could not be sent back)."""


def run_in_child_process(function: Callable[..., Any], args: tuple, log: Callable[[str], None], what: str) -> Any:
    """`function(*args, log=...)` in a fresh interpreter: its log lines reach `log` as it runs; its return value is
    returned and its exception raised here. `function` must be importable by module and name, `args` picklable.
    `what` names the step in the error of a child that ends without a result."""
    process, connection = start_child_interpreter(CHILD, [])
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
    die_with_parent()
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
