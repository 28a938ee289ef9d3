"""CPU tests of the torch API and the custom ops (CPU tensors run on flash_compress.reference).

Covered here: planning on the host (compiled planner where nvcc is, reference
otherwise), int32/int64 lengths, CUDA-graph padding, output allocation, the
schedule harness through the API and the ops, load_indices in decode, debug
mode, errors that name the argument, the fake kernels (FakeTensorMode,
``torch.library.opcheck``, ``torch.compile(fullgraph=True)``), the lazy
package exports, and the worked example of docs/USAGE.md.
"""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_compress as fc
from api_adapters import ApiImpl, OpsImpl
from flash_compress import _debug, _dispatch
from flash_compress import reference as ref
from flash_compress.c128_online import load_planner
from flash_compress.jit import JitDisabledError
from flash_compress.plan_rows import CHUNK_SIZE, ROW_BYTES, decode_rows, encode_rows
from schedule import ScheduleHarness, run_schedule

ROOT = Path(__file__).resolve().parents[1]
D = 64


@pytest.fixture
def compiled_planner(nvcc, monkeypatch):
    """The compiled planner variant, loaded as the API's planner (so it plans host plans too)."""
    module = load_planner()
    monkeypatch.setattr(_dispatch, "_planner", module)
    return module


@pytest.fixture
def no_variants(monkeypatch):
    """Nothing loaded, so the planner choice starts from nothing."""
    monkeypatch.setattr(_dispatch, "_modules", {})
    monkeypatch.setattr(_dispatch, "_planner", None)


def state_pool(slots: int = 6, d: int = D, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, 1, 3 * d, generator=gen), torch.randn(CHUNK_SIZE, d, generator=gen), gen)


# ---------------------------------------------------------------------------
# plan_prefill on the host.
# ---------------------------------------------------------------------------

PLAN_CASES = [([300, 57], [300, 57]), ([40, 200], [340, 257]), ([1], [128]), ([128, 1, 129], [256, 1, 1000])]


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("dtypes", [(torch.int64, torch.int64), (torch.int32, torch.int32), (torch.int32, torch.int64)])
@pytest.mark.parametrize("case", range(len(PLAN_CASES)))
def test_plan_prefill_on_host_matches_reference_planner(compiled_planner, case, dtypes, graph):
    extend, seq = PLAN_CASES[case]
    plan = fc.plan_prefill(torch.tensor(seq, dtype=dtypes[0]), torch.tensor(extend, dtype=dtypes[1]), device="cpu",
                           use_cuda_graph=graph)
    m = sum(extend)
    want_c = torch.zeros(m, ROW_BYTES, dtype=torch.uint8)
    want_w = torch.zeros(m, ROW_BYTES, dtype=torch.uint8)
    nc, nw = ref.plan_online_prefill(torch.tensor(extend), torch.tensor(seq), want_c, want_w, graph)
    assert isinstance(plan, fc.PrefillPlan) and plan.use_cuda_graph is graph and plan.counts is None
    assert (plan.num_compress, plan.num_write) == (nc, nw)
    assert plan.compress_plan.device.type == "cpu" and plan.compress_plan.dtype == torch.uint8
    assert torch.equal(plan.compress_plan, want_c[:nc]) and torch.equal(plan.write_plan, want_w[:nw])


def test_plan_prefill_without_a_loaded_variant_plans_cpu_plans_with_the_reference(no_variants, monkeypatch):
    def must_not_load(*args, **kwargs):
        raise AssertionError("planning for the CPU must not compile a variant")

    monkeypatch.setattr(_dispatch, "load_module", must_not_load)
    monkeypatch.setattr(_dispatch, "load_planner", must_not_load)
    plan = fc.plan_prefill(torch.tensor([130]), torch.tensor([130]), device="cpu")
    assert (plan.num_compress, plan.num_write) == (1, 1)
    assert decode_rows(plan.compress_plan).tolist() == [[127, 0, 127, 128]]


def test_planner_falls_back_to_the_reference_when_nothing_loads(no_variants, monkeypatch):
    def disabled(*args, **kwargs):
        raise JitDisabledError("c128_planner_pdl1", "no CUDA compiler", Path("/nowhere"), ("9.0",))

    monkeypatch.setattr(_dispatch, "load_planner", disabled)
    assert _dispatch.planner() is ref


def test_plan_prefill_empty_batch():
    plan = fc.plan_prefill(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), device="cpu")
    assert plan.compress_plan.shape == (0, 16) and plan.write_plan.shape == (0, 16)


@pytest.mark.parametrize(
    "seq, extend, kwargs, error, words",
    [
        ([5], [6], {}, ValueError, "extend_lens"),  # extend > seq
        ([5], [0], {}, ValueError, "extend_lens"),
        ([5, 6], [5], {}, ValueError, "seq_lens"),  # shapes differ
        ([5], [5], {"num_tokens": 4}, ValueError, "num_tokens"),
        # Lengths no plan can be sized for are refused before the plans are allocated.
        ([5, 5], [-1, 3], {}, ValueError, r"'extend_lens': expected 0 < extend_lens\[0\]"),
        ([2**31, 2**31], [2**31, 2**31], {}, ValueError, r"'extend_lens': expected a sum <= 4294967294"),
        ([2**33], [2**33], {}, ValueError, r"'seq_lens': expected seq_lens\[0\] <= 4294967294"),
        ([2**62, 2**62], [2**62, 2**62], {}, ValueError, r"'seq_lens': expected seq_lens\[0\] <= 4294967294"),
    ],
)
def test_plan_prefill_rejects_bad_lengths_naming_the_argument(seq, extend, kwargs, error, words):
    with pytest.raises(error, match=words):
        fc.plan_prefill(torch.tensor(seq), torch.tensor(extend), device="cpu", **kwargs)


