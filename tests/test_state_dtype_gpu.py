"""bfloat16 state pools and compact prefill output on a CUDA GPU (docs/SPEC.md sections 8 and 10).

Every schedule runs with the CPU reference as a shadow: each call is repeated on
the reference from the same pre-call pool, and the kernels' rows and stored
states must agree with it to float32 rounding (bf16 states bitwise, but for rare
rounding ties). The float64 oracle checks (looser for bf16, by the bound in
``tests/oracle.py``) run as well. Outputs are NaN-poisoned; untouched rows and
slots are checked bitwise.
"""

from __future__ import annotations

import pytest
import torch

import flash_compress as fc
from flash_compress import reference as ref
from flash_compress.c128_online import HEAD_DIMS_TESTED, STATE_DTYPES
from flash_compress.plan_rows import CHUNK_SIZE
from schedule import ScheduleHarness, check_state_against, run_schedule

pytestmark = pytest.mark.gpu

DEV = "cuda"
HEAD_DIMS = HEAD_DIMS_TESTED
PDL = (False, True)
DTYPES = {name: getattr(torch, name) for name in STATE_DTYPES}

_modules: dict[tuple[int, bool, str], object] = {}


def kernels(head_dim: int, use_pdl: bool, state_dtype: str):
    key = (head_dim, use_pdl, state_dtype)
    if key not in _modules:
        _modules[key] = fc.load_module(head_dim=head_dim, use_pdl=use_pdl, state_dtype=state_dtype)
    return _modules[key]


@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_bf16_mixed_schedule_matches_the_emulating_reference(gpu, head_dim, use_pdl):
    module = kernels(head_dim, use_pdl, "bfloat16")
    stats = run_schedule(module, head_dim=head_dim, device=DEV, steps=60, seed=300 + head_dim + int(use_pdl),
                         num_slots=16, max_requests=6, state_dtype=torch.bfloat16, compact=None, shadow=ref)
    assert stats.rows_checked > 0 and stats.states_checked > 0 and stats.shadow_checks == 60
    assert 0 < stats.compact_calls < stats.prefill_calls and stats.relocations > 0


@pytest.mark.parametrize("state_dtype", list(DTYPES))
def test_long_decode_only_schedule(gpu, state_dtype):
    """Up to 127 stored (rounded) states per chunk, through several chunks per request."""
    module = kernels(512, True, state_dtype)
    h = ScheduleHarness(module, head_dim=512, device=DEV, seed=41, num_slots=10, max_requests=6,
                        state_dtype=DTYPES[state_dtype], shadow=ref)
    batch = [h.start_request() for _ in range(6)]
    for _ in range(3 * CHUNK_SIZE + 5):
        h.decode_step(batch)
    h.check_live_states()
    assert h.stats.decode_closes >= 18 and h.stats.shadow_checks == 3 * CHUNK_SIZE + 5


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["plain_plans", "cuda_graph_plans"])
@pytest.mark.parametrize("state_dtype", list(DTYPES))
def test_compact_prefill_heavy_schedule(gpu, state_dtype, cuda_graph):
    module = kernels(512, True, state_dtype)
    stats = run_schedule(module, head_dim=512, device=DEV, steps=30, seed=77, decode_prob=0.2, relocate_prob=0.5,
                         cuda_graph=cuda_graph, max_step_tokens=2048, num_slots=20, max_requests=8,
                         state_dtype=DTYPES[state_dtype], compact=True, shadow=ref)
    assert stats.compact_calls == stats.prefill_calls > 0 and stats.max_boundaries_crossed >= 2
    if cuda_graph:
        assert stats.compact_padding_rows > 0


