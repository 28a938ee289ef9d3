"""Speculative verify and commit on a CUDA GPU (docs/SPEC.md section 9; kernels in csrc/deepseek_v4/c128_verify.cuh).

- The schedule harness (``tests/schedule.py``) with verify steps mixed into
  decode and prefill steps, on every ``(head_dim, use_pdl, state_dtype)``
  variant tested, with the CPU reference as shadow: each call is repeated on
  the reference from the same pre-call pool and must agree to float32
  rounding (bf16 states bitwise but for rare rounding ties), and the float64
  oracle, NaN-poisoned outputs and prefix states and bitwise-untouched slots
  are checked as on the CPU.
- Values the host cannot check (slots outside the pool, ``seq_len < T``,
  accepted lengths 0 or above T), through ``tests/device_runner.py`` with
  guard zones around every written tensor: skipped, nothing written anywhere.
- Argument errors raised before launching.
- Rounds of verify + commit back to back without a host synchronisation (the
  PDL chain), each checked afterwards against the reference.
- ``torch.compile(fullgraph=True)`` of a verify + accept + commit step.
- A whole engine step, verify, accepted lengths computed on the device from
  its outputs, commit, captured in one CUDA graph and replayed with new inputs
  and new accepted lengths, each replay checked against the reference.

Skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch

import flash_compress as fc
import oracle
from cuda_graphs import capture
from device_runner import DeviceRunner
from flash_compress import reference as ref
from flash_compress.c128_online import HEAD_DIMS_TESTED
from flash_compress._dispatch import TORCH_STATE_DTYPES, kernels  # kernels(head_dim, use_pdl, state_dtype), loaded once
from flash_compress.plan_rows import CHUNK_SIZE
from schedule import ScheduleHarness, bf16_state_flips, bits, plan_with, run_schedule

pytestmark = pytest.mark.gpu

DEV, HEAD_DIMS, PDL = "cuda", HEAD_DIMS_TESTED, (False, True)
DTYPES = {name: dtype for dtype, name in TORCH_STATE_DTYPES.items()}  # "float32" / "bfloat16" -> the pool's dtype


def assert_states_match(got: torch.Tensor, want: torch.Tensor, what: str) -> int:
    """``[R, 3D]`` states from the kernels against the reference's, row by row, to float32 rounding (bf16: bitwise
    but for rounding ties, which are counted and returned)."""
    got, want = got.cpu(), want.cpu()
    d = got.shape[-1] // 3
    flips = 0
    for i in range(got.shape[0]):
        if got.dtype == torch.bfloat16:
            flips += bf16_state_flips(got[i], want[i], f"{what}: row {i}")
        else:
            w = want[i].double()
            state = oracle.PartialState(max=w[:d], sum=w[d : 2 * d], kv=w[2 * d :])
            oracle.assert_state_close(got[i], state, f"{what}: row {i}", tol=oracle.FLOAT32)
    assert flips <= max(2, 1e-3 * got.numel()), f"{what}: {flips} bf16 elements differ from the reference"
    return flips


def assert_rows_match(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Output rows: written (not NaN) exactly where the reference wrote, and close there."""
    got, want = got.cpu(), want.cpu()
    written = ~torch.isnan(want).all(dim=1)
    assert torch.equal(~torch.isnan(got).all(dim=1), written), f"{what}: rows written elsewhere than the reference's"
    oracle.assert_rows_close(got[written], want[written], what, rtol=2e-5)