def test_plan_prefill_rejects_bad_tensors_naming_the_argument():
    with pytest.raises(TypeError, match=r"'seq_lens'.*int64 \(or int32\).*float32"):
        fc.plan_prefill(torch.tensor([5.0]), torch.tensor([5]), device="cpu")
    with pytest.raises(TypeError, match="'extend_lens'.*torch.Tensor.*list"):
        fc.plan_prefill(torch.tensor([5]), [5], device="cpu")
    with pytest.raises(ValueError, match="'extend_lens'.*1-D"):
        fc.plan_prefill(torch.tensor([5]), torch.tensor([[5]]), device="cpu")
    with pytest.raises(TypeError, match="argument 'use_cuda_graph': expected a bool, got str"):
        fc.plan_prefill(torch.tensor([5]), torch.tensor([5]), device="cpu", use_cuda_graph="no")
    with pytest.raises(TypeError, match="argument 'device': expected a torch.device or a device string, got NoneType"):
        fc.plan_prefill(torch.tensor([5]), torch.tensor([5]), device=None)


def test_prefill_takes_compact_only_as_a_bool():
    """A string is not taken for its truth value: compact="no" would return the compact rows."""
    buf, ape, gen = state_pool(slots=2)
    plan = fc.plan_prefill(torch.tensor([130]), torch.tensor([130]), device="cpu")
    with pytest.raises(TypeError, match="argument 'compact': expected a bool, got str"):
        fc.prefill(buf, torch.randn(130, 2 * D, generator=gen), ape, torch.tensor([0], dtype=torch.int32), plan,
                   compact="no")


def test_prefill_plan_is_frozen():
    plan = fc.plan_prefill(torch.tensor([5]), torch.tensor([5]), device="cpu")
    with pytest.raises(AttributeError):
        plan.num_write = 3  # type: ignore[misc]


# ---------------------------------------------------------------------------
# decode / prefill on CPU tensors (the reference behind the API).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", [ApiImpl(), OpsImpl()], ids=["api", "ops"])
def test_schedule_through_the_api_and_the_ops(impl):
    stats = run_schedule(impl, head_dim=D, steps=25, seed=3, num_slots=8, max_requests=4, max_step_tokens=400)
    assert stats.rows_checked > 0 and stats.states_checked > 0 and stats.relocations > 0


def test_decode_allocates_out_of_the_right_shape_and_returns_the_given_one():
    buf, ape, gen = state_pool()
    inp = torch.randn(3, 2 * D, generator=gen)
    idx = torch.tensor([0, 2, 4], dtype=torch.int32)
    seq = torch.tensor([128, 5, 256], dtype=torch.int32)
    out = fc.decode(buf.clone(), inp, ape, idx, seq)
    assert out.shape == (3, D) and out.dtype == torch.float32 and out.device == inp.device
    given = torch.full((3, D), float("nan"))
    assert fc.decode(buf.clone(), inp, ape, idx, seq, out=given) is given
    assert torch.equal(given[[0, 2]], out[[0, 2]]) and torch.isnan(given[1]).all()


def test_prefill_allocates_out_and_matches_the_reference():
    buf, ape, gen = state_pool()
    plan = fc.plan_prefill(torch.tensor([300, 60]), torch.tensor([200, 60]), device="cpu")
    inp = torch.randn(260, 2 * D, generator=gen)
    idx = torch.tensor([1, 3], dtype=torch.int32)
    got_buf, want_buf = buf.clone(), buf.clone()
    out = fc.prefill(got_buf, inp, ape, idx, plan)
    want = torch.full((260, D), float("nan"))
    ref.run_prefill(want_buf, inp, want, ape, idx, plan.compress_plan, plan.write_plan, None)
    rows = decode_rows(plan.compress_plan)[:, 0].tolist()
    assert out.shape == (260, D) and len(rows) == 2
    assert torch.equal(out[rows], want[rows]) and torch.equal(got_buf, want_buf)


