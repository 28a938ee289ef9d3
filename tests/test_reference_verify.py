"""CPU tests of speculative decoding in the reference (docs/SPEC.md section 9): ``run_verify`` and ``run_commit``.

Random schedules mixing decode, prefill and verify + commit steps run through
``tests/schedule.py``'s harness (the float64 oracle, NaN-poisoned outputs and
prefix states, bitwise-untouched slots, the reference or a float32 stand-in as
shadow). Besides: values the host cannot check (skipped, nothing written),
argument errors, T = 1 / a = 1 against a decode step, how bfloat16 prefix
states are rounded, the torch API and custom ops on CPU tensors, the
guard-zone runner of ``tests/device_runner.py``, and that the harness fails
implementations that are wrong in the ways a kernel could be.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flash_compress as fc
import oracle
from device_runner import DeviceRunner
from device_values import INT32_MAX, INT32_MIN, bad_slots
from flash_compress import reference as ref
from flash_compress.plan_rows import CHUNK_SIZE
from float32_model import Float32Model
from schedule import ScheduleHarness, bits, plan_with, run_schedule

BF16, F32 = torch.bfloat16, torch.float32
DTYPES = pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
I32 = functools.partial(torch.tensor, dtype=torch.int32)
D = 64


def _wrap(impl=ref, **overrides):
    """``impl``'s functions as an object, some replaced (a deliberately broken implementation)."""
    names = ("run_decode", "run_prefill", "run_prefill_compact", "plan_online_prefill", "run_verify", "run_commit")
    fields = {name: getattr(impl, name) for name in names}
    fields.update(overrides)
    return SimpleNamespace(**fields)


def _near_chunk_end(h: ScheduleHarness, n: int, offsets=(120, 124, 127)) -> list:
    """``n`` new requests of ``h``, prefilled to lengths ``128 + offsets[i]`` (a chunk closes inside a window)."""
    batch = [h.start_request() for _ in range(n)]
    h.prefill_step([(r, CHUNK_SIZE + offsets[i % len(offsets)], None) for i, r in enumerate(batch)])
    return batch


# ---------------------------------------------------------------------------
# The harness with verify steps, on the reference.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@DTYPES
def test_random_schedule_with_verify_steps(dtype, seed):
    stats = run_schedule(ref, head_dim=D, steps=60, seed=40 + seed, state_dtype=dtype, shadow=ref, verify_prob=0.5,
                         num_slots=14, max_requests=6)
    assert stats.verify_calls == stats.commit_calls > 15 and stats.decode_calls and stats.prefill_calls
    assert len(stats.verify_windows) >= 8 and stats.prefix_states_checked > 200
    assert stats.verify_closes > 0 and stats.verify_closes_rejected > 0 and stats.verify_crossings > 0
    assert stats.commits_closed > 0 and stats.accept_one > 0 and stats.accept_all > 0
    assert stats.relocations > 0  # some verified requests moved slots in an earlier prefill
    assert stats.shadow_checks == stats.decode_calls + stats.prefill_calls + 2 * stats.verify_calls
    assert stats.shadow_flips == 0  # the reference against itself: bitwise
    assert stats.live_states_checked > 0


@DTYPES
def test_verify_steps_mixed_with_compact_prefills_and_bad_values(dtype):
    stats = run_schedule(ref, head_dim=128, steps=40, seed=47, state_dtype=dtype, compact=None, shadow=ref,
                         verify_prob=0.5, verify_bad_prob=0.5, max_requests=5, num_slots=12)
    assert stats.verify_skipped > 0 and stats.commit_skipped > 0 and stats.commits > 0
    assert stats.compact_calls > 0 and stats.rows_checked > 0


@DTYPES
def test_float32_stand_in_verify_matches_the_reference_shadow(dtype):
    """A float32-arithmetic verify (the kernel's situation) passes the tight shadow checks."""
    h = ScheduleHarness(Float32Model(), head_dim=D, seed=48, state_dtype=dtype, shadow=ref, verify_prob=0.6,
                        verify_bad_prob=0.2)
    stats = h.run(40)
    assert stats.verify_calls > 15 and stats.shadow_state_elements > 50_000
    assert stats.shadow_flips <= 1e-3 * stats.shadow_state_elements


