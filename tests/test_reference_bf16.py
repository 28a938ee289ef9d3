"""CPU tests of bfloat16 states (SPEC section 8) and the compact prefill (section 10) in the reference,
and of the schedule harness's new checks (state dtype, compact prefills, the shadow implementation).

The accuracy bounds come from ``tests/oracle.py`` (measured by ``scripts/bf16_accuracy.py``).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch

import accuracy
import oracle
from flash_compress import reference as ref
from flash_compress.plan_rows import CHUNK_SIZE, PADDING_ROW, ROW_BYTES, decode_rows
from float32_model import Float32Model
from schedule import ScheduleHarness, bf16_state_flips, bits, plan_with

BF16, F32 = torch.bfloat16, torch.float32
I32 = functools.partial(torch.tensor, dtype=torch.int32)


def _wrap(impl=ref, **overrides):
    """``impl``'s functions as an object, some replaced (a deliberately broken implementation)."""
    names = ("run_decode", "run_prefill", "run_prefill_compact", "plan_online_prefill")
    fields = {name: getattr(impl, name) for name in names}
    fields.update(overrides)
    return SimpleNamespace(**fields)


# ---------------------------------------------------------------------------
# The schedule harness on the reference: both state dtypes, compact on / off / random.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("compact", [False, True, None], ids=["full", "compact", "random"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_schedule_on_the_reference(dtype, compact):
    h = ScheduleHarness(ref, head_dim=64, seed=31, state_dtype=dtype, compact=compact, shadow=ref, decode_prob=0.4)
    stats = h.run(40)
    assert h.buffer.dtype == dtype
    assert stats.decode_calls and stats.prefill_calls and stats.rows_checked and stats.states_checked
    assert stats.shadow_checks == stats.decode_calls + stats.prefill_calls
    assert stats.shadow_flips == 0  # the reference against itself: bitwise
    if compact is None:
        assert 0 < stats.compact_calls < stats.prefill_calls
    else:
        assert stats.compact_calls == (stats.prefill_calls if compact else 0)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_compact_schedule_with_cuda_graph_plans_checks_padding_rows(dtype):
    h = ScheduleHarness(ref, head_dim=64, seed=32, state_dtype=dtype, compact=True, cuda_graph=True, decode_prob=0.2)
    stats = h.run(25)
    assert stats.cuda_graph_plans == stats.prefill_calls == stats.compact_calls > 0
    assert stats.compact_padding_rows > 0 and stats.rows_checked > 0


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_float32_stand_in_matches_the_reference_shadow(dtype):
    """A float32-arithmetic implementation (the kernels' situation) passes the tight shadow checks."""
    h = ScheduleHarness(Float32Model(), head_dim=64, seed=33, state_dtype=dtype, compact=None, shadow=ref,
                        decode_prob=0.6)
    stats = h.run(40)
    assert stats.shadow_checks == stats.decode_calls + stats.prefill_calls > 0
    assert stats.shadow_state_elements > 10_000
    assert stats.shadow_flips <= 1e-3 * stats.shadow_state_elements


def test_relocation_and_load_indices_with_bf16_states():
    h = ScheduleHarness(ref, head_dim=64, seed=21, num_slots=6, state_dtype=BF16, shadow=Float32Model())
    a, b = h.start_request(), h.start_request()
    h.prefill_step([(a, 200, None), (b, 57, None)])
    old = a.slot
    kept = h.buffer[old].clone()
    h.prefill_step([(a, 30, h.free_slots[0]), (b, 71, None)], compact=True)  # b closes its chunk exactly
    assert a.slot != old and torch.equal(bits(h.buffer[old]), bits(kept))  # read, never written
    h.prefill_step([(b, 3, h.free_slots[-1]), (a, 1, None)], use_cuda_graph=True, compact=True)
    for _ in range(5):
        h.decode_step([b, a])
    h.check_live_states()
    assert h.stats.relocations == 2 and h.stats.shadow_checks == 8 and h.stats.compact_padding_rows > 0