def test_errors_about_the_output_name_the_out_argument_each_function_takes():
    """The exports call the output ``kv_compressed_output``; the torch API's callers pass it as ``out``."""
    buf, ape, gen = state_pool(slots=4)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    before = buf.clone()
    plan = fc.plan_prefill(torch.tensor([300]), torch.tensor([300]), device="cpu")  # two compress rows
    inp = torch.randn(300, 2 * D, generator=gen)
    with pytest.raises(ValueError, match=r"^argument 'out': expected shape .*\[2, \d+\], got \[3, "):
        fc.prefill(buf, inp, ape, i32(0), plan, compact=True, out=torch.full((3, D), float("nan")))
    with pytest.raises(ValueError, match=r"^argument 'out': expected shape .*\[300, \d+\], got \[300, "):
        fc.prefill(buf, inp, ape, i32(0), plan, out=torch.full((300, D + 64), float("nan")))
    with pytest.raises(TypeError, match=r"^argument 'out': expected dtype float32"):
        fc.verify(buf, torch.randn(4, 2 * D, generator=gen), ape, i32(0, 1), i32(9, 9),
                  out=torch.zeros(4, D, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"^argument 'out': expected dtype float32"):
        fc.decode(buf, torch.randn(2, 2 * D, generator=gen), ape, i32(0, 1), i32(9, 9),
                  out=torch.zeros(2, D, dtype=torch.float64))
    tokens = torch.randn(2, 2 * D, generator=gen)
    with pytest.raises(ValueError, match=r"^argument 'out': expected memory apart from 'kv_score_input' "
                                         r"\(the call writes 'out'\)"):
        fc.decode(buf, tokens, ape, i32(0, 1), i32(9, 9), out=tokens[:, :D])  # the output inside the input
    assert torch.equal(buf, before)


def test_decode_with_load_indices_reads_the_old_slot_and_writes_the_new():
    """Against a one-token prefill with the same load_indices (the reference's own relocation path)."""
    buf, ape, gen = state_pool(slots=6)
    inp = torch.randn(3, 2 * D, generator=gen)
    seq = [77, 128, 1]  # mid-chunk, closing, first token
    idx = torch.tensor([4, 5, 0], dtype=torch.int32)
    load = torch.tensor([1, 2, 3], dtype=torch.int32)
    got_buf, want_buf = buf.clone(), buf.clone()
    got = fc.decode(got_buf, inp, ape, idx, torch.tensor(seq, dtype=torch.int32), load_indices=load,
                    out=torch.full((3, D), float("nan")))
    plan = fc.plan_prefill(torch.tensor(seq), torch.tensor([1, 1, 1]), device="cpu")
    want = fc.prefill(want_buf, inp, ape, idx, plan, load_indices=load, out=torch.full((3, D), float("nan")))
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    for slot in (4, 0):  # the written slots
        torch.testing.assert_close(got_buf[slot], want_buf[slot], rtol=1e-6, atol=1e-6)
    for slot in (1, 2, 3):  # sources: untouched
        assert torch.equal(got_buf[slot], buf[slot])


def test_decode_moves_skip_bad_slots_as_a_prefill_does():
    """A move with a load slot outside the pool skips the request when it needs a prior state (as a
    one-token prefill with the same load_indices does); a swap is safe; nothing outside the pool is
    touched and no error is raised (the values are the device's: debug mode raises for them)."""
    buf, ape, gen = state_pool(slots=8)
    inp = torch.randn(6, 2 * D, generator=gen)
    # swap 1<->2 mid-chunk; bad load, needs a prior; bad load, fresh chunk; bad target; closing move
    seq = [77, 300, 50, 129, 60, 256]
    load = torch.tensor([1, 2, -1, 9, 5, 6], dtype=torch.int32)
    idx = torch.tensor([2, 1, 3, 4, 8, 7], dtype=torch.int32)
    got_buf, want_buf = buf.clone(), buf.clone()
    got = fc.decode(got_buf, inp, ape, idx, torch.tensor(seq, dtype=torch.int32), load_indices=load,
                    out=torch.full((6, D), float("nan")))
    plan = fc.plan_prefill(torch.tensor(seq), torch.ones(6, dtype=torch.int64), device="cpu")
    want = fc.prefill(want_buf, inp, ape, idx, plan, load_indices=load, out=torch.full((6, D), float("nan")))
    assert torch.isnan(got[:5]).all() and torch.isnan(want[:5]).all()
    torch.testing.assert_close(got[5], want[5], rtol=1e-6, atol=1e-6)
    for slot in (1, 2, 4):  # the swap's two targets and the fresh chunk's
        assert not torch.equal(got_buf[slot], buf[slot])
        torch.testing.assert_close(got_buf[slot], want_buf[slot], rtol=1e-6, atol=1e-6)
    for slot in (0, 3, 5, 6):  # skipped targets and untouched sources
        assert torch.equal(got_buf[slot], buf[slot]) and torch.equal(want_buf[slot], buf[slot])
    assert torch.equal(got_buf[7], buf[6])  # the closing request's state moved; decode leaves it there

    # No request moves: one of the call's slots is copied onto itself, bit for bit. A seq_len below 1 (the
    # kernel skips the request) moves nothing either.
    for load, seq in (([-5, 2**31 - 1], [5, 6]), ([2, 3], [0, -7])):
        got_buf = buf.clone()
        fc.decode(got_buf, inp[:2], ape, torch.tensor([0, 1], dtype=torch.int32), torch.tensor(seq, dtype=torch.int32),
                  load_indices=torch.tensor(load, dtype=torch.int32), out=torch.full((2, D), float("nan")))
        assert torch.equal(got_buf.view(torch.int32), buf.view(torch.int32)), (load, seq)


def test_a_decode_move_writes_no_slot_outside_the_call():
    """Another stream may be writing any slot the call does not name: the move's scatter, which has a row per
    request whatever moves, writes only slots of the call (slot 0 only where the call names no slot in the
    pool)."""
    from torch.overrides import TorchFunctionMode

    class ScatterTargets(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.targets = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.index_copy_:
                self.targets += args[2].tolist()
            return func(*args, **(kwargs or {}))

    buf, ape, gen = state_pool(slots=8)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    for indices, load, seq, allowed in (([3, 4], [3, 4], [5, 6], {3, 4}),      # nothing moves: reads in place
                                        ([5, 6], [1, 2], [1, 129], {5, 6}),    # first tokens: nothing to move
                                        ([-1, 9], [1, 2], [5, 6], {0}),        # no slot of the call in the pool
                                        ([5, 6], [1, 2], [5, 129], {5})):      # one moves
        inp = torch.randn(2, 2 * D, generator=gen)
        with ScatterTargets() as mode:
            fc.decode(buf, inp, ape, i32(*indices), i32(*seq), load_indices=i32(*load),
                      out=torch.full((2, D), float("nan")))
        assert mode.targets and set(mode.targets) <= allowed, (indices, mode.targets)


def test_decode_move_arguments_are_checked_before_the_pool_is_touched():
    buf, ape, gen = state_pool(slots=4)
    inp = torch.randn(2, 2 * D, generator=gen)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    before = buf.clone()
    with pytest.raises(TypeError, match="'load_indices'.*int32"):
        fc.decode(buf, inp, ape, i32(0, 1), i32(3, 3), load_indices=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="'load_indices'.*shape"):
        fc.decode(buf, inp, ape, i32(0, 1), i32(3, 3), load_indices=i32(1))
    with pytest.raises(TypeError, match="'seq_lens'.*int32"):
        fc.decode(buf, inp, ape, i32(0, 1), torch.tensor([3, 3]), load_indices=i32(1, 2))
    with pytest.raises(TypeError, match="'load_indices'.*torch.Tensor"):
        fc.decode(buf, inp, ape, i32(0, 1), i32(3, 3), load_indices=[1, 2])
    # The rest of the call is checked too (by the export, with no request) before anything moves.
    with pytest.raises(TypeError, match="'out'.*float32"):
        fc.decode(buf, inp, ape, i32(0, 1), i32(3, 3), load_indices=i32(2, 3), out=torch.zeros(2, D).double())
    with pytest.raises(ValueError, match=rf"'kv_score_input': expected shape \[2, {2 * D}\].*got \[2, {D}\]"):
        fc.decode(buf, inp[:, :D], ape, i32(0, 1), i32(3, 3), load_indices=i32(2, 3))
    with pytest.raises(ValueError, match=rf"'out': expected shape \[2, {D}\].*got \[2, {D + 16}\]"):
        fc.decode(buf, inp, ape, i32(0, 1), i32(3, 3), load_indices=i32(2, 3), out=torch.zeros(2, D + 16))
    with pytest.raises(ValueError, match="'out'.*2 rows like indices"):
        fc.decode(buf, inp, ape, i32(0, 1), i32(3, 3), load_indices=i32(2, 3), out=torch.zeros(3, D))
    # The move writes the pool before the kernel's own check of what it writes could see it.
    in_pool = buf.view(-1)[: 2 * D].view(2, D)
    with pytest.raises(ValueError, match="argument 'out': expected memory apart from 'kv_score_buffer'"):
        fc.decode(buf, inp, ape, i32(0, 1), i32(3, 3), load_indices=i32(2, 3), out=in_pool)
    with pytest.raises(TypeError, match="argument 'out': expected a torch.Tensor, got list"):
        fc.decode(buf, inp, ape, i32(0, 1), i32(3, 3), load_indices=i32(2, 3), out=[[0.0] * D] * 2)
    assert torch.equal(buf, before)


# ---------------------------------------------------------------------------
# Debug mode.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("value, on", [("1", True), ("yes", True), ("0", False), ("", False), ("off", False),
                                       ("OFF", False), ("False", False), (None, False)])
