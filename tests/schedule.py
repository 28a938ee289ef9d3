"""An engine-like random schedule driver for any online-c128 implementation.

``impl`` is anything with ``run_decode``, ``run_prefill`` and
``plan_online_prefill`` taking tensors as ``docs/SPEC.md`` section 3 says (and
``run_prefill_compact``, section 10, when compact prefills are asked for, and
``run_verify`` / ``run_commit``, section 9, for verify steps): the
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
  ``indices`` = new slot, or
- with ``verify_prob > 0``, a speculative verify step (SPEC section 9,
  :meth:`ScheduleHarness.verify_step`): T random tokens per request
  (``1 <= T <= 16``), ``run_verify`` then ``run_commit`` with random accepted
  lengths; each request then advances by its accepted count only (the
  rejected drafts are forgotten). Half of these steps first bring their
  requests to ``length % 128`` in 120..127 with a prefill, so that chunks
  close inside the window. With ``verify_bad_prob``, some verify steps mix in
  requests with values the host cannot check
  (:meth:`ScheduleHarness.verify_bad_values_step`), which must be skipped.

Requests also finish (their slot goes back to the free pool, content kept) and
new ones start at length 0. Token data is fresh ``torch.randn`` float32 (scores
scaled by ``score_scale`` so the softmax is far from uniform). The state buffer
(float32 or bfloat16, ``state_dtype``, SPEC section 8) starts all-NaN, so an
implementation that reads a state it should ignore (a chunk's first token, a
fresh slot) poisons its result and fails. A prefill goes through
``run_prefill`` or, with ``compact``, ``run_prefill_compact`` (an ``[M_c, D]``
output, one row per compress-plan row).

Checks after every call (tolerances in ``tests/oracle.py``):

- ``kv_compressed_output`` is poisoned with NaN before the call; every row of a
  chunk-closing token (compact: every row of a live compress-plan row, in plan
  order) must match the float64 offline chunk softmax (``oracle.chunk_output``),
  every other row (compact: every padding row's) must still be NaN;
- the planner's counts match the expected number of compress / write rows
  (``(M, M)`` with ``use_cuda_graph``, whose padding must be all 0xFF);
- every slot that must not be written is bitwise unchanged; every slot that must
  be written holds the oracle's partial-chunk state (``oracle.assert_state_close``,
  whose tolerances depend on the state dtype);
- with a ``shadow`` implementation (e.g. the reference module), the same call
  runs on a CPU copy of the pre-call buffer with the same inputs, and the
  implementation must match it tightly: emitted rows to :data:`SHADOW_ROW_RTOL`,
  float32 states to float32 rounding, bfloat16 states bitwise except elements
  one bf16 ulp apart (a float32 and a float64 computation that land on either
  side of a rounding boundary) or equal on their field's scale
  (:func:`bf16_state_flips`), which must stay rarer than
  :data:`SHADOW_MAX_FLIP_RATE` over the run.

A verify step poisons ``kv_compressed_output`` and ``prefix_states`` with NaN
and checks: the pool bitwise unchanged by ``run_verify``; the row of every
token that closes a chunk (also past the accepted prefix) against the oracle,
every other row still NaN; every prefix state against the oracle's state of
the chunk holding that token (``oracle.last_chunk_state``, compared as any
stored state); after ``run_commit``, each committed slot bitwise equal to the
prefix state of its accepted length, every other slot bitwise unchanged, and
``prefix_states`` unchanged. Skipped requests leave their rows and prefix
states NaN and their slot unchanged. With a ``shadow``, verify's rows and
prefix states are compared as for the other calls, and the shadow's commit
from the same pre-call pool and prefix states must give the same pool, bit
for bit (a commit copies).

Every error measured against the oracle is kept in the stats (``row_errors``,
``state_kv_errors``, ``state_lse_errors``), so a run can report its
distribution (``scripts/bf16_accuracy.py`` does).

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
from device_values import INT32_MAX, INT32_MIN, bad_slots
from flash_compress.plan_rows import CHUNK_SIZE, PADDING_BYTE, PADDING_ROW, ROW_BYTES, decode_rows

__all__ = [
    "SLICE_WIDTHS",
    "WIDEST_WRITE_SLICE",
    "slice_widths",
    "SHADOW_MAX_FLIP_RATE",
    "SHADOW_ROW_RTOL",
    "Request",
    "ScheduleHarness",
    "ScheduleStats",
    "bf16_state_flips",
    "bits",
    "choose_extend",
    "counts_of",
    "plan_with",
    "prefill_pass",
    "round_tokens",
    "rows_for_slice_width",
    "run_schedule",
]

#: Emitted rows against the shadow: a float32 computation against a float64 one from the same inputs.
SHADOW_ROW_RTOL = 2e-5
#: Most bfloat16 state elements (as a fraction of those compared) that may differ from the shadow's
#: (``bf16_state_flips``; measured with tests/float32_model.py: about 5e-5).
SHADOW_MAX_FLIP_RATE = 1e-3


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (bitwise comparisons; NaN equals an identical NaN)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def bf16_state_flips(got: torch.Tensor, want: torch.Tensor, what: str) -> int:
    """Compares two bfloat16 states ``[3D]`` bitwise, tolerating float32-vs-float64 rounding; returns how many differ.

    A differing element is tolerated when both values are finite and either
    (a) they are neighbouring bf16 values (same sign, encodings one apart: the
    two computations fell on either side of a rounding boundary), or (b) they
    are within ``SHADOW_ROW_RTOL`` of the largest ``|want|`` of their field
    (max, sum or kv): a near-zero ``kv`` channel is a difference of large
    terms, so its float32 value may be several of its own ulps off while
    being exact on the row's scale. Any other difference raises AssertionError.
    """
    g, w = bits(got).to(torch.int32), bits(want).to(torch.int32)
    differ = g != w
    if not bool(differ.any()):
        return 0
    got64, want64 = got.to(torch.float64).reshape(3, -1), want.to(torch.float64).reshape(3, -1)
    scale = want64.abs().amax(dim=1, keepdim=True)
    near = ((got64 - want64).abs() <= SHADOW_ROW_RTOL * scale).reshape(got.shape)
    neighbours = ((g < 0) == (w < 0)) & ((g - w).abs() == 1)
    bad = differ & ~((neighbours | near) & torch.isfinite(got) & torch.isfinite(want))
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} bf16 elements differ from the shadow by more than float32 rounding; "
            f"first at index {i} of [max | sum | kv]: {float(got.flatten()[i])!r} vs {float(want.flatten()[i])!r}"
        )
    return int(differ.sum())


def check_state_against(got: torch.Tensor, want: torch.Tensor, what: str) -> int:
    """A stored ``[3D]`` state against another implementation's on the same data (a float32 or bfloat16 pool
    of the same dtype): float32 to float32 rounding (:data:`oracle.FLOAT32`), bf16 bitwise but for flips
    (:func:`bf16_state_flips`); returns the flips."""
    got, want = got.detach().to("cpu"), want.detach().to("cpu")
    if got.dtype == torch.bfloat16:
        return bf16_state_flips(got, want, what)
    d = got.numel() // 3
    want64 = want.to(torch.float64)
    state = oracle.PartialState(max=want64[:d], sum=want64[d : 2 * d], kv=want64[2 * d :])
    oracle.assert_state_close(got, state, what, tol=oracle.FLOAT32)
    return 0


#: Channel slice widths a prefill pass may run with, widest first (``kSliceDims`` in ``c128_slice_width.cuh``),
#: where the pass may run them (:func:`slice_widths`).
SLICE_WIDTHS = (128, 64, 32, 16, 8)
#: The widest slice a write pass runs (``kWidestWriteSlice``).
WIDEST_WRITE_SLICE = 64
#: The most (split) rows a compress pass splits into 8-channel slices (``kMaxEightChannelCompressRows``).
MAX_EIGHT_CHANNEL_COMPRESS_ROWS = 8


def slice_widths(head_dim: int, write_pass: bool = False) -> tuple[int, ...]:
    """The widths a pass at ``head_dim`` may run, widest first (``slice_fits``): those that divide
    head_dim, and for a write pass none wider than :data:`WIDEST_WRITE_SLICE`."""
    return tuple(width for width in SLICE_WIDTHS
                 if head_dim % width == 0 and (not write_pass or width <= WIDEST_WRITE_SLICE))


def round_tokens(width: int) -> int:
    """Tokens one warp folds per round of loads at ``width`` channels (``PrefillLayout``'s ``kTokenLanes *
    kBatch``): 4 per lane, a token across ``width / 4`` lanes."""
    return 4 * (32 // (width // 4))


def fills_at_most_half(blocks: int, resident: int) -> bool:
    """``fills_at_most_half`` of ``c128_slice_width.cuh``: whether a grid of ``blocks`` blocks, of
    ``resident`` that fit the GPU at once, leaves room for a second grid as large beside it."""
    return 2 * blocks <= resident


def prefill_pass(rows: int, head_dim: int, multiprocessors: int, beside: Optional[tuple[int, int, int]] = None,
                 padding_rows: int = 0, write_pass: bool = False,
                 likely_rows: Optional[int] = None, leave_half: bool = False) -> tuple[int, int, int]:
    """``(width, grid, chain)`` that ``choose_slice_width`` (``csrc/deepseek_v4/c128_slice_width.cuh``)
    picks for a pass of ``rows`` live rows (``likely_rows`` of them likely live, where a padded plan only
    bounds them; all by default) and ``padding_rows`` CUDA-graph padding rows after them, on
    a GPU with this many multiprocessors and 16 resident prefill warps (8 blocks) on each;
    ``write_pass``: a write pass, which runs no slice wider than :data:`WIDEST_WRITE_SLICE`;
    ``beside``: what it picked for the compress pass a write pass starts beside. A mirror of its rule
    for the GPU tests that must reach every width (``tests/test_headers_nvcc.py`` checks it against
    the compiled rule): the width whose busiest warp has the shortest chain of dependent loads
    (waves of items times rounds per 128-token segment), a narrower width only where it cuts the
    chain, 16 or 8 channels (runs of 64 bytes or less) only where they halve the shortest chain of
    the longer-run widths, 8 channels only where their items fill at most a quarter of the warps (and
    for a compress pass only up to :data:`MAX_EIGHT_CHANNEL_COMPRESS_ROWS` rows),
    none but the widest where padding rows would take a warp over 4 rounds of 32 to skip, a tie in chain
    to the width with the shorter chain for ``likely_rows`` (halved, for 16 or 8 channels against a
    longer-run width, and then only where the likely rows' items fill at most half the warps); a write
    pass beside a compress pass where its grid fits in the slots left free and the two chains side
    by side take no longer than in turn. ``leave_half`` (a compress pass, :func:`leaves_room_for_write_pass`):
    the shortest chain among the widths whose grid fills at most half the GPU, where one does."""
    resident = 8 * multiprocessors
    warps = 2 * resident
    likely_rows = rows if likely_rows is None else likely_rows
    options = []
    widths = slice_widths(head_dim, write_pass)
    for width in widths:
        slices = head_dim // width
        items = rows * slices + padding_rows
        if width != widths[0] and (items // (warps * 32) > 4 or (width == 8 and (
                4 * items > warps or (not write_pass and rows > MAX_EIGHT_CHANNEL_COMPRESS_ROWS)))):
            continue
        chain, likely_chain = (-(-count * slices // warps) * -(-CHUNK_SIZE // round_tokens(width))
                               for count in (rows, likely_rows))
        few_likely_items = 2 * likely_rows * slices <= warps
        blocks = min(-(-items // 2), resident)
        if not fills_at_most_half(blocks, resident):  # padding rows get lanes where no write pass fits beside
            blocks = min(-(-max(rows * slices, -(-items // 32)) // 2), resident)
        options.append((width, blocks, chain, likely_chain, few_likely_items))

    def shortest(candidates):
        best = None
        for width, blocks, chain, likely_chain, few_likely_items in candidates:
            short = width * 4 <= 64
            if best is None or ((2 * chain <= best[2] or (chain == best[2] and few_likely_items
                                                          and 2 * likely_chain <= best[3]))
                                if short and best[0] * 4 > 64 else (chain, likely_chain) < best[2:4]):
                best = (width, blocks, chain, likely_chain, few_likely_items)
        return best

    chosen = (leave_half and shortest([o for o in options if fills_at_most_half(o[1], resident)])) or shortest(options)
    if beside is not None and beside[1] > 0:
        fitting = shortest([o for o in options if o[1] + beside[1] <= resident])
        if fitting is not None and max(fitting[2], beside[2]) <= beside[2] + chosen[2]:
            chosen = fitting
    return chosen[:3]


def pass_rows(write_pass: bool, num_rows: int, num_tokens: int, batch_size: int) -> tuple[int, int]:
    """``pass_rows`` of ``c128_slice_width.cuh``: the rows of a pass of a ``num_rows``-row plan (a call
    of ``num_tokens`` tokens from ``batch_size`` requests) that may be live, at most a row per request
    for a write pass and a row per 128 tokens plus one per request for a compress pass; and of those
    the ones likely live, about a row per 128 tokens for a compress pass of a plan with a row per token
    (a CUDA-graph plan), all of them otherwise."""
    bound = batch_size if write_pass else num_tokens // CHUNK_SIZE + batch_size
    split = min(num_rows, bound)
    padded = num_rows == num_tokens
    return split, (min(split, -(-num_tokens // CHUNK_SIZE)) if padded and not write_pass else split)


def leaves_room_for_write_pass(num_rows: int, num_tokens: int, batch_size: int) -> bool:
    """``leaves_room_for_write_pass`` of ``c128_slice_width.cuh``: whether the compress pass of a
    ``num_rows``-row plan over ``num_tokens`` tokens from ``batch_size`` requests, a write pass following
    it, leaves half the GPU to that pass (``prefill_pass``'s ``leave_half``): an exact plan (not a row
    per token) with more requests than chunks of tokens."""
    return num_rows != num_tokens and batch_size > num_tokens // CHUNK_SIZE


def exact_plan_passes(compress_rows: int, write_rows: int, lengths: Sequence[int], head_dim: int,
                      multiprocessors: int) -> tuple[Optional[tuple[int, int, int]], Optional[tuple[int, int, int]]]:
    """:func:`prefill_pass`'s (compress pass, write pass) for an exact plan of ``compress_rows`` and
    ``write_rows`` rows over requests extending by ``lengths``, as ``C128Online::prefill`` launches
    them; None for a pass without rows."""
    tokens = sum(lengths)
    leave_half = write_rows > 0 and leaves_room_for_write_pass(compress_rows, tokens, len(lengths))
    compress = prefill_pass(compress_rows, head_dim, multiprocessors, leave_half=leave_half) if compress_rows else None
    write = (prefill_pass(write_rows, head_dim, multiprocessors, beside=compress, write_pass=True)
             if write_rows else None)
    return compress, write


def graph_plan_passes(lengths: Sequence[int], head_dim: int, multiprocessors: int,
                      likely: bool = True) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """:func:`prefill_pass`'s (compress pass, write pass) for a CUDA-graph plan (a row per token each)
    of requests extending by ``lengths``, their rows as :func:`pass_rows` counts them (``likely=False``:
    the compress pass's likely rows all of its bound, the rule before ties went to the likely rows); the
    write pass beside the compress pass."""
    tokens = sum(lengths)
    compress_split, compress_likely = pass_rows(False, tokens, tokens, len(lengths))
    compress = prefill_pass(compress_split, head_dim, multiprocessors, padding_rows=tokens - compress_split,
                            likely_rows=compress_likely if likely else compress_split)
    write_split, write_likely = pass_rows(True, tokens, tokens, len(lengths))
    write = prefill_pass(write_split, head_dim, multiprocessors, beside=compress,
                         padding_rows=tokens - write_split, write_pass=True, likely_rows=write_likely)
    return compress, write


def rows_for_slice_width(head_dim: int, multiprocessors: int) -> dict[int, int]:
    """Width -> the fewest live rows of a compress pass that run it (:func:`prefill_pass`)."""
    found: dict[int, int] = {}
    for rows in range(1, 64 * multiprocessors):
        found.setdefault(prefill_pass(rows, head_dim, multiprocessors)[0], rows)
    missing = set(slice_widths(head_dim)) - set(found)
    assert not missing, f"this GPU has no row count for widths {missing}"
    return found


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
    compact_calls: int = 0
    compact_padding_rows: int = 0  # output rows of padding plan rows checked untouched
    shadow_checks: int = 0  # calls compared against the shadow
    shadow_state_elements: int = 0  # state elements compared against the shadow
    shadow_flips: int = 0  # of those, bf16 elements not bitwise equal (but within float32 rounding)
    verify_calls: int = 0
    commit_calls: int = 0
    verify_windows: dict[int, int] = field(default_factory=dict)  # T -> verify calls
    verify_closes: int = 0  # chunk-closing tokens in verify windows (rows checked)
    verify_closes_rejected: int = 0  # of those, tokens past the accepted prefix
    verify_crossings: int = 0  # windows that close a chunk and go on into the next one
    prefix_states_checked: int = 0
    commits: int = 0  # slots committed
    commits_closed: int = 0  # of those, after a chunk-closing token (the full chunk's state)
    accept_one: int = 0  # commits of 1 token
    accept_all: int = 0  # commits of the whole window (T > 1)
    verify_skipped: int = 0  # requests run_verify had to skip (slot outside the pool, seq_len < T)
    commit_skipped: int = 0  # verified requests run_commit had to skip (accepted length 0 or > T, bad slot)
    extend_kinds: dict[str, int] = field(default_factory=dict)
    prefix_mod: dict[int, int] = field(default_factory=dict)  # prefix % 128 in {127, 0, 1} before a prefill
    row_errors: list[float] = field(default_factory=list)  # per emitted row, vs the oracle
    state_kv_errors: list[float] = field(default_factory=list)  # per stored state, kv vs the oracle
    state_lse_errors: list[float] = field(default_factory=list)  # per stored state, max + log(sum) vs the oracle


class ScheduleHarness:
    """Drives ``impl`` through a random engine-like schedule and checks it against the float64 oracle.

    Args:
        impl: object with ``run_decode``, ``run_prefill``, ``plan_online_prefill`` (and
            ``run_prefill_compact``, ``run_verify``, ``run_commit`` when those steps are asked for).
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
        state_dtype: dtype of the state pool, float32 or bfloat16.
        compact: prefill through ``run_prefill_compact`` always (True), never (False)
            or at random (None).
        shadow: an implementation run call by call on CPU copies (see the module
            docstring), or None.
        tolerances: bounds against the oracle (default ``oracle.tolerances(state_dtype)``;
            ``oracle.Tolerances.unchecked()`` to only measure).
        verify_prob: chance that a step is a speculative verify + commit step (0: never,
            and the schedule draws exactly what it drew before verify steps existed).
        verify_bad_prob: chance that a verify step mixes in requests with values the
            host cannot check (:meth:`verify_bad_values_step`).
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
        state_dtype: torch.dtype = torch.float32,
        compact: Optional[bool] = False,
        shadow: Any = None,
        tolerances: Optional[oracle.Tolerances] = None,
        verify_prob: float = 0.0,
        verify_bad_prob: float = 0.0,
    ) -> None:
        if num_slots < max_requests:
            raise ValueError("num_slots must be >= max_requests")
        self.state_dtype = state_dtype
        self.tol = oracle.tolerances(state_dtype) if tolerances is None else tolerances
        self.compact = compact
        self.shadow = shadow
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
        self.verify_prob = verify_prob
        self.verify_bad_prob = verify_bad_prob
        ape = torch.randn(CHUNK_SIZE, head_dim, generator=self.gen) * ape_scale
        self.ape64 = ape.to(torch.float64)
        self.ape = ape.to(self.device)
        self.buffer = torch.full((num_slots, 1, 3 * head_dim), float("nan"), dtype=state_dtype, device=self.device)
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
        """Rows ``expected`` (output row -> oracle row) match the oracle; every other row is still NaN."""
        out_cpu = out.detach().to("cpu")
        written = torch.zeros(out_cpu.shape[0], dtype=torch.bool)
        if expected:
            rows = sorted(expected)
            written[rows] = True
            got, want = out_cpu[rows], torch.stack([expected[r] for r in rows])
            rel = oracle.row_relative_error(got, want)
            self.stats.row_errors += rel.tolist()
            oracle.assert_rows_close(got, want, f"{what}: output rows {rows}", rtol=self.tol.row_rtol)
            self.stats.rows_checked += len(rows)
        untouched = out_cpu[~written]
        if untouched.numel() and not bool(torch.isnan(untouched).all()):
            bad = (~torch.isnan(out_cpu).all(dim=1) & ~written).nonzero().flatten().tolist()
            raise AssertionError(f"{what}: output rows {bad} were written but must stay untouched (NaN)")
        self.stats.untouched_rows_checked += int((~written).sum())

    def _check_untouched(self, before: torch.Tensor, written: Sequence[int], what: str) -> None:
        """Every slot but ``written`` is bitwise what it was ``before``."""
        keep = torch.ones(self.num_slots, dtype=torch.bool, device=self.device)
        if written:
            keep[list(written)] = False
        if bool(keep.any()):
            if not torch.equal(bits(before[keep]), bits(self.buffer[keep])):
                slots = keep.nonzero().flatten().tolist()
                changed = [s for s in slots if not torch.equal(bits(before[s]), bits(self.buffer[s]))]
                raise AssertionError(f"{what}: slots {changed} changed but must stay bitwise untouched")

    def _check_buffer(self, before: torch.Tensor, written: dict[int, Request], what: str) -> None:
        self._check_untouched(before, list(written), what)
        for slot, request in written.items():
            want = request.open_state(self.ape64)
            assert want is not None, "harness bug: a written slot must have an open chunk"
            errors = oracle.assert_state_close(self.buffer[slot, 0], want, f"{what}: slot {slot} (request {request.rid})",
                                               tol=self.tol)
            self.stats.state_kv_errors.append(errors["kv"])
            self.stats.state_lse_errors.append(errors["lse"])
            self.stats.states_checked += 1

    def _check_shadow(self, out: torch.Tensor, shadow_out: torch.Tensor, shadow_buffer: torch.Tensor,
                      written: Sequence[int], what: str) -> None:
        """The implementation's output and written slots against the shadow's, tightly (module docstring)."""
        what = f"{what} vs shadow"
        self._check_shadow_rows(out, shadow_out, f"{what}: output rows")
        for slot in written:
            self._check_shadow_state(self.buffer[slot, 0], shadow_buffer[slot, 0], f"{what}: slot {slot}")
        self.stats.shadow_checks += 1

    @staticmethod
    def _check_shadow_rows(rows: torch.Tensor, shadow_rows: torch.Tensor, what: str) -> None:
        """Rows written (not all NaN) by both or neither, and the written ones close (``SHADOW_ROW_RTOL``)."""
        rows = rows.detach().to("cpu")
        nan_rows, shadow_nan_rows = torch.isnan(rows).all(dim=1), torch.isnan(shadow_rows).all(dim=1)
        if not torch.equal(nan_rows, shadow_nan_rows):
            bad = (nan_rows != shadow_nan_rows).nonzero().flatten().tolist()
            raise AssertionError(f"{what}: rows {bad} written by one of the two only")
        live = ~nan_rows
        oracle.assert_rows_close(rows[live], shadow_rows[live], what, rtol=SHADOW_ROW_RTOL)

    def _check_shadow_state(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        """One stored ``[3D]`` state against the shadow's (:func:`check_state_against`)."""
        self.stats.shadow_flips += check_state_against(got, want, what)
        self.stats.shadow_state_elements += got.numel()

    def check_shadow_flip_rate(self) -> None:
        """bf16 state elements not bitwise equal to the shadow's: at most ``SHADOW_MAX_FLIP_RATE`` of those compared.

        One flip is always allowed, so that a short run is not failed by a single one.
        """
        elements, flips = self.stats.shadow_state_elements, self.stats.shadow_flips
        if flips > max(1.0, SHADOW_MAX_FLIP_RATE * elements):
            raise AssertionError(
                f"{flips} of {elements} bf16 state elements differ from the shadow, more than the "
                f"{SHADOW_MAX_FLIP_RATE:g} allowed: a different rounding scheme, not float32 rounding"
            )

    def _in_shadow(self, call: str, before: torch.Tensor, out: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs ``shadow.<call>`` on a CPU copy of ``before`` and a NaN output like ``out``; returns (buffer, output)."""
        buffer = before.detach().to("cpu", copy=True)
        shadow_out = torch.full(tuple(out.shape), float("nan"), dtype=out.dtype)
        cpu_args = [a.detach().to("cpu") if isinstance(a, torch.Tensor) else a for a in args]
        getattr(self.shadow, call)(buffer, cpu_args[0], shadow_out, *cpu_args[1:])
        return buffer, shadow_out

    def check_live_states(self) -> None:
        """Every live request with an open chunk: its slot holds the oracle's partial-chunk state (and no NaN)."""
        for request in self.requests:
            want = request.open_state(self.ape64)
            if want is None:
                continue
            oracle.assert_state_close(self.buffer[request.slot, 0], want, f"live slot {request.slot} (request {request.rid})",
                                      tol=self.tol)
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
        if self.shadow is not None:
            shadow_buffer, shadow_out = self._in_shadow("run_decode", before, out, inp, self.ape, indices, seq_lens, None)
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
        if self.shadow is not None:
            self._check_shadow(out, shadow_out, shadow_buffer, list(written), what)
        self.stats.decode_calls += 1
        self.stats.tokens += n

    def prefill_step(
        self,
        batch: Sequence[tuple[Request, int, Optional[int]]],
        *,
        use_cuda_graph: bool = False,
        pass_load_indices: bool = False,
        compact: bool = False,
    ) -> None:
        """One plan + ``run_prefill`` (``run_prefill_compact`` with ``compact``) call.

        ``batch`` is ``[(request, extend_len, new_slot or None)]``. A request
        with a ``new_slot`` (a free slot) reads its prior state from its old
        slot (``load_indices``) and writes to the new one, then holds it.
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
        what = (f"prefill step {self.stats.prefill_calls} (extends {extend_lens}, cuda_graph={use_cuda_graph}, "
                f"compact={compact})")
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
        out = self._nan_output(compress_plan.shape[0] if compact else total)
        indices = torch.tensor(indices_list, dtype=torch.int32, device=self.device)
        use_load = bool(moving) or pass_load_indices
        load_indices = torch.tensor(load_list, dtype=torch.int32, device=self.device) if use_load else None
        before = self.buffer.clone()
        call = "run_prefill_compact" if compact else "run_prefill"
        args = (inp, self.ape, indices, compress_plan.to(self.device), write_plan.to(self.device), load_indices)
        getattr(self.impl, call)(self.buffer, args[0], out, *args[1:])
        if self.shadow is not None:
            shadow_buffer, shadow_out = self._in_shadow(call, before, out, *args)

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
        if compact:
            # Output row i holds compress-plan row i's chunk; the plan lists chunks by request, then
            # position, i.e. by ragged id, and its padding rows (CUDA-graph plans) come last.
            ragged = decode_rows(compress_plan)[:, 0].tolist()
            live = [r for r in ragged if r != PADDING_ROW]
            assert live == sorted(expected), f"{what}: compress plan ragged ids {live}, want {sorted(expected)}"
            expected = {i: expected[r] for i, r in enumerate(live)}
            self.stats.compact_calls += 1
            self.stats.compact_padding_rows += len(ragged) - len(live)
        self._check_outputs(out, expected, what)
        self._check_buffer(before, written, what)
        if self.shadow is not None:
            self._check_shadow(out, shadow_out, shadow_buffer, list(written), what)
        self.stats.prefill_calls += 1
        self.stats.load_indices_calls += int(use_load)
        self.stats.tokens += total

    # -- speculative decoding (SPEC section 9) --------------------------------

    def verify_step(self, batch: Sequence[Request], window: int, accept: Optional[Sequence[int]] = None) -> None:
        """``run_verify`` of ``window`` (T) fresh tokens per request of ``batch``, then ``run_commit``.

        ``accept[b]`` (``1 <= a <= T``; random when None: 1, T or anything
        between) is how many of request ``b``'s tokens are kept; the request
        advances by that many and forgets the rest. Checks: module docstring.
        """
        if accept is None:
            accept = [self.rng.choice([1, window, self.rng.randint(1, window)]) for _ in batch]
        if len(accept) != len(batch) or not all(1 <= a <= window for a in accept):
            raise ValueError(f"harness misuse: accepted lengths {list(accept)} for {len(batch)} requests, T = {window}")
        self._verify_and_commit(batch, window, list(accept), {})

    def verify_bad_values_step(self, batch: Sequence[Request], window: int,
                               kinds: Optional[Sequence[str]] = None) -> None:
        """A verify + commit step where some requests carry values the host cannot check.

        ``kinds[b]`` (random when None) is one of ``"good"`` (a valid request,
        random accepted length), ``"accept"`` (verified, then an accepted length
        of 0, negative or above T: commit skips it), ``"slot"`` (its index
        outside the pool: both calls skip it) or ``"seq_len"`` (``seq_len < T``:
        verify skips it; its accepted length is invalid too, so that commit
        does not copy the unwritten prefix state). A skipped request's rows
        and prefix states stay NaN, every slot but the good requests' is
        bitwise unchanged, and only the good requests advance.
        """
        rng = self.rng
        if kinds is None:
            kinds = [rng.choice(["good", "accept", "slot", "seq_len"]) for _ in batch]
        if len(kinds) != len(batch):
            raise ValueError(f"harness misuse: {len(kinds)} kinds for {len(batch)} requests")
        bad_accepts = [0, -1, window + 1, 17, 1000, INT32_MAX, INT32_MIN]
        accept: list[int] = []
        overrides: dict[int, tuple[str, int]] = {}
        for b, kind in enumerate(kinds):
            if kind == "good":
                accept.append(rng.randint(1, window))
            elif kind == "accept":
                accept.append(rng.choice(bad_accepts))
            elif kind == "slot":
                accept.append(rng.randint(1, window))
                overrides[b] = ("slot", rng.choice(bad_slots(self.num_slots)))
            elif kind == "seq_len":
                accept.append(rng.choice(bad_accepts))
                overrides[b] = ("seq_len", rng.choice([window - 1, 0, -1, -CHUNK_SIZE, INT32_MIN]))
            else:
                raise ValueError(f"harness misuse: unknown kind {kind!r}")
        self._verify_and_commit(batch, window, accept, overrides)

    def _verify_expectations(self, request: Request, kv64: torch.Tensor, score64: torch.Tensor):
        """The oracle for ``request`` followed by these T tokens: the state after each token
        (``oracle.last_chunk_state``) and ``{j: row}`` for the tokens that close a chunk."""
        if request.kv is None:
            kv, score = kv64, score64
        else:
            kv, score = torch.cat([request.kv, kv64]), torch.cat([request.score, score64])
        seen = request.length - request.base  # tokens of the open chunk (the history starts at a chunk start)
        states, rows = [], {}
        for j in range(kv64.shape[0]):
            n = seen + j + 1
            states.append(oracle.last_chunk_state(kv[:n], score[:n], self.ape64))
            if n % CHUNK_SIZE == 0:
                rows[j] = oracle.chunk_output(kv[:n], score[:n], self.ape64, n // CHUNK_SIZE - 1)
        return states, rows

    def _verify_and_commit(self, batch: Sequence[Request], window: int, accept: list[int],
                           overrides: dict[int, tuple[str, int]]) -> None:
        """The body of both verify steps; ``overrides[b] = ("slot" | "seq_len", value)`` spoils request ``b``."""
        n, t, d = len(batch), window, self.head_dim
        slots = [r.slot for r in batch]
        lens = [r.length + t for r in batch]
        for b, (field_name, value) in overrides.items():
            (slots if field_name == "slot" else lens)[b] = value
        verified = [0 <= slots[b] < self.num_slots and lens[b] >= t for b in range(n)]
        committed = [verified[b] and 1 <= accept[b] <= t for b in range(n)]
        assert all(verified[b] or not 1 <= accept[b] <= t or not 0 <= slots[b] < self.num_slots for b in range(n)), \
            "harness bug: a request verify skips must not be committed"

        inp, kv64, score64 = self._tokens(n * t)
        out = self._nan_output(n * t)
        prefix = torch.full((n * t, 3 * d), float("nan"), dtype=self.state_dtype, device=self.device)
        poison = prefix.clone()
        indices = torch.tensor(slots, dtype=torch.int32, device=self.device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=self.device)
        accept_lens = torch.tensor(accept, dtype=torch.int32, device=self.device)
        what = f"verify step {self.stats.verify_calls} (T = {t}, seq_lens {lens}, accept {accept})"

        before = self.buffer.clone()
        self.impl.run_verify(self.buffer, inp, out, self.ape, indices, seq_lens, prefix)
        self._check_untouched(before, [], f"{what}: run_verify")
        if self.shadow is not None:
            shadow_out = torch.full((n * t, d), float("nan"))
            shadow_prefix = poison.to("cpu", copy=True)
            self.shadow.run_verify(before.to("cpu", copy=True), inp.to("cpu"), shadow_out, self.ape.to("cpu"),
                                   indices.to("cpu"), seq_lens.to("cpu"), shadow_prefix)

        expected: dict[int, torch.Tensor] = {}
        prefix_cpu = prefix.detach().to("cpu", copy=True)  # a copy: commit must not change prefix_states
        for b, request in enumerate(batch):
            rows = slice(b * t, (b + 1) * t)
            if not verified[b]:
                if not torch.equal(bits(prefix_cpu[rows]), bits(poison[rows].cpu())):
                    raise AssertionError(f"{what}: prefix states of skipped request {b} were written")
                self.stats.verify_skipped += 1
                continue
            states, closed = self._verify_expectations(request, kv64[rows], score64[rows])
            for j, want in enumerate(states):
                errors = oracle.assert_state_close(prefix_cpu[b * t + j], want,
                                                   f"{what}: prefix state {j} of request {b}", tol=self.tol)
                self.stats.state_kv_errors.append(errors["kv"])
                self.stats.state_lse_errors.append(errors["lse"])
            self.stats.prefix_states_checked += t
            for j, row in closed.items():
                expected[b * t + j] = row
                self.stats.verify_closes += 1
                self.stats.verify_closes_rejected += int(j >= accept[b])
                self.stats.verify_crossings += int(j < t - 1)
        self._check_outputs(out, expected, f"{what}: run_verify")
        if self.shadow is not None:
            self._check_shadow_rows(out, shadow_out, f"{what} vs shadow: output rows")
            for b in range(n):
                for j in range(t) if verified[b] else ():
                    self._check_shadow_state(prefix_cpu[b * t + j], shadow_prefix[b * t + j],
                                             f"{what} vs shadow: prefix state {j} of request {b}")
            if not torch.equal(prefix_cpu.isnan(), shadow_prefix.isnan()):
                raise AssertionError(f"{what} vs shadow: prefix states written by one of the two only")
            self.stats.shadow_checks += 1

        self.impl.run_commit(self.buffer, prefix, indices, accept_lens)
        what = what.replace("verify step", "commit after verify step")
        if not torch.equal(bits(prefix.detach().to("cpu")), bits(prefix_cpu)):
            raise AssertionError(f"{what}: run_commit wrote prefix_states")
        written = [slots[b] for b in range(n) if committed[b]]
        self._check_untouched(before, written, what)
        for b in range(n):
            if not committed[b]:
                self.stats.commit_skipped += int(verified[b])
                continue
            got, want = self.buffer[slots[b], 0].detach().to("cpu"), prefix_cpu[b * t + accept[b] - 1]
            if not torch.equal(bits(got), bits(want)):
                raise AssertionError(f"{what}: slot {slots[b]} is not prefix state {accept[b] - 1} of request {b}")
        if self.shadow is not None:
            shadow_buffer = before.to("cpu", copy=True)
            self.shadow.run_commit(shadow_buffer, prefix_cpu.clone(), indices.to("cpu"), accept_lens.to("cpu"))
            if not torch.equal(bits(self.buffer.detach().to("cpu")), bits(shadow_buffer)):
                raise AssertionError(f"{what} vs shadow: the pools differ (a commit copies, bit for bit)")
            self.stats.shadow_checks += 1

        for b, request in enumerate(batch):
            if not committed[b]:
                continue
            a = accept[b]
            request.append(kv64[b * t : b * t + a], score64[b * t : b * t + a], self.ape64)
            self.stats.commits += 1
            self.stats.commits_closed += int(request.length % CHUNK_SIZE == 0)
            self.stats.accept_one += int(a == 1)
            self.stats.accept_all += int(a == t > 1)
        self.stats.verify_calls += 1
        self.stats.commit_calls += 1
        self.stats.verify_windows[t] = self.stats.verify_windows.get(t, 0) + 1
        self.stats.tokens += sum(accept[b] for b in range(n) if committed[b])

    def _approach_chunk_end(self, batch: Sequence[Request]) -> None:
        """A prefill step that brings every request of ``batch`` to ``length % 128`` in 120..127."""
        plan = []
        for request in batch:
            target = request.length - request.length % CHUNK_SIZE + self.rng.randint(CHUNK_SIZE - 8, CHUNK_SIZE - 1)
            if target <= request.length:
                target += CHUNK_SIZE
            plan.append((request, target - request.length, None))
        self.prefill_step(plan, use_cuda_graph=self.rng.random() < 0.5)

    def verify_every_window(self, batch: Sequence[Request]) -> None:
        """A verify step for every T from 1 to 16, each after bringing ``batch`` near a chunk end; request ``b``
        accepts 1, T or about half of the window, by ``b % 3``."""
        for window in range(1, 17):
            self._approach_chunk_end(batch)
            self.verify_step(batch, window, accept=[(1, window, (window + 1) // 2)[b % 3] for b in range(len(batch))])

    def random_verify_step(self, batch: Sequence[Request]) -> None:
        """A verify step with random T (1..16); half the time the requests are first brought near a chunk end."""
        rng = self.rng
        window = rng.randint(1, 16)
        if rng.random() < 0.5:
            self._approach_chunk_end(batch)
        if self.verify_bad_prob and rng.random() < self.verify_bad_prob:
            self.verify_bad_values_step(batch, window)
        else:
            self.verify_step(batch, window)

    def random_step(self) -> None:
        """One random engine step: maybe finish / start requests, then a decode, prefill or verify step."""
        rng = self.rng
        for request in list(self.requests):
            if request.length > 0 and rng.random() < self.finish_prob:
                self.finish_request(request)
        while len(self.requests) < self.max_requests and self.free_slots and (not self.requests or rng.random() < 0.3):
            self.start_request()
        batch = rng.sample(self.requests, rng.randint(1, len(self.requests)))
        if self.verify_prob and rng.random() < self.verify_prob:
            self.random_verify_step(batch)
            return
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
        pass_load_indices = rng.random() < 0.3
        compact = rng.random() < 0.5 if self.compact is None else self.compact
        self.prefill_step(plan, use_cuda_graph=use_cuda_graph, pass_load_indices=pass_load_indices, compact=compact)

    def run(self, steps: int) -> ScheduleStats:
        """Runs ``steps`` random steps, then checks every live state (and the shadow flip rate); returns the stats."""
        for _ in range(steps):
            self.random_step()
        self.check_live_states()
        self.check_shadow_flip_rate()
        return self.stats


def run_schedule(impl: Any, *, head_dim: int, steps: int, **kwargs: Any) -> ScheduleStats:
    """Builds a :class:`ScheduleHarness` (``kwargs`` as its constructor) and runs ``steps`` random steps."""
    return ScheduleHarness(impl, head_dim=head_dim, **kwargs).run(steps)
