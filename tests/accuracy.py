"""How far bfloat16 states put an implementation from the float64 oracle (``docs/SPEC.md`` section 8).

Shared by ``scripts/bf16_accuracy.py`` (which prints the numbers) and
``tests/test_reference_bf16.py`` (which checks them against the bounds in
``tests/oracle.py``). Every case runs an implementation with a bfloat16 state
pool and records, without judging them, the errors against float64: per
emitted row the max-abs relative error against the offline chunk softmax, per
stored state the error of its ``kv`` and of ``max + log(sum)``. The mixed and
extend cases drive ``tests/schedule.py``'s harness (with unchecked
tolerances); the decode cases batch many requests side by side
(:func:`lockstep`), which is much faster for long decodes.

The kinds of schedule (:data:`CASES` names the configurations measured):

- ``decode_only``: requests decoded one token per step from their first
  token through several full chunks (a chunk's row is built over up to 127
  rounded stores); ``decode_tail``: a prefill, then the last few tokens of the
  chunk by decode (as many stores as decode steps);
- ``mixed``: the harness's random engine schedule (prefills of every size,
  decodes, relocation through ``load_indices``, CUDA-graph plans, compact and
  full prefill outputs);
- ``extend``: for every ``n`` in 1..127, a request prefills ``n`` tokens (one
  rounded store) and then the rest of the chunk (``128 - n`` tokens), which
  emits the row: exactly one rounding between the tokens and the row.

Data and schedules depend only on the seed, never on the implementation, so
two implementations (e.g. :func:`naive_reference` and the reference) see the
same tokens.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

import oracle
from flash_compress import reference as ref
from flash_compress.plan_rows import CHUNK_SIZE, ROW_BYTES
from schedule import ScheduleHarness, ScheduleStats

__all__ = ["CASES", "Case", "Errors", "decode_only", "decode_tail", "extend", "lockstep", "mixed", "naive_reference"]

BF16 = torch.bfloat16


def naive_reference() -> Any:
    """The reference with the naive bf16 store (``exact_bf16_stores=False``): each field cast on its own."""
    naive = functools.partial
    return SimpleNamespace(
        run_decode=naive(ref.run_decode, exact_bf16_stores=False),
        run_prefill=naive(ref.run_prefill, exact_bf16_stores=False),
        run_prefill_compact=naive(ref.run_prefill_compact, exact_bf16_stores=False),
        plan_online_prefill=ref.plan_online_prefill,
    )


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q))


@dataclass
class Errors:
    """The errors one measurement recorded."""

    rows: list[float]  # per emitted row
    kv: list[float]  # per stored state: kv
    lse: list[float]  # per stored state: max + log(sum)

    @classmethod
    def of(cls, stats: ScheduleStats) -> "Errors":
        return cls(rows=list(stats.row_errors), kv=list(stats.state_kv_errors), lse=list(stats.state_lse_errors))

    def __add__(self, other: "Errors") -> "Errors":
        return Errors(self.rows + other.rows, self.kv + other.kv, self.lse + other.lse)

    def summary(self) -> dict[str, float]:
        """Max and 99th percentile of each list (NaN for an empty one)."""
        out = {}
        for name in ("rows", "kv", "lse"):
            values = getattr(self, name)
            out[f"{name}_max"] = max(values) if values else math.nan
            out[f"{name}_p99"] = _percentile(values, 0.99)
        out["n_rows"], out["n_states"] = len(self.rows), len(self.kv)
        return out


def _harness(impl: Any, seed: int, head_dim: int, slots: int, **kwargs: Any) -> ScheduleHarness:
    return ScheduleHarness(impl, head_dim=head_dim, seed=seed, num_slots=slots, max_requests=min(slots, 5),
                           state_dtype=BF16, tolerances=oracle.Tolerances.unchecked(), **kwargs)


def _prefix_states(kv: torch.Tensor, score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse, kv)`` of every prefix of every chunk: inputs ``[B, T, D]`` float64 (score with ape), T % 128 == 0.

    Entry ``[b, t]`` is the state of tokens ``128 * (t // 128) .. t`` of request ``b``: cumulative sums of
    ``exp(score - chunk max)``, an offline computation independent of the online update.
    """
    b, t, d = kv.shape
    kv, score = kv.reshape(b, t // CHUNK_SIZE, CHUNK_SIZE, d), score.reshape(b, t // CHUNK_SIZE, CHUNK_SIZE, d)
    top = score.amax(dim=2, keepdim=True)
    w = torch.exp(score - top)
    total = w.cumsum(dim=2)
    lse = top + torch.log(total)
    return lse.reshape(b, t, d), ((w * kv).cumsum(dim=2) / total).reshape(b, t, d)


def lockstep(impl: Any, seed: int, *, head_dim: int = 64, requests: int = 64, prefill: int = 0,
             decodes: int = 3 * CHUNK_SIZE) -> Errors:
    """``requests`` requests side by side: one prefill of ``prefill`` tokens each (if any), then ``decodes`` decode steps.

    Every request starts at position 0 in its own slot (slots shuffled against
    batch order) and ``prefill + decodes`` is a multiple of 128, so every
    chunk closes. Rows are checked against the offline softmax, and every
    stored state after every call against the offline prefix state.
    """
    length = prefill + decodes
    assert length % CHUNK_SIZE == 0 and length > 0
    gen = torch.Generator().manual_seed(seed)
    d = head_dim
    ape = torch.randn(CHUNK_SIZE, d, generator=gen)
    kv = torch.randn(requests, length, d, generator=gen)
    score = torch.randn(requests, length, d, generator=gen) * 2.0
    inputs = torch.cat([kv, score], dim=2)
    slots = torch.randperm(requests, generator=gen).to(torch.int32)
    biased = score.double() + ape.double().repeat(length // CHUNK_SIZE, 1)
    want_lse, want_kv = _prefix_states(kv.double(), biased)
    rows = oracle.chunk_outputs(kv.reshape(-1, d), score.reshape(-1, d), ape)  # chunks of all requests, in order
    rows = rows.reshape(requests, length // CHUNK_SIZE, d)
    buffer = torch.full((requests, 1, 3 * d), float("nan"), dtype=BF16)
    errors = Errors([], [], [])

    def record_states(t: int) -> None:
        """States after token ``t`` of every request (unless ``t`` closed its chunk: nothing is stored then)."""
        if t % CHUNK_SIZE == CHUNK_SIZE - 1:
            return
        got = buffer[slots.long(), 0].double()
        m, total, got_kv = got[:, :d], got[:, d : 2 * d], got[:, 2 * d :]
        errors.lse.extend((m + torch.log(total) - want_lse[:, t]).abs().amax(dim=1).tolist())
        errors.kv.extend(oracle.row_relative_error(got_kv, want_kv[:, t]).tolist())

    def record_rows(got: torch.Tensor, t: int) -> None:
        if t % CHUNK_SIZE == CHUNK_SIZE - 1:
            errors.rows.extend(oracle.row_relative_error(got, rows[:, t // CHUNK_SIZE]).tolist())

    if prefill:
        extend = torch.full((requests,), prefill, dtype=torch.int64)
        num_rows = requests * prefill
        compress_plan = torch.empty(num_rows, ROW_BYTES, dtype=torch.uint8)
        write_plan = torch.empty(num_rows, ROW_BYTES, dtype=torch.uint8)
        nc, nw = (int(c) for c in ref.plan_online_prefill(extend, extend, compress_plan, write_plan, False))
        out = torch.full((num_rows, d), float("nan"))
        impl.run_prefill(buffer, inputs[:, :prefill].reshape(num_rows, 2 * d), out, ape, slots,
                         compress_plan[:nc], write_plan[:nw], None)
        done = out.reshape(requests, prefill, d)
        for t in range(CHUNK_SIZE - 1, prefill, CHUNK_SIZE):
            record_rows(done[:, t], t)
        record_states(prefill - 1)
    for t in range(prefill, length):
        out = torch.full((requests, d), float("nan"))
        seq_lens = torch.full((requests,), t + 1, dtype=torch.int32)
        impl.run_decode(buffer, inputs[:, t], out, ape, slots, seq_lens, None)
        record_rows(out, t)
        record_states(t)
    return errors


def decode_only(impl: Any, seed: int, *, head_dim: int = 64, requests: int = 64, chunks: int = 3) -> Errors:
    """Requests decoded from their first token through ``chunks`` full chunks: up to 127 stores per row."""
    return lockstep(impl, seed, head_dim=head_dim, requests=requests, decodes=chunks * CHUNK_SIZE)


def decode_tail(impl: Any, seed: int, *, head_dim: int = 64, requests: int = 64, decodes: int = 1) -> Errors:
    """A prefill of ``128 - decodes`` tokens, then ``decodes`` decode steps close the chunk: ``decodes`` stores per row."""
    return lockstep(impl, seed, head_dim=head_dim, requests=requests, prefill=CHUNK_SIZE - decodes, decodes=decodes)


def mixed(impl: Any, seed: int, *, head_dim: int = 64, steps: int = 60) -> Errors:
    """The harness's random engine schedule (prefill, decode, relocation, CUDA-graph and compact prefills)."""
    h = _harness(impl, seed, head_dim, 12, compact=None)
    h.run(steps)
    return Errors.of(h.stats)


def extend(impl: Any, seed: int, *, head_dim: int = 64) -> Errors:
    """Every split ``n + (128 - n)`` of one chunk into two prefills, ``n`` in 1..127: one rounded store each."""
    h = _harness(impl, seed, head_dim, CHUNK_SIZE - 1)
    requests = [h.start_request() for _ in range(CHUNK_SIZE - 1)]
    h.prefill_step([(r, n, None) for n, r in enumerate(requests, start=1)])
    h.stats.row_errors.clear()
    h.prefill_step([(r, CHUNK_SIZE - n, None) for n, r in enumerate(requests, start=1)])
    return Errors.of(h.stats)


@dataclass(frozen=True)
class Case:
    """One measured schedule kind: the function, its keyword arguments and how many seeds it pools."""

    run: Callable[..., Errors]
    kwargs: dict[str, Any]
    seeds: int
    what: str

    def measure(self, impl: Any, *, head_dim: int, seeds: Optional[int] = None) -> Errors:
        """The errors over seeds ``0 .. seeds - 1`` (default ``self.seeds``), pooled."""
        total = Errors([], [], [])
        for seed in range(self.seeds if seeds is None else seeds):
            total = total + self.run(impl, seed, head_dim=head_dim, **self.kwargs)
        return total


#: The cases ``scripts/bf16_accuracy.py`` reports, in order; their names key ``oracle.BF16_ROW_BOUNDS``.
CASES = {
    "decode_only": Case(decode_only, {"requests": 32}, 2, "decode from token 0 through 3 chunks (<= 127 stores per row)"),
    "decode_1": Case(decode_tail, {"decodes": 1}, 2, "prefill 127, one decode closes (1 store)"),
    "decode_16": Case(decode_tail, {"decodes": 16}, 2, "prefill 112, 16 decodes close (16 stores)"),
    "mixed": Case(mixed, {}, 4, "random engine schedule: prefill, decode, relocation"),
    "extend": Case(extend, {}, 2, "prefill n, then 128 - n, n = 1..127 (1 store)"),
}