def test_debug_flag_is_read_at_call_time(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("FLASH_COMPRESS_DEBUG", raising=False)
    else:
        monkeypatch.setenv("FLASH_COMPRESS_DEBUG", value)
    assert _debug.enabled() is on


def test_debug_checks_run_only_in_debug_mode(monkeypatch):
    calls = []
    monkeypatch.setattr(_debug, "check_decode", lambda *args: calls.append(args))
    buf, ape, gen = state_pool()
    args = (buf, torch.randn(1, 2 * D, generator=gen), ape, torch.tensor([0], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32))
    monkeypatch.delenv("FLASH_COMPRESS_DEBUG", raising=False)
    fc.decode(*args)
    assert not calls
    monkeypatch.setenv("FLASH_COMPRESS_DEBUG", "1")
    fc.decode(*args)
    assert len(calls) == 1


@pytest.fixture
def debug_mode(monkeypatch):
    monkeypatch.setenv("FLASH_COMPRESS_DEBUG", "1")


def test_debug_decode_rejects_values_naming_the_argument(debug_mode):
    buf, ape, gen = state_pool(slots=4)
    inp = torch.randn(2, 2 * D, generator=gen)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match=r"'indices'.*\[0, 4\).*indices\[1\] = 4"):
        fc.decode(buf, inp, ape, i32(0, 4), i32(3, 3))
    with pytest.raises(ValueError, match=r"'load_indices'.*load_indices\[0\] = -1"):
        fc.decode(buf, inp, ape, i32(0, 1), i32(3, 3), load_indices=i32(-1, 1))
    fc.decode(buf, inp, ape, i32(0, 1), i32(1, 129), load_indices=i32(-1, 7))  # first tokens read no state
    with pytest.raises(ValueError, match=r"'seq_lens'.*>= 1.*seq_lens\[1\] = 0"):
        fc.decode(buf, inp, ape, i32(0, 1), i32(3, 0))


def test_debug_verify_and_commit_reject_values_the_kernels_would_skip(debug_mode):
    buf, ape, gen = state_pool(slots=4)
    inp = torch.randn(6, 2 * D, generator=gen)  # B = 2, T = 3
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    before = buf.clone()
    with pytest.raises(ValueError, match=r"'indices'.*\[0, 4\).*indices\[1\] = -1"):
        fc.verify(buf, inp, ape, i32(0, -1), i32(9, 9))
    with pytest.raises(ValueError, match=r"'seq_lens'.*>= T = 3.*seq_lens\[0\] = 2"):
        fc.verify(buf, inp, ape, i32(0, 1), i32(2, 9))
    _, prefix = fc.verify(buf, inp, ape, i32(0, 1), i32(3, 9))  # seq_len == T: the window starts at 0
    with pytest.raises(ValueError, match=r"'accept_lens'.*\[0, T = 3\].*accept_lens\[1\] = 4"):
        fc.commit(buf, prefix, i32(0, 1), i32(3, 4))
    with pytest.raises(ValueError, match=r"'accept_lens'.*accept_lens\[0\] = -1"):
        fc.commit(buf, prefix, i32(0, 1), i32(-1, 0))
    with pytest.raises(ValueError, match=r"'indices'.*indices\[0\] = 4"):
        fc.commit(buf, prefix, i32(4, 1), i32(1, 1))
    assert torch.equal(buf, before)
    fc.commit(buf, prefix, i32(0, 1), i32(0, 3))  # 0 keeps nothing: no error
    assert torch.equal(buf[0], before[0]) and torch.equal(buf[1, 0], prefix[5])


def _plan_of(rows_c, rows_w) -> fc.PrefillPlan:
    return fc.PrefillPlan(encode_rows(rows_c), encode_rows(rows_w), len(rows_c), len(rows_w), False)


