"""CUDA-graph capture and replay with static buffers (eager on CPU, or when disabled), and the one way a result
comes back to the host.

A `CapturedCall` owns one graph and its input/output buffers; a `GraphSet` owns one `CapturedCall` per token count.
Following SGLang, each phase owns its graphs: the target's decode step (engine.target_decoder) and, in speculation,
the draft phase, the verify and the tree compaction (engine.runners), so it is always clear which graph a step
replays and which buffers it may overwrite. `HostCopy` reads a graph's result without waiting for work queued
after it.
"""
from __future__ import annotations

import gc
from typing import Any, Callable

import torch

Outputs = Any  # a tensor or a tuple of tensors (None allowed)


class CapturedCall:
    """`fn(**inputs)` captured once over static input buffers; calling copies new inputs in and replays.

    The outputs are the graph's static tensors: they are overwritten by the next replay, so clone what you keep.
    """

    def __init__(self, fn: Callable[..., Outputs], static_inputs: dict[str, torch.Tensor],
                 enabled: bool = True, warmup: int = 2, pool=None):
        self.fn = fn
        self.inputs = static_inputs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Outputs = None
        device = next(iter(static_inputs.values())).device
        if enabled and device.type == "cuda":
            self._capture(warmup, pool)

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _capture(self, warmup: int, pool) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up runs allocate workspaces outside the graph
            for _ in range(warmup):
                self.fn(**self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # A graph of a decoder that died is freed when the garbage collector runs, and freeing a graph while
        # another is being captured invalidates that capture: no collection during ours.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph, pool=pool):
                self.outputs = self.fn(**self.inputs)
        finally:
            if collecting:
                gc.enable()

    def __call__(self, **inputs: torch.Tensor) -> Outputs:
        if self.graph is None:  # eager: inputs not given are the static buffers, as in a replay
            return self.fn(**{**self.inputs, **inputs})
        for name, value in inputs.items():
            buf = self.inputs[name]
            if value is not buf:
                buf.copy_(value)
        self.graph.replay()
        return self.outputs


class GraphSet:
    """One `CapturedCall` per size (e.g. tokens per verify forward). `make_inputs(size)` builds example buffers.
    The set's graphs share one memory pool (they never replay at once); it lives as long as the set."""

    def __init__(self, fn: Callable[..., Outputs], make_inputs: Callable[[int], dict[str, torch.Tensor]],
                 sizes: list[int] | tuple[int, ...], enabled: bool = True):
        self.pool = torch.cuda.graph_pool_handle() if enabled and torch.cuda.is_available() else None
        self.calls = {n: CapturedCall(fn, make_inputs(n), enabled=enabled, pool=self.pool)
                      for n in sorted(set(sizes), reverse=True)}  # largest first: smaller graphs reuse its pool

    def __call__(self, size: int, **inputs: torch.Tensor) -> Outputs:
        try:
            call = self.calls[size]
        except KeyError:
            raise ValueError(f"no graph captured for size {size}; captured: {sorted(self.calls)}") from None
        return call(**inputs)

    def buffers(self, size: int) -> dict[str, torch.Tensor]:
        """Static inputs of one size: write into them directly to skip a copy."""
        return self.calls[size].inputs


class HostCopy:
    """A device result read by the host without waiting for work queued after it: a copy into pinned memory and
    an event to wait on (on CPU, a plain copy)."""

    def __init__(self, size: int, device: torch.device):
        cuda = device.type == "cuda"
        self.buf = torch.empty(size, dtype=torch.long, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.n = 0

    def start(self, t: torch.Tensor) -> None:
        self.n = t.numel()
        self.buf[:self.n].copy_(t, non_blocking=True)
        if self.event is not None:
            self.event.record()

    def wait(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.buf[:self.n].tolist()
