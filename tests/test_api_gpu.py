"""The torch API and the custom ops on a CUDA GPU (skipped with a reason where none is visible).

Random schedules through ``flash_compress.decode`` / ``prefill`` and through
``torch.ops.flash_compress.*`` against the float64 oracle (outputs poisoned
with NaN, untouched slots checked bitwise, by ``tests/schedule.py``); host
plans copied to the GPU; ``torch.compile(fullgraph=True)``; CUDA-graph capture
and replay with changing inputs and plans against eager; debug mode; and the
GPU planner of the raw module, where the build has it.
"""

from __future__ import annotations

import pytest
import torch

import flash_compress as fc
import oracle
from api_adapters import ApiImpl, OpsImpl
from cuda_graphs import capture
from device_values import plausible_states
from flash_compress import reference as ref
from flash_compress.plan_rows import CHUNK_SIZE, PADDING_ROW, ROW_BYTES, decode_rows
from schedule import check_state_against, run_schedule

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _rows_of(plan: fc.PrefillPlan) -> list[int]:
    """The rows of ``out`` a plan writes (its compress rows' ragged ids, padding dropped)."""
    return [int(r[0]) for r in decode_rows(plan.compress_plan) if r[0] != PADDING_ROW]


def _random_step(gen, seq, extend, d):
    return (torch.tensor(seq), torch.tensor(extend), torch.randn(sum(extend), 2 * d, generator=gen).to(DEV))


@pytest.mark.parametrize("use_pdl", [False, True], ids=["pdl0", "pdl1"])
@pytest.mark.parametrize("impl_class", [ApiImpl, OpsImpl], ids=["api", "ops"])
def test_schedule_through_the_api_and_the_ops(gpu, impl_class, use_pdl):
    stats = run_schedule(impl_class(use_pdl=use_pdl), head_dim=256, device=DEV, steps=60, seed=21 + int(use_pdl),
                         num_slots=16, max_requests=6)
    assert stats.rows_checked > 0 and stats.states_checked > 0 and stats.relocations > 0


@pytest.mark.parametrize("graph", [False, True])
def test_plan_prefill_from_cpu_int32_lengths_lands_on_the_gpu(gpu, graph):
    seq, extend = [300, 57, 129, 1000], [300, 57, 2, 513]
    plan = fc.plan_prefill(torch.tensor(seq, dtype=torch.int32), torch.tensor(extend, dtype=torch.int32),
                           device=DEV, use_cuda_graph=graph)
    m = sum(extend)
    want_c, want_w = torch.zeros(m, ROW_BYTES, dtype=torch.uint8), torch.zeros(m, ROW_BYTES, dtype=torch.uint8)
    nc, nw = ref.plan_online_prefill(torch.tensor(extend), torch.tensor(seq), want_c, want_w, graph)
    assert plan.compress_plan.is_cuda and plan.write_plan.is_cuda and plan.counts is None
    assert (plan.num_compress, plan.num_write) == (nc, nw)
    assert torch.equal(plan.compress_plan.cpu(), want_c[:nc]) and torch.equal(plan.write_plan.cpu(), want_w[:nw])