@pytest.mark.parametrize(
    "rows_c, rows_w, words",
    [
        ([(200, 0, 127, 128)], [], "compress_plan.*outside kv_score_input's 130 rows"),
        ([(127, 1, 127, 128)], [], "compress_plan.*batch_id outside the batch of 1"),
        ([(127, 0, 126, 127)], [], "compress_plan.*must close a chunk"),
        ([(127, 0, 127, 0)], [], "compress_plan.*window_len not in"),
        ([], [(129, 0, 255, 128)], "write_plan.*must not close a chunk"),
        ([], [(129, 0, 130, 5)], "write_plan.*past the chunk start"),
    ],
)
def test_debug_prefill_rejects_bad_plan_rows(debug_mode, rows_c, rows_w, words):
    buf, ape, gen = state_pool()
    inp = torch.randn(130, 2 * D, generator=gen)
    before = buf.clone()
    with pytest.raises(ValueError, match=words):
        fc.prefill(buf, inp, ape, torch.tensor([0], dtype=torch.int32), _plan_of(rows_c, rows_w))
    assert torch.equal(buf, before)


def test_debug_mode_names_the_first_bad_row(debug_mode):
    buf, ape, gen = state_pool()
    inp = torch.randn(130, 2 * D, generator=gen)
    with pytest.raises(ValueError, match=r"got \(200, 0, 127, 128\)"):
        fc.prefill(buf, inp, ape, torch.tensor([0], dtype=torch.int32),
                   _plan_of([(200, 0, 127, 128), (201, 0, 127, 128)], []))


def test_debug_prefill_skips_padding_rows_and_checks_slots(debug_mode):
    """Slots the rows use are checked: ``indices`` where a write row stores, and the slot a row that continues
    a chunk reads. A load slot no row reads (a new request's, by an engine's convention -1) is not."""
    buf, ape, gen = state_pool(slots=3)
    inp = torch.randn(130, 2 * D, generator=gen)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    plan = fc.plan_prefill(torch.tensor([130]), torch.tensor([130]), device="cpu", use_cuda_graph=True)
    fc.prefill(buf, inp, ape, i32(2), plan)  # padding rows are fine
    with pytest.raises(ValueError, match=r"'indices'.*indices\[0\] = 3"):
        fc.prefill(buf, inp, ape, i32(3), plan)
    fc.prefill(buf, inp, ape, i32(2), plan, load_indices=i32(-1))  # from 0: no row reads a prior state
    continuing = fc.plan_prefill(torch.tensor([140]), torch.tensor([130]), device="cpu")  # from token 10
    with pytest.raises(ValueError, match=r"'load_indices'.*load_indices\[0\] = -1"):
        fc.prefill(buf, inp, ape, i32(2), continuing, load_indices=i32(-1))
    closing = fc.plan_prefill(torch.tensor([256]), torch.tensor([130]), device="cpu")  # no write row
    fc.prefill(buf, inp, ape, i32(-1), closing, load_indices=i32(0))
    with pytest.raises(ValueError, match=r"'indices'.*indices\[0\] = -1"):
        fc.prefill(buf, inp, ape, i32(-1), closing)  # the slot its first row reads