@DTYPES
def test_every_window_size_with_first_last_and_middle_accept_lengths(dtype):
    h = ScheduleHarness(ref, head_dim=D, seed=49, state_dtype=dtype, shadow=ref, num_slots=8, max_requests=4)
    h.verify_every_window(_near_chunk_end(h, 3))
    stats = h.stats
    assert stats.verify_windows == {t: 1 for t in range(1, 17)}
    assert stats.verify_closes_rejected > 0 and stats.verify_crossings > 0 and stats.commits_closed > 0
    h.check_live_states()


@DTYPES
def test_a_request_verified_from_length_zero_and_across_a_chunk_start(dtype):
    """A fresh request's first window starts a chunk (the NaN slot is never read); T = 16 from 127 crosses."""
    h = ScheduleHarness(ref, head_dim=D, seed=50, state_dtype=dtype, shadow=ref, num_slots=4, max_requests=2)
    fresh, old = h.start_request(), h.start_request()
    h.prefill_step([(old, CHUNK_SIZE - 1, None)])
    h.verify_step([fresh, old], 16, accept=[16, 16])  # old: closes at j = 0, then 15 tokens of a new chunk
    assert (fresh.length, old.length) == (16, CHUNK_SIZE + 15)
    h.verify_step([old, fresh], 16, accept=[1, 5])
    for _ in range(3):
        h.decode_step([fresh, old])
    h.check_live_states()
    assert h.stats.verify_closes == 1 and h.stats.verify_crossings == 1


@DTYPES
def test_rejected_drafts_are_forgotten(dtype):
    """After a commit of a < T, the next window overwrites positions a.. with new tokens; only those count."""
    h = ScheduleHarness(ref, head_dim=D, seed=51, state_dtype=dtype, num_slots=4, max_requests=2)
    (r,) = _near_chunk_end(h, 1, offsets=(125,))
    h.verify_step([r], 8, accept=[2])  # tokens at 125..132 verified (closes at 127), 125 and 126 kept
    assert r.length == CHUNK_SIZE + 127
    h.verify_step([r], 8, accept=[8])  # 127 again, now with a new token: the chunk's row is a different one
    assert r.length == 2 * CHUNK_SIZE + 7 and h.stats.verify_closes == 2 and h.stats.verify_closes_rejected == 1
    for _ in range(CHUNK_SIZE - 7):
        h.decode_step([r])
    assert h.stats.decode_closes == 1


# ---------------------------------------------------------------------------
# Values the host cannot check: skipped, nothing written.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["accept", "slot", "seq_len"])
@DTYPES
def test_bad_values_are_skipped_next_to_good_requests(dtype, kind):
    h = ScheduleHarness(ref, head_dim=D, seed=52, state_dtype=dtype, shadow=ref, num_slots=8, max_requests=4)
    batch = _near_chunk_end(h, 4)
    for step in range(8):
        kinds = ["good", kind, "good", kind] if step % 2 else [kind, kind, "good", kind]
        h.verify_bad_values_step(batch, 1 + 5 * step % 16, kinds)
    stats = h.stats
    assert stats.commits == 4 * 1 + 4 * 2  # 1 good request on even steps, 2 on odd ones
    if kind == "accept":
        assert stats.commit_skipped == 20 and stats.verify_skipped == 0
    else:
        assert stats.verify_skipped == 20 and stats.commit_skipped == 0
    h.check_live_states()


def _verify_args(dtype=F32, batch=3, window=4, seed=0, num_slots=5):
    gen = torch.Generator().manual_seed(seed)
    rows = batch * window
    buffer = (torch.randn(num_slots, 1, 3 * D, generator=gen).abs() + 0.5).to(dtype)  # plausible states
    return dict(
        buffer=buffer,
        inp=torch.randn(rows, 2 * D, generator=gen),
        out=torch.full((rows, D), float("nan")),
        ape=torch.randn(CHUNK_SIZE, D, generator=gen),
        indices=I32(list(range(batch))),
        seq_lens=I32([CHUNK_SIZE + 2 + b for b in range(batch)]),  # window closes a chunk: 124 + 4 > 127
        prefix=torch.full((rows, 3 * D), float("nan"), dtype=dtype),
        accept=I32([window] * batch),
    )


