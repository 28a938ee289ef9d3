"""CPU tests of :mod:`flash_compress.reference` against the float64 offline oracle, and of its planner."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import device_values as dv
import oracle
from flash_compress import reference as ref
from flash_compress.plan_rows import CHUNK_SIZE, PADDING_ROW, ROW_BYTES, decode_rows, encode_rows
from schedule import ScheduleHarness, plan_with, run_schedule


# ---------------------------------------------------------------------------
# Random mixed schedules.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_random_mixed_schedule(head_dim, seed):
    stats = run_schedule(ref, head_dim=head_dim, steps=100, seed=seed)
    assert stats.decode_calls and stats.prefill_calls
    assert stats.rows_checked > 0 and stats.states_checked > 0 and stats.live_states_checked > 0


def test_random_mixed_schedule_head_dim_512():
    stats = run_schedule(ref, head_dim=512, steps=30, seed=7, max_requests=4)
    assert stats.rows_checked > 0 and stats.states_checked > 0


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_schedule_with_and_without_cuda_graph_plans(cuda_graph):
    stats = run_schedule(ref, head_dim=64, steps=40, seed=11, cuda_graph=cuda_graph, decode_prob=0.3)
    assert stats.prefill_calls > 0
    assert stats.cuda_graph_plans == (stats.prefill_calls if cuda_graph else 0)


def test_schedule_covers_the_edge_cases():
    """One longer schedule exercises every kind of step the harness knows."""
    stats = run_schedule(ref, head_dim=64, steps=150, seed=3, max_requests=6, num_slots=14)
    kinds = set(stats.extend_kinds)
    assert {"one", "small", "inside", "close", "end127", "end1", "cross1", "cross_many", "aligned"} <= kinds
    assert any(k.startswith("first") for k in kinds)
    assert {0, 1, 127} <= set(stats.prefix_mod)  # prefixes ending at 128k, 128k+1 and 128k+127 tokens
    assert stats.max_boundaries_crossed >= 3
    assert stats.relocations_mid_chunk > 0 and stats.load_indices_calls > 0
    assert 0 < stats.cuda_graph_plans < stats.prefill_calls
    assert stats.decode_closes > 0 and stats.decode_resets > 0
    assert stats.requests_finished > 0


def test_decode_only_request_through_several_chunks():
    h = ScheduleHarness(ref, head_dim=64, seed=5)
    request = h.start_request()
    for _ in range(3 * CHUNK_SIZE + 5):
        h.decode_step([request])
    h.check_live_states()
    assert h.stats.decode_closes == 3 and h.stats.rows_checked == 3 and h.stats.decode_resets == 4


def test_decode_only_schedule_with_staggered_requests():
    stats = run_schedule(ref, head_dim=64, steps=300, seed=8, decode_prob=1.0, max_requests=4, finish_prob=0.002)
    assert stats.prefill_calls == 0 and stats.decode_closes >= 2


def test_prefill_only_schedule():
    stats = run_schedule(ref, head_dim=128, steps=40, seed=9, decode_prob=0.0)
    assert stats.decode_calls == 0 and stats.rows_checked > 0


def test_decode_and_prefill_agree():
    """The same 300 tokens, by decode one at a time and by a chunked prefill, give the same rows and state."""
    d = 64
    gen = torch.Generator().manual_seed(0)
    tokens = torch.cat([torch.randn(300, d, generator=gen), 2 * torch.randn(300, d, generator=gen)], dim=1)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen)
    by_decode = torch.full((2, 1, 3 * d), float("nan"))
    rows_decode = []
    for t in range(300):
        out = torch.full((1, d), float("nan"))
        ref.run_decode(by_decode, tokens[t : t + 1], out, ape, torch.tensor([1], dtype=torch.int32),
                       torch.tensor([t + 1], dtype=torch.int32))
        if t % CHUNK_SIZE == CHUNK_SIZE - 1:
            rows_decode.append(out[0])
    by_prefill = torch.full((2, 1, 3 * d), float("nan"))
    rows_prefill = []
    done = 0
    for extend in (100, 60, 140):
        counts, cp, wp = plan_with(ref, [extend], [done + extend], False)
        out = torch.full((extend, d), float("nan"))
        ref.run_prefill(by_prefill, tokens[done : done + extend], out, ape, torch.tensor([1], dtype=torch.int32),
                        cp[: counts[0]], wp[: counts[1]])
        rows_prefill += [out[int(r)] for r in decode_rows(cp[: counts[0]])[:, 0]]
        done += extend
    oracle.assert_rows_close(torch.stack(rows_decode), torch.stack(rows_prefill), "decode vs prefill rows")
    oracle.assert_rows_close(by_decode[1, 0], by_prefill[1, 0], "decode vs prefill state")
    assert torch.isnan(by_decode[0]).all() and torch.isnan(by_prefill[0]).all()


# ---------------------------------------------------------------------------
# Relocation through load_indices.
# ---------------------------------------------------------------------------


def _relocation_harness():
    h = ScheduleHarness(ref, head_dim=64, seed=21, num_slots=6)
    request = h.start_request()
    h.prefill_step([(request, 200, None)])
    return h, request


@pytest.mark.parametrize("extend", [1, 20, 55, 56, 57, 300])
def test_relocation_reads_old_slot_writes_new(extend):
    """Prefix 200 (offset 72): extends that stay inside, close the chunk, or cross it, while moving slots."""
    h, request = _relocation_harness()
    old = request.slot
    new = h.free_slots[0]
    old_state = h.buffer[old].clone()
    h.prefill_step([(request, extend, new)])
    assert request.slot == new
    assert torch.equal(h.buffer[old].view(torch.int32), old_state.view(torch.int32))  # old slot never written
    h.check_live_states()


def test_relocation_with_other_requests_in_batch():
    h, a = _relocation_harness()
    b = h.start_request()
    h.prefill_step([(b, 130, None)])
    target = [s for s in h.free_slots][0]
    h.prefill_step([(b, 10, None), (a, 100, target)], pass_load_indices=True)
    h.prefill_step([(a, 3, None), (b, 200, h.free_slots[0])], use_cuda_graph=True)
    h.check_live_states()
    assert h.stats.relocations == 2


def test_prefill_reads_load_indices_not_indices():
    """Direct check: the prior state comes from load_indices[b], not indices[b]."""
    d = 64
    gen = torch.Generator().manual_seed(1)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen)
    first = torch.randn(10, 2 * d, generator=gen)
    second = torch.randn(5, 2 * d, generator=gen)
    buf = torch.full((3, 1, 3 * d), float("nan"))
    counts, cp, wp = plan_with(ref, [10], [10], False)
    ref.run_prefill(buf, first, torch.empty(10, d), ape, torch.tensor([0], dtype=torch.int32), cp[:0], wp[: counts[1]])
    counts, cp, wp = plan_with(ref, [5], [15], False)
    ref.run_prefill(buf, second, torch.empty(5, d), ape, torch.tensor([2], dtype=torch.int32), cp[:0], wp[: counts[1]],
                    torch.tensor([0], dtype=torch.int32))
    tokens = torch.cat([first, second]).double()
    want = oracle.partial_state(tokens[:, :d], tokens[:, d:], ape)
    oracle.assert_state_close(buf[2, 0], want)
    assert torch.isnan(buf[1]).all()


# ---------------------------------------------------------------------------
# run_* edge cases.
# ---------------------------------------------------------------------------


def _tensors(d=64, n=4, slots=3):
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(slots, 1, 3 * d, generator=gen),
        torch.randn(n, 2 * d, generator=gen),
        torch.full((n, d), float("nan")),
        torch.randn(CHUNK_SIZE, d, generator=gen),
    )


def test_decode_batch_zero_is_a_noop():
    buf, _, _, ape = _tensors()
    before = buf.clone()
    ref.run_decode(buf, torch.empty(0, 128), torch.empty(0, 64), ape, torch.empty(0, dtype=torch.int32),
                   torch.empty(0, dtype=torch.int32), None)
    assert torch.equal(buf, before)


def test_prefill_empty_plans_are_a_noop():
    buf, inp, out, ape = _tensors()
    before = buf.clone()
    empty = torch.empty(0, ROW_BYTES, dtype=torch.uint8)
    ref.run_prefill(buf, inp[:0], out[:0], ape, torch.empty(0, dtype=torch.int32), empty, empty)
    ref.run_prefill(buf, inp, out, ape, torch.tensor([0], dtype=torch.int32), empty, empty, None)
    assert torch.equal(buf, before) and torch.isnan(out).all()


def test_prefill_skips_sentinel_rows():
    buf, inp, out, ape = _tensors()
    before = buf.clone()
    pad = torch.full((4, ROW_BYTES), 0xFF, dtype=torch.uint8)
    ref.run_prefill(buf, inp, out, ape, torch.tensor([0], dtype=torch.int32), pad, pad.clone())
    assert torch.equal(buf, before) and torch.isnan(out).all()


@pytest.mark.parametrize(
    "row, which",
    [
        ((3, 0, 127, 4), "write"),  # write row that closes a chunk
        ((3, 0, 126, 4), "compress"),  # compress row that does not close one
        ((3, 0, 10, 5), "write"),  # ragged start before row 0
        ((3, 0, 130, 4), "write"),  # window crosses a chunk start
        ((3, 0, 3, 0), "write"),  # window 0
        ((3, 0, 200, 129), "write"),  # window > 128
        ((3, 1, 3, 4), "write"),  # batch id past the batch
        ((9, 0, 9, 4), "write"),  # ragged id past the input
    ],
)
def test_prefill_skips_malformed_rows(row, which):
    """A row the kernels skip (docs/RELIABILITY.md section 2) is skipped here too: no error, nothing written."""
    buf, inp, out, ape = _tensors()
    before = buf.clone()
    bad = encode_rows([row])
    empty = torch.empty(0, ROW_BYTES, dtype=torch.uint8)
    plans = (bad, empty) if which == "compress" else (empty, bad)
    ref.run_prefill(buf, inp, out, ape, torch.tensor([0], dtype=torch.int32), *plans)
    assert torch.equal(buf, before) and torch.isnan(out).all()


def test_run_functions_skip_bad_slots_and_lengths():
    """Slots outside the pool and seq_len < 1 are device values: skipped, as the kernels skip them."""
    buf, inp, out, ape = _tensors()
    before = buf.clone()
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    ref.run_decode(buf, inp[:1], out[:1], ape, i32(3), i32(5))  # slot past the pool
    ref.run_decode(buf, inp[:1], out[:1], ape, i32(-1), i32(5))
    ref.run_decode(buf, inp[:1], out[:1], ape, i32(0), i32(0))  # seq_len 0: no token position
    ref.run_decode(buf, inp[:1], out[:1], ape, i32(0), i32(-5))
    ref.run_decode(buf, inp[:1], out[:1], ape, i32(2**31 - 1), i32(128))  # would write the output row
    _, cp, wp = plan_with(ref, [4], [10], False)
    ref.run_prefill(buf, inp[:4], out[:4], ape, i32(0), cp[:0], wp[:1], i32(7))  # load slot past the pool
    ref.run_prefill(buf, inp[:4], out[:4], ape, i32(-2**31), cp[:0], wp[:1], i32(0))  # target past the pool
    assert torch.equal(buf, before) and torch.isnan(out).all()


def test_run_functions_reject_bad_arguments():
    """What the compiled exports check on the host raises here too, before anything is written."""
    buf, inp, out, ape = _tensors()
    before = buf.clone()
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match="indices"):
        ref.run_decode(buf, inp[:2], out[:2], ape, i32(0), i32(5))  # batch mismatch
    with pytest.raises(TypeError, match="indices"):
        ref.run_decode(buf, inp[:1], out[:1], ape, torch.tensor([0.0]), i32(5))
    with pytest.raises(TypeError, match="seq_lens.*int32"):
        ref.run_decode(buf, inp[:1], out[:1], ape, i32(0), torch.tensor([5]))  # int64
    with pytest.raises(TypeError, match="kv_score_input.*float32"):
        ref.run_decode(buf, inp[:1].double(), out[:1], ape, i32(0), i32(5))
    with pytest.raises(TypeError, match="ape.*float32"):
        ref.run_decode(buf, inp[:1], out[:1], ape.half(), i32(0), i32(5))
    with pytest.raises(TypeError, match="kv_compressed_output.*float32"):
        ref.run_decode(buf, inp[:1], out[:1].bfloat16(), ape, i32(0), i32(5))
    with pytest.raises(TypeError, match="kv_score_buffer"):
        ref.run_decode(buf.double(), inp[:1], out[:1], ape, i32(0), i32(5))
    _, cp, wp = plan_with(ref, [4], [10], False)
    with pytest.raises(TypeError, match="load_indices.*int32"):
        ref.run_prefill(buf, inp[:4], out[:4], ape, i32(0), cp[:0], wp[:1], torch.tensor([0]))
    with pytest.raises(TypeError, match="write_plan"):
        ref.run_prefill(buf, inp[:4], out[:4], ape, i32(0), cp[:0], wp[:1].int(), None)
    with pytest.raises(ValueError, match="compress_plan"):
        ref.run_prefill(buf, inp[:4], out[:4], ape, i32(0), cp[:0, :8], wp[:1], None)
    assert torch.equal(buf, before) and torch.isnan(out).all()


@pytest.mark.parametrize("seed", range(12))
def test_skips_match_the_kernels_skip_rule(seed):
    """The reference on calls mixing good and bad device values equals the reference on the good rows alone,
    which ``tests/device_values.py`` picks with its own statement of the kernels' skip rule."""
    for call in (dv.bad_decode_call(seed, 64), dv.bad_prefill_call(seed, 64), dv.random_bytes_call(seed, 64)):
        args = list(call.args())
        args[0], args[2] = call.buffer.clone(), call.output.clone()  # the pool and the output, written in place
        run = ref.run_decode if isinstance(call, dv.DecodeCall) else ref.run_prefill
        run(*args)
        dv.check_against_reference(call, args[0], args[2], f"seed {seed} {type(call).__name__}")