# ---------------------------------------------------------------------------
# The harness's checks fail a wrong implementation.
# ---------------------------------------------------------------------------


def test_shadow_catches_the_naive_bf16_scheme():
    """The naive store passes the loose float64 checks here but is not what the kernels store."""
    h = ScheduleHarness(accuracy.naive_reference(), head_dim=64, seed=34, state_dtype=BF16, shadow=ref)
    with pytest.raises(AssertionError, match="vs shadow.*more than float32 rounding"):
        h.run(20)


def test_harness_catches_a_written_padding_row():
    def compact_writes_padding(buffer, inp, out, *args, **kwargs):
        ref.run_prefill_compact(buffer, inp, out, *args, **kwargs)
        out[torch.isnan(out).all(dim=1)] = 0.0

    h = ScheduleHarness(_wrap(run_prefill_compact=compact_writes_padding), head_dim=64, seed=35, state_dtype=BF16,
                        compact=True, cuda_graph=True, decode_prob=0.0)
    with pytest.raises(AssertionError, match="must stay untouched"):
        h.run(5)


def test_harness_catches_a_slot_written_at_a_chunk_close():
    """Decode must leave the slot alone when the token closes the chunk; rewriting even its own bits is caught."""
    def decode_touches_closing_slots(buffer, inp, out, ape, indices, seq_lens, extra=None):
        ref.run_decode(buffer, inp, out, ape, indices, seq_lens, extra)
        closing = indices[(seq_lens % CHUNK_SIZE) == 0].long()
        buffer[closing] = buffer[closing].neg()  # -NaN or a negated state: other bits either way

    h = ScheduleHarness(_wrap(run_decode=decode_touches_closing_slots), head_dim=64, seed=36, state_dtype=BF16,
                        decode_prob=1.0, max_requests=2, finish_prob=0.0)
    with pytest.raises(AssertionError, match="bitwise untouched"):
        h.run(400)


def test_harness_catches_frequent_one_ulp_differences():
    """Every stored element one ulp off the shadow's is within rounding each time, but far too often."""
    def decode_one_ulp_up(buffer, inp, out, ape, indices, seq_lens, extra=None):
        ref.run_decode(buffer, inp, out, ape, indices, seq_lens, extra)
        stored = indices[(seq_lens % CHUNK_SIZE) != 0].long()
        kv = buffer[stored, 0, 128:]
        buffer[stored, 0, 128:] = (bits(kv) + torch.where(bits(kv) >= 0, 1, -1).to(torch.int16)).view(BF16)

    h = ScheduleHarness(_wrap(run_decode=decode_one_ulp_up), head_dim=64, seed=37, state_dtype=BF16, shadow=ref,
                        decode_prob=1.0, tolerances=oracle.Tolerances.unchecked())
    with pytest.raises(AssertionError, match="differ from the shadow, more than"):
        h.run(20)


def test_bf16_state_flips_rules():
    want = torch.tensor([3.0, -1.5, 1.0, 1.25, 0.5, -2.0], dtype=BF16)  # D = 2: [max | sum | kv]
    assert bf16_state_flips(want.clone(), want, "same") == 0
    one_up = want.clone()
    one_up[2] = (bits(want)[2] + 1).view(BF16)
    assert bf16_state_flips(one_up, want, "one ulp") == 1
    two_up = want.clone()
    two_up[2] = (bits(want)[2] + 2).view(BF16)
    with pytest.raises(AssertionError, match="more than float32 rounding"):
        bf16_state_flips(two_up, want, "two ulps")
    near_zero = torch.tensor([3.0, -1.5, 1.0, 1.25, 1e-6, -2.0], dtype=BF16)
    near_zero_got = near_zero.clone()
    near_zero_got[4] = 3e-6  # many of its own ulps, but 1e-6 of the kv row's scale
    assert bf16_state_flips(near_zero_got, near_zero, "near zero") == 1
    nan = want.clone()
    nan[0] = float("nan")
    with pytest.raises(AssertionError):
        bf16_state_flips(nan, want, "nan")