def _run_both(a):
    ref.run_verify(a["buffer"], a["inp"], a["out"], a["ape"], a["indices"], a["seq_lens"], a["prefix"])
    ref.run_commit(a["buffer"], a["prefix"], a["indices"], a["accept"])


@pytest.mark.parametrize("field,values", [
    ("indices", bad_slots(5)),
    ("seq_lens", [3, 0, -1, -CHUNK_SIZE, INT32_MIN]),
    ("accept", [0, -1, 5, 17, INT32_MAX, INT32_MIN]),
])
@DTYPES
def test_each_bad_value_writes_nothing_for_its_request(dtype, field, values):
    for value in values:
        a = _verify_args(dtype)
        a[field][1] = value
        if field == "seq_lens":
            a["accept"][1] = 0  # commit cannot see seq_lens: an engine does not commit a request verify skipped
        before = a["buffer"].clone()
        _run_both(a)
        rows = slice(4, 8)
        if field == "accept":  # verified as usual, not committed
            assert not bool(torch.isnan(a["prefix"][rows].float()).any())
            assert torch.equal(bits(a["buffer"][1]), bits(before[1]))
        else:
            assert torch.isnan(a["prefix"][rows].float()).all() and torch.isnan(a["out"][rows]).all()
            assert torch.equal(bits(a["buffer"][1]), bits(before[1]))
        for b in (0, 2):  # the others as usual
            assert torch.equal(bits(a["buffer"][b, 0]), bits(a["prefix"][4 * b + 3]))
        assert torch.equal(bits(a["buffer"][3:]), bits(before[3:]))


@DTYPES
def test_an_empty_batch_is_a_no_op(dtype):
    a = _verify_args(dtype)
    before = a["buffer"].clone()
    empty = I32([])
    ref.run_verify(a["buffer"], a["inp"][:0], a["out"][:0], a["ape"], empty, empty, a["prefix"][:0])
    ref.run_commit(a["buffer"], a["prefix"][:0], empty, empty)
    assert torch.equal(bits(a["buffer"]), bits(before))


# ---------------------------------------------------------------------------
# Argument errors: raised before anything is written.
# ---------------------------------------------------------------------------


def _replace(a, **changes):
    return {**a, **changes}