def test_decode_semantics_by_position():
    """pos 0 resets (ignores the old state), pos 127 writes out and leaves the state, others store."""
    d = 64
    buf, inp, _, ape = _tensors(d=d, n=3, slots=3)
    buf[0] = float("nan")
    before = buf.clone()
    out = torch.full((3, d), float("nan"))
    ref.run_decode(buf, inp, out, ape, torch.tensor([0, 1, 2], dtype=torch.int32),
                   torch.tensor([129, 256, 5], dtype=torch.int32))
    s0 = inp[0, d:].double() + ape[0].double()
    assert torch.equal(buf[0, 0, :d], s0.float()) and torch.equal(buf[0, 0, d : 2 * d], torch.ones(d))
    assert torch.equal(buf[0, 0, 2 * d :], inp[0, :d])
    assert torch.isnan(out[0]).all() and torch.isnan(out[2]).all()
    assert torch.equal(buf[1], before[1]) and not torch.isnan(out[1]).any()
    assert not torch.equal(buf[2], before[2])


# ---------------------------------------------------------------------------
# Planner: hand-computed edge cases.
# ---------------------------------------------------------------------------


def _rows(plan, n):
    return [tuple(r) for r in decode_rows(plan[:n]).tolist()]


@pytest.mark.parametrize(
    "extend, seq, compress, write",
    [
        # crossing 0 chunk boundaries: positions 10..14
        ([5], [15], [], [(4, 0, 14, 5)]),
        # extend of 1, mid chunk
        ([1], [50], [], [(0, 0, 49, 1)]),
        # crossing 1 boundary: positions 100..149
        ([50], [150], [(27, 0, 127, 28)], [(49, 0, 149, 22)]),
        # crossing many: positions 0..299
        ([300], [300], [(127, 0, 127, 128), (255, 0, 255, 128)], [(299, 0, 299, 44)]),
        # prefix ending at 127 (127 tokens before): one token closes the chunk
        ([1], [128], [(0, 0, 127, 1)], []),
        # prefix 128: a fresh chunk
        ([1], [129], [], [(0, 0, 128, 1)]),
        # prefix 129, positions 129..328
        ([200], [329], [(126, 0, 255, 127)], [(199, 0, 328, 73)]),
        # full 128-aligned: prefix 128, positions 128..383
        ([256], [384], [(127, 0, 255, 128), (255, 0, 383, 128)], []),
        # whole request in one prefill, ending at 127
        ([128], [128], [(127, 0, 127, 128)], []),
        # several requests: ragged ids continue across requests
        (
            [3, 130, 1],
            [130, 130, 7],
            [(0, 0, 127, 1), (130, 1, 127, 128)],
            [(2, 0, 129, 2), (132, 1, 129, 2), (133, 2, 6, 1)],
        ),
        # long history, short extend
        ([3], [1_000_000], [], [(2, 0, 999_999, 3)]),
        # empty batch
        ([], [], [], []),
    ],
)
@pytest.mark.parametrize("graph", [False, True])
def test_planner_edge_cases(extend, seq, compress, write, graph):
    counts, cp, wp = plan_with(ref, extend, seq, graph, fill_seed=3)
    m = sum(extend)
    assert counts == ((m, m) if graph else (len(compress), len(write)))
    assert isinstance(counts[0], int)
    assert _rows(cp, len(compress)) == compress
    assert _rows(wp, len(write)) == write
    if graph:
        assert bool((cp[len(compress) :] == 0xFF).all()) and bool((wp[len(write) :] == 0xFF).all())
        assert all(r[0] == PADDING_ROW for r in _rows(cp, m)[len(compress) :])
    else:
        # Rows past the counts are left as they were.
        gen = torch.Generator().manual_seed(3)
        fill_c = torch.randint(0, 256, (m, ROW_BYTES), dtype=torch.uint8, generator=gen)
        fill_w = torch.randint(0, 256, (m, ROW_BYTES), dtype=torch.uint8, generator=gen)
        assert torch.equal(cp[len(compress) :], fill_c[len(compress) :])
        assert torch.equal(wp[len(write) :], fill_w[len(write) :])


