"""An engine-like random schedule driver for any online-c128 implementation.

``impl`` is anything with ``run_decode``, ``run_prefill`` and
``plan_online_prefill`` taking tensors as ``docs/SPEC.md`` section 3 says: the
:mod:`flash_compress.reference` module, or a compiled module from
``flash_compress.load_module(head_dim)`` (whose planner returns a
``tvm_ffi.Array``; counts are normalised with ``tuple(int(x) for x in r)``).

The harness keeps ``num_slots`` state slots and up to ``max_requests`` live
requests, each holding one slot. Every step is either

- a batched decode (a random subset of requests, one new token each, batch
  order shuffled so batch index != slot), or
- a chunked prefill (a random subset, each with a random extend: 1 token,
  a few, up to / exactly to / just past a chunk end, across one or many chunk
  boundaries, 128-aligned, ...), optionally planned with ``use_cuda_graph``,
  where some requests move to a free slot: ``load_indices`` = old slot,
  ``indices`` = new slot.

Requests also finish (their slot goes back to the free pool, content kept) and
new ones start at length 0. Token data is fresh ``torch.randn`` float32 (scores
scaled by ``score_scale`` so the softmax is far from uniform). The state buffer
starts all-NaN, so an implementation that reads a state it should ignore (a
chunk's first token, a fresh slot) poisons its result and fails.

Checks after every call (tolerances in ``tests/oracle.py``):

- ``kv_compressed_output`` is poisoned with NaN before the call; every row of a
  chunk-closing token must match the float64 offline chunk softmax
  (``oracle.chunk_output``), every other row must still be NaN;
- the planner's counts match the expected number of compress / write rows
  (``(M, M)`` with ``use_cuda_graph``, whose padding must be all 0xFF);
- every slot that must not be written is bitwise unchanged; every slot that must
  be written holds the oracle's partial-chunk state.

``check_live_states()`` (run at the end of :meth:`ScheduleHarness.run`) checks
every live request's slot against the oracle's partial-chunk state (finite,
max / sum / kv close); a request at a chunk boundary (``L % 128 == 0``) has no
open chunk and its slot holds nothing meaningful, so it is not checked.

Example::

    import flash_compress.reference as ref
    from schedule import ScheduleHarness

    harness = ScheduleHarness(ref, head_dim=128, device="cpu", seed=1)
    stats = harness.run(steps=40)
    assert stats.rows_checked > 0
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

import oracle
from flash_compress.plan_rows import CHUNK_SIZE, PADDING_BYTE, ROW_BYTES

__all__ = [
    "Request",
    "ScheduleHarness",
    "ScheduleStats",
    "choose_extend",
    "counts_of",
    "plan_with",
    "run_schedule",
]


def counts_of(result: Any) -> tuple[int, ...]:
    """Normalises a planner result (Python tuple or ``tvm_ffi.Array``) to a tuple of ints."""
    return tuple(int(x) for x in result)


def plan_with(
    impl: Any,
    extend_lens: Sequence[int],
    seq_lens: Sequence[int],
    use_cuda_graph: bool,
    *,
    fill_seed: int = 0,
    rows: Optional[int] = None,
) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor]:
    """Calls ``impl.plan_online_prefill`` on CPU int64 lengths and random-filled ``[rows, 16]`` uint8 plans.

    ``rows`` defaults to ``sum(extend_lens)``. The plans start as random bytes
    from ``fill_seed`` (the same bytes for the same seed and shape), so rows the
    planner does not write show. Returns ``(counts, compress_plan, write_plan)``.
    """
    total = sum(int(e) for e in extend_lens) if rows is None else rows
    gen = torch.Generator().manual_seed(fill_seed)
    compress_plan = torch.randint(0, 256, (total, ROW_BYTES), dtype=torch.uint8, generator=gen)
    write_plan = torch.randint(0, 256, (total, ROW_BYTES), dtype=torch.uint8, generator=gen)
    counts = counts_of(
        impl.plan_online_prefill(
            torch.tensor(list(extend_lens), dtype=torch.int64),
            torch.tensor(list(seq_lens), dtype=torch.int64),
            compress_plan,
            write_plan,
            bool(use_cuda_graph),
        )
    )
    return counts, compress_plan, write_plan


def choose_extend(rng: random.Random, length: int, budget: int) -> tuple[int, str]:
    """A random extend size for a request of current ``length`` (<= ``budget`` tokens), and its kind.

    Kinds cover: one token, a few, staying inside the open chunk, closing it
    exactly, ending at chunk offset 127 / 0 / 1 (so the next prefix ends at 127,
    128 or 129 mod 128), crossing one or many chunk boundaries, 128-aligned
    extends, and first prefills of 1 / 127 / 128 / 129 / 256 / random tokens.
    """
    budget = max(1, budget)
    r = length % CHUNK_SIZE
    to_close = CHUNK_SIZE - r  # extend that makes the new length a multiple of 128
    options: list[tuple[int, str]] = [(1, "one"), (rng.randint(2, 16), "small")]
    if to_close > 1:
        options.append((rng.randint(1, to_close - 1), "inside"))
    options += [
        (to_close, "close"),
        (to_close - 1 + CHUNK_SIZE * rng.randint(0, 1), "end127"),
        (to_close + 1 + CHUNK_SIZE * rng.randint(0, 1), "end1"),
        (to_close + rng.randint(1, CHUNK_SIZE - 1), "cross1"),
        (to_close + CHUNK_SIZE * rng.randint(1, 4) + rng.randint(0, CHUNK_SIZE - 1), "cross_many"),
        (CHUNK_SIZE * rng.randint(1, 3), "aligned"),
    ]
    if length == 0:
        options += [(n, f"first{n}") for n in (1, 127, 128, 129, 256)]
        options.append((rng.randint(1, 600), "first_random"))
    options = [(n, kind) for n, kind in options if 0 < n <= budget]
    if not options:
        return 1, "one"
    return rng.choice(options)


@dataclass
class Request:
    """One live request: its slot and the token history of its OPEN chunk.

    ``length`` is the number of tokens seen; ``kv`` / ``score`` hold the
    float64 values of positions ``base .. length-1`` where ``base`` is the
    start of the open chunk (so at most 127 rows are kept).
    """

    rid: int
    slot: int
    length: int = 0
    base: int = 0
    kv: Optional[torch.Tensor] = None
    score: Optional[torch.Tensor] = None

    def append(self, kv: torch.Tensor, score: torch.Tensor, ape64: torch.Tensor) -> dict[int, torch.Tensor]:
        """Appends new tokens (float64 CPU ``[n, D]``); returns ``{position: oracle row}`` of every chunk they close."""
        full_kv = kv if self.kv is None else torch.cat([self.kv, kv])
        full_score = score if self.score is None else torch.cat([self.score, score])
        closed = full_kv.shape[0] // CHUNK_SIZE
        rows = {
            self.base + CHUNK_SIZE * k + CHUNK_SIZE - 1: oracle.chunk_output(full_kv, full_score, ape64, k)
            for k in range(closed)
        }
        self.kv = full_kv[CHUNK_SIZE * closed :].clone()
        self.score = full_score[CHUNK_SIZE * closed :].clone()
        self.base += CHUNK_SIZE * closed
        self.length += kv.shape[0]
        return rows

    def open_state(self, ape64: torch.Tensor) -> Optional[oracle.PartialState]:
        """The oracle's state of the open chunk, or None at a chunk boundary."""
        if self.kv is None or self.length % CHUNK_SIZE == 0:
            return None
        return oracle.partial_state(self.kv, self.score, ape64)