VERIFY_ERRORS = {
    "T does not divide": (lambda a: _replace(a, inp=a["inp"][:11], out=a["out"][:11], prefix=a["prefix"][:11]),
                          ValueError, r"'kv_score_input'.*not a multiple of 3"),
    "T > 16": (lambda a: _replace(a, inp=torch.randn(51, 2 * D), out=torch.full((51, D), float("nan")),
                                  prefix=torch.full((51, 3 * D), float("nan"), dtype=a["prefix"].dtype)),
               ValueError, r"'kv_score_input'.*T = 17"),
    "rows for no request": (lambda a: _replace(a, indices=I32([]), seq_lens=I32([])),
                            ValueError, r"'kv_score_input'.*0 rows for an empty batch"),
    "prefix_states dtype": (lambda a: _replace(a, prefix=a["prefix"].to(F32 if a["prefix"].dtype == BF16 else BF16)),
                            TypeError, r"'prefix_states'.*dtype .* like kv_score_buffer"),
    "prefix_states rows": (lambda a: _replace(a, prefix=a["prefix"][:8]), ValueError, r"'prefix_states'.*\[B\*T, 3D\]"),
    "prefix_states width": (lambda a: _replace(a, prefix=a["prefix"][:, :D]), ValueError, r"'prefix_states'.*192"),
    "output rows": (lambda a: _replace(a, out=a["out"][:8]), ValueError, r"'kv_compressed_output'"),
    "input width": (lambda a: _replace(a, inp=a["inp"][:, :D]), ValueError, r"'kv_score_input'"),
    "seq_lens shape": (lambda a: _replace(a, seq_lens=I32([5, 6])), ValueError, r"'seq_lens'.*\[3\]"),
    "seq_lens dtype": (lambda a: _replace(a, seq_lens=a["seq_lens"].long()), TypeError, r"'seq_lens'.*int32"),
    "indices dtype": (lambda a: _replace(a, indices=a["indices"].long()), TypeError, r"'indices'.*int32"),
    "indices 2-D": (lambda a: _replace(a, indices=a["indices"][None]), ValueError, r"'indices'"),
    "prefix_states device": (lambda a: _replace(a, prefix=a["prefix"].to("meta")), ValueError,
                             r"'prefix_states'.*device"),
    "seq_lens device": (lambda a: _replace(a, seq_lens=a["seq_lens"].to("meta")), ValueError, r"'seq_lens'.*device"),
    "buffer dtype": (lambda a: _replace(a, buffer=a["buffer"].half()), TypeError, r"'kv_score_buffer'.*dtype"),
    "ape shape": (lambda a: _replace(a, ape=a["ape"][:64]), ValueError, r"'ape'"),
    "ape dtype": (lambda a: _replace(a, ape=a["ape"].half()), TypeError, r"'ape'.*float32"),
    "input dtype": (lambda a: _replace(a, inp=a["inp"].double()), TypeError, r"'kv_score_input'.*float32"),
    "output dtype": (lambda a: _replace(a, out=a["out"].bfloat16()), TypeError, r"'kv_compressed_output'.*float32"),
}


@pytest.mark.parametrize("case", list(VERIFY_ERRORS))
@DTYPES
def test_verify_argument_errors(dtype, case):
    spoil, error, message = VERIFY_ERRORS[case]
    a = spoil(_verify_args(dtype))
    written = {k: a[k] for k in ("buffer", "out", "prefix") if a[k].device.type == "cpu"}
    kept = {k: v.clone() for k, v in written.items()}
    with pytest.raises(error, match=message):
        ref.run_verify(a["buffer"], a["inp"], a["out"], a["ape"], a["indices"], a["seq_lens"], a["prefix"])
    for k, v in written.items():
        assert torch.equal(bits(v), bits(kept[k])), k


COMMIT_ERRORS = {
    "T does not divide": (lambda a: _replace(a, prefix=a["prefix"][:11]), ValueError,
                          r"'prefix_states'.*not a multiple of 3"),
    "T > 16": (lambda a: _replace(a, prefix=torch.full((51, 3 * D), 1.0, dtype=a["prefix"].dtype)), ValueError,
               r"'prefix_states'.*T = 17"),
    "prefix_states dtype": (lambda a: _replace(a, prefix=a["prefix"].to(F32 if a["prefix"].dtype == BF16 else BF16)),
                            TypeError, r"'prefix_states'.*like kv_score_buffer"),
    "prefix_states width": (lambda a: _replace(a, prefix=a["prefix"][:, :D]), ValueError, r"'prefix_states'"),
    "accept_lens dtype": (lambda a: _replace(a, accept=a["accept"].long()), TypeError, r"'accept_lens'.*int32"),
    "accept_lens shape": (lambda a: _replace(a, accept=a["accept"][:2]), ValueError, r"'accept_lens'.*\[3\]"),
    "accept_lens device": (lambda a: _replace(a, accept=a["accept"].to("meta")), ValueError, r"'accept_lens'.*device"),
    "indices dtype": (lambda a: _replace(a, indices=a["indices"].long()), TypeError, r"'indices'.*int32"),
    "buffer width": (lambda a: _replace(a, buffer=a["buffer"][..., :100]), ValueError, r"'kv_score_buffer'.*3D"),
    "buffer dtype": (lambda a: _replace(a, buffer=a["buffer"].double()), TypeError, r"'kv_score_buffer'.*dtype"),
    "not a tensor": (lambda a: _replace(a, prefix=[1.0]), TypeError, r"'prefix_states'.*torch.Tensor"),
}