def test_planner_row_bytes_are_little_endian():
    counts, cp, wp = plan_with(ref, [5, 300], [15, 329], False)
    assert counts == (2, 2)
    # Request 1: positions 29..328, ragged 5..304. Compress rows close at 127 and 255.
    expected_compress = bytes(
        [
            *(103).to_bytes(4, "little"), 1, 0, 0, 0, 127, 0, 0, 0, 99, 0, 0, 0,
            *(231).to_bytes(4, "little"), 1, 0, 0, 0, 0xFF, 0, 0, 0, 128, 0, 0, 0,
        ]
    )
    expected_write = bytes(
        [
            4, 0, 0, 0, 0, 0, 0, 0, 14, 0, 0, 0, 5, 0, 0, 0,
            0x30, 0x01, 0, 0, 1, 0, 0, 0, 0x48, 0x01, 0, 0, 73, 0, 0, 0,  # ragged 304, position 328
        ]
    )
    assert bytes(cp[:2].flatten().tolist()) == expected_compress
    assert bytes(wp[:2].flatten().tolist()) == expected_write


def test_planner_cuda_graph_padding_is_all_ff():
    counts, cp, wp = plan_with(ref, [130, 5], [130, 5], True, fill_seed=9)
    assert counts == (135, 135)
    assert bool((cp[1:] == 0xFF).all()) and bool((wp[2:] == 0xFF).all())
    assert not bool((cp[0] == 0xFF).all())