def test_oracle_compares_bf16_states_by_kv_and_log_sum_exp():
    d = 4
    want = oracle.PartialState(max=torch.full((d,), 3.3, dtype=torch.float64), sum=torch.full((d,), 2.0, dtype=torch.float64),
                               kv=torch.linspace(-1, 1, d, dtype=torch.float64))
    # Same partial softmax, expressed against a different max: passes (max and sum are not compared alone).
    shifted = ref.state_to_store(want.max, want.sum, want.kv, BF16)
    assert not torch.equal(shifted[:d].double(), want.max)
    oracle.assert_state_close(shifted, want)
    wrong_sum = ref.state_to_store(want.max, want.sum * 1.2, want.kv, BF16)
    with pytest.raises(AssertionError, match="lse off by"):
        oracle.assert_state_close(wrong_sum, want)
    wrong_kv = ref.state_to_store(want.max, want.sum, want.kv + 0.2, BF16)
    with pytest.raises(AssertionError, match="kv off by"):
        oracle.assert_state_close(wrong_kv, want)
    # A float32 state still has max and sum checked on their own.
    with pytest.raises(AssertionError, match="max off by"):
        oracle.assert_state_close(shifted.float(), want)


# ---------------------------------------------------------------------------
# The bf16 store rule.
# ---------------------------------------------------------------------------


def test_exact_store_rebases_the_sum_on_the_rounded_max():
    m = torch.tensor([100.3, -7.77, 0.001, 5.0], dtype=torch.float64)  # bf16 holds 100.5, -7.75, ..., 5.0
    total = torch.tensor([1.0, 3.0, 1.5, 120.0], dtype=torch.float64)
    kv = torch.tensor([0.1, -0.2, 0.3, 0.4], dtype=torch.float64)
    exact = ref.state_to_store(m, total, kv, BF16).double()
    naive = ref.state_to_store(m, total, kv, BF16, exact_bf16_stores=False).double()
    assert torch.equal(exact[:4], m.to(BF16).double()) and torch.equal(naive[:4], exact[:4])
    assert torch.equal(exact[8:], kv.to(BF16).double())
    assert torch.equal(exact[4:8], (total * torch.exp(m - m.to(BF16).double())).to(BF16).double())
    lse = m + torch.log(total)
    exact_err = (exact[:4] + torch.log(exact[4:8]) - lse).abs()
    naive_err = (naive[:4] + torch.log(naive[4:8]) - lse).abs()
    assert bool((exact_err <= 2.0**-8).all())  # one rounding of the sum: half a bf16 ulp, relative
    assert float(naive_err[0]) > 0.1  # the max's own rounding (0.2 at 100.3) goes straight into the lse
    assert torch.equal(ref.state_to_store(m, total, kv, F32), torch.cat([m, total, kv]).float())


