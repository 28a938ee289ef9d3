"""Capturing a step in a CUDA graph, as the GPU tests do (they replay it with new inputs)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch


def capture(step: Callable[[], Any], warm_up: Optional[Callable[[], Any]] = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Runs ``warm_up`` (default: ``step``) on a side stream, which loads the variants and makes the
    first-call allocations outside the capture, then captures ``step``; returns the graph and what
    ``step`` returned during the capture (tensors the replays write)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        (warm_up or step)()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result