def test_planner_takes_int64_host_lengths_as_the_compiled_host_planner():
    cp = torch.zeros(130, ROW_BYTES, dtype=torch.uint8)
    wp = torch.zeros(130, ROW_BYTES, dtype=torch.uint8)
    i64 = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    with pytest.raises(TypeError, match="extend_lens.*int64"):
        ref.plan_online_prefill(i64(130).int(), i64(200), cp, wp, False)
    with pytest.raises(TypeError, match="seq_lens.*int64"):
        ref.plan_online_prefill(i64(130), i64(200).int(), cp, wp, False)
    with pytest.raises(ValueError, match="extend_lens.*host"):
        ref.plan_online_prefill(i64(130).to("meta"), i64(200), cp, wp, False)
    assert not cp.any() and not wp.any()
    assert ref.plan_online_prefill(i64(130), i64(200), cp, wp, False) == (1, 1)
    assert _rows(cp, 1) == [(57, 0, 127, 58)] and _rows(wp, 1) == [(129, 0, 199, 72)]


def test_encode_decode_roundtrip():
    rows = [(0, 1, 2, 3), (PADDING_ROW, PADDING_ROW, PADDING_ROW, PADDING_ROW), (0x12345678, 7, 0xABCDEF01, 128)]
    assert [tuple(r) for r in decode_rows(encode_rows(rows)).tolist()] == rows


