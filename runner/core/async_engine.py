"""The engine's step loop on its own thread, fed by asyncio code (the HTTP server).

Only the loop thread touches the scheduler and the KV cache. Callers validate and tokenize in their own thread
(`LLMEngine.new_request`), hand the request over through a command queue, and receive its events on an asyncio
queue. A request whose caller goes away is aborted through the same command queue, which frees its cache row
before the next step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from runner.core.engine import LLMEngine, TokenEvent
from runner.core.metrics import EngineMetrics
from runner.core.request import FinishReason, Request
from runner.core.tensor_parallel import RankFailure


class EngineOverloaded(RuntimeError):
    """The waiting queue is full: the caller should retry later (HTTP 503)."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class EngineLoopError(RuntimeError):
    """The step loop met an error that no step's own handling caught (a bug): the engine cannot be trusted to go on."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    submitted: float = field(default_factory=time.perf_counter)
    last_token: float | None = None


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_waiting: int = 64,
        metrics: EngineMetrics | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`on_fatal`: called (on the loop thread) when the engine fails for good (a tensor-parallel rank is gone, or
        an error escaped the step loop): every request has its error by then and no new one is taken; the server
        stops itself there."""
        self.engine = engine
        self.fatal: BaseException | None = None  # the error the engine cannot go on after
        self.on_fatal = on_fatal
        self.max_waiting = max_waiting
        self.metrics = metrics or EngineMetrics()
        self.metrics.track_cache(engine.executor.cache.resident_bytes)
        if engine.speculation is not None:
            self.metrics.track_speculation(engine.speculation_stats)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._pending = 0  # submitted, not yet admitted by the loop thread
        self._lock = threading.Lock()
        self._accepting = True
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # -- caller side (event loop threads) ---------------------------------------------------------------------

    def num_waiting(self) -> int:
        return self._pending + len(self.engine.scheduler.waiting)

    async def generate(self, requests: list[Request]) -> AsyncIterator[TokenEvent]:
        """Run `requests` (the n completions of one prompt) and yield their events until all are finished.
        Leaving the iteration early (client gone, error) aborts whatever is still running."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:  # the engine failing takes this lock too: a stream registered here gets that failure
            if not self._accepting:
                why = f"the engine has stopped: {self.fatal}" if self.fatal else "the server is shutting down"
                raise EngineStopped(why)
            if self.num_waiting() + len(requests) > self.max_waiting + self._free_rows():
                self.metrics.rejected.inc()
                raise EngineOverloaded(f"the server is at capacity ({self.max_waiting} requests waiting); retry later")
            self._pending += len(requests)
            for request in requests:
                self._streams[request.request_id] = stream
            self._commands.put(("add", requests))
        unfinished = {r.request_id for r in requests}
        try:
            while unfinished:
                event = await stream.events.get()
                if isinstance(event, BaseException):
                    raise event
                if event.finished:
                    unfinished.discard(event.request.request_id)
                yield event
        finally:
            if unfinished:
                self._commands.put(("abort", [r for r in requests if r.request_id in unfinished]))
            for request in requests:
                self._streams.pop(request.request_id, None)

    def shutdown(self, grace_seconds: float = 10.0) -> None:
        """Stop taking requests, let running ones finish for up to `grace_seconds`, abort the rest, stop the loop."""
        self._accepting = False
        deadline = time.monotonic() + grace_seconds
        while self.engine.scheduler.has_work and time.monotonic() < deadline:
            time.sleep(0.05)
        self._commands.put(("stop", None))
        self._thread.join(timeout=30)

    def _free_rows(self) -> int:
        return self.engine.scheduler.max_rows - len(self.engine.scheduler.running)

    # -- loop thread ------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._run_commands_and_steps()
        except Exception as err:  # a bug must fail every caller, not leave them waiting forever
            traceback.print_exception(err)
            failure = EngineLoopError(f"the engine's step loop stopped on an unexpected error: {err!r}")
            failure.__cause__ = err
            self._fail_for_good(failure)

    def _run_commands_and_steps(self) -> None:
        while True:
            idle = not self.engine.scheduler.has_work
            try:
                command, payload = self._commands.get(timeout=0.1) if idle else self._commands.get_nowait()
            except queue.Empty:
                command = None
            if command == "stop":
                self._abort_all()
                return
            if command == "add":
                with self._lock:
                    self._pending -= len(payload)
                for request in payload:
                    self.engine.add(request)
                self.metrics.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in payload))
            elif command == "abort":
                for request in payload:
                    self._abort(request)
                self._after_aborts()
            if command is not None:
                continue  # drain every command before the next step
            if self.engine.scheduler.has_work:
                self._step()
            if self.fatal is not None:  # every request has its error; nothing will run here again
                return

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except RankFailure as err:  # the engine cannot go on: fail every request, take no more
            self._fail_for_good(err)
            return
        except Exception as err:  # a failing graph call must not kill the server: fail the requests it ran
            for request in list(self.engine.scheduler.running):
                self._abort(request, err)
            return
        now = time.perf_counter()
        for event in events:
            self._deliver(event, now)
        scheduler = self.engine.scheduler
        tokens = sum(1 for e in events if e.request.output_token_ids)  # a prompt-only request (max_tokens 0) makes none
        self.metrics.observe_step(len(scheduler.waiting) + self._pending, len(scheduler.running), tokens, now)

    def _after_aborts(self) -> None:
        scheduler = self.engine.scheduler
        self.metrics.observe_step(
            len(scheduler.waiting) + self._pending, len(scheduler.running), 0, time.perf_counter()
        )

    def _deliver(self, event: TokenEvent, now: float) -> None:
        stream = self._streams.get(event.request.request_id)
        if stream is None:  # its caller is gone; the abort command is on its way
            return
        if len(event.request.output_token_ids) == 1:  # the request's first token: its prompt is in the cache now
            self.metrics.prefix_cache_hits.inc(event.request.num_cached_tokens)
        if event.request.output_token_ids:  # a prompt-only request (max_tokens 0) ends without a token to time
            if stream.last_token is None:
                self.metrics.ttft.observe(now - stream.submitted)
            else:
                self.metrics.inter_token.observe(now - stream.last_token)
            stream.last_token = now
        if event.finished:  # (stop or length: aborts finish in `_abort`, not in a step)
            self.metrics.request_finished(event.request.finish_reason, now - stream.submitted)
        if not _send(stream, event):  # its caller's event loop is gone: nobody will read the rest
            self._streams.pop(event.request.request_id, None)
            self._abort(event.request)

    def _abort(self, request: Request, error: BaseException | None = None) -> None:
        if request.finished:
            return
        self.engine.abort(request)
        self.metrics.request_finished(FinishReason.ABORT, None)
        stream = self._streams.get(request.request_id)
        if stream is not None:
            payload = error if error is not None else TokenEvent(request, "", True)
            _send(stream, payload)

    def _abort_all(self, error: BaseException | None = None) -> None:
        scheduler = self.engine.scheduler
        for request in list(scheduler.running) + list(scheduler.waiting):
            self._abort(request, error)
        while True:  # requests still in the command queue never reached the scheduler
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                for request in payload:
                    self._abort(request, error)

    def _fail_for_good(self, error: BaseException) -> None:
        with self._lock:
            self.fatal, self._accepting = error, False
        try:
            self._abort_all(error)
        except Exception as err:  # the engine's own abort failed too: its callers still get their error below
            traceback.print_exception(err)
        for stream in {id(s): s for s in list(self._streams.values())}.values():
            _send(stream, error)
        if self.on_fatal is not None:
            self.on_fatal(error)


def _send(stream: _Stream, payload: TokenEvent | BaseException) -> bool:
    """Hand `payload` to the stream's caller; False when its event loop is closed (nobody waits there)."""
    try:
        stream.loop.call_soon_threadsafe(stream.events.put_nowait, payload)
    except RuntimeError:
        return False
    return True