def test_api_prefill_and_decode_against_the_reference_with_poisoned_outputs(gpu):
    d = 512
    gen = torch.Generator().manual_seed(5)
    state = torch.randn(8, 1, 3 * d, generator=gen).to(DEV)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen).to(DEV)
    want_state = state.clone()
    idx = torch.tensor([6, 1, 3], dtype=torch.int32, device=DEV)
    load = torch.tensor([2, 1, 0], dtype=torch.int32, device=DEV)
    seq, extend, inp = _random_step(gen, [767, 128, 300], [600, 1, 200], d)
    plan = fc.plan_prefill(seq, extend, device=DEV)
    out = torch.full((inp.shape[0], d), float("nan"), device=DEV)
    assert fc.prefill(state, inp, ape, idx, plan, out=out, load_indices=load) is out
    want = torch.full_like(out, float("nan"))
    ref.run_prefill(want_state, inp, want, ape, idx, plan.compress_plan, plan.write_plan, load)
    rows = _rows_of(plan)
    written = torch.zeros(out.shape[0], dtype=torch.bool)
    written[rows] = True
    oracle.assert_rows_close(out[rows], want[rows], "prefill rows")
    assert torch.isnan(out[~written.to(DEV)]).all(), "rows no chunk closes must stay untouched"
    for slot in range(8):
        if slot in (6, 3):  # request 1 ends at a chunk boundary: no write row, slot 1 stays as it was
            check_state_against(state[slot, 0], want_state[slot, 0], f"slot {slot}")
        else:
            assert torch.equal(state[slot], want_state[slot]), f"slot {slot} must stay untouched"

    # Decode with a move: requests 0 and 2 go to free slots 4 and 5. Request 0's token (position 767)
    # closes a chunk, so its row is written and slot 4 keeps the moved state; request 1's starts one.
    before = state.clone()
    dec = torch.randn(3, 2 * d, generator=gen).to(DEV)
    seq_dec = torch.tensor([768, 129, 301], dtype=torch.int32, device=DEV)
    new_idx = torch.tensor([4, 1, 5], dtype=torch.int32, device=DEV)
    got = torch.full((3, d), float("nan"), device=DEV)
    assert fc.decode(state, dec, ape, new_idx, seq_dec, out=got, load_indices=idx) is got
    want_state = before.cpu()
    want_state[[4, 1, 5]] = want_state[[6, 1, 3]]
    want_out = torch.full((3, d), float("nan"))
    ref.run_decode(want_state, dec.cpu(), want_out, ape.cpu(), new_idx.cpu(), seq_dec.cpu())
    assert not want_out[0].isnan().any() and want_out[1:].isnan().all()
    oracle.assert_rows_close(got[:1].cpu(), want_out[:1], "decode row of the closing token")
    assert torch.isnan(got[1:]).all(), "decode rows no chunk closes must stay untouched"
    for slot in range(8):
        if slot in (4, 1, 5):
            check_state_against(state[slot, 0], want_state[slot, 0], f"decode slot {slot}")
        else:
            assert torch.equal(state[slot].cpu(), before[slot].cpu()), f"decode: slot {slot} must stay untouched"


def _compile_step(d):
    def step(state, prefill_input, decode_input, ape, indices, plan, seq_lens):
        rows = fc.prefill(state, prefill_input, ape, indices, plan)
        return rows, fc.decode(state, decode_input, ape, indices, seq_lens)

    gen = torch.Generator().manual_seed(8)
    state = torch.randn(6, 1, 3 * d, generator=gen).to(DEV)
    seq, extend, inp = _random_step(gen, [300, 60], [200, 60], d)
    plan = fc.plan_prefill(seq, extend, device=DEV)
    args = (inp, torch.randn(2, 2 * d, generator=gen).to(DEV), torch.randn(CHUNK_SIZE, d, generator=gen).to(DEV),
            torch.tensor([1, 3], dtype=torch.int32, device=DEV), plan,
            torch.tensor([301, 61], dtype=torch.int32, device=DEV))
    return step, state, args, plan


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_matches_eager(gpu, backend):
    step, state, args, plan = _compile_step(256)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    got_state, want_state = state.clone(), state.clone()
    got_rows, got_decode = compiled(got_state, *args)
    want_rows, want_decode = step(want_state, *args)
    torch.cuda.synchronize()
    rows = _rows_of(plan)
    assert rows and torch.equal(got_rows[rows], want_rows[rows])
    assert torch.equal(got_state, want_state)