# ---------------------------------------------------------------------------
# Planner errors: each raises, nothing is written.
# ---------------------------------------------------------------------------


def _lens(*v, dtype=torch.int64):
    return torch.tensor(v, dtype=dtype)


def _plans(m, width=ROW_BYTES, dtype=torch.uint8):
    return torch.full((m, width), 7, dtype=dtype), torch.full((m, width), 7, dtype=dtype)


ERROR_CASES = {
    "extend_gt_seq": lambda: (_lens(5), _lens(4), *_plans(5)),
    "extend_zero": lambda: (_lens(0, 3), _lens(4, 4), *_plans(3)),
    "extend_negative": lambda: (_lens(-1, 4), _lens(4, 4), *_plans(3)),
    "sum_mismatch_short": lambda: (_lens(3, 4), _lens(10, 10), *_plans(6)),
    "sum_mismatch_long": lambda: (_lens(3, 4), _lens(10, 10), *_plans(8)),
    "plans_differ_in_rows": lambda: (_lens(3), _lens(3), _plans(3)[0], _plans(2)[1]),
    "extend_float": lambda: (_lens(3, dtype=torch.float32), _lens(3), *_plans(3)),
    "seq_int16": lambda: (_lens(3), _lens(3, dtype=torch.int16), *_plans(3)),
    "plan_width_15": lambda: (_lens(3), _lens(3), *_plans(3, width=15)),
    "plan_int8": lambda: (_lens(3), _lens(3), *_plans(3, dtype=torch.int8)),
    "plan_int32": lambda: (_lens(3), _lens(3), *_plans(3, dtype=torch.int32)),
    "plan_1d": lambda: (_lens(3), _lens(3), torch.zeros(48, dtype=torch.uint8), torch.zeros(48, dtype=torch.uint8)),
    "plan_not_contiguous": lambda: (_lens(3), _lens(3), torch.zeros(3, 2 * ROW_BYTES, dtype=torch.uint8)[:, :ROW_BYTES],
                                    torch.zeros(3, 2 * ROW_BYTES, dtype=torch.uint8)[:, :ROW_BYTES]),
    "lengths_2d": lambda: (_lens(3).reshape(1, 1), _lens(3).reshape(1, 1), *_plans(3)),
    "batch_mismatch": lambda: (_lens(3), _lens(3, 4), *_plans(3)),
    "seq_too_long": lambda: (_lens(3), _lens(2**32), *_plans(3)),
    "not_a_tensor": lambda: ([3], [3], *_plans(3)),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
@pytest.mark.parametrize("graph", [False, True])
def test_planner_errors_raise_and_write_nothing(case, graph):
    extend, seq, cp, wp = ERROR_CASES[case]()
    before = (cp.clone(), wp.clone()) if isinstance(cp, torch.Tensor) else None
    with pytest.raises((ValueError, TypeError)):
        ref.plan_online_prefill(extend, seq, cp, wp, graph)
    assert torch.equal(cp, before[0]) and torch.equal(wp, before[1])


@pytest.mark.parametrize("case", ["extend_gt_seq", "extend_zero", "sum_mismatch_short", "batch_mismatch"])
def test_planner_value_errors_name_the_argument(case):
    extend, seq, cp, wp = ERROR_CASES[case]()
    with pytest.raises(ValueError, match="argument '"):
        ref.plan_online_prefill(extend, seq, cp, wp, False)


# ---------------------------------------------------------------------------
# Planner invariants (checked here on a large batch; the property tests are in tests/test_fuzz.py).
# ---------------------------------------------------------------------------


def check_plan_invariants(extend, seq, counts, cp, wp, graph):
    """Every new token is covered exactly once, by well-formed rows in order."""
    m = sum(extend)
    compress = decode_rows(cp)
    write = decode_rows(wp)
    if graph:
        assert counts == (m, m)
        nc = int((compress[:, 0] != PADDING_ROW).sum())
        nw = int((write[:, 0] != PADDING_ROW).sum())
        assert bool((compress[nc:] == PADDING_ROW).all()) and bool((write[nw:] == PADDING_ROW).all()), "padding only at the end"
    else:
        nc, nw = counts
    compress, write = compress[:nc].tolist(), write[:nw].tolist()
    starts = np.concatenate([[0], np.cumsum(extend)]).astype(int).tolist()
    covered = np.zeros(m + 1, dtype=np.int64)  # difference array of coverage counts
    for rows, closes in ((compress, True), (write, False)):
        keys = [(b, p) for _, b, p, _ in rows]
        assert keys == sorted(keys) and len(set(keys)) == len(keys), "rows ordered by request, then position"
        for ragged, b, position, window in rows:
            assert 0 <= b < len(extend)
            assert 1 <= window <= CHUNK_SIZE
            assert (position % CHUNK_SIZE == CHUNK_SIZE - 1) == closes
            first = position - window + 1
            assert first >= CHUNK_SIZE * (position // CHUNK_SIZE), "a segment never crosses a chunk start"
            prefix = seq[b] - extend[b]
            assert prefix <= first and position < seq[b]
            assert ragged == starts[b] + position - prefix, "ragged id consistent with position"
            covered[ragged - window + 1] += 1
            covered[ragged + 1] -= 1
    assert bool((np.cumsum(covered)[:m] == 1).all()), "every token covered exactly once"
    per_request = [b for _, b, _, _ in write]
    assert len(per_request) == len(set(per_request)), "at most one write row per request"
    assert sorted(per_request) == [b for b in range(len(seq)) if seq[b] % CHUNK_SIZE != 0]
    for _, b, position, _ in write:
        assert position == seq[b] - 1, "the write row is the request's last segment"
    assert len(compress) == sum(len(range(s - e + (CHUNK_SIZE - 1 - (s - e) % CHUNK_SIZE), s, CHUNK_SIZE)) for e, s in zip(extend, seq))


def test_planner_large_random_batch():
    rng = random.Random(0)
    extend = [rng.randint(1, 300) for _ in range(512)]
    seq = [e + rng.randint(0, 10**6) for e in extend]
    for graph in (False, True):
        counts, cp, wp = plan_with(ref, extend, seq, graph)
        check_plan_invariants(extend, seq, counts, cp, wp, graph)


# ---------------------------------------------------------------------------
# Cases an audit's mutants survived (nineteenth session): each test fails on one of them.
# ---------------------------------------------------------------------------


def test_compact_output_keeps_a_skipped_rows_place():
    """Compress-plan row i's result goes to output row i even where an earlier row is skipped: request 0's
    chunk needs a prior state from a slot outside the pool, so row 0 stays poisoned and row 1 still gets
    request 1's chunk (not shifted up into row 0)."""
    d = 64
    gen = torch.Generator().manual_seed(11)
    pool, ape = torch.randn(3, 1, 3 * d, generator=gen), torch.randn(CHUNK_SIZE, d, generator=gen)
    extend, seq = [100, 128], [200, 128]
    x = torch.randn(sum(extend), 2 * d, generator=gen)
    cp, wp = (torch.zeros(sum(extend), ROW_BYTES, dtype=torch.uint8) for _ in range(2))
    num_compress, num_write = ref.plan_online_prefill(torch.tensor(extend), torch.tensor(seq), cp, wp, False)
    assert num_compress == 2
    cp, wp = cp[:num_compress], wp[:num_write]
    indices, load = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([-1, 1], dtype=torch.int32)
    compact = torch.full((2, d), float("nan"))
    ref.run_prefill_compact(pool.clone(), x, compact, ape, indices, cp, wp, load)
    full = torch.full((sum(extend), d), float("nan"))
    ref.run_prefill(pool.clone(), x, full, ape, indices, cp, wp, load)
    assert torch.isnan(compact[0]).all()
    assert torch.equal(compact[1], full[int(decode_rows(cp)[1, 0])])


@pytest.mark.parametrize("run", ["prefill", "decode"])
def test_the_naive_bf16_store_is_a_plain_cast_of_each_field(run):
    """``exact_bf16_stores=False`` stores bf16 casts of max, sum and kv as they are: here the float32 pool's
    values (the same tokens) cast, where the default scheme re-expresses the sum against the rounded max."""
    d = 64
    gen = torch.Generator().manual_seed(5)
    pool32 = torch.randn(2, 1, 3 * d, generator=gen).abs()
    ape = torch.randn(CHUNK_SIZE, d, generator=gen)
    start = pool32.to(torch.bfloat16).float()  # a state both pools hold exactly
    stored = {}
    for name, dtype, exact in (("f32", torch.float32, True), ("naive", torch.bfloat16, False),
                               ("exact", torch.bfloat16, True)):
        pool = start.to(dtype, copy=True)
        kwargs = {} if dtype == torch.float32 else {"exact_bf16_stores": exact}
        indices = torch.tensor([0, 1], dtype=torch.int32)
        if run == "prefill":
            extend, seq = [30, 40], [50, 60]  # both continue a chunk and store a state
            cp, wp = (torch.zeros(70, ROW_BYTES, dtype=torch.uint8) for _ in range(2))
            num_c, num_w = ref.plan_online_prefill(torch.tensor(extend), torch.tensor(seq), cp, wp, False)
            x = torch.randn(70, 2 * d, generator=torch.Generator().manual_seed(6))
            ref.run_prefill(pool, x, torch.empty(70, d), ape, indices, cp[:num_c], wp[:num_w], **kwargs)
        else:
            x = torch.randn(2, 2 * d, generator=torch.Generator().manual_seed(6))
            ref.run_decode(pool, x, torch.empty(2, d), ape, indices, torch.tensor([50, 60], dtype=torch.int32),
                           **kwargs)
        stored[name] = pool
    assert torch.equal(stored["naive"].view(torch.int16), stored["f32"].to(torch.bfloat16).view(torch.int16))
    assert not torch.equal(stored["exact"], stored["naive"])


def test_a_sum_of_exactly_max_length_is_a_plan_the_planner_takes():
    """``MAX_LENGTH`` tokens in all is allowed: a 1-row plan is refused for its row count, not for the sum."""
    from flash_compress.plan_rows import MAX_LENGTH

    lengths = torch.tensor([MAX_LENGTH], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"argument 'compress_plan': expected \[sum\(extend_lens\), 16\] = \[4294967294"):
        ref.plan_online_prefill(lengths, lengths, *_plans(1), False)
