"""AOTInductor backend: the step graph is a package torch's ahead-of-time compiler built (builder/aoti.py); the side
graphs (sampler, draft head) are ONNX and run on onnxruntime, on the CPU.

The cache buffers the runner binds are handed to the package as tensors over the same memory (numpy arrays on CPU,
viewed without a copy; device tensors on CUDA, runner/core/kv_cache.py's DeviceKVCache), and the package writes the
new K/V into them: present_key.i is past_key.i. Small inputs and the per-token outputs cross between numpy and the
device at each call. On CUDA a bound decode graph (one token per row) is captured as a CUDA graph per KV-length
bucket (the manifest's decode `past_lengths`): the attention bias is padded with zeros to the bucket, which the
graph's causal mask makes harmless, so the decode steps of a bucket share one capture, and a step still reads no
more of the cache than its bucket; each replay copies the step's inputs into the graph's own tensors.
"""

from __future__ import annotations

import numpy as np

from engines.format import Artifact, ArtifactError, GraphSpec
from engines.target import check_target, gpu_architecture, torch_version

PACKAGE_SUFFIX = ".pt2"


class AOTInductorBackend:
    def __init__(
        self, artifact: Artifact, threads: int | None = None, profile_prefix: str | None = None, cuda_graphs=True
    ) -> None:
        try:
            import torch
        except ImportError:
            raise ArtifactError(
                "this engine's step graph was compiled by AOTInductor: its runner needs torch "
                "(pip install 'llm-engine-builder[aoti]')"
            ) from None
        if profile_prefix:
            raise ArtifactError(
                "per-node profiles are onnxruntime's; this engine's step graph is an AOTInductor package"
            )
        from engines.backends.onnxruntime import OnnxRuntimeBackend

        manifest = artifact.manifest
        self.torch = torch
        self.device = manifest.device
        _check_target(torch, manifest.device, manifest.target)
        if threads:
            torch.set_num_threads(threads)
        compiled = {key for key, graph in manifest.graphs.items() if graph.file.endswith(PACKAGE_SUFFIX)}
        self.packages, self.specs = {}, {}
        for key in compiled:
            graph = manifest.graphs[key]
            try:
                # single-threaded: the runner calls a package from one thread only, and the container's
                # thread-synchronisation (an event query per run) is illegal inside a CUDA graph capture
                self.packages[key] = torch._inductor.aoti_load_package(
                    str(artifact.path(graph.file)), run_single_threaded=True
                )
            except Exception as err:  # the loader raises RuntimeError subclasses of its own for damaged packages
                raise ArtifactError(f"AOTInductor cannot load {graph.file}: {str(err).splitlines()[0]}") from None
            self.specs[key] = graph
        self.side = OnnxRuntimeBackend(artifact, threads=1, graphs=set(manifest.graphs) - compiled)
        self.cuda_graphs = cuda_graphs and self.device == "cuda"
        self.kv_buckets = manifest.phases["decode"].past_lengths
        self.cuda_graph_error = None  # why capture failed, if it did: decode then runs without CUDA graphs (warned)
        self.provider = f"AOTInductor ({self.device})"  # what runs the step graph (reports, tuning choices)

    def bucket_width(self, width: int, most: int) -> int:
        """The bias width a decode call of `width` attended positions is padded to on CUDA: its KV-length bucket
        (the manifest's decode `past_lengths`), at most `most`, so the calls of a bucket share one CUDA graph."""
        return min([bucket for bucket in self.kv_buckets if bucket >= width] + [most])

    def stop_capturing(self, err: Exception) -> None:
        """Decode without CUDA graphs from now on, saying so once (a capture failure costs speed, not results)."""
        import warnings

        self.cuda_graphs = False
        self.cuda_graph_error = str(err).splitlines()[0]
        warnings.warn(f"CUDA graph capture failed, decoding without CUDA graphs: {self.cuda_graph_error}", stacklevel=2)

    @property
    def cache_device(self) -> str:
        """Where the runner must keep the KV cache for this backend."""
        return self.device

    def run(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if graph not in self.packages:
            return self.side.run(graph, feeds)
        return BoundPackage(self, graph, {}, capture=False).outputs_of(feeds)

    def bind(self, graph: str, buffers: dict) -> BoundPackage:
        if graph not in self.packages:
            return self.side.bind(graph, buffers)
        return BoundPackage(self, graph, buffers)

    def greedy_loop(self, graph: str, cache_buffers: dict, batch: int, max_seq_len: int) -> DeviceGreedyLoop:
        """The executor's greedy decode loop for this backend: its state stays on the device between calls."""
        return DeviceGreedyLoop(self, graph, cache_buffers, batch, max_seq_len)

    def end_profiling(self) -> dict[str, str]:
        return {}

    def tensor(self, array, dtype: str):
        """An input as a tensor on the package's device: bound memory without a copy where it is already there."""
        torch = self.torch
        if isinstance(array, torch.Tensor):
            return array
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if dtype == "bfloat16" and tensor.dtype == torch.uint16:
            tensor = tensor.view(torch.bfloat16)  # numpy holds a bf16 cache as its bits (runner/core/kv_cache.py)
        return tensor if self.device == "cpu" else tensor.to(self.device, non_blocking=True)


class BoundPackage:
    """A package with some inputs and outputs bound to fixed memory, as onnxruntime's BoundGraph: the cache tensors
    (past_key.i, written in place, so present_key.i needs nothing) and, for a greedy loop, every other input and the
    arrays its outputs are copied into."""

    def __init__(self, backend: AOTInductorBackend, graph: str, buffers: dict, capture: bool = True) -> None:
        self.backend = backend
        self.capture = capture and backend.cuda_graphs
        self.package = backend.packages[graph]
        spec: GraphSpec = backend.specs[graph]
        self.input_names = [t.name for t in spec.inputs]
        self.input_dtypes = {t.name: t.dtype for t in spec.inputs}
        self.key_names = [name for name in self.input_names if name.startswith("past_key.")]  # in layer order
        self.value_names = [name for name in self.input_names if name.startswith("past_value.")]
        self.output_names = [t.name for t in spec.outputs][:3]  # the rest are the cache inputs, written in place
        # the cache becomes tensors once (the same memory); other bound inputs are arrays the caller refills between
        # runs, so they cross to the device at each run
        self.bound_inputs = {
            name: backend.tensor(buffers[name], self.input_dtypes[name]) if _is_cache(name) else buffers[name]
            for name in self.input_names
            if name in buffers
        }
        self.bound_outputs = {name: buffers[name] for name in self.output_names if name in buffers}
        self.per_run_inputs = set(self.input_names) - set(self.bound_inputs)
        self.per_run_outputs = set(self.output_names) - set(self.bound_outputs)
        self.graph_replays = {}  # KV-length bucket -> a CUDA graph of this binding (decode calls on CUDA)

    def run(self, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
        if set(feeds) != self.per_run_inputs:
            raise ValueError(f"every input not bound for good needs a value: {sorted(self.per_run_inputs)}")
        if set(outputs) != self.per_run_outputs:
            raise ValueError(f"every output not bound for good needs an array: {sorted(self.per_run_outputs)}")
        for name, value in self.outputs_of(feeds).items():
            np.copyto((outputs | self.bound_outputs)[name], value)

    def outputs_of(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        backend = self.backend
        torch = backend.torch
        given = self.bound_inputs | feeds
        _check_shapes(given)
        inputs = {name: backend.tensor(value, self.input_dtypes[name]) for name, value in given.items()}
        with torch.inference_mode():
            if self.capture and backend.cuda_graphs and inputs["input_ids"].shape[1] == 1:
                results = self._replay(inputs)
            else:
                results = self._call(inputs)
        return {name: result.cpu().numpy() for name, result in zip(self.output_names, results)}

    def call_graph(self, inputs: dict, width: int, copy: bool = False) -> list:
        """Run; on CUDA (capturing) through a CUDA graph per bias width, recorded on that width's first call over
        static copies of the inputs (`copy`) or over the caller's own tensors, which it refills in place between
        runs (DeviceGreedyLoop: nothing to copy in)."""
        if not (self.capture and self.backend.cuda_graphs):
            return self._call(inputs)
        replay = self.graph_replays.get(width)
        if replay is None:
            try:
                replay = self.graph_replays[width] = CapturedCall(self.backend.torch, self._call, inputs, copy)
            except RuntimeError as err:  # torch reports a failed capture as a RuntimeError
                self.backend.stop_capturing(err)
                return self._call(inputs)
        return replay.run(inputs)

    def _call(self, inputs: dict) -> list:
        plain = [inputs[name] for name in self.input_names[:6]]
        keys = [inputs[name] for name in self.key_names]
        values = [inputs[name] for name in self.value_names]
        return self.package(*plain, keys, values)

    def _replay(self, inputs: dict) -> list:
        """Decode through the CUDA graph of the step's KV-length bucket: the bias padded to the bucket."""
        bias = inputs["attention_bias"]
        width = self.backend.bucket_width(bias.shape[-1], most=inputs["past_key.0"].shape[2])
        inputs["attention_bias"] = self.backend.torch.nn.functional.pad(bias, (0, width - bias.shape[-1]))
        return self.call_graph(inputs, width, copy=True)


class CapturedCall:
    """One package call recorded as a CUDA graph, over static copies of its per-call inputs (`copy`), or over the
    caller's own tensors, which it refills in place (no copy)."""

    def __init__(self, torch, call, inputs: dict, copy: bool) -> None:
        self.torch = torch
        self.copy = copy
        self.static = {name: t.clone() if copy and not _is_cache(name) else t for name, t in inputs.items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call(self.static)  # warm-up outside the graph: the package's first run allocates and loads kernels
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = call(self.static)

    def run(self, inputs: dict) -> list:
        for name, tensor in inputs.items():
            if self.copy and not _is_cache(name):
                self.static[name].copy_(tensor, non_blocking=True)
        self.graph.replay()
        return self.outputs


class DeviceGreedyLoop:
    """The executor's greedy decode loop (runner/core/executor.py GreedyDecodeLoop: one token per row per call, each
    row's argmax fed back) with its inputs, outputs and the fed-back tokens on the package's device: between two
    calls nothing crosses to the host. On CUDA every call is a CUDA graph replay (one graph per KV-length bucket)
    and the tokens come back once, after the last call; the calls after a row's stop token then write K/V where
    that row's next call writes again (harmless, as the executor's contract says) and their tokens are dropped. On
    CPU the stop tokens are checked after every call, as the host loop does."""

    def __init__(self, backend: AOTInductorBackend, graph: str, cache_buffers: dict, batch: int, max_seq_len: int):
        torch = backend.torch
        self.backend, self.torch, self.batch = backend, torch, batch
        self.bound = BoundPackage(backend, graph, cache_buffers)
        device = backend.device
        self.input_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.past_lens = torch.zeros(batch, dtype=torch.long, device=device)  # also each one-token row's position
        self.query_lens = torch.zeros(batch, dtype=torch.long, device=device)
        self.logits_index = torch.zeros(batch, 1, dtype=torch.long, device=device)
        # every bias a decode call needs is zeros (a row sees its whole past): one buffer viewed at each width
        self.zero_bias = torch.zeros(batch * (max_seq_len + 1), device=device)
        # check for stop tokens after every call (a host sync) or once at the end (CUDA: no sync between calls)
        self.stop_each_call = device == "cpu"

    def run(self, rows: list[int], token_ids: list[int], positions: list[int], steps: int, stop: np.ndarray):
        torch, batch = self.torch, self.batch
        device = self.input_ids.device
        index = torch.as_tensor(rows, device=device)
        for tensor, values in ((self.input_ids[:, 0], token_ids), (self.past_lens, positions), (self.query_lens, 1)):
            tensor.zero_()  # rows left out take no part
            tensor[index] = torch.as_tensor(values, device=device)
        stop_tokens = torch.as_tensor(stop, device=device)
        chosen = torch.empty(steps, len(rows), dtype=torch.long, device=device)
        length = max(positions) + 1
        inputs = {
            "input_ids": self.input_ids,
            "positions": self.past_lens.view(batch, 1),
            "past_lens": self.past_lens,
            "query_lens": self.query_lens,
            "logits_index": self.logits_index,
            **self.bound.bound_inputs,
        }
        with torch.inference_mode():
            for step in range(steps):
                width = self._width(length + step)
                inputs["attention_bias"] = self.zero_bias[: batch * width].view(batch, 1, 1, width)
                argmax = self.bound.call_graph(inputs, width)[1][:, 0]
                chosen[step] = argmax[index]
                if self.stop_each_call and bool(stop_tokens[chosen[step]].any()):
                    return chosen[:step].T.numpy()
                self.input_ids[:, 0] = argmax
                self.past_lens += self.query_lens
        tokens = chosen.T.cpu().numpy()
        stopped = stop[tokens].any(axis=0)
        return tokens[:, : int(stopped.argmax()) if stopped.any() else steps]

    def _width(self, length: int) -> int:
        """The bias width of a call attending `length` positions: exact on CPU, its KV-length bucket on CUDA (the
        zero padding is masked by causality)."""
        if not self.bound.capture:
            return length
        return self.backend.bucket_width(length, most=self.zero_bias.numel() // self.batch)


def _check_shapes(inputs: dict) -> None:
    """A compiled graph does not check its inputs against each other, and a mismatch reads or writes out of bounds:
    check the step's sizes agree (one cache view stands for all, they are slices of one buffer)."""
    batch, steps = inputs["input_ids"].shape
    cache = inputs["past_key.0"].shape
    width = inputs["attention_bias"].shape
    expected = {
        "positions": (batch, steps),
        "past_lens": (batch,),
        "query_lens": (batch,),
        "logits_index": (batch, inputs["logits_index"].shape[-1]),
        "attention_bias": (batch, 1, steps, width[-1]),
        "past_key.0": (batch, *cache[1:]),
        "past_value.0": (batch, *cache[1:]),
    }
    for name, shape in expected.items():
        if tuple(inputs[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(inputs[name].shape)}, the step's inputs ask for {shape}")
    past_lens = inputs["past_lens"]
    if isinstance(past_lens, np.ndarray) and (past_lens.max(initial=0) + steps > cache[2] or width[-1] > cache[2]):
        raise ValueError(f"a row's positions run past the cache buffer's {cache[2]}")


def _is_cache(name: str) -> bool:
    return name.startswith(("past_key.", "past_value."))


def _check_target(torch, device: str, target: dict[str, str]) -> None:
    """Refuse, in one line, a package compiled for another torch or another GPU than this machine's."""
    here = {"torch": torch_version()}
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ArtifactError("this engine was compiled for CUDA and this machine has no CUDA device")
        here["gpu"] = gpu_architecture()
    check_target(target, here, "compiled")