@pytest.mark.parametrize("through_ops", [False, True], ids=["api", "ops"])
def test_cuda_graph_replay_with_new_inputs_and_plans_equals_eager(gpu, through_ops):
    """Capture prefill (CUDA-graph plans) + decode once; replay with new tokens, lengths and plans."""
    d, slots = 256, 8
    gen = torch.Generator().manual_seed(9)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen).to(DEV)
    indices = torch.tensor([2, 5], dtype=torch.int32, device=DEV)
    m = 400  # tokens per prefill step, the captured shape
    static_state = torch.randn(slots, 1, 3 * d, generator=gen).to(DEV)
    static_inp = torch.empty(m, 2 * d, device=DEV)
    static_dec = torch.empty(2, 2 * d, device=DEV)
    static_seq = torch.empty(2, dtype=torch.int32, device=DEV)
    static_c = torch.empty(m, ROW_BYTES, dtype=torch.uint8, device=DEV)
    static_w = torch.empty(m, ROW_BYTES, dtype=torch.uint8, device=DEV)
    static_out = torch.empty(m, d, device=DEV)
    static_dec_out = torch.empty(2, d, device=DEV)

    def run(state, inp, c, w, dec, seq, out, dec_out):
        if through_ops:
            torch.ops.flash_compress.prefill(state, inp, out, ape, indices, c, w, None, None)
            torch.ops.flash_compress.decode(state, dec, dec_out, ape, indices, seq, None, None)
        else:
            plan = fc.PrefillPlan(c, w, m, m, True)
            fc.prefill(state, inp, ape, indices, plan, out=out)
            fc.decode(state, dec, ape, indices, seq, out=dec_out)

    def load_step(prefix: list[int], extend: list[int]):
        seq = [p + e for p, e in zip(prefix, extend)]
        plan = fc.plan_prefill(torch.tensor(seq), torch.tensor(extend), device=DEV, use_cuda_graph=True)
        static_inp.copy_(torch.randn(m, 2 * d, generator=gen))
        static_dec.copy_(torch.randn(2, 2 * d, generator=gen))
        static_seq.copy_(torch.tensor([s + 1 for s in seq], dtype=torch.int32))
        static_c.copy_(plan.compress_plan)
        static_w.copy_(plan.write_plan)
        static_out.fill_(float("nan"))
        static_dec_out.fill_(float("nan"))

    # (prefix, extend) per step; each step's decode adds one token, so the next prefix is seq + 1.
    steps = [([0, 0], [250, 150]), ([251, 151], [10, 390]), ([262, 542], [395, 5]), ([658, 548], [200, 200])]
    load_step(*steps[0])
    captured_state = static_state.clone()
    graph, _ = capture(  # the warm-up runs on copies of what the replays write
        lambda: run(static_state, static_inp, static_c, static_w, static_dec, static_seq, static_out, static_dec_out),
        warm_up=lambda: run(static_state.clone(), static_inp, static_c, static_w, static_dec, static_seq,
                            static_out.clone(), static_dec_out.clone()))
    static_state.copy_(captured_state)  # capture does not run the kernels, but be sure

    eager_state = static_state.clone()
    for k, step in enumerate(steps):
        load_step(*step)
        eager_out = torch.full_like(static_out, float("nan"))
        eager_dec_out = torch.full_like(static_dec_out, float("nan"))
        run(eager_state, static_inp, static_c, static_w, static_dec, static_seq, eager_out, eager_dec_out)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_state, eager_state), f"step {k}: states differ from eager"
        assert torch.equal(static_out.isnan(), eager_out.isnan()), f"step {k}: written rows differ from eager"
        written = ~eager_out.isnan()
        assert torch.equal(static_out[written], eager_out[written]), f"step {k}: prefill rows differ from eager"
        assert torch.equal(static_dec_out.nan_to_num(7.0), eager_dec_out.nan_to_num(7.0)), f"step {k}: decode rows"