@pytest.mark.parametrize("case", list(COMMIT_ERRORS))
@DTYPES
def test_commit_argument_errors(dtype, case):
    spoil, error, message = COMMIT_ERRORS[case]
    a = _verify_args(dtype)
    a["prefix"] = torch.randn(a["prefix"].shape).to(dtype)
    a = spoil(a)
    before = a["buffer"].clone()
    with pytest.raises(error, match=message):
        ref.run_commit(a["buffer"], a["prefix"], a["indices"], a["accept"])
    assert torch.equal(bits(a["buffer"]), bits(before))


@pytest.mark.parametrize("function", [ref.run_verify, ref.run_commit])
def test_exactly_16_tokens_per_request_is_accepted(function):
    a = _verify_args(window=16)
    if function is ref.run_verify:
        function(a["buffer"], a["inp"], a["out"], a["ape"], a["indices"], a["seq_lens"], a["prefix"])
        assert not bool(torch.isnan(a["prefix"]).any())
    else:
        function(a["buffer"], torch.ones_like(a["prefix"]), a["indices"], a["accept"])
        assert bool((a["buffer"][:3] == 1).all())


def test_verify_checks_exact_bf16_stores():
    a = _verify_args(BF16)
    with pytest.raises(TypeError, match="argument 'exact_bf16_stores': expected a bool"):
        ref.run_verify(a["buffer"], a["inp"], a["out"], a["ape"], a["indices"], a["seq_lens"], a["prefix"],
                       exact_bf16_stores=1)
    assert torch.isnan(a["prefix"].float()).all()


# ---------------------------------------------------------------------------
# T = 1, a = 1 is a decode step; how prefix states are rounded.
# ---------------------------------------------------------------------------


@DTYPES
def test_window_of_one_with_one_accepted_is_a_decode_step(dtype):
    """Rows and states bitwise equal to decode's, but after a chunk-closing token, where decode leaves the slot
    alone and commit stores the closed chunk's state (harmless: the next token starts afresh)."""
    gen = torch.Generator().manual_seed(9)
    ape = torch.randn(CHUNK_SIZE, D, generator=gen)
    lengths = [1, 100, 255]
    slots = I32([2, 0, 1])
    by_decode = torch.full((3, 1, 3 * D), float("nan"), dtype=dtype)
    prompt = torch.randn(sum(lengths), 2 * D, generator=gen)
    counts, cp, wp = plan_with(ref, lengths, lengths, False)
    ref.run_prefill(by_decode, prompt, torch.empty(sum(lengths), D), ape, slots, cp[: counts[0]], wp[: counts[1]])
    by_verify = by_decode.clone()
    history = list(prompt.split(lengths))
    closed_commits = 0
    for step in range(300):
        lens = [n + step + 1 for n in lengths]
        inp = torch.randn(3, 2 * D, generator=gen) * torch.tensor([1.0] * D + [2.0] * D)
        decode_out = torch.full((3, D), float("nan"))
        verify_out = decode_out.clone()
        prefix = torch.full((3, 3 * D), float("nan"), dtype=dtype)
        before = by_decode.clone()
        ref.run_decode(by_decode, inp, decode_out, ape, slots, I32(lens))
        ref.run_verify(by_verify, inp, verify_out, ape, slots, I32(lens), prefix)
        ref.run_commit(by_verify, prefix, slots, I32([1, 1, 1]))
        assert torch.equal(verify_out.nan_to_num(7.0), decode_out.nan_to_num(7.0))
        for b, slot in enumerate(slots.tolist()):
            history[b] = torch.cat([history[b], inp[b : b + 1]])
            if lens[b] % CHUNK_SIZE:
                assert torch.equal(bits(by_verify[slot]), bits(by_decode[slot])), (step, b)
            else:
                closed_commits += 1
                assert torch.equal(bits(by_decode[slot]), bits(before[slot]))  # decode: slot left alone
                want = oracle.last_chunk_state(history[b][:, :D], history[b][:, D:], ape)
                oracle.assert_state_close(by_verify[slot, 0], want)  # commit: the closed chunk's state
                assert torch.equal(decode_out[b], verify_out[b]) and not bool(torch.isnan(decode_out[b]).any())
    assert closed_commits >= 3


