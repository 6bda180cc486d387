"""Tensor-parallel ranks: the processes that run a sharded engine (builder/tensor_parallel.py) in lock-step.

Rank 0 is the process that opened the engine: it owns the scheduler, the sampler, the API and the server, like a
single-rank engine, and its executor (`LeaderExecutor`) sends every step-graph call and every KV cache change to
the other ranks before it makes the same one itself. The other ranks (`serve_rank`) only make those calls, on their
own shards and their own KV caches (their KV heads'). Inside each step graph the ranks meet at the collectives
(plugins/collectives.c, through a shared-memory segment), and every rank gets the same logits.

The other ranks are processes rank 0 starts (one command, like vLLM's tensor_parallel_size), with as many threads
each as the cores divided by the ranks. The per-step message from rank 0 goes over ZeroMQ (pyzmq; one socket per
rank over loopback TCP): about 20 us per message where an MPI broadcast under MPICH costs 25 us and gloo's 200 us;
MPICH was tried first, and its process manager kills every process of the job, rank 0 too, when one rank dies.

Faults: a rank whose process ends makes the collectives of the others fail at once (they watch each other's
process ids), and rank 0 raises RankFailure from then on; the other ranks exit when rank 0's process is gone.
A hung rank makes the others' collectives fail after runner.core.shared_segment.DEFAULT_TIMEOUT_S, and rank 0 raises
RankFailure. The shared segment's name is removed as soon as every rank has attached, so nothing is left behind.
"""

from __future__ import annotations

import json
import os
import pickle
import platform
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

from engines.format import Artifact, ArtifactError
from runner.core.executor import Executor
from runner.core.shared_segment import SharedSegment

# KV cache changes that every rank makes on its own cache
MIRRORED_CACHE_CALLS = frozenset({"free_row", "copy_prefix", "keep", "release"})


class RankFailure(RuntimeError):
    """A rank of a tensor-parallel engine failed: the engine cannot go on."""


@dataclass(frozen=True)
class RankSetup:
    """What a rank other than 0 is told when it starts (as JSON on its command line)."""

    engine: str
    rank: int
    ranks: int
    segment: str
    threads: int
    leader_pid: int
    steps: str  # the address its calls come from
    reports: str  # the address it reports to once ready (its pid) or failed (why)