def test_decode_stores_once_per_token_and_prefill_once_per_call():
    """A prefill segment builds on the unrounded state; decoding the same tokens rounds after each one."""
    d = 64
    gen = torch.Generator().manual_seed(4)
    tokens = torch.cat([torch.randn(40, d, generator=gen), 2 * torch.randn(40, d, generator=gen)], dim=1)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen)
    by_prefill = torch.full((2, 1, 3 * d), float("nan"), dtype=BF16)
    by_decode = by_prefill.clone()
    for done, extend in ((0, 10), (10, 30)):
        counts, cp, wp = plan_with(ref, [extend], [done + extend], False)
        ref.run_prefill(by_prefill, tokens[done : done + extend], torch.empty(extend, d), ape, I32([1]),
                        cp[: counts[0]], wp[: counts[1]])
        if done == 0:
            by_decode.copy_(by_prefill)
    for t in range(10, 40):
        ref.run_decode(by_decode, tokens[t : t + 1], torch.empty(1, d), ape, I32([1]), I32([t + 1]))
    # The prefill's second call: the prior (read exactly) merged with 30 tokens in float64, rounded once.
    prior = by_decode.new_empty(0)  # placeholder to keep names short below
    counts, cp, wp = plan_with(ref, [10], [10], False)
    first = torch.full((1, 1, 3 * d), float("nan"), dtype=BF16)
    ref.run_prefill(first, tokens[:10], torch.empty(10, d), ape, I32([0]), cp[:0], wp[: counts[1]])
    prior = first[0, 0].double()
    seg = tokens[10:40].double()
    s = seg[:, d:] + ape[10:40].double()
    top = torch.maximum(prior[:d], s.max(dim=0).values)
    w_prior = prior[d : 2 * d] * torch.exp(prior[:d] - top)
    w = torch.exp(s - top)
    total = w_prior + w.sum(dim=0)
    kv = (prior[2 * d :] * w_prior + (w * seg[:, :d]).sum(dim=0)) / total
    assert torch.equal(bits(by_prefill[1, 0]), bits(ref.state_to_store(top, total, kv, BF16)))
    assert not torch.equal(bits(by_prefill[1, 0]), bits(by_decode[1, 0]))  # 30 roundings differ from one
    want = oracle.partial_state(tokens[:40, :d].double(), tokens[:40, d:].double(), ape)
    oracle.assert_state_close(by_prefill[1, 0], want)
    oracle.assert_state_close(by_decode[1, 0], want)
    assert torch.isnan(by_prefill[0].float()).all()


def test_decode_first_token_of_a_chunk_ignores_a_nan_bf16_slot():
    d = 64
    gen = torch.Generator().manual_seed(5)
    inp = torch.randn(1, 2 * d, generator=gen)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen)
    buf = torch.full((1, 1, 3 * d), float("nan"), dtype=BF16)
    ref.run_decode(buf, inp, torch.empty(1, d), ape, I32([0]), I32([129]))
    s = inp[0, d:].double() + ape[0].double()
    want = ref.state_to_store(s, torch.ones_like(s), inp[0, :d].double(), BF16)
    assert torch.equal(bits(buf[0, 0]), bits(want))


# ---------------------------------------------------------------------------
# run_prefill_compact.
# ---------------------------------------------------------------------------


def _prefill_case(d=64, graph=False, extend=(130, 5, 300), seq=(200, 5, 300)):
    gen = torch.Generator().manual_seed(6)
    n = sum(extend)
    inp = torch.cat([torch.randn(n, d, generator=gen), 2 * torch.randn(n, d, generator=gen)], dim=1)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen)
    counts, cp, wp = plan_with(ref, list(extend), list(seq), graph)
    if not graph:
        cp, wp = cp[: counts[0]], wp[: counts[1]]
    buf = torch.randn(4, 1, 3 * d, generator=gen).abs() + 0.5  # plausible prior states (sums > 0)
    return buf, inp, ape, I32([3, 0, 1]), cp, wp, I32([2, 0, 1])


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_compact_rows_are_the_full_outputs_rows_in_plan_order(dtype, graph):
    buf, inp, ape, idx, cp, wp, load = _prefill_case(graph=graph)
    buf = buf.to(dtype)
    full_buf, compact_buf = buf.clone(), buf.clone()
    full = torch.full((inp.shape[0], 64), float("nan"))
    compact = torch.full((cp.shape[0], 64), float("nan"))
    ref.run_prefill(full_buf, inp, full, ape, idx, cp, wp, load)
    ref.run_prefill_compact(compact_buf, inp, compact, ape, idx, cp, wp, load)
    ragged = decode_rows(cp)[:, 0]
    live = ragged != PADDING_ROW
    assert int(live.sum()) == 3  # chunks closed: 1 (positions 70..199) + 0 + 2 (0..299)
    assert torch.equal(compact[live], full[ragged[live]])
    assert torch.isnan(compact[~live]).all() and bool((~live).any()) == graph
    assert torch.equal(bits(full_buf), bits(compact_buf)) and not torch.equal(bits(full_buf), bits(buf))