def test_bf16_prefix_states_build_on_the_unrounded_running_state():
    """Each prefix state is the float64 running state rounded once; decoding the same tokens rounds each time."""
    a = _verify_args(BF16, batch=1, window=16, seed=10)
    a["seq_lens"] = I32([40])  # positions 24..39: reads the prior state in slot 0
    ref.run_verify(a["buffer"], a["inp"], a["out"], a["ape"], a["indices"], a["seq_lens"], a["prefix"])
    prior = a["buffer"][0, 0].double()
    m, total, kv = prior[:D], prior[D : 2 * D], prior[2 * D :]
    x = a["inp"].double()
    for j in range(16):
        s = x[j, D:] + a["ape"][24 + j].double()
        top = torch.maximum(m, s)
        old, new = total * torch.exp(m - top), torch.exp(s - top)
        m, total, kv = top, old + new, (kv * old + x[j, :D] * new) / (old + new)
        assert torch.equal(bits(a["prefix"][j]), bits(ref.state_to_store(m, total, kv, BF16)))
    decoded = a["buffer"].clone()
    for j in range(16):
        ref.run_decode(decoded, a["inp"][j : j + 1], torch.empty(1, D), a["ape"], I32([0]), I32([25 + j]))
    assert not torch.equal(bits(decoded[0, 0]), bits(a["prefix"][15]))  # 16 roundings, not one
    naive = torch.full_like(a["prefix"], float("nan"))
    ref.run_verify(a["buffer"], a["inp"], a["out"], a["ape"], a["indices"], a["seq_lens"], naive,
                   exact_bf16_stores=False)
    assert torch.equal(bits(naive[15]), bits(ref.state_to_store(m, total, kv, BF16, exact_bf16_stores=False)))


def test_commit_copies_the_accepted_row_bit_for_bit_and_verify_never_writes_the_pool():
    a = _verify_args(BF16, batch=3, window=5)
    a["buffer"][3:] = float("nan")
    before = a["buffer"].clone()
    ref.run_verify(a["buffer"], a["inp"], a["out"], a["ape"], a["indices"], a["seq_lens"], a["prefix"])
    assert torch.equal(bits(a["buffer"]), bits(before))
    ref.run_commit(a["buffer"], a["prefix"], I32([4, 0, 3]), I32([2, 5, 1]))
    for slot, row in ((4, 1), (0, 9), (3, 10)):
        assert torch.equal(bits(a["buffer"][slot, 0]), bits(a["prefix"][row]))
    assert torch.equal(bits(a["buffer"][1:3]), bits(before[1:3]))


# ---------------------------------------------------------------------------
# The torch API and the custom ops on CPU tensors.
# ---------------------------------------------------------------------------


@DTYPES
def test_api_verify_and_commit_on_cpu_tensors(dtype):
    a = _verify_args(dtype, window=6)
    want = {k: v.clone() for k, v in a.items()}
    _run_both(want)
    got_buffer = a["buffer"].clone()
    out, prefix = fc.verify(got_buffer, a["inp"], a["ape"], a["indices"], a["seq_lens"])
    assert out.shape == (18, D) and out.dtype == F32 and prefix.shape == (18, 3 * D) and prefix.dtype == dtype
    assert torch.equal(bits(prefix), bits(want["prefix"]))
    closing = ~torch.isnan(want["out"]).all(dim=1)
    assert int(closing.sum()) == 3 and torch.equal(out[closing], want["out"][closing])
    assert fc.commit(got_buffer, prefix, a["indices"], a["accept"]) is got_buffer
    assert torch.equal(bits(got_buffer), bits(want["buffer"]))
    # Given out and prefix_states, they are the ones filled and returned.
    out2, prefix2 = a["out"].clone(), a["prefix"].clone()
    got = fc.verify(a["buffer"], a["inp"], a["ape"], a["indices"], a["seq_lens"], out=out2, prefix_states=prefix2)
    assert got[0] is out2 and got[1] is prefix2 and torch.equal(out2.nan_to_num(3.0), want["out"].nan_to_num(3.0))


