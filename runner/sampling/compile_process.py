"""A child process that compiles structured-output grammars under a deadline and a memory cap.

How long xgrammar takes for a grammar does not follow from the size of its request: a JSON schema of 60 KB (2,000
optional properties) compiles for ~20 s and needs ~0.9 GB, and twice that for minutes. A thread cannot be stopped,
so the compile runs in a process of its own that can be: past `timeout` seconds it is killed (and started again for
the next grammar), and its address space is capped so that an exploding grammar ends there, not in the serving
process. It compiles at a lower priority, so that its work gives way to the engine's steps and the server's event loop.

The process is started on the first compile (spawned: the serving process has threads) and serves one compile at a
time; its xgrammar compiler caches grammars across requests. What comes back is the compiled grammar serialized
(xgrammar's own format), which the caller deserializes against the same vocabulary.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import resource
import signal
import threading
from pathlib import Path

# what a start may take: spawning Python and importing xgrammar (with torch) is ~3 s on an idle core
START_SECONDS = 120.0
# the nice value added to the compile process once started (its start, once, at the server's priority): its work
# gives way to the server's, at ~1/4 of a busy core's share, without stalling a legitimate compile under load
PRIORITY = 5
PR_SET_PDEATHSIG, M_ARENA_MAX = 1, -8  # prctl's and mallopt's parameters


class GrammarError(ValueError):
    """A schema or regex xgrammar cannot compile (or not within the limits), or xgrammar is missing."""


class CompileProcess:
    def __init__(
        self, tokenizer_file: Path, vocab_size: int, stop_token_ids: list[int], timeout: float, memory_mib: int
    ) -> None:
        self.timeout, self.memory_mib = timeout, memory_mib
        self._vocabulary = (str(tokenizer_file), vocab_size, list(stop_token_ids))
        self._lock = threading.Lock()  # one compile at a time: a request's deadline starts when its compile does
        self._process = None
        self._connection = None
        self._ready = False  # whether the process said it is ready

    def start(self) -> None:
        """Starts the process now, without waiting for it to be ready (the first compile waits)."""
        with self._lock:
            if self._process is None:
                self._spawn()

    def compile(self, kind: str, source: str) -> str:
        """The grammar of `source` ("json": a schema's text, "regex") serialized; GrammarError when it cannot be
        compiled, takes longer than `timeout` seconds or needs more than `memory_mib`."""
        with self._lock:
            connection = self._started()
            try:
                connection.send((kind, source))
                if not connection.poll(self.timeout):
                    self._stop()
                    raise GrammarError(
                        f"compiling the structured output took longer than {self.timeout:g} s, this server's limit"
                    )
                status, payload = connection.recv()
            except (EOFError, OSError):  # it exited: on the memory cap, the allocator's failure ends it
                self._stop()
                raise GrammarError(
                    f"compiling the structured output needed more than {self.memory_mib} MiB, this server's limit"
                ) from None
        if status == "error":
            raise GrammarError(payload)
        return payload

    def _spawn(self) -> None:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(
            target=serve_compiles,
            args=(theirs, *self._vocabulary, self.memory_mib),
            name="grammar-compile",
            daemon=True,
        )
        process.start()
        theirs.close()
        self._process, self._connection, self._ready = process, ours, False

    def _started(self):
        """The connection to a process that is ready to compile, started if needed."""
        if self._process is not None and self._ready and self._process.is_alive():
            return self._connection
        if self._process is None or not self._process.is_alive():
            self._stop()
            self._spawn()
        ours = self._connection
        if not ours.poll(START_SECONDS):
            self._stop()
            raise GrammarError(f"the grammar compile process did not start within {START_SECONDS:g} s")
        try:
            status, payload = ours.recv()
        except EOFError:
            status, payload = "error", "it exited while starting"
        if status != "ready":
            self._stop()
            raise GrammarError(f"the grammar compile process did not start: {payload}")
        self._ready = True
        return ours

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._connection.close()
        self._process = self._connection = None


def serve_compiles(
    connection, tokenizer_file: str, vocab_size: int, stop_token_ids: list[int], memory_mib: int
) -> None:
    """The child: compiles what comes in until the pipe closes (the parent is gone)."""
    with contextlib.suppress(OSError, AttributeError):  # glibc on Linux
        libc = ctypes.CDLL("libc.so.6")
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the parent
        # one malloc arena for xgrammar's compile threads: an arena each reserves 64 MiB of address space
        libc.mallopt(M_ARENA_MAX, 1)
    try:
        from runner.sampling.structured import compile_grammar, new_compiler, tokenizer_info

        compiler = new_compiler(tokenizer_info(Path(tokenizer_file), vocab_size, stop_token_ids))
        compile_grammar(compiler, "regex", "[0-9]+")  # starts its thread pool before the cap, which counts stacks
    except Exception as err:  # noqa: BLE001 - reported to the parent, which refuses the request with it
        connection.send(("error", f"{type(err).__name__}: {err}"))
        return
    _cap_address_space(memory_mib)
    os.nice(PRIORITY)
    connection.send(("ready", None))
    while True:
        try:
            kind, source = connection.recv()
        except EOFError:
            return
        try:
            connection.send(("ok", compile_grammar(compiler, kind, source).serialize_json()))
        except (GrammarError, RuntimeError, MemoryError) as err:
            if isinstance(err, MemoryError) or "bad_alloc" in str(err):
                return  # the cap was reached: the parent reads the exit as that
            connection.send(("error", str(err)))


def _cap_address_space(memory_mib: int) -> None:
    """At most `memory_mib` more address space than the process has mapped now (xgrammar's and torch's libraries)."""
    with open("/proc/self/status") as status:
        mapped_kib = int(status.read().split("VmSize:")[1].split()[0])
    limit = (mapped_kib * 1024) + memory_mib * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
