"""Stress: 10,000 random decode and prefill steps on the GPU across many slots, every emitted row checked.

The schedule is ``tests/schedule.py``'s (``ScheduleHarness.random_step``:
requests start, finish, move slots through ``load_indices``, prefill with and
without CUDA-graph padding), with up to 64 live requests over 96 slots. The
harness's own checks (a float64 offline softmax per step on the host) are too
slow for 10,000 steps, so :class:`StressHarness` replaces them with a float64
*incremental* oracle that stays on the GPU: one state ``[max | sum | kv]`` per
slot, advanced per step with segment reductions over all of the step's
tokens at once (``_advance_oracle``). It never reads the kernels' state, so
an error in one step cannot leak into the next step's expectation: failures
do not accumulate, and the first failing call is reported with its step.

Per call, on the device, without a sync: every output row of a chunk-closing
token against the oracle (max-abs relative error, ``oracle.ROW_RTOL``), every
other row still NaN, every slot the call must not write bitwise unchanged,
every slot it writes against the oracle's state. The verdicts are gathered
every 500 calls. At the end every live state must be finite and match.

Marked ``gpu`` (it runs in the normal GPU suite) and ``stress`` (select it
alone with ``-m stress``). ``FLASH_COMPRESS_STRESS_STEPS`` changes the step count.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np
import pytest
import torch

import oracle
from flash_compress.plan_rows import CHUNK_SIZE, ROW_BYTES
from schedule import Request, ScheduleHarness, counts_of

pytestmark = [pytest.mark.gpu, pytest.mark.stress]

STEPS = int(os.environ.get("FLASH_COMPRESS_STRESS_STEPS", "10000"))
CHECK_EVERY = 500


class StressHarness(ScheduleHarness):
    """``ScheduleHarness``'s random schedule, checked by a float64 incremental oracle on the device."""

    def __init__(self, impl: Any, *, head_dim: int, device: str, seed: int, **kwargs: Any) -> None:
        super().__init__(impl, head_dim=head_dim, device=device, seed=seed, **kwargs)
        self.ape64_dev = self.ape.to(torch.float64)
        self.oracle_state = torch.full((self.num_slots, 3, head_dim), float("nan"), dtype=torch.float64,
                                       device=self.device)
        self.device_gen = torch.Generator(device=self.device).manual_seed(seed)
        self.verdicts: list[torch.Tensor] = []  # per call: [nan mismatches, stray writes, row score, state score]
        self.descriptions: list[str] = []
        self.checked_upto = 0

    # -- the oracle ----------------------------------------------------------

    def _advance_oracle(self, inp: torch.Tensor, prefix: np.ndarray, extend: np.ndarray, load: np.ndarray,
                        target: np.ndarray):
        """Advances the oracle by one call's tokens; returns (expected output, written slots, their states).

        Request b's tokens are positions ``prefix[b] ..`` (ragged rows in
        order). They split into segments at chunk starts; a segment that
        starts mid-chunk continues the state of slot ``load[b]``. A segment
        that closes its chunk emits a row; the request's trailing partial
        segment becomes slot ``target[b]``'s state.
        """
        d, dev = self.head_dim, self.device
        n = int(extend.sum())
        token_batch = np.repeat(np.arange(len(extend)), extend)
        starts = np.cumsum(extend) - extend
        pos = prefix[token_batch] + np.arange(n) - starts[token_batch]
        chunk = pos // CHUNK_SIZE
        new_segment = np.ones(n, dtype=bool)
        new_segment[1:] = (token_batch[1:] != token_batch[:-1]) | (chunk[1:] != chunk[:-1])
        segment = np.cumsum(new_segment) - 1
        first = np.flatnonzero(new_segment)
        last = np.r_[first[1:] - 1, n - 1]
        seg_batch = token_batch[first]
        has_prior = pos[first] % CHUNK_SIZE != 0
        closes = pos[last] % CHUNK_SIZE == CHUNK_SIZE - 1

        seg_t = torch.as_tensor(segment, device=dev)
        x = inp.to(torch.float64)
        s = x[:, d:] + self.ape64_dev[torch.as_tensor(pos % CHUNK_SIZE, device=dev)]
        v = x[:, :d]
        num_segments = len(first)
        prior = torch.zeros(num_segments, 3, d, dtype=torch.float64, device=dev)
        prior[:, 0] = float("-inf")
        if has_prior.any():
            prior[torch.as_tensor(np.flatnonzero(has_prior), device=dev)] = self.oracle_state[
                torch.as_tensor(load[seg_batch[has_prior]], device=dev)]
        index = seg_t[:, None].expand(-1, d)
        top = torch.full((num_segments, d), float("-inf"), dtype=torch.float64, device=dev)
        top = top.scatter_reduce(0, index, s, reduce="amax").maximum(prior[:, 0])
        weight = torch.exp(s - top[seg_t])
        prior_weight = prior[:, 1] * torch.exp(prior[:, 0] - top)  # 0 where there is no prior
        total = torch.zeros_like(top).index_add_(0, seg_t, weight) + prior_weight
        acc = torch.zeros_like(top).index_add_(0, seg_t, weight * v) + prior[:, 2] * prior_weight
        kv = acc / total

        expected = torch.full((n, d), float("nan"), dtype=torch.float64, device=dev)
        closing = torch.as_tensor(np.flatnonzero(closes), device=dev)
        expected[torch.as_tensor(last[closes], device=dev)] = kv[closing]
        trailing = np.flatnonzero(~closes)
        slots = target[seg_batch[trailing]]
        states = torch.stack([top, total, kv], dim=1)[torch.as_tensor(trailing, device=dev)]
        self.oracle_state[torch.as_tensor(slots, device=dev)] = states
        self.stats.rows_checked += int(closes.sum())
        self.stats.states_checked += len(slots)
        return expected, slots, states

    # -- checks (no sync) ----------------------------------------------------

    def _verdict(self, out: torch.Tensor, expected: torch.Tensor, before: torch.Tensor, slots: np.ndarray,
                 states: torch.Tensor) -> torch.Tensor:
        dev = self.device
        nan_mismatch = (torch.isnan(out) != torch.isnan(expected)).sum().to(torch.float64)
        closing = ~torch.isnan(expected[:, 0])
        row_score = torch.zeros((), dtype=torch.float64, device=dev)
        if out.shape[0]:
            rel = self._row_rel(out[closing], expected[closing])
            row_score = rel.max() / oracle.ROW_RTOL if rel.numel() else row_score
        changed = (before.view(torch.int32) != self.buffer.view(torch.int32)).flatten(1).any(dim=1)
        allowed = torch.zeros(self.num_slots, dtype=torch.bool, device=dev)
        slots_t = torch.as_tensor(slots, dtype=torch.int64, device=dev)
        allowed[slots_t] = True
        stray = (changed & ~allowed).sum().to(torch.float64)
        state_score = self._state_score(self.buffer[slots_t, 0], states)
        return torch.stack([nan_mismatch, stray, row_score, state_score])

    @staticmethod
    def _row_rel(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        """Per row ``max |got - want| / max |want|``; inf where got is not finite."""
        got = got.to(torch.float64)
        rel = (got - want).abs().amax(dim=1) / want.abs().amax(dim=1).clamp_min(1e-30)
        return torch.where(torch.isfinite(got).all(dim=1), rel, torch.full_like(rel, float("inf")))

    def _state_score(self, got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        """Worst of the three state errors, each divided by its tolerance (<= 1 passes); inf for non-finite."""
        if got.shape[0] == 0:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        d = self.head_dim
        g = got.to(torch.float64).reshape(-1, 3, d)
        m, total, kv = g[:, 0], g[:, 1], g[:, 2]
        om, ototal, okv = want[:, 0], want[:, 1], want[:, 2]
        max_score = ((m - om).abs() / (1 + om.abs())).amax() / oracle.MAX_TOL
        sum_score = ((total * torch.exp(m - om) - ototal).abs() / ototal).amax() / oracle.SUM_RTOL
        kv_score = self._row_rel(kv, okv).amax() / oracle.ROW_RTOL
        score = torch.stack([max_score, sum_score, kv_score]).amax()
        return torch.where(torch.isfinite(g).all(), torch.nan_to_num(score, nan=float("inf")),
                           torch.full_like(score, float("inf")))

    def check_verdicts(self) -> None:
        """Syncs once and fails on the first call whose verdict is bad."""
        pending = self.verdicts[self.checked_upto :]
        if not pending:
            return
        table = torch.stack(pending).cpu()
        bad = (table[:, 0] > 0) | (table[:, 1] > 0) | ~(table[:, 2] <= 1) | ~(table[:, 3] <= 1)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            nan_mismatch, stray, row_score, state_score = table[i].tolist()
            call = self.checked_upto + i
            raise AssertionError(
                f"call {call} ({self.descriptions[call]}): {int(nan_mismatch)} output elements NaN where they "
                f"must not be or written where they must not be, {int(stray)} slots written that must stay "
                f"untouched, worst row error {row_score:.2f} x tolerance, worst state error {state_score:.2f} x "
                f"tolerance; {int(bad.sum())} of {len(pending)} calls in this batch fail"
            )
        self.checked_upto = len(self.verdicts)

    # -- steps ---------------------------------------------------------------

    def _tokens_on_device(self, n: int) -> torch.Tensor:
        inp = torch.randn(n, 2 * self.head_dim, generator=self.device_gen, device=self.device)
        inp[:, self.head_dim :] *= self.score_scale
        return inp

    def _i32(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int32, device=self.device)

    def decode_step(self, batch: Sequence[Request]) -> None:
        n = len(batch)
        inp = self._tokens_on_device(n)
        out = torch.full((n, self.head_dim), float("nan"), device=self.device)
        slots = np.array([r.slot for r in batch])
        prefix = np.array([r.length for r in batch])
        before = self.buffer.clone()
        self.impl.run_decode(self.buffer, inp, out, self.ape, self._i32(slots), self._i32(prefix + 1), None)
        expected, written, states = self._advance_oracle(inp, prefix, np.ones(n, dtype=np.int64), slots, slots)
        self.verdicts.append(self._verdict(out, expected, before, written, states))
        self.descriptions.append(f"step {len(self.descriptions)}: decode of {n}, positions {prefix[:6].tolist()}...")
        for r in batch:
            self.stats.decode_closes += int(r.length % CHUNK_SIZE == CHUNK_SIZE - 1)
            self.stats.decode_resets += int(r.length % CHUNK_SIZE == 0)
            r.length += 1
        self.stats.decode_calls += 1
        self.stats.tokens += n

    def prefill_step(self, batch: Sequence[tuple[Request, int, Optional[int]]], *, use_cuda_graph: bool = False,
                     pass_load_indices: bool = False, compact: bool = False) -> None:
        # The on-device oracle checks full [N, D] outputs; compact ones are the schedule tests' (compact=True).
        assert not compact, "StressHarness runs run_prefill only: construct it with compact=False"
        extend = np.array([e for _, e, _ in batch])
        prefix = np.array([r.length for r, _, _ in batch])
        load = np.array([r.slot for r, _, _ in batch])
        target = np.array([r.slot if s is None else s for r, _, s in batch])
        total = int(extend.sum())
        compress_plan = torch.empty(total, ROW_BYTES, dtype=torch.uint8)
        write_plan = torch.empty(total, ROW_BYTES, dtype=torch.uint8)
        counts = counts_of(self.planner.plan_online_prefill(torch.tensor(extend), torch.tensor(prefix + extend),
                                                            compress_plan, write_plan, bool(use_cuda_graph)))
        if use_cuda_graph:
            assert counts == (total, total), f"planner returned {counts}, want {(total, total)}"
            self.stats.cuda_graph_plans += 1
        else:
            want_write = int(((prefix + extend) % CHUNK_SIZE != 0).sum())
            want_compress = int(((prefix + extend) // CHUNK_SIZE - prefix // CHUNK_SIZE).sum())
            assert counts == (want_compress, want_write), f"planner returned {counts}"
            compress_plan, write_plan = compress_plan[: counts[0]], write_plan[: counts[1]]
        moving = bool((load != target).any())
        use_load = moving or pass_load_indices
        inp = self._tokens_on_device(total)
        out = torch.full((total, self.head_dim), float("nan"), device=self.device)
        before = self.buffer.clone()
        self.impl.run_prefill(self.buffer, inp, out, self.ape, self._i32(target), compress_plan.to(self.device),
                              write_plan.to(self.device), self._i32(load) if use_load else None)
        expected, written, states = self._advance_oracle(inp, prefix, extend, load, target)
        self.verdicts.append(self._verdict(out, expected, before, written, states))
        self.descriptions.append(f"step {len(self.descriptions)}: prefill of extends {extend[:6].tolist()}... "
                                 f"prefixes {prefix[:6].tolist()}..., cuda_graph={use_cuda_graph}, moving={moving}")
        for request, e, new_slot in batch:
            if new_slot is not None:
                self.free_slots.remove(new_slot)
                self.free_slots.append(request.slot)
                self.stats.relocations += 1
                self.stats.relocations_mid_chunk += int(request.length % CHUNK_SIZE != 0)
                request.slot = new_slot
            request.length += e
        self.stats.prefill_calls += 1
        self.stats.load_indices_calls += int(use_load)
        self.stats.tokens += total

    def random_step(self) -> None:
        super().random_step()
        if len(self.verdicts) - self.checked_upto >= CHECK_EVERY:
            self.check_verdicts()

    def check_live_states(self) -> None:
        """Every live request with an open chunk: its slot is finite and matches the oracle."""
        self.check_verdicts()
        live = [r.slot for r in self.requests if r.length % CHUNK_SIZE != 0]
        slots = torch.tensor(live, dtype=torch.int64, device=self.device)
        got = self.buffer[slots, 0]
        assert bool(torch.isfinite(got).all()), "NaN or inf in a live state"
        score = float(self._state_score(got, self.oracle_state[slots]))
        assert score <= 1, f"live states off by {score:.2f} x tolerance"
        self.stats.live_states_checked += len(live)


def run_stress(impl: Any, *, device: str, steps: int, head_dim: int = 512, seed: int = 2024):
    harness = StressHarness(impl, head_dim=head_dim, device=device, seed=seed, num_slots=96, max_requests=64,
                            finish_prob=0.01, max_step_tokens=512, relocate_prob=0.2, compact=False)
    return harness.run(steps)


def test_ten_thousand_random_steps(gpu):
    import flash_compress

    module = flash_compress.load_module(head_dim=512)
    stats = run_stress(module, device="cuda", steps=STEPS)
    assert stats.decode_calls + stats.prefill_calls == STEPS
    assert stats.rows_checked > 0 and stats.decode_closes > 0 and stats.relocations_mid_chunk > 0
    assert 0 < stats.cuda_graph_plans < stats.prefill_calls and stats.live_states_checked > 0