def test_debug_prefill_checks_the_gpu_planner_error_flag(debug_mode):
    buf, ape, gen = state_pool()
    inp = torch.randn(4, 2 * D, generator=gen)
    pad = torch.full((4, ROW_BYTES), 0xFF, dtype=torch.uint8)
    flagged = fc.PrefillPlan(pad, pad.clone(), 4, 4, True, counts=torch.tensor([4, 4, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"'plan'.*error flag 1 \(some extend_lens\[b\] < 1\)"):
        fc.prefill(buf, inp, ape, torch.tensor([0], dtype=torch.int32), flagged)
    clean = fc.PrefillPlan(pad, pad.clone(), 4, 4, True, counts=torch.tensor([4, 4, 0], dtype=torch.int32))
    fc.prefill(buf, inp, ape, torch.tensor([0], dtype=torch.int32), clean)
    short = fc.PrefillPlan(pad, pad.clone(), 4, 4, True, counts=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"argument 'plan': expected counts of shape \[3\].*got \[2\]"):
        fc.prefill(buf, inp, ape, torch.tensor([0], dtype=torch.int32), short)


def test_a_pool_that_requires_grad_is_refused_in_eager_ops_and_compiled_calls():
    """The calls update the pool in place and have no gradient: eager torch raised about a leaf view, a
    compiled call updated the leaf silently."""
    buf, ape, gen = state_pool(slots=4)
    buf.requires_grad_(True)
    inp = torch.randn(2, 2 * D, generator=gen)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    calls = {
        "decode": lambda: fc.decode(buf, inp, ape, i32(0, 1), i32(3, 3)),
        "op": lambda: torch.ops.flash_compress.decode(buf, inp, torch.empty(2, D), ape, i32(0, 1), i32(3, 3),
                                                      None, None),
        "compiled": torch.compile(lambda: fc.decode(buf, inp, ape, i32(0, 1), i32(3, 3)), backend="eager",
                                  fullgraph=True),
        "verify": lambda: fc.verify(buf, inp, ape, i32(0, 1), i32(3, 3)),
    }
    before = buf.detach().clone()
    for name, call in calls.items():
        with pytest.raises(ValueError, match="argument 'kv_score_buffer': expected a tensor that does not require"):
            call()
        assert torch.equal(buf.detach(), before), name


def test_inputs_that_require_grad_leave_the_pool_without_a_gradient():
    """An ``nn.Parameter`` ape or an input that requires grad: the reference's in-place writes, like the
    kernels', track no gradient, so the pool stays a plain tensor and the next call runs."""
    buf, ape, gen = state_pool(slots=4)
    ape = torch.nn.Parameter(ape)
    x = torch.randn(2, 2 * D, generator=gen, requires_grad=True)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    for _ in range(2):
        fc.decode(buf, x, ape, i32(0, 1), i32(3, 3))
        out, prefix = fc.verify(buf, x, ape, i32(0, 1), i32(3, 3))
        fc.commit(buf, prefix, i32(0, 1), i32(1, 1))
        plan = fc.plan_prefill(torch.tensor([3, 3]), torch.tensor([1, 1]), device="cpu")
        fc.prefill(buf, x, ape, i32(2, 3), plan)
        assert not buf.requires_grad and buf.grad_fn is None
        assert not out.requires_grad and not prefix.requires_grad


def test_plans_on_another_device_than_the_pool_are_refused_on_the_cpu_too():
    buf, ape, gen = state_pool(slots=4)
    x = torch.randn(3, 2 * D, generator=gen)
    plan = fc.plan_prefill(torch.tensor([3]), torch.tensor([3]), device="meta")
    with pytest.raises(ValueError, match=r"argument 'compress_plan': expected device cpu like kv_score_buffer, "
                                         r"got meta"):
        fc.prefill(buf, x, ape, torch.tensor([0], dtype=torch.int32), plan)


def test_debug_mode_checks_the_planner_flag_through_the_ops_as_in_eager(debug_mode):
    """Under torch.compile (and for a pool of a tensor subclass) the call goes through the op, which gets
    the plan's counts too."""
    buf, ape, gen = state_pool()
    inp = torch.randn(4, 2 * D, generator=gen)
    pad = torch.full((4, ROW_BYTES), 0xFF, dtype=torch.uint8)
    flagged = fc.PrefillPlan(pad, pad.clone(), 4, 4, True, counts=torch.tensor([0, 0, 2], dtype=torch.int32))
    slots = torch.tensor([0], dtype=torch.int32)
    compiled = torch.compile(lambda: fc.prefill(buf, inp, ape, slots, flagged), backend="eager", fullgraph=True)
    for call in (compiled, lambda: fc.prefill(torch.nn.Buffer(buf), inp, ape, slots, flagged)):
        with pytest.raises(ValueError, match=r"argument 'plan'.*error flag 2"):
            call()


def test_use_pdl_takes_a_bool_or_none_and_names_anything_else():
    from flash_compress.c128_online import resolve_use_pdl

    assert resolve_use_pdl(None, ("9.0",)) is True and resolve_use_pdl(0, ("9.0",)) is False
    for bad in ("false", "no", 2):
        with pytest.raises(TypeError, match=r"use_pdl: expected True, False or None"):
            resolve_use_pdl(bad, ("9.0",))


def test_debug_mode_names_the_slot_races_the_kernels_cannot_see(debug_mode):
    buf, ape, gen = state_pool(slots=4)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match=r"argument 'indices': expected a distinct slot.*indices\[0\] = indices\[2\] = 1"):
        fc.decode(buf, torch.randn(3, 2 * D, generator=gen), ape, i32(1, 2, 1), i32(3, 3, 3))
    prefix = torch.randn(6, 3 * D, generator=gen)
    with pytest.raises(ValueError, match=r"indices\[0\] = indices\[1\] = 3"):
        fc.commit(buf, prefix, i32(3, 3), i32(1, 2))
    fc.commit(buf, prefix, i32(3, 3), i32(0, 2))  # the request that keeps nothing writes nothing
    # Two requests whose write rows start mid-chunk (they continue 10 and 20 tokens) and swap slots.
    plan = fc.plan_prefill(torch.tensor([15, 25]), torch.tensor([5, 5]), device="cpu")
    inp = torch.randn(10, 2 * D, generator=gen)
    with pytest.raises(ValueError, match=r"argument 'load_indices'.*load_indices\[0\] = indices\[1\] = 2"):
        fc.prefill(buf, inp, ape, i32(1, 2), plan, load_indices=i32(2, 1))
    with pytest.raises(ValueError, match=r"'indices'.*two write rows storing to one slot"):
        fc.prefill(buf, inp, ape, i32(1, 1), plan)
    fc.prefill(buf, inp, ape, i32(1, 3), plan, load_indices=i32(2, 0))  # a move to free slots is fine
    with pytest.raises(TypeError, match="argument 'load_indices': expected a torch.Tensor, got list"):
        fc.prefill(buf, inp, ape, i32(1, 2), plan, load_indices=[2, 1])  # named by the checks, not a crash
    # Write rows that start a chunk read nothing: two of them may swap slots.
    fresh = fc.plan_prefill(torch.tensor([128 + 5, 256 + 5]), torch.tensor([5, 5]), device="cpu")
    fc.prefill(buf, inp, ape, i32(1, 2), fresh, load_indices=i32(2, 1))


def test_debug_mode_leaves_wrong_shapes_to_the_checks_that_name_them(debug_mode):
    """Debug mode reads values; a tensor of the wrong rank is the shape checks' to name, not a crash in the
    value check or a complaint about another argument."""
    buf, ape, gen = state_pool(slots=4)
    inp = torch.randn(2, 2 * D, generator=gen)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match="argument 'indices'"):
        fc.decode(buf, inp, ape, i32(0, 9).reshape(1, 2), i32(3, 3))
    with pytest.raises(ValueError, match="argument 'seq_lens'"):
        fc.decode(buf, inp, ape, i32(0, 1), i32(3, 0).reshape(1, 2))
    with pytest.raises(ValueError, match="argument 'kv_score_buffer'"):
        fc.decode(buf[0, 0, 0], inp, ape, i32(0, 1), i32(3, 3))
    plan = fc.plan_prefill(torch.tensor([2]), torch.tensor([2]), device="cpu")
    with pytest.raises(ValueError, match="argument 'indices'"):
        fc.prefill(buf, inp, ape, i32(0).reshape(1, 1), plan)