@pytest.mark.parametrize("state_dtype", list(DTYPES))
def test_compact_output_with_gpu_planned_plans_through_the_api(gpu, state_dtype):
    """``fc.prefill(compact=True)`` on plans from the GPU planner (CUDA-graph form, padded to N rows)."""
    d, dtype = 256, DTYPES[state_dtype]
    gen = torch.Generator().manual_seed(5)
    seq = torch.tensor([300, 129, 7, 1000], dtype=torch.int32)
    ext = torch.tensor([300, 2, 7, 500], dtype=torch.int32)
    n = int(ext.sum())
    state = torch.randn(6, 1, 3 * d, generator=gen).to(dtype)
    inp = torch.randn(n, 2 * d, generator=gen)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen)
    idx = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    plan = fc.plan_prefill(seq.to(DEV), ext.to(DEV), device=DEV, num_tokens=n)
    assert plan.compress_plan.shape[0] == n  # padded: the output has a row per plan row
    out = torch.full((n, d), float("nan"), device=DEV)
    got_state = state.to(DEV)
    result = fc.prefill(got_state, inp.to(DEV), ape.to(DEV), idx.to(DEV), plan, compact=True, out=out)
    assert result is out

    want_state = state.clone()
    want = torch.full((n, d), float("nan"))
    ref.run_prefill_compact(want_state, inp, want, ape, idx, plan.compress_plan.cpu(), plan.write_plan.cpu(), None)
    written = ~torch.isnan(want).all(dim=1)
    num_compress = int(plan.counts[0])
    assert int(written.sum()) == num_compress > 0 and bool(written[:num_compress].all())
    torch.testing.assert_close(out.cpu()[written], want[written], rtol=2e-5, atol=2e-6)
    assert bool(torch.isnan(out.cpu()[~written]).all())
    for slot in range(4):
        check_state_against(got_state[slot, 0], want_state[slot, 0], f"slot {slot}")
    assert torch.equal(got_state.cpu()[4:].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       state[4:].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_each_variant_refuses_the_other_state_dtype_before_launching(gpu):
    d = 128
    ape = torch.randn(CHUNK_SIZE, d, device=DEV)
    inp = torch.randn(2, 2 * d, device=DEV)
    idx = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    for variant, wrong in (("float32", torch.bfloat16), ("bfloat16", torch.float32)):
        module = kernels(d, True, variant)
        state = torch.randn(2, 1, 3 * d, device=DEV).to(wrong)
        before = state.clone()
        out = torch.full((2, d), float("nan"), device=DEV)
        with pytest.raises(TypeError, match="kv_score_buffer.*dtype"):
            module.run_decode(state, inp, out, ape, idx, idx + 5, None)
        torch.cuda.synchronize()
        assert torch.equal(state, before) and bool(torch.isnan(out).all())


@pytest.mark.parametrize("bad", [torch.float16, torch.float64])
def test_api_refuses_float16_and_float64_pools(gpu, bad):
    d = 128
    state = torch.randn(2, 1, 3 * d, device=DEV).to(bad)
    with pytest.raises(TypeError, match="'kv_score_buffer'.*float32 or bfloat16.*" + str(bad).removeprefix("torch.")):
        fc.decode(state, torch.randn(2, 2 * d, device=DEV), torch.randn(CHUNK_SIZE, d, device=DEV),
                  torch.tensor([0, 1], dtype=torch.int32, device=DEV), torch.tensor([3, 4], dtype=torch.int32,
                                                                                     device=DEV))


@pytest.mark.parametrize("state_dtype", list(DTYPES))
def test_compact_output_of_the_wrong_row_count_is_refused(gpu, state_dtype):
    d = 128
    module = kernels(d, True, state_dtype)
    plan = fc.plan_prefill(torch.tensor([300]), torch.tensor([300]), device=DEV)  # 2 compress rows, 1 write row
    state = torch.randn(1, 1, 3 * d, device=DEV).to(DTYPES[state_dtype])
    before = state.clone()
    args = (torch.randn(300, 2 * d, device=DEV), None, torch.randn(CHUNK_SIZE, d, device=DEV),
            torch.zeros(1, dtype=torch.int32, device=DEV), plan.compress_plan, plan.write_plan, None)
    for rows in (300, 1, 3):
        out = torch.full((rows, d), float("nan"), device=DEV)
        with pytest.raises(ValueError, match="kv_compressed_output"):
            module.run_prefill_compact(state, args[0], out, *args[2:])
        torch.cuda.synchronize()
        assert torch.equal(state, before) and bool(torch.isnan(out).all())
    out = torch.full((2, d), float("nan"), device=DEV)
    module.run_prefill_compact(state, args[0], out, *args[2:])
    torch.cuda.synchronize()
    assert not bool(torch.isnan(out).any())


def test_torch_compile_fullgraph_with_a_bf16_pool_and_compact_output(gpu):
    d = 128
    gen = torch.Generator().manual_seed(9)
    state0 = torch.randn(3, 1, 3 * d, generator=gen).to(torch.bfloat16).to(DEV)
    inp = torch.randn(260, 2 * d, generator=gen).to(DEV)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen).to(DEV)
    idx = torch.tensor([0, 2], dtype=torch.int32, device=DEV)
    plan = fc.plan_prefill(torch.tensor([200, 60]), torch.tensor([200, 60]), device=DEV)

    def step(state, inp):
        return fc.prefill(state, inp, ape, idx, plan, compact=True)

    eager_state, compiled_state = state0.clone(), state0.clone()
    want = step(eager_state, inp)
    got = torch.compile(step, fullgraph=True)(compiled_state, inp)
    assert got.shape == (plan.compress_plan.shape[0], d)
    assert torch.equal(got, want) and torch.equal(compiled_state, eager_state)


def test_cuda_graph_replay_of_bf16_decode_equals_eager(gpu):
    d = 256
    module = kernels(d, True, "bfloat16")
    gen = torch.Generator().manual_seed(13)
    b = 40
    state = torch.randn(b, 1, 3 * d, generator=gen).to(torch.bfloat16).to(DEV)
    inp = torch.empty(b, 2 * d, device=DEV)
    out = torch.full((b, d), float("nan"), device=DEV)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen).to(DEV)
    idx = torch.randperm(b, generator=gen).to(torch.int32).to(DEV)
    seq = torch.empty(b, dtype=torch.int32, device=DEV)
    eager_state = state.clone()
    eager_out = out.clone()
    seq.copy_(torch.randint(1, 1000, (b,), generator=gen))
    inp.copy_(torch.randn(b, 2 * d, generator=gen))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        module.run_decode(state, inp, out, ape, idx, seq, None)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        seq.copy_(torch.randint(1, 1000, (b,), generator=gen))
        inp.copy_(torch.randn(b, 2 * d, generator=gen))
        graph.replay()
        module.run_decode(eager_state, inp, eager_out, ape, idx, seq, None)
        torch.cuda.synchronize()
        assert torch.equal(state.view(torch.int16), eager_state.view(torch.int16))
        assert torch.equal(out.nan_to_num(7.0), eager_out.nan_to_num(7.0))
