"""The prefill planner in Python (``docs/SPEC.md`` section 3): the same cuts, rows and checks as the
compiled ``plan_online_prefill``, on the host.

:func:`plan_segments` cuts a batch's new tokens at every chunk boundary;
:func:`plan_online_prefill` checks its arguments as the compiled planner does and writes the
segments as 16-byte plan rows (:mod:`flash_compress.plan_rows`). The CPU reference
(:mod:`flash_compress.reference`) exposes it as its own planner, and the tests compare the
compiled planners against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np
import torch

from ._arguments import check_apart, check_contiguous
from .plan_rows import CHUNK_SIZE, MAX_LENGTH, PADDING_BYTE, ROW_BYTES, check_plan_tensor, encode_rows

__all__ = ["check_lengths", "plan_online_prefill", "plan_segments", "plan_tensors", "planned_tokens"]

_LENGTH_DTYPES = (torch.int64, torch.int32)


Lengths = Union[torch.Tensor, Sequence[int]]


def plan_segments(extend_lens: Lengths, seq_lens: Lengths) -> tuple[np.ndarray, np.ndarray]:
    """Cuts a prefill into segments: returns ``(compress_rows, write_rows)`` as ``[n, 4]`` int64 arrays.

    ``extend_lens`` and ``seq_lens`` are sequences of ints (already validated).
    Request ``b``'s new tokens are positions ``seq_len - extend_len .. seq_len - 1``
    and ragged rows ``sum(extend_lens[:b]) ..``. They are cut at every chunk
    boundary; a segment whose last token closes a chunk (``position % 128 == 127``)
    is a compress row, the trailing partial segment (if any) a write row. Rows
    are ``(ragged_id, batch_id, position, window_len)`` of the segment's LAST
    token, requests in order and, within a request, segments in position order.
    """
    compress: list[np.ndarray] = []
    write: list[tuple[int, int, int, int]] = []
    ragged_start = 0
    for batch, (extend, seq) in enumerate(zip(extend_lens, seq_lens)):
        extend, seq = int(extend), int(seq)
        prefix = seq - extend  # position of the request's first new token
        # Positions in [prefix, seq) that close a chunk: p = 128k + 127.
        first_close = prefix + (CHUNK_SIZE - 1 - prefix % CHUNK_SIZE)
        closes = np.arange(first_close, seq, CHUNK_SIZE, dtype=np.int64)
        if closes.size:
            ragged = ragged_start + (closes - prefix)
            window = np.minimum(CHUNK_SIZE, closes - prefix + 1)
            compress.append(np.stack([ragged, np.full_like(closes, batch), closes, window], axis=1))
        last = seq - 1
        if last % CHUNK_SIZE != CHUNK_SIZE - 1:
            window = min(last % CHUNK_SIZE + 1, extend)
            write.append((ragged_start + extend - 1, batch, last, window))
        ragged_start += extend
    compress_rows = np.concatenate(compress) if compress else np.zeros((0, 4), dtype=np.int64)
    write_rows = np.asarray(write, dtype=np.int64).reshape(-1, 4)
    return compress_rows, write_rows


def check_lengths(lengths: object, name: str) -> None:
    """Raises TypeError or ValueError naming argument ``name`` unless ``lengths`` is a 1-D int64
    (or int32) tensor, on any device."""
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"argument '{name}': expected a torch.Tensor, got {type(lengths).__name__}")
    if lengths.dtype not in _LENGTH_DTYPES:
        raise TypeError(f"argument '{name}': expected dtype int64 (or int32), got {lengths.dtype}")
    if lengths.dim() != 1:
        raise ValueError(f"argument '{name}': expected a 1-D tensor [B], got shape {list(lengths.shape)}")


def _check_on_host(tensor: torch.Tensor, name: str) -> None:
    """ValueError naming argument ``name`` unless ``tensor`` is in host memory (torch's "cpu": plain or pinned)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"argument '{name}': expected a host (CPU or pinned) tensor, got device {tensor.device}")


def _host_lengths(lengths: object, name: str) -> list[int]:
    """The values of a ``[B]`` int64 host tensor, checked as the compiled host planner checks it."""
    check_lengths(lengths, name)
    if lengths.dtype != torch.int64:
        raise TypeError(f"argument '{name}': expected dtype int64, got {lengths.dtype}")
    _check_on_host(lengths, name)
    check_contiguous(lengths, name)
    return [int(x) for x in lengths.tolist()]


def _export_bool(value: object, name: str) -> bool:
    """A ``bool`` argument as tvm-ffi hands one to the compiled export: a bool, or an integer (Python or
    numpy) that fits an int64, taken as its truth value; anything else (a float, a numpy bool, None) is
    a TypeError naming the argument."""
    if isinstance(value, (bool, np.integer)) or (isinstance(value, int) and -(2**63) <= value < 2**63):
        return bool(value)
    raise TypeError(f"argument '{name}': expected a bool, got {type(value).__name__}")


def planned_tokens(extend: Sequence[int], seq: Sequence[int]) -> int:
    """``sum(extend)``, the rows a plan needs, once each length is one the planner takes (``0 < extend_len <=
    seq_len <= MAX_LENGTH``, the sum at most ``MAX_LENGTH``); else ValueError naming the argument."""
    total = 0
    for b, (e, s) in enumerate(zip(extend, seq)):
        if not 0 < e <= s:
            raise ValueError(
                f"argument 'extend_lens': expected 0 < extend_lens[{b}] <= seq_lens[{b}], "
                f"got extend_lens[{b}] = {e} and seq_lens[{b}] = {s}"
            )
        if s > MAX_LENGTH:
            raise ValueError(f"argument 'seq_lens': expected seq_lens[{b}] <= {MAX_LENGTH}, got {s}")
        total += e
    if total > MAX_LENGTH:
        raise ValueError(f"argument 'extend_lens': expected a sum <= {MAX_LENGTH}, got {total}")
    return total


def plan_online_prefill(
    extend_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    compress_plan: torch.Tensor,
    write_plan: torch.Tensor,
    use_cuda_graph: bool,
) -> tuple[int, int]:
    """Plans an online prefill; writes the plan rows in place and returns ``(num_compress, num_write)``.

    ``extend_lens`` and ``seq_lens`` are ``[B]`` int64 host (CPU or pinned) tensors;
    ``seq_lens`` include the new tokens. ``compress_plan`` and ``write_plan`` are
    contiguous ``[M, 16]`` uint8 tensors with ``M = sum(extend_lens)``. Rows
    ``0 .. num_compress`` of ``compress_plan`` and ``0 .. num_write`` of
    ``write_plan`` are written (see :func:`plan_segments` for their content and
    order); the remaining rows are left untouched, unless ``use_cuda_graph``, in
    which case they are filled with all-0xFF sentinel rows and ``(M, M)`` is
    returned.

    Raises :class:`TypeError` for a wrong type or dtype and :class:`ValueError`
    (naming the argument) for a wrong shape, ``not 0 < extend_len <= seq_len``,
    ``seq_len > MAX_LENGTH`` or ``sum(extend_lens) != M``. Nothing is written
    when it raises.
    """
    extend = _host_lengths(extend_lens, "extend_lens")
    seq = _host_lengths(seq_lens, "seq_lens")
    if len(extend) != len(seq):
        raise ValueError(
            f"argument 'seq_lens': expected shape [{len(extend)}] like extend_lens, got [{len(seq)}]"
        )
    check_plan_tensor(compress_plan, "compress_plan")
    check_plan_tensor(write_plan, "write_plan")
    for plan, name in ((compress_plan, "compress_plan"), (write_plan, "write_plan")):
        _check_on_host(plan, name)  # as the compiled host planner: plans of host lengths stay on the host
        check_contiguous(plan, name)
    if write_plan.shape[0] != compress_plan.shape[0]:
        raise ValueError(
            f"argument 'write_plan': expected {compress_plan.shape[0]} rows like compress_plan, "
            f"got {write_plan.shape[0]}"
        )
    check_apart([("extend_lens", extend_lens, False), ("seq_lens", seq_lens, False),
                 ("compress_plan", compress_plan, True), ("write_plan", write_plan, True)])
    use_cuda_graph = _export_bool(use_cuda_graph, "use_cuda_graph")
    total = planned_tokens(extend, seq)
    num_rows = compress_plan.shape[0]
    if total != num_rows:
        raise ValueError(
            f"argument 'compress_plan': expected [sum(extend_lens), {ROW_BYTES}] = [{total}, {ROW_BYTES}] "
            f"(write_plan too), got [{num_rows}, {ROW_BYTES}]"
        )

    compress_rows, write_rows = plan_segments(extend, seq)
    num_compress, num_write = len(compress_rows), len(write_rows)
    if num_compress:
        compress_plan[:num_compress].copy_(encode_rows(compress_rows))
    if num_write:
        write_plan[:num_write].copy_(encode_rows(write_rows))
    if not use_cuda_graph:
        return num_compress, num_write
    compress_plan[num_compress:].fill_(PADDING_BYTE)
    write_plan[num_write:].fill_(PADDING_BYTE)
    return num_rows, num_rows


def plan_tensors(planner: Any, extend_lens: Lengths, seq_lens: Lengths, use_cuda_graph: bool = False, *,
                 pin_memory: bool = False, rows: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plans a prefill on the host with ``planner`` (anything with ``plan_online_prefill``: a compiled
    module or the reference) and returns ``(compress_plan, write_plan)``, CPU uint8 tensors sliced to
    the counts it returns (``sum(extend_lens)`` rows each with ``use_cuda_graph``); ``pin_memory``
    allocates them pinned, for a ``non_blocking`` copy to a GPU. ``rows``: ``sum(extend_lens)``, where
    the caller has it already (the planner checks it)."""
    extend = torch.as_tensor(extend_lens, dtype=torch.int64, device="cpu").contiguous()
    seq = torch.as_tensor(seq_lens, dtype=torch.int64, device="cpu").contiguous()
    if rows is None:
        rows = int(extend.sum())
    compress_plan = torch.empty((rows, ROW_BYTES), dtype=torch.uint8, pin_memory=pin_memory)
    write_plan = torch.empty((rows, ROW_BYTES), dtype=torch.uint8, pin_memory=pin_memory)
    num_compress, num_write = (int(n) for n in planner.plan_online_prefill(extend, seq, compress_plan, write_plan,
                                                                         bool(use_cuda_graph)))
    return compress_plan[:num_compress], write_plan[:num_write]