@dataclass
class ScheduleStats:
    """What a schedule exercised (tests assert on coverage)."""

    decode_calls: int = 0
    prefill_calls: int = 0
    tokens: int = 0
    rows_checked: int = 0
    untouched_rows_checked: int = 0
    states_checked: int = 0
    live_states_checked: int = 0
    relocations: int = 0
    relocations_mid_chunk: int = 0
    cuda_graph_plans: int = 0
    load_indices_calls: int = 0
    requests_started: int = 0
    requests_finished: int = 0
    decode_closes: int = 0
    decode_resets: int = 0
    max_boundaries_crossed: int = 0
    extend_kinds: dict[str, int] = field(default_factory=dict)
    prefix_mod: dict[int, int] = field(default_factory=dict)  # prefix % 128 in {127, 0, 1} before a prefill


class ScheduleHarness:
    """Drives ``impl`` through a random engine-like schedule and checks it against the float64 oracle.

    Args:
        impl: object with ``run_decode``, ``run_prefill``, ``plan_online_prefill``.
        head_dim: D.
        device: where state, inputs, outputs and plans live (``"cpu"`` or ``"cuda"``);
            planner inputs are always CPU (int64 lengths, uint8 plans).
        num_slots: S, the state pool size (>= max_requests + a few, for relocation).
        max_requests: most live requests at a time.
        seed: drives both the schedule (``random.Random``) and the data (``torch.Generator``).
        cuda_graph: plan with ``use_cuda_graph`` always (True), never (False) or at random (None).
        relocate_prob: chance that a prefilling request moves to a free slot.
        decode_prob: chance that a step is a decode step (1.0: decode only, 0.0: prefill only).
        max_step_tokens: cap on the tokens of one prefill step.
        finish_prob: chance per step that a live request (length > 0) finishes.
        score_scale, ape_scale: standard deviations of scores and ape.
        planner: object whose ``plan_online_prefill`` plans (default ``impl``).
    """

    def __init__(
        self,
        impl: Any,
        *,
        head_dim: int,
        device: str | torch.device = "cpu",
        num_slots: int = 12,
        max_requests: int = 5,
        seed: int = 0,
        cuda_graph: Optional[bool] = None,
        relocate_prob: float = 0.3,
        decode_prob: float = 0.5,
        max_step_tokens: int = 768,
        finish_prob: float = 0.04,
        score_scale: float = 2.0,
        ape_scale: float = 1.0,
        planner: Any = None,
    ) -> None:
        if num_slots < max_requests:
            raise ValueError("num_slots must be >= max_requests")
        self.impl = impl
        self.planner = impl if planner is None else planner
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.num_slots = num_slots
        self.max_requests = max_requests
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.cuda_graph = cuda_graph
        self.relocate_prob = relocate_prob
        self.decode_prob = decode_prob
        self.max_step_tokens = max_step_tokens
        self.finish_prob = finish_prob
        self.score_scale = score_scale
        ape = torch.randn(CHUNK_SIZE, head_dim, generator=self.gen) * ape_scale
        self.ape64 = ape.to(torch.float64)
        self.ape = ape.to(self.device)
        self.buffer = torch.full((num_slots, 1, 3 * head_dim), float("nan"), device=self.device)
        self.requests: list[Request] = []
        self.free_slots: list[int] = list(range(num_slots))
        self.next_rid = 0
        self.stats = ScheduleStats()

    # -- requests ----------------------------------------------------------

    def start_request(self) -> Request:
        """Starts a length-0 request on a random free slot."""
        slot = self.free_slots.pop(self.rng.randrange(len(self.free_slots)))
        request = Request(rid=self.next_rid, slot=slot)
        self.next_rid += 1
        self.requests.append(request)
        self.stats.requests_started += 1
        return request

    def finish_request(self, request: Request) -> None:
        """Ends a request; its slot (content untouched) returns to the free pool."""
        self.requests.remove(request)
        self.free_slots.append(request.slot)
        self.stats.requests_finished += 1

    # -- data --------------------------------------------------------------

    def _tokens(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fresh float32 tokens: returns (input ``[n, 2D]`` on device, kv64, score64 on CPU)."""
        kv = torch.randn(n, self.head_dim, generator=self.gen)
        score = torch.randn(n, self.head_dim, generator=self.gen) * self.score_scale
        inp = torch.cat([kv, score], dim=1).contiguous()
        return inp.to(self.device), kv.to(torch.float64), score.to(torch.float64)

    def _nan_output(self, n: int) -> torch.Tensor:
        return torch.full((n, self.head_dim), float("nan"), device=self.device)

    # -- checks ------------------------------------------------------------

    def _check_outputs(self, out: torch.Tensor, expected: dict[int, torch.Tensor], what: str) -> None:
        out_cpu = out.detach().to("cpu")
        written = torch.zeros(out_cpu.shape[0], dtype=torch.bool)
        if expected:
            rows = sorted(expected)
            written[rows] = True
            oracle.assert_rows_close(out_cpu[rows], torch.stack([expected[r] for r in rows]), f"{what}: output rows {rows}")
            self.stats.rows_checked += len(rows)
        untouched = out_cpu[~written]
        if untouched.numel() and not bool(torch.isnan(untouched).all()):
            bad = (~torch.isnan(out_cpu).all(dim=1) & ~written).nonzero().flatten().tolist()
            raise AssertionError(f"{what}: output rows {bad} were written but must stay untouched (NaN)")
        self.stats.untouched_rows_checked += int((~written).sum())

    def _check_buffer(self, before: torch.Tensor, written: dict[int, Request], what: str) -> None:
        keep = torch.ones(self.num_slots, dtype=torch.bool, device=self.device)
        if written:
            keep[list(written)] = False
        if bool(keep.any()):
            old = before[keep].view(torch.int32)
            new = self.buffer[keep].view(torch.int32)
            if not torch.equal(old, new):
                slots = keep.nonzero().flatten().tolist()
                changed = [s for s in slots if not torch.equal(before[s].view(torch.int32), self.buffer[s].view(torch.int32))]
                raise AssertionError(f"{what}: slots {changed} changed but must stay bitwise untouched")
        for slot, request in written.items():
            want = request.open_state(self.ape64)
            assert want is not None, "harness bug: a written slot must have an open chunk"
            oracle.assert_state_close(self.buffer[slot, 0], want, f"{what}: slot {slot} (request {request.rid})")
            self.stats.states_checked += 1

    def check_live_states(self) -> None:
        """Every live request with an open chunk: its slot holds the oracle's partial-chunk state (and no NaN)."""
        for request in self.requests:
            want = request.open_state(self.ape64)
            if want is None:
                continue
            oracle.assert_state_close(self.buffer[request.slot, 0], want, f"live slot {request.slot} (request {request.rid})")
            self.stats.live_states_checked += 1

    # -- steps -------------------------------------------------------------

    def decode_step(self, batch: Sequence[Request]) -> None:
        """One ``run_decode`` call: one new token for each request of ``batch`` (in that order)."""
        n = len(batch)
        inp, kv64, score64 = self._tokens(n)
        out = self._nan_output(n)
        seq_lens = torch.tensor([r.length + 1 for r in batch], dtype=torch.int32, device=self.device)
        indices = torch.tensor([r.slot for r in batch], dtype=torch.int32, device=self.device)
        before = self.buffer.clone()
        self.impl.run_decode(self.buffer, inp, out, self.ape, indices, seq_lens, None)
        expected: dict[int, torch.Tensor] = {}
        written: dict[int, Request] = {}
        for b, request in enumerate(batch):
            position = request.length
            closed = request.append(kv64[b : b + 1], score64[b : b + 1], self.ape64)
            if closed:
                expected[b] = closed[position]
                self.stats.decode_closes += 1
            else:
                written[request.slot] = request
            self.stats.decode_resets += int(position % CHUNK_SIZE == 0)
        what = f"decode step {self.stats.decode_calls} (batch {n})"
        self._check_outputs(out, expected, what)
        self._check_buffer(before, written, what)
        self.stats.decode_calls += 1
        self.stats.tokens += n

    def prefill_step(
        self,
        batch: Sequence[tuple[Request, int, Optional[int]]],
        *,
        use_cuda_graph: bool = False,
        pass_load_indices: bool = False,
    ) -> None:
        """One plan + ``run_prefill`` call; ``batch`` is ``[(request, extend_len, new_slot or None)]``.

        A request with a ``new_slot`` (a free slot) reads its prior state from
        its old slot (``load_indices``) and writes to the new one, then holds it.
        ``load_indices`` is passed when anything moves or ``pass_load_indices``.
        """
        extend_lens = [e for _, e, _ in batch]
        seq_lens = [r.length + e for r, e, _ in batch]
        total = sum(extend_lens)
        moving = [(r, s) for r, _, s in batch if s is not None]
        for r, s in moving:
            assert s in self.free_slots, "harness bug: relocation target must be free"
        indices_list = [r.slot if s is None else s for r, _, s in batch]
        load_list = [r.slot for r, _, _ in batch]

        # Plan on the host, into plans full of random bytes (so unwritten rows show).
        compress_cpu = torch.randint(0, 256, (total, ROW_BYTES), dtype=torch.uint8, generator=self.gen)
        write_cpu = torch.randint(0, 256, (total, ROW_BYTES), dtype=torch.uint8, generator=self.gen)
        counts = counts_of(
            self.planner.plan_online_prefill(
                torch.tensor(extend_lens, dtype=torch.int64),
                torch.tensor(seq_lens, dtype=torch.int64),
                compress_cpu,
                write_cpu,
                bool(use_cuda_graph),
            )
        )
        want_compress = sum(
            len(range(r.length + (CHUNK_SIZE - 1 - r.length % CHUNK_SIZE), r.length + e, CHUNK_SIZE)) for r, e, _ in batch
        )
        want_write = sum(1 for n in seq_lens if n % CHUNK_SIZE != 0)
        what = f"prefill step {self.stats.prefill_calls} (extends {extend_lens}, cuda_graph={use_cuda_graph})"
        if use_cuda_graph:
            assert counts == (total, total), f"{what}: planner returned {counts}, want {(total, total)}"
            for name, plan, n in (("compress", compress_cpu, want_compress), ("write", write_cpu, want_write)):
                assert bool((plan[n:] == PADDING_BYTE).all()), f"{what}: {name} plan padding past row {n} is not all 0xFF"
            compress_plan, write_plan = compress_cpu, write_cpu
            self.stats.cuda_graph_plans += 1
        else:
            assert counts == (want_compress, want_write), (
                f"{what}: planner returned {counts}, want {(want_compress, want_write)}"
            )
            compress_plan, write_plan = compress_cpu[: counts[0]], write_cpu[: counts[1]]

        inp, kv64, score64 = self._tokens(total)
        out = self._nan_output(total)
        indices = torch.tensor(indices_list, dtype=torch.int32, device=self.device)
        use_load = bool(moving) or pass_load_indices
        load_indices = torch.tensor(load_list, dtype=torch.int32, device=self.device) if use_load else None
        before = self.buffer.clone()
        self.impl.run_prefill(
            self.buffer,
            inp,
            out,
            self.ape,
            indices,
            compress_plan.to(self.device),
            write_plan.to(self.device),
            load_indices,
        )

        expected: dict[int, torch.Tensor] = {}
        written: dict[int, Request] = {}
        offset = 0
        for (request, extend, new_slot), slot in zip(batch, indices_list):
            prefix = request.length
            if prefix % CHUNK_SIZE in (CHUNK_SIZE - 1, 0, 1) and prefix > 0:
                key = prefix % CHUNK_SIZE
                self.stats.prefix_mod[key] = self.stats.prefix_mod.get(key, 0) + 1
            closed = request.append(kv64[offset : offset + extend], score64[offset : offset + extend], self.ape64)
            for position, row in closed.items():
                expected[offset + position - prefix] = row
            self.stats.max_boundaries_crossed = max(self.stats.max_boundaries_crossed, len(closed))
            if new_slot is not None:
                self.free_slots.remove(new_slot)
                self.free_slots.append(request.slot)
                request.slot = new_slot
                self.stats.relocations += 1
                self.stats.relocations_mid_chunk += int(prefix % CHUNK_SIZE != 0)
            if request.length % CHUNK_SIZE != 0:
                written[slot] = request
            offset += extend
        self._check_outputs(out, expected, what)
        self._check_buffer(before, written, what)
        self.stats.prefill_calls += 1
        self.stats.load_indices_calls += int(use_load)
        self.stats.tokens += total

    def random_step(self) -> None:
        """One random engine step: maybe finish / start requests, then a decode or a prefill step."""
        rng = self.rng
        for request in list(self.requests):
            if request.length > 0 and rng.random() < self.finish_prob:
                self.finish_request(request)
        while len(self.requests) < self.max_requests and self.free_slots and (not self.requests or rng.random() < 0.3):
            self.start_request()
        batch = rng.sample(self.requests, rng.randint(1, len(self.requests)))
        if rng.random() < self.decode_prob:
            self.decode_step(batch)
            return
        free = list(self.free_slots)
        rng.shuffle(free)
        budget = self.max_step_tokens
        plan = []
        for i, request in enumerate(batch):
            left = len(batch) - i - 1  # keep one token for each remaining request
            extend, kind = choose_extend(rng, request.length, budget - left)
            budget -= extend
            self.stats.extend_kinds[kind] = self.stats.extend_kinds.get(kind, 0) + 1
            new_slot = free.pop() if free and rng.random() < self.relocate_prob else None
            plan.append((request, extend, new_slot))
        use_cuda_graph = rng.random() < 0.5 if self.cuda_graph is None else self.cuda_graph
        self.prefill_step(plan, use_cuda_graph=use_cuda_graph, pass_load_indices=rng.random() < 0.3)

    def run(self, steps: int) -> ScheduleStats:
        """Runs ``steps`` random steps, then checks every live state; returns the stats."""
        for _ in range(steps):
            self.random_step()
        self.check_live_states()
        return self.stats


def run_schedule(impl: Any, *, head_dim: int, steps: int, **kwargs: Any) -> ScheduleStats:
    """Builds a :class:`ScheduleHarness` (``kwargs`` as its constructor) and runs ``steps`` random steps."""
    return ScheduleHarness(impl, head_dim=head_dim, **kwargs).run(steps)