def threads_per_rank(ranks: int, threads: int | None) -> int:
    """`threads` as asked, else this machine's cores shared between the ranks (so they do not oversubscribe)."""
    if threads is not None:
        return threads
    return max(1, len(os.sched_getaffinity(0)) // ranks)


def rank_artifact(artifact: Artifact, rank: int) -> Artifact:
    return Artifact(artifact.directory, artifact.manifest.for_rank(rank))


def _zmq():
    try:
        import zmq
    except ImportError:
        raise ArtifactError(
            "this engine is tensor-parallel: its ranks talk over ZeroMQ (pip install 'llm-engine-builder[tp]')"
        ) from None
    return zmq


# How long rank 0 waits for the other ranks to open their shards.
START_TIMEOUT_S = 300.0


class RankGroup:
    """Rank 0's side of the group: the other ranks' processes, a socket to each, and the shared segment."""

    def __init__(self, artifact: Artifact, threads: int | None) -> None:
        """Under an MPI launcher (`mpirun -n N runner serve E`) every process builds this: ranks 1..N-1 then serve
        rank 0's calls and exit when it closes (they never return from here); otherwise rank 0 starts them."""
        manifest = artifact.manifest
        self.ranks = manifest.tensor_parallel
        world = _launched_world(self.ranks)
        if world is not None and world.Get_rank() > 0:
            serve_rank(world.bcast(None, root=0)[world.Get_rank() - 1])
            sys.exit(0)
        self.threads = threads_per_rank(self.ranks, threads)
        self.artifact = rank_artifact(artifact, 0)
        library = artifact.path(self.artifact.manifest.graphs[manifest.phases["decode"].graph].native_library)
        zmq = self._zmq = _zmq()
        self.context = zmq.Context()
        self.sockets = [self.context.socket(zmq.PUSH) for _ in range(1, self.ranks)]
        reports = self.context.socket(zmq.PULL)
        for socket in [*self.sockets, reports]:
            socket.setsockopt(zmq.LINGER, 0)
        ports = [socket.bind_to_random_port("tcp://127.0.0.1") for socket in self.sockets]
        report_port = reports.bind_to_random_port("tcp://127.0.0.1")
        segment = SharedSegment.create(library, self.ranks)
        self.failure: RankFailure | None = None
        self.processes = []  # the other ranks' processes where this one started them (not under mpirun)
        try:
            self.segment = SharedSegment(library, segment, 0, self.ranks)
            setups = [
                RankSetup(
                    str(artifact.directory),
                    rank,
                    self.ranks,
                    str(segment),
                    self.threads,
                    os.getpid(),
                    f"tcp://127.0.0.1:{port}",
                    f"tcp://127.0.0.1:{report_port}",
                )
                for rank, port in enumerate(ports, start=1)
            ]
            if world is not None:
                world.bcast(setups, root=0)
            else:
                for setup in setups:
                    start = f"from {__name__} import run_rank; run_rank()"
                    command = [sys.executable, "-c", start, json.dumps(asdict(setup))]
                    self.processes.append(subprocess.Popen(command, stdin=subprocess.DEVNULL))
            self.pids = self._wait_for_ranks(zmq, reports)
        except BaseException:
            self._stop(self.processes, self.sockets, self.context, tell=False)
            raise
        finally:
            segment.unlink(missing_ok=True)
            reports.close()
        # stop the other ranks when this object goes, or at the latest when the interpreter exits
        weakref.finalize(self, RankGroup._stop, self.processes, self.sockets, self.context, True)
        threading.Thread(target=self._watch_ranks, name="rank-watch", daemon=True).start()

    def _wait_for_ranks(self, zmq, reports) -> list[int]:
        """Each other rank's pid once it has opened its shard; an ArtifactError with the reason if one cannot."""
        pids, deadline = {}, time.monotonic() + START_TIMEOUT_S
        while len(pids) < self.ranks - 1:
            exited = [p.returncode for p in self.processes if p.poll() is not None]
            if exited:
                raise ArtifactError(f"a tensor-parallel rank exited while starting (exit status {exited[0]})")
            if time.monotonic() > deadline:
                raise ArtifactError(f"the tensor-parallel ranks did not start within {START_TIMEOUT_S:.0f} s")
            if reports.poll(100, zmq.POLLIN):
                rank, report = json.loads(reports.recv())
                if isinstance(report, str):
                    raise ArtifactError(f"tensor-parallel rank {rank} could not start: {report}")
                pids[rank] = report
        return [pids[rank] for rank in range(1, self.ranks)]

    def send(self, message: tuple) -> None:
        """Hand one call to every other rank (they make it in the order sent)."""
        if self.failure is not None:
            raise self.failure
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, socket in enumerate(self.sockets, start=1):
            try:  # without blocking: a rank whose process is gone would leave the send waiting for it forever
                socket.send(data, copy=False, flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                self.check()
                # its socket can close before its process is seen to exit: the group has failed all the same, so
                # later calls (the aborts that free the requests' rows) must not try the send again
                self._fail(rank, "takes no more calls")
                raise self.failure from None

    def check(self) -> None:
        """Raise RankFailure if a rank has failed, or a collective gave up on one (hung)."""
        if self.failure is None:
            self._find_failure()
        if self.failure is None and self.segment.aborted():
            self.failure = RankFailure(
                "a tensor-parallel rank did not reach a collective in time: the engine cannot go on"
            )
        if self.failure is not None:
            raise self.failure

    def _find_failure(self) -> None:
        for rank, pid in enumerate(self.pids, start=1):
            process = self.processes[rank - 1] if self.processes else None
            if process is not None and process.poll() is not None:
                code = process.returncode
                how = f"exited ({f'signal {-code}' if code < 0 else f'status {code}'})"
            elif process is None and not _alive(pid):
                how = "is gone"
            else:
                continue
            self._fail(rank, how)
            return

    def _fail(self, rank: int, how: str) -> None:
        """The group has failed for good: every later call raises, every collective on the other ranks fails."""
        self.failure = RankFailure(f"tensor-parallel rank {rank} {how}: the engine cannot go on")
        self.segment.abort()

    def _watch_ranks(self) -> None:
        """Every 50 ms: a rank gone makes every collective fail at once, and every call after it raise."""
        while self.failure is None:
            self._find_failure()
            time.sleep(0.05)

    @staticmethod
    def _stop(processes, sockets, context, tell: bool) -> None:
        """Tell the other ranks to exit (`tell`), wait for them a little, end those that do not."""
        zmq = _zmq()
        for socket in sockets if tell else ():
            try:
                socket.send(pickle.dumps(None), flags=zmq.NOBLOCK)
            except zmq.Again:  # a rank already gone: nothing to tell it
                pass
        for process in processes:
            try:
                process.wait(timeout=5 if tell else 0.1)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for socket in sockets:
            socket.close()
        context.term()


def _launched_world(ranks: int):
    """MPI's world communicator where an MPI launcher started this process among others (mpirun, mpiexec), else
    None. Its ranks must be the engine's, on one host (the collectives go through shared memory)."""
    if not any(key in os.environ for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        raise ArtifactError("launched by an MPI launcher: the ranks meet through mpi4py (pip install mpi4py)") from None
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        return None
    if world.Get_size() != ranks:
        raise ArtifactError(f"this engine has {ranks} tensor-parallel ranks; it was launched with {world.Get_size()}")
    if len(set(world.allgather(platform.node()))) > 1:
        raise ArtifactError(
            "a tensor-parallel engine's ranks must run on one host (their collectives use shared memory)"
        )
    return world


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MirroredCache:
    """Rank 0's KV cache: its changes are made on every rank's cache (MIRRORED_CACHE_CALLS); reads are its own."""

    def __init__(self, cache, group: RankGroup) -> None:
        self._cache = cache
        self._group = group

    def __getattr__(self, name: str):
        value = getattr(self._cache, name)
        if name not in MIRRORED_CACHE_CALLS:
            return value

        def mirrored(*args):
            if self._group.failure is None:  # (after a failure only rank 0's own bookkeeping is left to do)
                self._group.send(("cache", name, args))
            return value(*args)

        return mirrored


class LeaderExecutor(Executor):
    """Rank 0's executor: every step-graph call (`_run`, and the greedy loop's burst of calls) goes to the other
    ranks first, and every KV cache change (MirroredCache)."""

    def __init__(self, artifact: Artifact, backend, group: RankGroup) -> None:
        super().__init__(artifact, backend)
        self.group = group
        self.cache = MirroredCache(self.cache, group)

    def _run(self, *args):
        self.group.send(("executor", "_run", args))
        return self._checked(super()._run, args)

    def pad_single_rows_if_they_round_differently(self) -> None:
        """The probe runs on every rank (its calls are sent); its outcome, the fewest rows a call runs with, decides
        call shapes, so the other ranks take it too."""
        super().pad_single_rows_if_they_round_differently()
        self.group.send(("set", "min_rows", self.min_rows))

    def decode_greedy(self, *args):
        self.group.send(("executor", "decode_greedy", args))
        return self._checked(super().decode_greedy, args)

    def _checked(self, call, args):
        try:
            return call(*args)
        except Exception:  # where a collective gave up, the group's failure (RankFailure) is the error to report
            self.group.check()
            raise


def run_rank() -> None:
    """A rank RankGroup started: its RankSetup is the last command-line argument."""
    serve_rank(RankSetup(**json.loads(sys.argv[-1])))


def serve_rank(setup: RankSetup) -> None:
    """A rank other than 0: open its shard, report, then make each call rank 0 sends until it sends None."""
    from engines.backends.onnxruntime import OnnxRuntimeBackend
    from engines.format import open_artifact

    zmq = _zmq()
    context = zmq.Context()
    steps, reports = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    steps.connect(setup.steps)
    reports.connect(setup.reports)
    threading.Thread(target=_exit_with, args=(setup.leader_pid,), name="leader-watch", daemon=True).start()
    try:
        artifact = rank_artifact(open_artifact(setup.engine, verify_checksums=False), setup.rank)
        manifest = artifact.manifest
        step = manifest.phases["decode"].graph
        library = artifact.path(manifest.graphs[step].native_library)
        segment = SharedSegment(library, Path(setup.segment), setup.rank, setup.ranks)
        executor = Executor(artifact, OnnxRuntimeBackend(artifact, threads=setup.threads, graphs={step}))
    except Exception as err:  # rank 0 reports it and refuses the engine
        reports.send(json.dumps([setup.rank, str(err)]).encode())
        reports.close(linger=5000)
        return
    reports.send(json.dumps([setup.rank, os.getpid()]).encode())
    while (message := pickle.loads(steps.recv())) is not None:
        target, name, args = message
        try:
            if target == "set":  # rank 0's executor state that decides call shapes (min_rows)
                setattr(executor, name, args)
            else:
                getattr(executor.cache if target == "cache" else executor, name)(*args)
        except Exception as err:
            segment.abort()
            print(f"tensor-parallel rank {setup.rank}: {err}", file=sys.stderr)
            os._exit(1)


def _exit_with(pid: int) -> None:
    """Exit when rank 0's process is gone (its calls would never come)."""
    while _alive(pid):
        time.sleep(0.2)
    os._exit(1)