# ---------------------------------------------------------------------------
# Errors name the argument.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_verify_then_commit_take_a_head_dim_no_variant_builds(dtype):
    """On the CPU both halves of a speculative step run the reference, so commit takes whatever head dim
    verify took (32 here, under the compiled variants' 64): each slot gets its accepted prefix's state."""
    d = 32
    gen = torch.Generator().manual_seed(5)
    buf = torch.randn(4, 1, 3 * d, generator=gen).to(dtype)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    inp = torch.randn(6, 2 * d, generator=gen)
    _, prefix = fc.verify(buf, inp, ape, i32(1, 3), i32(200, 7))
    before = buf.clone()
    fc.commit(buf, prefix, i32(1, 3), i32(2, 3))  # request 0 keeps 2 of its 3 tokens, request 1 all 3
    assert torch.equal(buf[1, 0], prefix[1]) and torch.equal(buf[3, 0], prefix[5])
    assert torch.equal(buf[[0, 2]], before[[0, 2]])
    with pytest.raises(ValueError, match=r"argument 'kv_score_buffer': expected shape \[slots, 1, 3\*D\], got"):
        fc.commit(torch.zeros(4, 1, 3 * d + 1, dtype=dtype), prefix, i32(1, 3), i32(2, 3))


def test_errors_name_the_argument():
    buf, ape, gen = state_pool()
    inp = torch.randn(1, 2 * D, generator=gen)
    i32 = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(TypeError, match="'ape'.*torch.Tensor.*list"):
        fc.decode(buf, inp, [[0.0]], i32, i32)
    with pytest.raises(TypeError, match="'kv_score_buffer'.*torch.Tensor.*NoneType"):
        fc.decode(None, inp, ape, i32, i32 + 1, out=torch.empty(1, D))
    with pytest.raises(TypeError, match="'plan'.*PrefillPlan.*tuple"):
        fc.prefill(buf, inp, ape, i32, (None, None))
    with pytest.raises(ValueError, match="'ape'.*multiple of 64.*D = 100"):
        _dispatch.kernels(100, None)


# ---------------------------------------------------------------------------
# Custom ops: schema, fake kernels, torch.compile.
# ---------------------------------------------------------------------------


def _decode_args(gen, batch=3):
    buf = torch.randn(6, 1, 3 * D, generator=gen)
    return (buf, torch.randn(batch, 2 * D, generator=gen), torch.full((batch, D), float("nan")),
            torch.randn(CHUNK_SIZE, D, generator=gen), torch.tensor([0, 2, 4], dtype=torch.int32)[:batch],
            torch.tensor([128, 5, 1], dtype=torch.int32)[:batch])


def _prefill_args(gen):
    plan = fc.plan_prefill(torch.tensor([300, 60]), torch.tensor([200, 60]), device="cpu")
    return (torch.randn(6, 1, 3 * D, generator=gen), torch.randn(260, 2 * D, generator=gen),
            torch.full((260, D), float("nan")), torch.randn(CHUNK_SIZE, D, generator=gen),
            torch.tensor([1, 3], dtype=torch.int32), plan.compress_plan, plan.write_plan,
            torch.tensor([5, 3], dtype=torch.int32))


def test_op_schemas_declare_the_mutated_arguments():
    for op in (torch.ops.flash_compress.decode.default, torch.ops.flash_compress.prefill.default):
        mutated = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert mutated == ["kv_score_buffer", "out"], (op, mutated)
        assert not op._schema.returns


def test_opcheck_decode_and_prefill():
    gen = torch.Generator().manual_seed(1)
    torch.library.opcheck(torch.ops.flash_compress.decode.default, _decode_args(gen))
    torch.library.opcheck(torch.ops.flash_compress.prefill.default, _prefill_args(gen))


def test_fake_kernels_run_under_fake_tensor_mode():
    gen = torch.Generator().manual_seed(2)
    decode_args, prefill_args = _decode_args(gen), _prefill_args(gen)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_decode = [mode.from_tensor(t) for t in decode_args]
        fake_prefill = [mode.from_tensor(t) for t in prefill_args]
        assert torch.ops.flash_compress.decode(*fake_decode) is None
        assert torch.ops.flash_compress.prefill(*fake_prefill) is None