def test_compact_with_no_compress_rows_takes_an_empty_output():
    buf, inp, ape, _, cp, wp, _ = _prefill_case(extend=(5,), seq=(20,))
    assert cp.shape[0] == 0
    before = buf.clone()
    ref.run_prefill_compact(buf, inp, torch.empty(0, 64), ape, I32([1]), cp, wp)
    assert not torch.equal(buf[1], before[1]) and torch.equal(buf[[0, 2, 3]], before[[0, 2, 3]])
    empty = torch.empty(0, ROW_BYTES, dtype=torch.uint8)
    ref.run_prefill_compact(buf, inp[:0], torch.empty(0, 64), ape, I32([]), empty, empty)


@pytest.mark.parametrize("rows", [0, 2, 4, 435 + 1])
def test_compact_output_with_the_wrong_row_count_is_refused_before_writing(rows):
    buf, inp, ape, idx, cp, wp, load = _prefill_case(graph=True)
    assert cp.shape[0] == 435
    cp = cp[:3] if rows < 435 else cp  # the 3 live rows alone, or the padded 435-row plan
    out = torch.full((rows, 64), float("nan"))
    before = buf.clone()
    with pytest.raises(ValueError) as caught:
        ref.run_prefill_compact(buf, inp, out, ape, idx, cp, wp, load)
    message = str(caught.value)
    assert "argument 'kv_compressed_output'" in message and "compress_plan rows" in message
    assert f"[{cp.shape[0]}, 64]" in message and f"got [{rows}, 64]" in message
    assert torch.equal(buf, before) and torch.isnan(out).all()
    # run_prefill keeps its own rule (one row per input token) and message.
    with pytest.raises(ValueError, match=rf"expected shape \[{inp.shape[0]}, 64\], got \[{rows}, 64\]"):
        ref.run_prefill(buf, inp, out, ape, idx, cp, wp, load)


# ---------------------------------------------------------------------------
# Bad state dtypes and flags.
# ---------------------------------------------------------------------------


def _calls(buf):
    d = 64
    gen = torch.Generator().manual_seed(7)
    inp = torch.randn(4, 2 * d, generator=gen)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen)
    counts, cp, wp = plan_with(ref, [4], [10], False)
    out = torch.full((4, d), float("nan"))
    return {
        "run_decode": (ref.run_decode, (buf, inp[:1], out[:1], ape, I32([0]), I32([5]), None), out),
        "run_prefill": (ref.run_prefill, (buf, inp, out, ape, I32([0]), cp[:0], wp[: counts[1]]), out),
        "run_prefill_compact": (ref.run_prefill_compact,
                                (buf, inp, out[:0], ape, I32([0]), cp[:0], wp[: counts[1]]), out),
    }


