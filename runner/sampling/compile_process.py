"""A child process that compiles structured-output grammars under a deadline and a memory cap.

How long xgrammar takes for a grammar does not follow from the size of its request: a JSON schema of 60 KB (2,000
optional properties) compiles for ~20 s and needs ~0.9 GB, and twice that for minutes. A thread cannot be stopped,
so the compile runs in a process of its own that can be: past `timeout` seconds it is killed (and started again at
once, for the next grammar), and its address space is capped so that an exploding grammar ends there, not in the serving
process. It compiles at a lower priority, so that its work gives way to the engine's steps and the server's event loop.

The process is a fresh interpreter running this module's `main` (CHILD; engines/child_interpreter.py says why not a
fork or multiprocessing's spawn). It serves one compile at a time, and its xgrammar compiler caches grammars across
requests. What comes back is the compiled grammar serialized (xgrammar's own format), which the caller deserializes
against the same vocabulary.

Callers wait for their turn at most `timeout` seconds too: past that a compile is refused as busy
(GrammarBusy), so that a queue of slow grammars cannot hold a request, or the thread that serves it, for longer.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from engines.child_interpreter import die_with_parent, start_child_interpreter

# what a start may take: spawning Python and importing xgrammar (with torch) is ~3 s on an idle core
START_SECONDS = 120.0
# the nice value added to the compile process once started (its start, once, at the server's priority): its work
# gives way to the server's, at ~1/4 of a busy core's share, without stalling a legitimate compile under load
PRIORITY = 5
M_ARENA_MAX = -8  # mallopt's parameter
# the child's program: this module imported (`-m` would run a second copy of it as __main__, with classes of its own)
CHILD = "import sys; from runner.sampling.compile_process import main; main(sys.argv[1:])"


class GrammarError(ValueError):
    """A schema or regex xgrammar cannot compile (or not within the limits), or xgrammar is missing."""


class GrammarBusy(GrammarError):
    """Other requests' grammars held the compile process for longer than this request's deadline."""


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
        if not self._lock.acquire(timeout=self.timeout):
            raise GrammarBusy(
                f"the server compiled other requests' structured outputs for longer than {self.timeout:g} s, this "
                "server's limit; try again"
            )
        try:
            connection = self._started()
            try:
                connection.send((kind, source))
                if not connection.poll(self.timeout):
                    self._restart()
                    raise GrammarError(
                        f"compiling the structured output took longer than {self.timeout:g} s, this server's limit"
                    )
                status, payload = connection.recv()
            except (EOFError, OSError):  # it exited: on the memory cap, the allocator's failure ends it
                self._restart()
                raise GrammarError(
                    f"compiling the structured output needed more than {self.memory_mib} MiB, this server's limit"
                ) from None
        finally:
            self._lock.release()
        if status == "error":
            raise GrammarError(payload)
        return payload

    def _spawn(self) -> None:
        self._process, self._connection = start_child_interpreter(
            CHILD, [json.dumps([*self._vocabulary, self.memory_mib])]
        )
        self._ready = False

    def _started(self):
        """The connection to a process that is ready to compile, started if needed."""
        if self._process is not None and self._ready and self._process.poll() is None:
            return self._connection
        if self._process is None or self._process.poll() is not None:
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

    def _restart(self) -> None:
        """A fresh process in place of one that failed, starting now: the next compile finds it (nearly) ready."""
        self._stop()
        self._spawn()

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._connection.close()
        self._process = self._connection = None


def serve_compiles(
    connection: Connection, tokenizer_file: str, vocab_size: int, stop_token_ids: list[int], memory_mib: int
) -> None:
    """The child: compiles what comes in until the connection closes (the parent is gone)."""
    # (the thread that started it is one of the server's pool threads or the caller's, which live as long as it)
    libc = die_with_parent()
    if libc is not None:
        libc.mallopt(M_ARENA_MAX, 1)  # one malloc arena for xgrammar's compile threads: each reserves 64 MiB
    try:
        from runner.sampling.structured import compile_grammar, new_compiler, tokenizer_info

        compiler = new_compiler(tokenizer_info(Path(tokenizer_file), vocab_size, stop_token_ids))
        compile_grammar(compiler, "regex", "[0-9]+")  # starts its thread pool before the cap, which counts stacks
    except Exception as err:  # noqa: BLE001 - reported to the parent, which refuses the request with it
        connection.send(("error", f"{type(err).__name__}: {err}"))
        return
    _cap_address_space(memory_mib)
    os.nice(PRIORITY)
    with contextlib.suppress(EOFError, BrokenPipeError, ConnectionResetError):  # the parent is gone
        connection.send(("ready", None))
        while True:
            kind, source = connection.recv()
            try:
                reply = ("ok", compile_grammar(compiler, kind, source).serialize_json())
            except (GrammarError, RuntimeError, MemoryError) as err:
                if isinstance(err, MemoryError) or "bad_alloc" in str(err):
                    return  # the cap was reached: the parent reads the exit as that
                reply = ("error", str(err))
            connection.send(reply)


def _cap_address_space(memory_mib: int) -> None:
    """At most `memory_mib` more address space than the process has mapped now (xgrammar's and torch's libraries)."""
    with open("/proc/self/status") as status:
        mapped_kib = int(status.read().split("VmSize:")[1].split()[0])
    limit = (mapped_kib * 1024) + memory_mib * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main(argv: list[str]) -> None:
    """The child's entry (CHILD): `FD '[tokenizer_file, vocab_size, stop_token_ids, memory_mib]'`."""
    serve_compiles(Connection(int(argv[0])), *json.loads(argv[1]))