def test_api_errors_name_the_argument():
    a = _verify_args(BF16)
    with pytest.raises(TypeError, match="'prefix_states'"):
        fc.verify(a["buffer"], a["inp"], a["ape"], a["indices"], a["seq_lens"], prefix_states=a["prefix"].float())
    with pytest.raises(ValueError, match="'prefix_states'.*T = 17"):
        fc.commit(a["buffer"], torch.zeros(51, 3 * D, dtype=BF16), a["indices"], a["accept"])


@DTYPES
def test_custom_ops_opcheck_and_compile(dtype):
    a = _verify_args(dtype)
    verify_args = (a["buffer"], a["inp"], a["out"], a["ape"], a["indices"], a["seq_lens"], a["prefix"])
    torch.library.opcheck(torch.ops.flash_compress.verify.default, verify_args)
    ref.run_verify(*verify_args)
    torch.library.opcheck(torch.ops.flash_compress.commit.default, (a["buffer"].clone(), a["prefix"], a["indices"],
                                                                     a["accept"]))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(buffer, inp, out, prefix, accept):
        fc.verify(buffer, inp, a["ape"], a["indices"], a["seq_lens"], out=out, prefix_states=prefix)
        fc.commit(buffer, prefix, a["indices"], accept)
        return out

    fresh = _verify_args(dtype)
    eager = {k: v.clone() for k, v in fresh.items()}
    step(eager["buffer"], eager["inp"], eager["out"], eager["prefix"], eager["accept"])
    got = torch.compile(step, backend=backend, fullgraph=True)(fresh["buffer"], fresh["inp"], fresh["out"],
                                                               fresh["prefix"], fresh["accept"])
    targets = [str(n.target).removesuffix(".default") for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert "flash_compress.verify" in targets and "flash_compress.commit" in targets, targets
    assert got is fresh["out"] and torch.equal(got.nan_to_num(3.0), eager["out"].nan_to_num(3.0))
    assert torch.equal(bits(fresh["buffer"]), bits(eager["buffer"]))
    assert torch.equal(bits(fresh["prefix"]), bits(eager["prefix"]))


# ---------------------------------------------------------------------------
# The guard-zone runner (on the CPU here, with the reference as its module).
# ---------------------------------------------------------------------------


@DTYPES
def test_device_runner_drives_every_function_with_guard_zones(dtype):
    runner = DeviceRunner(ref, guard_elems=64, device="cpu")
    stats = run_schedule(runner, head_dim=D, steps=30, seed=53, state_dtype=dtype, compact=None, verify_prob=0.4,
                         verify_bad_prob=0.3, shadow=ref)
    assert stats.verify_calls and stats.compact_calls and stats.decode_calls
    assert runner.calls == stats.decode_calls + stats.prefill_calls + 2 * stats.verify_calls


def test_device_runner_catches_a_write_past_prefix_states():
    def verify_one_past(buffer, inp, out, ape, indices, seq_lens, prefix):
        ref.run_verify(buffer, inp, out, ape, indices, seq_lens, prefix)
        prefix.as_strided((prefix.numel() + 1,), (1,))[-1] = 0.0

    runner = DeviceRunner(_wrap(run_verify=verify_one_past), guard_elems=64, device="cpu")
    h = ScheduleHarness(runner, head_dim=D, seed=54, state_dtype=BF16)
    (r,) = [h.start_request()]
    with pytest.raises(AssertionError, match="guard elements around 'prefix_states'"):
        h.verify_step([r], 3)
    with pytest.raises(ValueError, match="16-byte alignment"):
        DeviceRunner(ref, guard_elems=4, device="cpu").run_commit(torch.zeros(2, 1, 3 * D, dtype=BF16),
                                                                  torch.zeros(2, 3 * D, dtype=BF16), I32([0]), I32([1]))


# ---------------------------------------------------------------------------
# The harness fails wrong implementations.
# ---------------------------------------------------------------------------


def _verify_then(after):
    def run_verify(buffer, inp, out, ape, indices, seq_lens, prefix):
        ref.run_verify(buffer, inp, out, ape, indices, seq_lens, prefix)
        after(buffer, inp, out, ape, indices, seq_lens, prefix)

    return run_verify


def _touch_first_slot(buffer, *rest):
    buffer[0] = buffer[0].neg()


def _drop_rows_of_early_closes(buffer, inp, out, ape, indices, seq_lens, prefix):
    window = inp.shape[0] // indices.shape[0]
    out.view(indices.shape[0], window, -1)[:, :-1] = float("nan")  # only the last token's row survives


def _commit_one_late(buffer, prefix, indices, accept):
    window = prefix.shape[0] // indices.shape[0]
    ref.run_commit(buffer, prefix, indices, (accept + 1).clamp(max=window))


def _verify_ignoring_seq_lens(buffer, inp, out, ape, indices, seq_lens, prefix):
    window = inp.shape[0] // indices.shape[0]
    ref.run_verify(buffer, inp, out, ape, indices, seq_lens.clamp(min=window), prefix)


def _verify_rounding_every_token(buffer, inp, out, ape, indices, seq_lens, prefix):
    """Rounds the running state after each token (as a chain of decodes would): not what the kernel does."""
    window = inp.shape[0] // indices.shape[0]
    scratch = buffer.clone()
    for j in range(window):
        rows = torch.arange(indices.shape[0]) * window + j
        step_out = torch.full((rows.shape[0], out.shape[1]), float("nan"))
        ref.run_decode(scratch, inp[rows], step_out, ape, indices, seq_lens - window + j + 1)
        out[rows] = step_out
        prefix[rows] = scratch[indices.long(), 0]


WRONG = {
    "verify writes the pool": (dict(run_verify=_verify_then(_touch_first_slot)), {}, "bitwise untouched"),
    "rows of early closes missing": (dict(run_verify=_verify_then(_drop_rows_of_early_closes)), {},
                                     "output rows|rows .* written by one"),
    "commit one token late": (dict(run_commit=_commit_one_late), {}, "is not prefix state"),
    "verify ignores seq_len < T": (dict(run_verify=_verify_ignoring_seq_lens), dict(verify_bad_prob=1.0),
                                   "prefix states of skipped request"),
    "bf16 rounding after each token": (dict(run_verify=_verify_rounding_every_token), dict(shadow=ref),
                                       "prefix state"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_harness_catches_a_wrong_verify_or_commit(case):
    overrides, options, message = WRONG[case]
    options = {"seed": 55, "state_dtype": BF16, "verify_prob": 0.7, **options}
    h = ScheduleHarness(_wrap(**overrides), head_dim=D, **options)
    with pytest.raises(AssertionError, match=message):
        h.run(60)


# ---------------------------------------------------------------------------
# docs/USAGE.md section 10 and scripts/speculative_step.py, on the CPU.
# ---------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def test_usage_md_speculative_snippet_runs_on_cpu():
    text = (ROOT / "docs" / "USAGE.md").read_text()
    snippet = text[text.index("## 10. Speculative decoding"):].split("```python\n")[1].split("```")[0]
    namespace: dict = {}
    exec(compile(snippet.replace('"cuda"', '"cpu"'), "USAGE.md section 10", "exec"), namespace)
    state, prefix = namespace["state"], namespace["prefix_states"]
    assert torch.equal(state[3, 0], prefix[2]) and torch.equal(state[5, 0], prefix[4])
    assert namespace["seq_lens"].tolist() == [133, 45]
    assert not bool(torch.isnan(prefix).any())


@pytest.mark.parametrize("options", [[], ["--state-dtype", "bfloat16", "--window", "7"], ["--window", "1"]],
                         ids=["f32", "bf16_T7", "T1"])
def test_speculative_step_script_on_cpu(options, capsys):
    spec = importlib.util.spec_from_file_location("speculative_step", ROOT / "scripts" / "speculative_step.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--device", "cpu", "--head-dim", "64", "--rounds", "40", *options]) == 0
    assert capsys.readouterr().out.rstrip().endswith("OK")
