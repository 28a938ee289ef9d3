"""The compiled kernels on a CUDA GPU against the float64 offline oracle (skipped without a GPU).

Every variant ``(head_dim, use_pdl)`` for head_dim 128, 256, 512 and PDL off /
on runs random mixed schedules through ``tests/schedule.py``: chunked prefill
of random sizes interleaved with decode steps, requests moving to new slots
through ``load_indices``, plans with and without ``use_cuda_graph``, outputs
poisoned with NaN so rows that must be written and rows that must stay
untouched are both checked, and untouched slots checked bitwise.
"""

from __future__ import annotations

import pytest
import torch

from flash_compress import reference as ref
from flash_compress.c128_online import HEAD_DIMS_TESTED
from flash_compress.plan_rows import CHUNK_SIZE, ROW_BYTES
import oracle
from schedule import (ScheduleHarness, bits, check_state_against, exact_plan_passes, graph_plan_passes, plan_with,
                      prefill_pass, rows_for_slice_width, run_schedule, slice_widths)

pytestmark = pytest.mark.gpu

HEAD_DIMS = HEAD_DIMS_TESTED
PDL = (False, True)

_modules: dict[tuple[int, bool, str], object] = {}


def kernels(head_dim: int, use_pdl: bool, state_dtype: str = "float32"):
    """The compiled variant (built once per session, then cached on disk)."""
    key = (head_dim, use_pdl, state_dtype)
    if key not in _modules:
        import flash_compress

        _modules[key] = flash_compress.load_module(head_dim=head_dim, use_pdl=use_pdl, state_dtype=state_dtype)
    return _modules[key]


@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_random_mixed_schedule(gpu, head_dim, use_pdl):
    module = kernels(head_dim, use_pdl)
    stats = run_schedule(module, head_dim=head_dim, device="cuda", steps=80, seed=head_dim + int(use_pdl),
                         num_slots=16, max_requests=6)
    assert stats.rows_checked > 0 and stats.states_checked > 0
    assert stats.relocations > 0 and 0 < stats.cuda_graph_plans < stats.prefill_calls


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["plain_plans", "cuda_graph_plans"])
@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
def test_prefill_heavy_schedule_with_relocation(gpu, use_pdl, cuda_graph):
    module = kernels(512, use_pdl)
    stats = run_schedule(module, head_dim=512, device="cuda", steps=40, seed=100 + int(use_pdl),
                         decode_prob=0.25, relocate_prob=0.6, cuda_graph=cuda_graph, max_step_tokens=2048,
                         num_slots=20, max_requests=8)
    assert stats.relocations_mid_chunk > 0 and stats.max_boundaries_crossed >= 2
    assert stats.cuda_graph_plans == (stats.prefill_calls if cuda_graph else 0)


@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
def test_every_channel_slice_width(gpu, use_pdl):
    """Each prefill pass runs each of its channel slice widths in some step
    (``choose_slice_width``, mirrored by ``prefill_pass``; on 132 SMs at head_dim 512 a compress
    pass of 1-8 rows runs 8 channels, 9-66 16, 67-132 32, 133-264 64, 397-528 128; a write pass
    runs no more than 64): write-only steps of
    ``rows[32]`` and then 240 requests, a step of mid-chunk starts, then for each width the fewest
    requests whose compress pass runs it, 128 tokens from mid-chunk (one compress and at most one
    write row each). The widths the steps reach are asserted through the mirror, the results
    against the float64 oracle."""
    module = kernels(512, use_pdl)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = rows_for_slice_width(512, sms)
    requests = max(240, *rows.values())
    h = ScheduleHarness(module, head_dim=512, device="cuda", seed=11, num_slots=requests + 10,
                        max_requests=requests)
    batch = [h.start_request() for _ in range(requests)]
    reached: set[tuple[str, int]] = set()
    h.prefill_step([(r, h.rng.randint(1, 100), None) for r in batch[: rows[32]]])  # write rows only
    h.prefill_step([(r, h.rng.randint(1, 27), None) for r in batch[:240]])  # write rows only, none closes
    reached |= {("write", prefill_pass(rows[32], 512, sms, write_pass=True)[0]),
                ("write", prefill_pass(240, 512, sms, write_pass=True)[0])}
    h.prefill_step([(r, h.rng.randint(1, 300), None) for r in batch])  # mid-chunk starts
    for width, count in sorted(rows.items()):
        h.prefill_step([(r, 128, None) for r in batch[:count]])
        compress = prefill_pass(count, 512, sms)
        reached |= {("compress", compress[0]),
                    ("write", prefill_pass(count, 512, sms, beside=compress, write_pass=True)[0])}
    h.check_live_states()
    assert reached == ({("compress", w) for w in slice_widths(512)} |
                       {("write", w) for w in slice_widths(512, write_pass=True)}), sorted(reached)
    assert h.stats.prefill_calls == 3 + len(rows) and h.stats.rows_checked >= sum(rows.values())  # a row per 128-token request


