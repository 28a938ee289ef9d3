"""A CPU stand-in for the kernels: SPEC sections 1, 3 and 8-10 in float32 arithmetic.

The reference (:mod:`flash_compress.reference`) computes in float64; the
kernels compute in float32 and store float32 or bfloat16 states. This module
does what the kernels do, on CPU tensors, so that the schedule harness's
``shadow`` comparison (``tests/schedule.py``) can be exercised without a GPU:
run with ``impl=Float32Model()`` and ``shadow=reference``, the differences are
exactly those of float32 against float64 arithmetic, and for bfloat16 states
the rare one-ulp flips where the two land on either side of a rounding
boundary. Written apart from the reference on purpose (token by token, like an
online kernel, rather than segment softmax plus merge), and without argument
checks: it trusts its caller.
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_compress import reference
from flash_compress.plan_rows import CHUNK_SIZE, PADDING_ROW, decode_rows, live_rows

__all__ = ["Float32Model"]

F32 = torch.float32


def _add(state: Optional[tuple[torch.Tensor, ...]], s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One online-softmax step in float32; ``state`` None starts a chunk. Works row-wise on ``[..., D]``."""
    if state is None:
        return s, torch.ones_like(s), v
    m, l, x = state
    top = torch.maximum(m, s)
    old = l * torch.exp(m - top)
    new = torch.exp(s - top)
    l2 = old + new
    return top, l2, (x * old + v * new) / l2


def _stored(state: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """The state as the kernels write it: bf16 max rounded first, the sum re-based on it, all in float32."""
    m, l, x = state
    if dtype == torch.bfloat16:
        rounded = m.to(dtype)
        l = l * torch.exp(m - rounded.to(F32))
        m = rounded
    return torch.cat([m, l, x], dim=-1).to(dtype)


class Float32Model:
    """``run_decode``, ``run_prefill``, ``run_prefill_compact``, ``run_verify``, ``run_commit`` in float32; plans
    with the reference planner."""

    plan_online_prefill = staticmethod(reference.plan_online_prefill)

    def run_decode(self, buffer, kv_score_input, out, ape, indices, seq_lens, extra=None) -> None:
        d = ape.shape[1]
        offset = (seq_lens.long() - 1) % CHUNK_SIZE
        slots = indices.long()
        v, s = kv_score_input[:, :d].to(F32), kv_score_input[:, d:].to(F32) + ape.to(F32)[offset]
        prior = buffer[slots, 0].to(F32)
        fresh = (offset == 0)[:, None]
        m, l, x = _add((prior[:, :d], prior[:, d : 2 * d], prior[:, 2 * d :]), s, v)
        state = (torch.where(fresh, s, m), torch.where(fresh, torch.ones_like(l), l), torch.where(fresh, v, x))
        closing = offset == CHUNK_SIZE - 1
        out[closing] = state[2][closing].to(out.dtype)
        buffer[slots[~closing], 0] = _stored(tuple(t[~closing] for t in state), buffer.dtype)

    def _segment(self, row, kv_score_input, ape, prior: torch.Tensor):
        ragged, _, position, window = (int(f) for f in row)
        d = ape.shape[1]
        first = position % CHUNK_SIZE - window + 1
        state = None if first == 0 else (prior[:d].to(F32), prior[d : 2 * d].to(F32), prior[2 * d :].to(F32))
        for k in range(window):
            token = kv_score_input[ragged - window + 1 + k].to(F32)
            state = _add(state, token[d:] + ape[first + k].to(F32), token[:d])
        return state

    def _prefill(self, buffer, kv_score_input, out, ape, indices, compress_plan, write_plan, load_indices,
                 compact: bool) -> None:
        load = (indices if load_indices is None else load_indices).long().tolist()
        store = indices.long().tolist()
        compress = decode_rows(compress_plan)
        results = []
        for i, row in enumerate(compress.tolist()):
            if row[0] != PADDING_ROW:
                _, _, x = self._segment(row, kv_score_input, ape, buffer[load[row[1]], 0])
                results.append((i if compact else row[0], x))
        states = [(store[row[1]], self._segment(row, kv_score_input, ape, buffer[load[row[1]], 0]))
                  for row in live_rows(decode_rows(write_plan)).tolist()]
        for target, x in results:
            out[target] = x.to(out.dtype)
        for slot, state in states:
            buffer[slot, 0] = _stored(state, buffer.dtype)

    def run_prefill(self, buffer, kv_score_input, out, ape, indices, compress_plan, write_plan,
                    load_indices=None) -> None:
        self._prefill(buffer, kv_score_input, out, ape, indices, compress_plan, write_plan, load_indices, False)

    def run_prefill_compact(self, buffer, kv_score_input, out, ape, indices, compress_plan, write_plan,
                            load_indices=None) -> None:
        self._prefill(buffer, kv_score_input, out, ape, indices, compress_plan, write_plan, load_indices, True)

    def run_verify(self, buffer, kv_score_input, out, ape, indices, seq_lens, prefix_states) -> None:
        """SPEC section 9 as ``c128_verify_kernel`` does it: request by request, token by token, skipping
        a slot outside the pool or ``seq_len < T``; only what is stored is rounded."""
        d = ape.shape[1]
        batch = indices.shape[0]
        window = kv_score_input.shape[0] // batch if batch else 0
        for b, (slot, seq_len) in enumerate(zip(indices.tolist(), seq_lens.tolist())):
            if not 0 <= slot < buffer.shape[0] or seq_len < window:
                continue
            first = (seq_len - window) % CHUNK_SIZE
            prior = buffer[slot, 0].to(F32)
            state = None if first == 0 else (prior[:d], prior[d : 2 * d], prior[2 * d :])
            for j in range(window):
                offset, row = (first + j) % CHUNK_SIZE, b * window + j
                token = kv_score_input[row].to(F32)
                state = _add(None if offset == 0 else state, token[d:] + ape[offset].to(F32), token[:d])
                prefix_states[row] = _stored(state, prefix_states.dtype)
                if offset == CHUNK_SIZE - 1:
                    out[row] = state[2].to(out.dtype)

    def run_commit(self, buffer, prefix_states, indices, accept_lens) -> None:
        batch = indices.shape[0]
        window = prefix_states.shape[0] // batch if batch else 0
        for b, (slot, accepted) in enumerate(zip(indices.tolist(), accept_lens.tolist())):
            if 1 <= accepted <= window and 0 <= slot < buffer.shape[0]:
                buffer[slot, 0] = prefix_states[b * window + accepted - 1]