@pytest.mark.parametrize("function", ["run_decode", "run_prefill", "run_prefill_compact"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_state_buffer_of_another_float_dtype_is_refused_before_writing(function, dtype):
    buf = torch.randn(2, 1, 192).to(dtype)
    before = buf.clone()
    fn, args, out = _calls(buf)[function]
    with pytest.raises(TypeError, match=r"argument 'kv_score_buffer': expected dtype float32 or bfloat16.*got "
                       + str(dtype)):
        fn(*args)
    assert torch.equal(buf, before) and torch.isnan(out).all()


@pytest.mark.parametrize("function", ["run_decode", "run_prefill", "run_prefill_compact"])
def test_exact_bf16_stores_must_be_a_bool(function):
    buf = torch.randn(2, 1, 192).to(BF16)
    before = buf.clone()
    fn, args, _ = _calls(buf)[function]
    with pytest.raises(TypeError, match="argument 'exact_bf16_stores': expected a bool"):
        fn(*args, exact_bf16_stores="yes")
    assert torch.equal(bits(buf), bits(before))
    fn(*args, exact_bf16_stores=False)  # accepted by keyword
    assert not torch.equal(bits(buf), bits(before))


def test_float32_states_ignore_the_switch():
    results = []
    for exact in (True, False):
        buf = torch.randn(2, 1, 192, generator=torch.Generator().manual_seed(8)).abs() + 0.5
        fn, args, _ = _calls(buf)["run_prefill"]
        fn(*args, exact_bf16_stores=exact)
        results.append(buf)
    assert torch.equal(bits(results[0]), bits(results[1]))


# ---------------------------------------------------------------------------
# Accuracy against float64 (bounds in tests/oracle.py, measured by scripts/bf16_accuracy.py).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(accuracy.CASES))
def test_bf16_row_errors_stay_under_the_documented_bounds(case):
    errors = accuracy.CASES[case].measure(ref, head_dim=64)
    summary = errors.summary()
    bound = oracle.BF16_ROW_BOUNDS[case]
    assert summary["n_rows"] >= 100
    assert summary["rows_max"] <= bound.max, summary
    assert summary["rows_p99"] <= bound.p99, summary
    assert max(errors.kv) <= oracle.BFLOAT16.kv_rtol and max(errors.lse) <= oracle.BFLOAT16.lse_tol
    assert summary["rows_max"] <= oracle.BFLOAT16.row_rtol


def test_exact_stores_are_no_worse_than_naive_on_the_extend_case():
    exact = accuracy.CASES["extend"].measure(ref, head_dim=64, seeds=1).summary()
    naive = accuracy.CASES["extend"].measure(accuracy.naive_reference(), head_dim=64, seeds=1).summary()
    assert exact["rows_max"] <= naive["rows_max"] and exact["rows_p99"] <= naive["rows_p99"]
    assert exact["lse_max"] <= naive["lse_max"]
    assert exact["lse_max"] <= 2.0**-8 * 1.01  # one rounding of the sum, nothing from the max
    assert exact["rows_max"] < 8.3e-3  # upstream's naive number for this case


def test_bound_table_covers_every_measured_case():
    assert set(oracle.BF16_ROW_BOUNDS) == set(accuracy.CASES)
    for bound in oracle.BF16_ROW_BOUNDS.values():
        assert 0 < bound.p99 <= bound.max <= oracle.BFLOAT16.row_rtol
    assert math.isinf(oracle.Tolerances.unchecked().row_rtol)


def _decoded_chunk(score: float, dtype: torch.dtype, d: int = 64) -> bool:
    """Decodes one chunk of 128 tokens whose scores lie within 2 of ``score`` into a ``dtype`` pool;
    whether its row and the stored states stay finite."""
    gen = torch.Generator().manual_seed(0)
    pool, ape = torch.zeros(1, 1, 3 * d, dtype=dtype), torch.zeros(CHUNK_SIZE, d)
    out = torch.full((1, d), float("nan"))
    slot = torch.tensor([0], dtype=torch.int32)
    finite = True
    for position in range(CHUNK_SIZE):
        token = torch.randn(1, 2 * d, generator=gen)
        token[:, d:] = score + 4 * torch.rand(1, d, generator=gen) - 2
        ref.run_decode(pool, token, out, ape, slot, torch.tensor([position + 1], dtype=torch.int32))
        finite &= bool(torch.isfinite(pool.float()).all())
    return finite and bool(torch.isfinite(out).all())


def test_a_bf16_pool_holds_scores_below_2_to_the_15_as_spec_section_8_says():
    """Below 2^15 the stored max's rounding gap is under 88 and the rescaled sum stays in range; near 32868
    it overflows (docs/SPEC.md section 8 says so, with these figures); a float32 pool does not."""
    for score in (-30000.0, 1000.0, 32700.0):
        assert _decoded_chunk(score, torch.bfloat16), score
    assert not _decoded_chunk(32868.0, torch.bfloat16)
    assert _decoded_chunk(32868.0, torch.float32)