@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
def test_decode_through_several_chunks(gpu, use_pdl):
    module = kernels(256, use_pdl)
    h = ScheduleHarness(module, head_dim=256, device="cuda", seed=7, num_slots=8)
    batch = [h.start_request() for _ in range(4)]
    h.prefill_step([(batch[1], 100, None), (batch[2], 127, None), (batch[3], 129, None)])
    for _ in range(2 * CHUNK_SIZE + 3):
        h.decode_step(batch)
    h.check_live_states()
    assert h.stats.decode_closes >= 8


def test_decode_and_verify_batches_that_fill_most_of_the_gpu(gpu):
    """Decode and verify grids that fill over half of the GPU but fit it at once launch the next
    kernel early with each SM capped at their share of blocks, through dynamic shared memory no
    thread uses (``C128Online::smem_for_early_launch``; float32 at head_dim 512 on an H200, decode
    at 6 blocks of 2 requests per SM: 793 to 1584 requests, capped up to 1320; verify at 5 blocks
    of one request per SM, 96 registers: 331 to 660, capped up to 528). Batches of 4 to 16
    requests per SM, capped ones among them, decode through chunk ends and verify then commit,
    against the float64 oracle, with poisoned outputs and untouched slots checked bitwise."""
    module = kernels(512, True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sizes = [per_sm * sms for per_sm in (4, 6, 8, 10, 12, 16)]
    h = ScheduleHarness(module, head_dim=512, device="cuda", seed=13, num_slots=max(sizes) + 8,
                        max_requests=max(sizes))
    batch = [h.start_request() for _ in range(max(sizes))]
    h.prefill_step([(r, h.rng.randint(1, 127), None) for r in batch])  # write rows only
    for size in sizes:
        h.decode_step(batch[:size])
        h.verify_step(batch[:size], window=4)
    h.check_live_states()
    assert h.stats.decode_calls == len(sizes) and h.stats.verify_calls == len(sizes)
    assert h.stats.decode_closes > 0 and h.stats.verify_closes > 0


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [512, 1024])
def test_128_channel_compress_slices_fold_prior_states(gpu, head_dim, state_dtype):
    """The fewest requests whose compress pass runs 128-channel slices (``rows_for_slice_width``; 397
    at head_dim 512 and 199 at 1024 on 132 SMs), in both state dtypes: a write-only step of 60 tokens
    each, then two steps of 128 (the second with a CUDA-graph plan), so that every compress row
    folds a stored state into 68 tokens from position 60 and every write row starts a chunk; its
    write passes run 64 channels or fewer. Against the float64 oracle and the store-emulating
    reference, with poisoned outputs and untouched slots checked bitwise."""
    module = kernels(head_dim, True, state_dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    count = rows_for_slice_width(head_dim, sms)[128]
    compress = prefill_pass(count, head_dim, sms)
    assert compress[0] == 128 and prefill_pass(count, head_dim, sms, beside=compress, write_pass=True)[0] <= 64
    h = ScheduleHarness(module, head_dim=head_dim, device="cuda", seed=57 + head_dim, num_slots=count + 2,
                        max_requests=count, state_dtype=getattr(torch, state_dtype), shadow=ref)
    batch = [h.start_request() for _ in range(count)]
    h.prefill_step([(r, 60, None) for r in batch])  # write rows only
    h.prefill_step([(r, CHUNK_SIZE, None) for r in batch])
    h.prefill_step([(r, CHUNK_SIZE, None) for r in batch], use_cuda_graph=True)
    h.check_live_states()
    assert h.stats.prefill_calls == 3 and h.stats.rows_checked >= 2 * count


@pytest.mark.parametrize("head_dim", [256, 512, 1024])
def test_cuda_graph_plans_with_few_live_compress_rows(gpu, head_dim):
    """4 requests of 300 tokens beside 1000 or more of one (the fewest for which what follows holds on
    this GPU; 1000 on 132 SMs), twice, in CUDA-graph plans: 8 live compress rows, where the plan bounds
    them at a row per 128 tokens and one per request (1021). At that bound the widths tie in chain,
    and the tie goes to the width whose chain is shortest for a row per 128 tokens
    (``graph_plan_passes``): narrower than the bound alone would pick. The second step folds
    stored states. Against the float64 oracle and the store-emulating reference, with poisoned outputs
    and untouched slots checked bitwise."""
    module = kernels(head_dim, True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def retied(lengths):
        chosen, at_bound = (graph_plan_passes(lengths, head_dim, sms, likely)[0] for likely in (True, False))
        return chosen[0] < at_bound[0] and chosen[2] == at_bound[2]

    candidates = ([300] * 4 + [1] * ones for ones in range(1000, 3000, 4))
    lengths = next((lengths for lengths in candidates if retied(lengths)), None)
    assert lengths is not None, f"no batch of 1000 to 3000 one-token requests retie at head_dim {head_dim}, {sms} SMs"
    h = ScheduleHarness(module, head_dim=head_dim, device="cuda", seed=83 + head_dim, num_slots=len(lengths) + 3,
                        max_requests=len(lengths), shadow=ref)
    batch = [h.start_request() for _ in lengths]
    for _ in range(2):
        h.prefill_step([(r, n, None) for r, n in zip(batch, lengths)], use_cuda_graph=True)
    h.check_live_states()
    assert h.stats.prefill_calls == 2 and h.stats.rows_checked >= 16


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [128, 512])
def test_write_passes_of_long_open_chunks_among_one_token_rows(gpu, head_dim, state_dtype):
    """Write passes of 256 rows in which 1 to 256 requests extend by 17 to 127 tokens (an open-chunk
    segment longer than two rounds of a warp at 64-channel slices) and the rest by one token: the
    few-row shape of a long request with decode tokens riding along, and its mixes. Segments from a
    chunk start and from mid-chunk (a prior state to merge), with exact and CUDA-graph plans (other
    grids); against the float64 oracle, with poisoned outputs and untouched slots checked bitwise.
    The shape the pooled write pass of docs/experiments/pooled_write_pass.patch reorganises."""
    module = kernels(head_dim, True, state_dtype)
    requests = 256
    h = ScheduleHarness(module, head_dim=head_dim, device="cuda", seed=31 + head_dim, num_slots=requests + 4,
                        max_requests=requests, state_dtype=getattr(torch, state_dtype))
    batch = [h.start_request() for _ in range(requests)]
    long_segments = 0
    for step, long_count in enumerate((1, 8, 40, 128, 256, 3, 64)):
        long_ones = set(h.rng.sample(range(requests), long_count))
        extends = [h.rng.randint(17, 127) if i in long_ones else 1 for i in range(requests)]
        for r, e in zip(batch, extends):
            new_tokens_in_open_chunk = min(e, (r.length + e) % CHUNK_SIZE)
            long_segments += new_tokens_in_open_chunk > 16
        h.prefill_step([(r, e, None) for r, e in zip(batch, extends)], use_cuda_graph=step % 2 == 1)
    h.check_live_states()
    assert long_segments >= 400, long_segments  # 454 at head_dim 128, 462 at 512
    assert h.stats.prefill_calls == 7


def test_planner_from_reference_kernels_from_module(gpu):
    """The kernels accept the reference planner's plans (the same bytes) too."""
    module = kernels(128, True)
    run_schedule(module, head_dim=128, device="cuda", steps=30, seed=5, planner=ref)


def test_reference_on_cuda_tensors(gpu):
    run_schedule(ref, head_dim=128, device="cuda", steps=20, seed=6)


@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
def test_empty_batch_and_empty_plans_are_noops(gpu, use_pdl):
    d = 128
    module = kernels(d, use_pdl)
    dev = "cuda"
    buf = torch.randn(4, 1, 3 * d, device=dev)
    before = buf.clone()
    ape = torch.randn(CHUNK_SIZE, d, device=dev)
    none_i32 = torch.empty(0, dtype=torch.int32, device=dev)
    module.run_decode(buf, torch.empty(0, 2 * d, device=dev), torch.empty(0, d, device=dev), ape, none_i32,
                      none_i32, None)
    empty_plan = torch.empty(0, ROW_BYTES, dtype=torch.uint8, device=dev)
    module.run_prefill(buf, torch.empty(0, 2 * d, device=dev), torch.empty(0, d, device=dev), ape, none_i32,
                       empty_plan, empty_plan, None)
    # A batch whose plans are all sentinel rows (cuda-graph padding only): nothing is written.
    inp = torch.randn(5, 2 * d, device=dev)
    out = torch.full((5, d), float("nan"), device=dev)
    pad = torch.full((5, ROW_BYTES), 0xFF, dtype=torch.uint8, device=dev)
    idx = torch.tensor([1], dtype=torch.int32, device=dev)
    module.run_prefill(buf, inp, out, ape, idx, pad, pad.clone(), idx)
    torch.cuda.synchronize()
    assert torch.equal(buf, before) and torch.isnan(out).all()


@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
def test_compress_only_plan_leaves_buffer_alone(gpu, use_pdl):
    """A prefill that ends exactly at a chunk end has no write row: the buffer is not touched."""
    d = 256
    module = kernels(d, use_pdl)
    h = ScheduleHarness(module, head_dim=d, device="cuda", seed=9, num_slots=6, max_requests=2)
    request = h.start_request()
    h.prefill_step([(request, 200, None)])
    h.prefill_step([(request, 56, h.free_slots[0])], use_cuda_graph=True)  # reads old slot, closes chunk 1
    counts, _, _ = plan_with(module, [56], [256], False)
    assert counts == (1, 0)


@pytest.mark.parametrize(("head_dim", "cuda_graph", "state_dtype"),
                         [(512, False, "float32"), (512, False, "bfloat16"), (512, True, "bfloat16"),
                          (128, True, "float32")])
def test_one_token_rows_beside_a_request_that_reads_their_slot(gpu, head_dim, cuda_graph, state_dtype):
    """1 x 8132 + 255 x 1 without ``load_indices``, where the write pass would not start beside the compress
    pass (asserted through the width rule's mirror): the shape that docs/PERF_LOG.md's one-token-rows
    forms move into the compress pass. Request 1 names request 0's slot, which request 0's first compress
    row reads (from position 60) and request 1's one-token write row stores: the store must follow the read.
    Request 2 names a slot outside the pool; requests 3 to 5 start or close a chunk. Outputs poisoned,
    against the reference on the same data, untouched slots checked bitwise."""
    module = kernels(head_dim, True, state_dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(head_dim + 2 * cuda_graph)
    requests, slots = 256, 264
    positions = torch.randint(1, CHUNK_SIZE - 1, (requests,), generator=gen)  # one token mid-chunk
    positions[3], positions[4], positions[5] = 0, CHUNK_SIZE - 1, CHUNK_SIZE - 1  # starts a chunk; closes one
    seq_lens = [64 * CHUNK_SIZE] + [int(CHUNK_SIZE * torch.randint(0, 40, ()) + p + 1) for p in positions[1:]]
    extend_lens = [64 * CHUNK_SIZE - 60] + [1] * (requests - 1)
    counts, compress_plan, write_plan = plan_with(module, extend_lens, seq_lens, cuda_graph)
    if cuda_graph:
        compress, write = graph_plan_passes(extend_lens, head_dim, sms)
    else:
        compress, write = exact_plan_passes(counts[0], counts[1], extend_lens, head_dim, sms)
        compress_plan, write_plan = compress_plan[: counts[0]], write_plan[: counts[1]]
    assert compress[1] + write[1] > 8 * sms, "the write pass would start beside the compress pass"
    dtype = getattr(torch, state_dtype)
    state = torch.randn(slots, 1, 3, head_dim, generator=gen)
    state[:, :, 1] = state[:, :, 1].abs() + 0.5  # sums of exponentials
    state = state.view(slots, 1, 3 * head_dim).to(dtype).cuda()
    indices = torch.randperm(slots, generator=gen)[:requests].to(torch.int32)
    indices[1], indices[2] = indices[0], slots
    tokens = torch.randn(sum(extend_lens), 2 * head_dim, generator=gen).cuda()
    ape = torch.randn(CHUNK_SIZE, head_dim, generator=gen).cuda()
    out = torch.full((tokens.shape[0], head_dim), float("nan"), device="cuda")
    want_state, want_out = state.clone(), out.clone()
    indices, compress_plan, write_plan = indices.cuda(), compress_plan.cuda(), write_plan.cuda()
    module.run_prefill(state, tokens, out, ape, indices, compress_plan, write_plan, None)
    ref.run_prefill(want_state, tokens, want_out, ape, indices, compress_plan, write_plan, None)
    torch.cuda.synchronize()
    written = ~torch.isnan(want_out[:, 0])
    assert int(written.sum()) == 64 + 2 and torch.isnan(out[~written]).all()
    oracle.assert_rows_close(out[written], want_out[written], "compressed rows")
    stored = set(indices[1:].tolist()) - {indices[4].item(), indices[5].item(), slots}
    assert len(stored) == requests - 4
    for slot in range(slots):
        if slot not in stored:
            assert torch.equal(bits(state[slot]), bits(want_state[slot])), f"slot {slot} must stay untouched"
        else:
            check_state_against(state[slot, 0], want_state[slot, 0], f"slot {slot}")