@pytest.mark.parametrize("through_ops", [False, True], ids=["api", "ops"])
def test_decode_moves_capture_in_a_cuda_graph_and_skip_as_on_the_cpu(gpu, through_ops):
    """A decode with load_indices makes no host sync (it captures), and its replays, slots outside the
    pool included, compute what the CPU path (the reference) computes."""
    d, slots = 128, 8
    gen = torch.Generator().manual_seed(12)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen)
    ape_dev = ape.to(DEV)
    # Positive sums: a merge with a negative one can cancel and magnify float32 rounding past ROW_RTOL.
    static_state = plausible_states(gen, slots, d).to(DEV)
    static_inp = torch.empty(4, 2 * d, device=DEV)
    static_out = torch.empty(4, d, device=DEV)
    static = {name: torch.empty(4, dtype=torch.int32, device=DEV) for name in ("indices", "load", "seq")}
    # (indices, load_indices, seq_lens): a swap, a fresh chunk from a bad slot, a closing move; a load slot
    # outside the pool that needs a prior state, a target outside it; nothing moving.
    steps = [([1, 2, 3, 4], [2, 1, 9, 6], [77, 300, 129, 256]),
             ([5, 6, 0, 8], [0, -1, 3, 1], [50, 60, 70, 1]),
             ([0, 1, 2, 3], [-7, 2**31 - 1, -1, 8], [5, 6, 7, 8])]

    def run(state, out):
        if through_ops:
            torch.ops.flash_compress.decode(state, static_inp, out, ape_dev, static["indices"], static["seq"],
                                            static["load"], None)
        else:
            fc.decode(state, static_inp, ape_dev, static["indices"], static["seq"], out=out,
                      load_indices=static["load"])

    def load_step(step):
        for name, values in zip(("indices", "load", "seq"), step):
            static[name].copy_(torch.tensor(values, dtype=torch.int32))
        static_inp.copy_(torch.randn(4, 2 * d, generator=gen))
        static_out.fill_(float("nan"))

    load_step(steps[0])
    graph, _ = capture(lambda: run(static_state, static_out),
                       warm_up=lambda: run(static_state.clone(), static_out.clone()))
    for k, step in enumerate(steps):
        load_step(step)
        before = static_state.cpu()
        want_state, want_out = before.clone(), static_out.cpu()
        fc.decode(want_state, static_inp.cpu(), ape, *(static[name].cpu() for name in ("indices", "seq")),
                  out=want_out, load_indices=static["load"].cpu())
        graph.replay()
        torch.cuda.synchronize()
        got_state, got_out = static_state.cpu(), static_out.cpu()
        assert torch.equal(got_out.isnan(), want_out.isnan()), f"step {k}: written rows differ from the CPU"
        written = ~want_out.isnan().all(dim=1)
        if written.any():
            oracle.assert_rows_close(got_out[written], want_out[written], f"step {k}: rows")
        for slot in range(slots):
            if torch.equal(want_state[slot], before[slot]):
                assert torch.equal(got_state[slot], before[slot]), f"step {k}: slot {slot} written"
            else:
                check_state_against(got_state[slot, 0], want_state[slot, 0], f"step {k}: slot {slot}")


def test_a_refused_decode_move_leaves_the_pool_alone(gpu):
    """The move writes the pool before the kernel, so the whole call is checked first; a view with no rows
    passes any layout check, so the layouts are checked on the full tensors."""
    d = 128
    gen = torch.Generator().manual_seed(14)
    buf = torch.randn(4, 1, 3 * d, generator=gen).to(DEV)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen).to(DEV)
    inp = torch.randn(2, 2 * d, generator=gen).to(DEV)
    before = buf.clone()
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=DEV)  # noqa: E731
    bad = {
        "'kv_score_input'.*contiguous": dict(kv_score_input=torch.zeros(2, 4 * d, device=DEV)[:, ::2]),
        "'out'.*aligned to 16 bytes": dict(out=torch.zeros(2 * d + 1, device=DEV)[1:].view(2, d)),
        "'out'.*float32": dict(out=torch.zeros(2, d, dtype=torch.float64, device=DEV)),
        "'kv_score_input'": dict(kv_score_input=inp[:, :d].contiguous()),
        "'ape'": dict(ape=ape[:64]),
    }
    # Index columns of one [B, 2] tensor: the move reads them in full.
    columns = torch.tensor([[0, 3], [1, 3]], dtype=torch.int32, device=DEV)
    bad["'seq_lens'.*contiguous"] = dict(seq_lens=columns[:, 1])
    bad["'indices'.*contiguous"] = dict(indices=columns[:, 0])
    for message, change in bad.items():
        args = {"kv_score_input": inp, "ape": ape, "out": None, "indices": i32(0, 1), "seq_lens": i32(3, 3), **change}
        with pytest.raises((TypeError, ValueError), match=message):
            fc.decode(buf, args["kv_score_input"], args["ape"], args["indices"], args["seq_lens"],
                      load_indices=i32(2, 3), out=args["out"])
        assert torch.equal(buf, before), message