def prefilled_pool(d: int, dtype: torch.dtype, lengths: list[int], slots: list[int], num_slots: int, seed: int):
    """A pool whose ``slots`` hold requests of ``lengths`` tokens, prefilled on the reference; ``(pool, ape)``,
    on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen)
    pool = torch.full((num_slots, 1, 3 * d), float("nan"), dtype=dtype)
    counts, cp, wp = plan_with(ref, lengths, lengths, False)
    n = sum(lengths)
    tokens = torch.cat([torch.randn(n, d, generator=gen), 2 * torch.randn(n, d, generator=gen)], dim=1)
    ref.run_prefill(pool, tokens, torch.empty(n, d), ape, torch.tensor(slots, dtype=torch.int32),
                    cp[: counts[0]], wp[: counts[1]])
    return pool, ape


def verify_inputs(gen: torch.Generator, rows: int, d: int) -> torch.Tensor:
    return torch.cat([torch.randn(rows, d, generator=gen), 2 * torch.randn(rows, d, generator=gen)], dim=1)


# ---------------------------------------------------------------------------
# The schedule harness with verify steps, shadowed by the reference.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("state_dtype", list(DTYPES))
@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_schedule_with_verify_steps_matches_the_reference(gpu, head_dim, use_pdl, state_dtype):
    module = kernels(head_dim, use_pdl, state_dtype)
    stats = run_schedule(module, head_dim=head_dim, device=DEV, steps=40, seed=600 + head_dim + int(use_pdl),
                         num_slots=14, max_requests=6, state_dtype=DTYPES[state_dtype], compact=None, shadow=ref,
                         verify_prob=0.5, verify_bad_prob=0.2)
    assert stats.verify_calls >= 10 and stats.prefix_states_checked > 0 and stats.commits > 0
    assert stats.verify_closes > 0 and stats.rows_checked > 0 and stats.states_checked > 0
    assert stats.shadow_checks == stats.decode_calls + stats.prefill_calls + 2 * stats.verify_calls


@pytest.mark.parametrize("state_dtype", list(DTYPES))
def test_every_window_size_through_chunk_ends(gpu, state_dtype):
    h = ScheduleHarness(kernels(512, True, state_dtype), head_dim=512, device=DEV, seed=61, num_slots=8,
                        max_requests=4, state_dtype=DTYPES[state_dtype], shadow=ref)
    h.verify_every_window([h.start_request() for _ in range(3)])
    h.check_live_states()
    h.check_shadow_flip_rate()
    assert h.stats.verify_closes_rejected > 0 and h.stats.verify_crossings > 0 and h.stats.commits_closed > 0


# ---------------------------------------------------------------------------
# Values the host cannot check, behind guard zones.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("state_dtype", list(DTYPES))
@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
def test_bad_values_are_skipped_behind_guard_zones(gpu, use_pdl, state_dtype):
    runner = DeviceRunner(kernels(128, use_pdl, state_dtype), guard_elems=1024)
    h = ScheduleHarness(runner, head_dim=128, device="cpu", seed=62, num_slots=8, max_requests=5,
                        state_dtype=DTYPES[state_dtype], shadow=ref)
    batch = [h.start_request() for _ in range(5)]
    h.prefill_step([(r, CHUNK_SIZE + 119 + 2 * i, None) for i, r in enumerate(batch)])
    for kind in ("accept", "slot", "seq_len"):
        for window in (1, 7, 16):
            h.verify_bad_values_step(batch, window, [kind, "good", kind, kind, "good"])
    for window in range(1, 17):
        h.verify_bad_values_step(batch, window)  # random kinds
    for kind in ("slot", "seq_len", "accept"):  # every request bad: nothing written at all
        h.verify_bad_values_step(batch, 5, [kind] * 5)
    h.check_live_states()
    assert h.stats.verify_skipped > 0 and h.stats.commit_skipped > 0 and h.stats.commits > 0


@pytest.mark.parametrize("state_dtype", list(DTYPES))
def test_argument_errors_are_raised_before_launching(gpu, state_dtype):
    d, dtype = 128, DTYPES[state_dtype]
    module = kernels(d, True, state_dtype)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    pool = torch.randn(4, 1, 3 * d, device=DEV).to(dtype)
    before = pool.clone()
    ape = torch.randn(CHUNK_SIZE, d, device=DEV)
    idx = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV)
    seq = torch.tensor([20, 30, 40], dtype=torch.int32, device=DEV)

    def verify(rows, prefix_dtype=dtype, prefix_rows=None):
        out = torch.full((rows, d), float("nan"), device=DEV)
        prefix = torch.full((rows if prefix_rows is None else prefix_rows, 3 * d), float("nan"), device=DEV)
        module.run_verify(pool, torch.randn(rows, 2 * d, device=DEV), out, ape, idx, seq, prefix.to(prefix_dtype))

    with pytest.raises(ValueError, match="kv_score_input"):
        verify(11)  # 11 rows for 3 requests
    with pytest.raises(ValueError, match="kv_score_input"):
        verify(51)  # T = 17
    with pytest.raises(TypeError, match="prefix_states"):
        verify(12, prefix_dtype=other)
    with pytest.raises(ValueError, match="prefix_states"):
        verify(12, prefix_rows=9)
    prefix = torch.zeros(12, 3 * d, device=DEV).to(dtype)
    with pytest.raises(ValueError, match="prefix_states"):
        module.run_commit(pool, prefix[:11], idx, idx)
    with pytest.raises(TypeError, match="accept_lens"):
        module.run_commit(pool, prefix, idx, idx.long())
    with pytest.raises(TypeError, match="prefix_states"):
        module.run_commit(pool, prefix.to(other), idx, idx)
    with pytest.raises(ValueError, match="kv_score_input"):  # rows for an empty batch
        module.run_verify(pool, torch.randn(3, 2 * d, device=DEV), torch.empty(3, d, device=DEV), ape, idx[:0],
                          seq[:0], prefix[:3])
    empty = idx[:0]  # B = 0 with 0 rows: nothing to do
    module.run_verify(pool, torch.empty(0, 2 * d, device=DEV), torch.empty(0, d, device=DEV), ape, empty, empty,
                      prefix[:0])
    module.run_commit(pool, prefix[:0], empty, empty)
    torch.cuda.synchronize()
    assert torch.equal(bits(pool), bits(before))


# ---------------------------------------------------------------------------
# Back to back without a host synchronisation (the PDL chain).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("state_dtype", list(DTYPES))
@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
def test_rounds_back_to_back_without_a_sync(gpu, use_pdl, state_dtype):
    """verify, commit, verify, commit, ... queued at once: each kernel must see the one before it complete.

    The chain runs twice from the same pool: once with a copy of the pool taken before every round (so that
    each round can be checked against the reference from the pool it saw), once with nothing but the two
    kernels in the loop (so that PDL lets each one start early); the kernels are deterministic, so both
    must give the same bits.
    """
    d, dtype, t = 512, DTYPES[state_dtype], 6
    module = kernels(d, use_pdl, state_dtype)
    lengths, slots = [120, 127, 1, 200, 64], [4, 0, 2, 6, 1]
    b = len(slots)
    pool_cpu, ape_cpu = prefilled_pool(d, dtype, lengths, slots, 8, seed=63)
    ape = ape_cpu.to(DEV)
    idx = torch.tensor(slots, dtype=torch.int32)
    gen = torch.Generator().manual_seed(64)
    rounds = []
    for r in range(8):
        accept = [[t, 1, 3, t, 2][(i + r) % 5] for i in range(b)]
        seq = torch.tensor([n + t for n in lengths], dtype=torch.int32)
        rounds.append(dict(inp=verify_inputs(gen, b * t, d), seq=seq, accept=torch.tensor(accept, dtype=torch.int32)))
        lengths = [n + a for n, a in zip(lengths, accept)]
    device_rounds = [{k: v.to(DEV) for k, v in r.items()} for r in rounds]  # uploaded before the chain
    idx_dev = idx.to(DEV)

    def chain(snapshots: bool):
        pool = pool_cpu.to(DEV, copy=True)
        outs = [torch.full((b * t, d), float("nan"), device=DEV) for _ in rounds]
        prefixes = [torch.full((b * t, 3 * d), float("nan"), device=DEV).to(dtype) for _ in rounds]
        pools = []
        torch.cuda.synchronize()
        for r, out, prefix in zip(device_rounds, outs, prefixes):  # no host synchronisation in this loop
            if snapshots:
                pools.append(pool.clone())
            module.run_verify(pool, r["inp"], out, ape, idx_dev, r["seq"], prefix)
            module.run_commit(pool, prefix, idx_dev, r["accept"])
        pools.append(pool)
        torch.cuda.synchronize()
        return [o.cpu() for o in outs], [p.cpu() for p in prefixes], [p.cpu() for p in pools]

    outs, prefixes, pools = chain(snapshots=True)
    for i, r in enumerate(rounds):
        want_out = torch.full((b * t, d), float("nan"))
        want_prefix = torch.full((b * t, 3 * d), float("nan"), dtype=dtype)
        start = pools[i].clone()
        ref.run_verify(start, r["inp"], want_out, ape_cpu, idx, r["seq"], want_prefix)
        assert_rows_match(outs[i], want_out, f"round {i}: output rows")
        assert_states_match(prefixes[i], want_prefix, f"round {i}: prefix states")
        ref.run_commit(start, prefixes[i], idx, r["accept"])
        assert torch.equal(bits(pools[i + 1]), bits(start)), f"round {i}: the pool after commit"
    fast_outs, fast_prefixes, fast_pools = chain(snapshots=False)
    assert torch.equal(bits(fast_pools[-1]), bits(pools[-1]))
    for i in range(len(rounds)):
        assert torch.equal(bits(fast_prefixes[i]), bits(prefixes[i])), f"round {i}: prefix states"
        assert torch.equal(fast_outs[i].nan_to_num(7.0), outs[i].nan_to_num(7.0)), f"round {i}: output rows"


# ---------------------------------------------------------------------------
# torch.compile and CUDA graphs.
# ---------------------------------------------------------------------------


def accepted_lengths(prefix_states: torch.Tensor, threshold: torch.Tensor, window: int) -> torch.Tensor:
    """A stand-in for the target model's acceptance, computed on the device from verify's output: draft ``j``
    agrees when channel 0 of ``kv`` in its prefix state exceeds ``threshold[b]``; the accepted length is 1 plus
    the drafts that agree before the first that does not."""
    batch = threshold.shape[0]
    kv0 = prefix_states.view(batch, window, -1)[:, 1:, 2 * (prefix_states.shape[-1] // 3)].float()
    agree = (kv0 > threshold[:, None]).to(torch.int32)
    return agree.cumprod(dim=1).sum(dim=1).add(1).clamp(1, window).to(torch.int32)


@pytest.mark.parametrize("state_dtype", list(DTYPES))
def test_torch_compile_fullgraph_of_a_verify_accept_commit_step(gpu, state_dtype):
    d, dtype, t = 256, DTYPES[state_dtype], 4
    lengths, slots = [125, 126, 3], [1, 3, 0]
    pool_cpu, ape_cpu = prefilled_pool(d, dtype, lengths, slots, 4, seed=65)
    ape, idx = ape_cpu.to(DEV), torch.tensor(slots, dtype=torch.int32, device=DEV)
    seq = torch.tensor([n + t for n in lengths], dtype=torch.int32, device=DEV)
    threshold = torch.tensor([0.0, float("-inf"), 0.0], device=DEV)
    inp = verify_inputs(torch.Generator().manual_seed(66), 3 * t, d).to(DEV)

    def step(pool, inp, out, prefix):
        fc.verify(pool, inp, ape, idx, seq, out=out, prefix_states=prefix)
        accept = accepted_lengths(prefix, threshold, t)
        fc.commit(pool, prefix, idx, accept)
        return accept

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):  # eager first: it loads the variant
        pool = pool_cpu.to(DEV, copy=True)
        out = torch.full((3 * t, d), float("nan"), device=DEV)
        prefix = torch.full((3 * t, 3 * d), float("nan"), device=DEV).to(dtype)
        accept = fn(pool, inp, out, prefix)
        torch.cuda.synchronize()
        results.append((pool.cpu(), out.cpu(), prefix.cpu(), accept.cpu()))
    (want_pool, want_out, want_prefix, want_accept), (pool, out, prefix, accept) = results
    assert torch.equal(accept, want_accept) and int(accept[1]) == t
    assert torch.equal(bits(prefix), bits(want_prefix)) and torch.equal(bits(pool), bits(want_pool))
    assert torch.equal(out.nan_to_num(7.0), want_out.nan_to_num(7.0)) and not bool(torch.isnan(out).all())


@pytest.mark.parametrize("state_dtype", list(DTYPES))
def test_a_whole_verify_step_captured_in_one_cuda_graph(gpu, state_dtype):
    """verify, accepted lengths from its outputs, commit: one graph, replayed with new inputs and new lengths."""
    d, dtype, t = 256, DTYPES[state_dtype], 5
    lengths, slots = [120, 125, 127, 3, 250, 188], [5, 0, 7, 2, 3, 1]
    b = len(slots)
    pool_cpu, ape_cpu = prefilled_pool(d, dtype, lengths, slots, 8, seed=67)
    pool, ape = pool_cpu.to(DEV), ape_cpu.to(DEV)
    idx_cpu = torch.tensor(slots, dtype=torch.int32)
    idx = idx_cpu.to(DEV)
    # Static tensors the graph reads and writes; each replay's data is copied into them.
    inp = torch.zeros(b * t, 2 * d, device=DEV)
    seq = torch.tensor([n + t for n in lengths], dtype=torch.int32, device=DEV)
    threshold = torch.zeros(b, device=DEV)
    out = torch.full((b * t, d), float("nan"), device=DEV)
    prefix = torch.full((b * t, 3 * d), float("nan"), device=DEV).to(dtype)

    def step():
        fc.verify(pool, inp, ape, idx, seq, out=out, prefix_states=prefix)
        accept = accepted_lengths(prefix, threshold, t)
        fc.commit(pool, prefix, idx, accept)
        return accept

    saved = pool.clone()
    # The warm-up runs every op once outside the capture, then puts the pool back.
    graph, accept = capture(step, warm_up=lambda: (step(), pool.copy_(saved)))

    gen = torch.Generator().manual_seed(68)
    inf = float("inf")
    thresholds = [[-inf] * b, [inf] * b, [0.0, -inf, inf, 0.0, 0.1, -0.1], [0.0] * b, [-0.2, 0.2, 0.0, -inf, 0.0, inf]]
    seen = set()
    for replay, th in enumerate(thresholds):
        x = verify_inputs(gen, b * t, d)
        lens = [n + t for n in lengths]
        inp.copy_(x)
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        threshold.copy_(torch.tensor(th))
        out.fill_(float("nan"))
        prefix.fill_(float("nan"))
        before = pool.to("cpu", copy=True)
        graph.replay()
        torch.cuda.synchronize()
        got_accept, got_prefix, got_out, got_pool = accept.cpu(), prefix.cpu(), out.cpu(), pool.cpu()
        what = f"replay {replay} (seq_lens {lens}, accept {got_accept.tolist()})"
        assert torch.equal(got_accept, accepted_lengths(got_prefix, torch.tensor(th), t)), what
        want_out = torch.full((b * t, d), float("nan"))
        want_prefix = torch.full((b * t, 3 * d), float("nan"), dtype=dtype)
        ref.run_verify(before, x, want_out, ape_cpu, idx_cpu, torch.tensor(lens, dtype=torch.int32), want_prefix)
        assert_rows_match(got_out, want_out, f"{what}: output rows")
        assert_states_match(got_prefix, want_prefix, f"{what}: prefix states")
        ref.run_commit(before, got_prefix, idx_cpu, got_accept)
        assert torch.equal(bits(got_pool), bits(before)), f"{what}: the pool after commit"
        lengths = [n + int(a) for n, a in zip(lengths, got_accept)]
        seen.update(got_accept.tolist())
    assert {1, t} <= seen and len(seen) >= 3