def test_tensors_without_data_go_through_the_ops_fake_kernels():
    """Meta tensors, FakeTensorMode and make_fx's fake tracing: the public functions reach the ops (the
    reference, which reads values, cannot run them)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gen = torch.Generator().manual_seed(8)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    pool, ape = torch.randn(4, 1, 3 * D, generator=gen), torch.randn(CHUNK_SIZE, D, generator=gen)
    args = (pool, torch.randn(2, 2 * D, generator=gen), ape, i32(0, 1), i32(3, 3))

    def step(buf, x, ape, indices, seq_lens):
        out, prefix = fc.verify(buf, x, ape, indices, seq_lens)
        fc.commit(buf, prefix, indices, torch.ones_like(indices))  # on the pool's device, as every tensor
        return fc.decode(buf, x, ape, indices, seq_lens + 1), out

    traced = make_fx(step, tracing_mode="fake")(*args)
    ops = [str(n.target) for n in traced.graph.nodes if str(n.target).startswith("flash_compress.")]
    assert ops == ["flash_compress.verify.default", "flash_compress.commit.default", "flash_compress.decode.default"]
    with FakeTensorMode() as mode:
        rows, out = step(*(mode.from_tensor(a) for a in args))
        assert rows.shape == (2, D) and out.shape == (2, D)
    rows, out = step(*(a.to("meta") for a in args))
    assert rows.is_meta and rows.shape == (2, D)
    # A meta pool with real inputs (a model built on meta, its pool never materialised) is refused, not a no-op.
    with pytest.raises(ValueError, match=r"argument 'kv_score_input': expected device meta like kv_score_buffer"):
        fc.decode(pool.to("meta"), *args[1:])


def test_torch_compile_fullgraph_calls_the_ops_and_matches_eager():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(buf, prefill_input, decode_input, ape, indices, plan, seq_lens):
        rows = fc.prefill(buf, prefill_input, ape, indices, plan)
        return rows, fc.decode(buf, decode_input, ape, indices, seq_lens)

    gen = torch.Generator().manual_seed(4)
    buf, ape = torch.randn(6, 1, 3 * D, generator=gen), torch.randn(CHUNK_SIZE, D, generator=gen)
    plan = fc.plan_prefill(torch.tensor([300, 60]), torch.tensor([200, 60]), device="cpu")
    args = (torch.randn(260, 2 * D, generator=gen), torch.randn(2, 2 * D, generator=gen), ape,
            torch.tensor([1, 3], dtype=torch.int32), plan, torch.tensor([301, 61], dtype=torch.int32))
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    got_buf, want_buf = buf.clone(), buf.clone()
    got_rows, got_decode = compiled(got_buf, *args)
    want_rows, want_decode = step(want_buf, *args)
    targets = [str(node.target).removesuffix(".default") for node in graphs[0].graph.nodes
               if node.op == "call_function"]
    assert "flash_compress.prefill" in targets and "flash_compress.decode" in targets, targets
    assert len(graphs) == 1
    rows = decode_rows(plan.compress_plan)[:, 0].tolist()
    assert torch.equal(got_rows[rows], want_rows[rows]) and torch.equal(got_buf, want_buf)


# ---------------------------------------------------------------------------
# Package exports, the example.
# ---------------------------------------------------------------------------


def test_api_names_are_lazy_exports():
    for name in ("decode", "prefill", "plan_prefill", "PrefillPlan", "ops", "api"):
        assert name in fc.__all__, name
    assert fc.decode is fc.api.decode and fc.PrefillPlan is fc.api.PrefillPlan
    code = ("import sys; import flash_compress; "
            "assert 'flash_compress.api' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules); "
            "flash_compress.plan_prefill; assert 'flash_compress.api' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT / "python", timeout=120)


def test_usage_example_runs_on_cpu(capsys):
    namespace = runpy.run_path(str(ROOT / "scripts" / "usage_example.py"))
    assert namespace["main"](["--device", "cpu", "--head-dim", "128"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_prefill_step_checks_hold_on_a_harness_with_cuda_graph_plans():
    h = ScheduleHarness(ApiImpl(), head_dim=D, seed=11, num_slots=6, max_requests=2)
    a, b = h.start_request(), h.start_request()
    h.prefill_step([(a, 200, None), (b, 1, None)], use_cuda_graph=True)
    h.prefill_step([(a, 56, h.free_slots[0]), (b, 300, None)], use_cuda_graph=True, pass_load_indices=True)
    h.check_live_states()
    assert h.stats.cuda_graph_plans == 2


def test_demo_reports_whether_the_load_built_or_hit_the_cache(monkeypatch):
    from flash_compress import demo, jit

    for status, said in (("built", "built"), ("cached", "cache hit")):
        monkeypatch.setattr(jit, "ensure_built", lambda spec, arch_list, s=status: SimpleNamespace(status=s))
        monkeypatch.setattr(jit, "load", lambda spec, arch_list: f"module {spec.name}")
        module, _, how = demo._load_kernels(64)
        assert module.startswith("module c128_online_hd64_") and how == said


def test_cli_help_lists_every_command(capsys):
    from flash_compress.__main__ import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("demo", "prebuild", "status", "clear"):
        assert command in out, command


def _prebuild_grid(monkeypatch, argv):
    """What ``prebuild argv`` would build (nothing is built): its exit status and the specs of its grid."""
    from flash_compress.__main__ import main
    from flash_compress.jit import cli

    grids = []
    monkeypatch.setattr(cli, "prebuild", lambda grid, **kwargs: grids.append([spec for _, spec in grid]) or 0)
    status = main(["prebuild", *argv])
    return status, grids[0] if grids else None


def test_prebuild_builds_the_grid_asked_for_once_each(monkeypatch, capsys):
    from flash_compress.c128_online import planner_spec, spec

    assert _prebuild_grid(monkeypatch, ["--head-dim", "128", "128", "--pdl", "1", "1", "--state-dtype", "float32",
                                        "--arch", "9.0"]) == (0, [planner_spec(True), spec(128, True)])
    # No PDL before sm_90: the default grid leaves it out, and asking for it is refused before any build.
    assert _prebuild_grid(monkeypatch, ["--head-dim", "128", "--state-dtype", "float32", "--arch", "8.0"]) == (
        0, [planner_spec(False), spec(128, False)])
    for argv, said in ((["--head-dim", "128", "--pdl", "1", "--arch", "8.0"], "PDL needs sm_90"),
                       (["--head-dim", "0", "--arch", "9.0"], "head_dim: expected a multiple of 64")):
        assert _prebuild_grid(monkeypatch, argv) == (2, None)
        assert said in capsys.readouterr().err


@pytest.mark.parametrize("variant", ["planner", "kernels"])
def test_a_cannot_build_error_prints_the_prebuild_command_of_that_variant(monkeypatch, variant):
    """The command a JitDisabledError prints builds that variant (and its planner), not the default grid."""
    from flash_compress.c128_online import planner_spec, spec
    from flash_compress.jit import JitDisabledError

    wanted = planner_spec(False) if variant == "planner" else spec(192, True, "bfloat16")
    message = str(JitDisabledError(wanted.name, "no nvcc", Path("/cache"), ("9.0",), wanted.prebuild_options))
    command = message.split("`")[1].split()
    assert command[:4] == ["python", "-m", "flash_compress", "prebuild"] and command[-2:] == ["--cache-dir", "/cache"]
    status, grid = _prebuild_grid(monkeypatch, command[4:-2])
    assert status == 0 and grid == ([wanted] if variant == "planner" else [planner_spec(True), wanted])


def test_usage_md_worked_example_runs_on_cpu():
    text = (ROOT / "docs" / "USAGE.md").read_text()
    snippet = text[text.index("## 9."):].split("```python\n")[1].split("```")[0]
    namespace: dict = {}
    exec(compile(snippet.replace('"cuda"', '"cpu"'), "USAGE.md section 9", "exec"), namespace)
    assert namespace["rows"].shape == (2, 512) and namespace["written"].tolist() == [127, 255]