def test_debug_mode_refuses_bad_slots_before_launching(gpu, monkeypatch):
    monkeypatch.setenv("FLASH_COMPRESS_DEBUG", "1")
    d = 128
    state = torch.zeros(4, 1, 3 * d, device=DEV)
    ape = torch.zeros(CHUNK_SIZE, d, device=DEV)
    inp = torch.zeros(1, 2 * d, device=DEV)
    with pytest.raises(ValueError, match="'indices'"):
        fc.decode(state, inp, ape, torch.tensor([4], dtype=torch.int32, device=DEV),
                  torch.tensor([3], dtype=torch.int32, device=DEV))
    plan = fc.plan_prefill(torch.tensor([3]), torch.tensor([1]), device=DEV)  # continues a chunk: reads its slot
    with pytest.raises(ValueError, match="'load_indices'"):
        fc.prefill(state, inp, ape, torch.tensor([0], dtype=torch.int32, device=DEV), plan,
                   load_indices=torch.tensor([-2], dtype=torch.int32, device=DEV))
    torch.cuda.synchronize()  # the context is still healthy: nothing bad was launched


def test_raw_errors_reach_the_api_naming_the_argument(gpu):
    d = 128
    state = torch.zeros(4, 1, 3 * d, device=DEV)
    ape = torch.zeros(CHUNK_SIZE, d, device=DEV)
    idx = torch.tensor([0], dtype=torch.int32, device=DEV)
    with pytest.raises(TypeError, match="seq_lens"):
        fc.decode(state, torch.zeros(1, 2 * d, device=DEV), ape, idx, torch.tensor([3], device=DEV))
    with pytest.raises(ValueError, match="kv_score_input"):
        fc.decode(state, torch.zeros(1, 2 * d + 1, device=DEV), ape, idx, idx + 1)
    with pytest.raises(ValueError, match="compress_plan"):
        cpu_plan = fc.plan_prefill(torch.tensor([128]), torch.tensor([128]), device="cpu")
        fc.prefill(state, torch.zeros(128, 2 * d, device=DEV), ape, idx, cpu_plan)


# ---------------------------------------------------------------------------
# The GPU planner (lengths on the device).
# ---------------------------------------------------------------------------


@pytest.fixture
def gpu_planner(gpu):
    """A GPU; the compiled planner (plan_online_prefill_counted) always has the GPU path."""


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_gpu_planner_matches_the_host_planner(gpu_planner, dtype):
    import random

    rng = random.Random(3)
    for _ in range(20):
        b = rng.randint(1, 64)
        extend = [rng.choice([1, rng.randint(1, 300), 128]) for _ in range(b)]
        seq = [e + rng.randint(0, 10**6) for e in extend]
        got = fc.plan_prefill(torch.tensor(seq, dtype=dtype, device=DEV), torch.tensor(extend, dtype=dtype, device=DEV),
                              device=DEV, num_tokens=sum(extend))
        want = fc.plan_prefill(torch.tensor(seq), torch.tensor(extend), device=DEV, use_cuda_graph=True)
        exact = fc.plan_prefill(torch.tensor(seq), torch.tensor(extend), device="cpu")
        assert got.use_cuda_graph and got.counts is not None
        assert torch.equal(got.compress_plan, want.compress_plan) and torch.equal(got.write_plan, want.write_plan)
        assert got.counts.tolist() == [exact.num_compress, exact.num_write, 0]


def test_gpu_planner_flags_bad_lengths_and_debug_mode_refuses_the_plan(gpu_planner, monkeypatch):
    plan = fc.plan_prefill(torch.tensor([5], device=DEV), torch.tensor([6], device=DEV), device=DEV, num_tokens=6)
    assert int(plan.counts[2]) != 0
    assert bool((plan.compress_plan == 0xFF).all()) and bool((plan.write_plan == 0xFF).all())
    monkeypatch.setenv("FLASH_COMPRESS_DEBUG", "1")
    d = 128
    with pytest.raises(ValueError, match="'plan'.*error flag"):
        fc.prefill(torch.zeros(2, 1, 3 * d, device=DEV), torch.zeros(6, 2 * d, device=DEV),
                   torch.zeros(CHUNK_SIZE, d, device=DEV), torch.tensor([0], dtype=torch.int32, device=DEV), plan)
