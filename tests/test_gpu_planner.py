"""The GPU planner (``plan_online_prefill`` on CUDA lengths) against the host planner, byte for byte.

The GPU path always writes the CUDA-graph form, so every comparison is with the
host planner at ``use_cuda_graph=True``, over the whole ``[M, 16]`` plans. GPU
plans start as random bytes, so a row the kernel leaves unwritten shows.
Invalid lengths cannot raise on the device path: they must give all-sentinel
plans and a non-zero error flag in ``counts[2]`` (bits as in
``docs/GPU_PLANNER.md``). The last tests capture plan + prefill in a CUDA graph
and replay it with new lengths, checked against :mod:`flash_compress.reference`.

Tests without the ``gpu`` marker check the host-side boundary of the new
argument and need only nvcc.
"""

from __future__ import annotations

import random

import pytest
import torch

import oracle
from boundary import DL_CUDA, relabel
from conftest import cuda_available
from cuda_graphs import capture
from flash_compress import reference as ref
from flash_compress.plan_rows import CHUNK_SIZE, PADDING_BYTE, ROW_BYTES, PlanError
from schedule import check_state_against, counts_of, plan_with
from test_planner import LIMIT_CASES

pytestmark = pytest.mark.nvcc

ERRORS = (ValueError, TypeError, RuntimeError)
# The error flag's bits.
EXTEND_NOT_POSITIVE, EXTEND_EXCEEDS_SEQ = PlanError.EXTEND_NOT_POSITIVE, PlanError.EXTEND_EXCEEDS_SEQ
SEQ_TOO_LONG, SUM_MISMATCH = PlanError.SEQ_TOO_LONG, PlanError.SUM_MISMATCH

_modules: dict[tuple[int, bool], object] = {}


def kernels(head_dim: int = 128, use_pdl: bool = True):
    key = (head_dim, use_pdl)
    if key not in _modules:
        import flash_compress

        _modules[key] = flash_compress.load_module(head_dim=head_dim, use_pdl=use_pdl)
    return _modules[key]


def gpu_plan(module, extend, seq, *, dtypes=(torch.int64, torch.int64), rows=None, counts_dtype=torch.int32,
             fill_seed=0, use_counts=True, use_cuda_graph=True):
    """Plans on the GPU into random-filled CUDA plans; returns (result, compress, write, counts) on the CPU."""
    total = sum(int(e) for e in extend) if rows is None else rows
    gen = torch.Generator().manual_seed(fill_seed)
    compress = torch.randint(0, 256, (total, ROW_BYTES), dtype=torch.uint8, generator=gen).cuda()
    write = torch.randint(0, 256, (total, ROW_BYTES), dtype=torch.uint8, generator=gen).cuda()
    extend_t = torch.tensor(list(extend), dtype=dtypes[0]).cuda()
    seq_t = torch.tensor(list(seq), dtype=dtypes[1]).cuda()
    args = [extend_t, seq_t, compress, write, use_cuda_graph]
    counts = None
    if use_counts:
        counts = torch.full((3,), -7, dtype=counts_dtype, device="cuda")
        args.append(counts)
    plan = module.plan_online_prefill_counted if use_counts else module.plan_online_prefill
    result = counts_of(plan(*args))
    torch.cuda.synchronize()
    return result, compress.cpu(), write.cpu(), None if counts is None else counts.cpu().tolist()


def assert_gpu_matches_host(module, extend, seq, what="", **kwargs):
    m = sum(extend)
    result, gpu_c, gpu_w, counts = gpu_plan(module, extend, seq, **kwargs)
    (host_m, _), host_c, host_w = plan_with(module, extend, seq, True)
    where = f"{what} B={len(extend)} M={m} extend={list(extend[:6])} seq={list(seq[:6])}"
    assert result == (m, m), f"{where}: returned {result}"
    assert torch.equal(gpu_c, host_c), f"{where}: compress plans differ at rows {_diff_rows(gpu_c, host_c)}"
    assert torch.equal(gpu_w, host_w), f"{where}: write plans differ at rows {_diff_rows(gpu_w, host_w)}"
    if counts is not None:
        want_c, want_w = ref.plan_segments(extend, seq)
        assert counts == [len(want_c), len(want_w), 0], f"{where}: counts {counts}"


def _diff_rows(a, b):
    return (a != b).any(dim=1).nonzero().flatten()[:8].tolist()


def random_batch(rng: random.Random, batch: int, max_prefix: int = 10**6, max_extend: int = 300):
    """Extends of every kind (1, small, chunk-aligned, up to max_extend) after prefixes near chunk ends or random."""
    extend, seq = [], []
    for _ in range(batch):
        e = rng.choice([1, rng.randint(1, 16), rng.randint(1, max_extend), 127, 128, 129, 256])
        p = rng.choice([0, 1, 127, 128, 129, rng.randint(0, 1000), rng.randint(0, max_prefix)])
        extend.append(e)
        seq.append(p + e)
    return extend, seq


# --- exact agreement --------------------------------------------------------------------------


# 2048 requests make one tile of the kernel's scan: 2047 / 2048 / 2049 and 4097 cross it.
BATCHES = [1, 2, 7, 31, 64, 100, 511, 512, 513, 1000, 2047, 2048, 2049, 4096, 4097, 6000]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", BATCHES)
def test_random_batches_match_host(gpu, batch):
    module = kernels()
    rng = random.Random(batch)
    for rep in range(3):
        extend, seq = random_batch(rng, batch)
        assert_gpu_matches_host(module, extend, seq, what=f"rep {rep}", fill_seed=rep)


LENGTH_DTYPES = [(torch.int64, torch.int64), (torch.int32, torch.int32), (torch.int32, torch.int64),
                 (torch.int64, torch.int32)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", LENGTH_DTYPES, ids=lambda d: f"{str(d[0])[6:]}_{str(d[1])[6:]}")
def test_int32_and_int64_lengths_match_host(gpu, dtypes):
    module = kernels()
    rng = random.Random(17)
    for batch in (1, 64, 512, 4096):
        extend, seq = random_batch(rng, batch)
        assert_gpu_matches_host(module, extend, seq, what=str(dtypes), dtypes=dtypes)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    ([10**6], [10**6]),                      # one request, 7812 compress rows written across the grid
    ([10**6 - 5], [10**6]),
    ([3, 999_000, 5], [3, 10**6, 10**6]),
    ([128] * 4096, [128 * (k % 7 + 1) for k in range(4096)]),  # every request closes exactly, no write rows
    ([1] * 4096, [k + 1 for k in range(4096)]),                 # one token each
    ([5], [15]), ([1], [128]), ([1], [129]), ([300], [300]), ([127], [127]), ([129], [129]),
    ([3, 130, 1], [130, 130, 7]),
])
def test_edge_cases_match_host(gpu, case):
    extend, seq = case
    assert_gpu_matches_host(kernels(), extend, seq)


@pytest.mark.gpu
def test_lengths_near_uint32_limit_match_host(gpu):
    module = kernels()
    for extend, seq in LIMIT_CASES:
        assert_gpu_matches_host(module, extend, seq, what="limit")


@pytest.mark.gpu
def test_empty_batch(gpu):
    module = kernels()
    result, c, w, counts = gpu_plan(module, [], [])
    assert result == (0, 0) and c.numel() == 0 and w.numel() == 0 and counts == [0, 0, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("use_pdl", [False, True], ids=["pdl0", "pdl1"])
def test_without_counts_int64_counts_and_graph_flag_ignored(gpu, use_pdl):
    """The 5-argument call plans on the GPU too; int64 counts work; use_cuda_graph=False still pads."""
    module = kernels(128, use_pdl)
    extend, seq = random_batch(random.Random(3), 300)
    assert_gpu_matches_host(module, extend, seq, use_counts=False)
    assert_gpu_matches_host(module, extend, seq, counts_dtype=torch.int64)
    assert_gpu_matches_host(module, extend, seq, use_cuda_graph=False)


# --- invalid lengths: all sentinel + flag ------------------------------------------------------


def _with(values, index, value):
    out = list(values)
    out[index] = value
    return out


def _error_cases():
    extend, seq = random_batch(random.Random(99), 4096, max_prefix=1000)
    m = sum(extend)
    return {
        "extend_zero": ([0, 3], [4, 4], 3, EXTEND_NOT_POSITIVE),
        "extend_negative": ([-1, 4], [4, 4], 3, EXTEND_NOT_POSITIVE),
        "extend_gt_seq": ([5], [4], 5, EXTEND_EXCEEDS_SEQ),
        "seq_too_long": ([3], [2**32 - 1], 3, SEQ_TOO_LONG),
        "seq_way_too_long": ([3], [2**62], 3, SEQ_TOO_LONG),
        "sum_short": ([3, 4], [10, 10], 6, SUM_MISMATCH),
        "sum_long": ([3, 4], [10, 10], 8, SUM_MISMATCH),
        "empty_batch_rows": ([], [], 4, SUM_MISMATCH),
        # One bad request deep in the second tile of a large batch spoils the whole plan.
        "bad_in_second_tile": (_with(extend, 3000, 0), seq, m - extend[3000], EXTEND_NOT_POSITIVE),
        "big_sum_short": (extend, seq, m - 1, SUM_MISMATCH),
        "two_kinds": ([0, 9], [4, 4], 9, EXTEND_NOT_POSITIVE | EXTEND_EXCEEDS_SEQ),
    }


ERROR_CASES = _error_cases()


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(ERROR_CASES))
@pytest.mark.parametrize("dtypes", [(torch.int64, torch.int64), (torch.int32, torch.int32)], ids=["i64", "i32"])
def test_invalid_lengths_give_all_sentinel_plans_and_a_flag(gpu, case, dtypes):
    extend, seq, rows, flag = ERROR_CASES[case]
    if dtypes[1] == torch.int32 and max(seq, default=0) >= 2**31:
        pytest.skip("seq_len does not fit int32")
    result, c, w, counts = gpu_plan(kernels(), extend, seq, rows=rows, dtypes=dtypes)
    assert result == (rows, rows)
    assert bool((c == PADDING_BYTE).all()) and bool((w == PADDING_BYTE).all()), f"{case}: plan rows written"
    assert counts == [0, 0, flag], f"{case}: counts {counts}, want [0, 0, {flag}]"


@pytest.mark.gpu
def test_a_bad_plan_then_a_good_one_into_the_same_buffers(gpu):
    """The flag and the rows are rewritten on every call: nothing sticks from a bad call."""
    module = kernels()
    compress = torch.zeros(6, ROW_BYTES, dtype=torch.uint8, device="cuda")
    write = torch.zeros_like(compress)
    counts = torch.zeros(3, dtype=torch.int32, device="cuda")
    lens = lambda *v: torch.tensor(v, dtype=torch.int64, device="cuda")  # noqa: E731
    module.plan_online_prefill_counted(lens(0, 6), lens(4, 6), compress, write, True, counts)
    assert counts.tolist() == [0, 0, EXTEND_NOT_POSITIVE]
    module.plan_online_prefill_counted(lens(4, 2), lens(130, 4), compress, write, True, counts)
    (_, _), host_c, host_w = plan_with(module, [4, 2], [130, 4], True)
    assert counts.tolist() == [1, 2, 0]  # request 0 closes chunk 0 and goes on; both end mid-chunk
    assert torch.equal(compress.cpu(), host_c) and torch.equal(write.cpu(), host_w)


# --- host-side checks of the GPU path ----------------------------------------------------------

# They run before its launch, so where no GPU is visible host tensors labelled as CUDA ones stand in for
# the CUDA arguments: tensors made on CHECK_DEVICE, passed through on_gpu_path.
CHECK_DEVICE = "cuda" if cuda_available() else "cpu"


def on_gpu_path(tensor: torch.Tensor):
    """``tensor`` as the GPU path takes it: itself on a GPU, else relabelled as a CUDA tensor."""
    return tensor if cuda_available() else relabel(tensor, DL_CUDA)


def test_gpu_path_argument_errors_raise_and_name_the_argument():
    """The GPU path's host checks, before its launch: without a GPU, host tensors labelled as CUDA ones
    stand in for the CUDA arguments (with one, they are CUDA tensors); the wrong-device cases stay on the
    CPU either way."""
    module = kernels()
    device, cuda = CHECK_DEVICE, on_gpu_path
    host = lambda t: t.cpu()  # noqa: E731
    lens = torch.tensor([3], dtype=torch.int64, device=device)
    plan = lambda m=3, w=ROW_BYTES: torch.zeros(m, w, dtype=torch.uint8, device=device)  # noqa: E731
    counts = torch.zeros(3, dtype=torch.int32, device=device)
    mid_row = torch.zeros(5, ROW_BYTES, dtype=torch.uint8, device=device).view(-1)[24:72].view(3, ROW_BYTES)
    bad = [
        ("extend_lens", (cuda(lens.double()), cuda(lens), cuda(plan()), cuda(plan()), cuda(counts))),
        ("extend_lens", (cuda(lens.reshape(1, 1)), cuda(lens.reshape(1, 1)), cuda(plan()), cuda(plan()),
                         cuda(counts))),
        ("seq_lens", (cuda(lens), cuda(lens.to(torch.int16)), cuda(plan()), cuda(plan()), cuda(counts))),
        ("seq_lens", (cuda(lens), host(lens), cuda(plan()), cuda(plan()), cuda(counts))),
        ("seq_lens", (cuda(lens), cuda(torch.cat([lens, lens])), cuda(plan()), cuda(plan()), cuda(counts))),
        ("compress_plan", (cuda(lens), cuda(lens), host(plan()), cuda(plan()), cuda(counts))),
        ("compress_plan", (cuda(lens), cuda(lens), cuda(plan(3, 15)), cuda(plan(3, 15)), cuda(counts))),
        ("compress_plan", (cuda(lens), cuda(lens), cuda(mid_row), cuda(plan()), cuda(counts))),  # 8 bytes off
        ("write_plan", (cuda(lens), cuda(lens), cuda(plan()), cuda(plan(2)), cuda(counts))),
        ("counts", (cuda(lens), cuda(lens), cuda(plan()), cuda(plan()), host(counts))),
        ("counts", (cuda(lens), cuda(lens), cuda(plan()), cuda(plan()), cuda(counts[:2]))),
        ("counts", (cuda(lens), cuda(lens), cuda(plan()), cuda(plan()), cuda(counts.float()))),
    ]
    for name, args in bad:
        with pytest.raises(ERRORS, match=f"'{name}'"):
            module.plan_online_prefill_counted(*args[:4], True, args[4])


# No GPU needed: the host path and the new argument's boundary.


def test_gpu_path_refuses_outputs_sharing_memory():
    """The GPU path's memory check runs on the host before its launch, so without a GPU host tensors
    labelled as CUDA ones stand in (with one, they are CUDA tensors)."""
    module = kernels()
    device, place = CHECK_DEVICE, on_gpu_path
    lens = torch.tensor([3], dtype=torch.int64, device=device)
    rows = torch.zeros(4, ROW_BYTES, dtype=torch.uint8, device=device)
    compress, write = rows[:3], torch.zeros(3, ROW_BYTES, dtype=torch.uint8, device=device)
    counts_in_row_2 = rows[2].view(torch.int32)[:3]
    lens_in_row_0 = compress.view(torch.int64).view(-1)[:1]
    before = rows.clone()
    cases = [
        ((lens, lens, compress, write, counts_in_row_2), "'counts': expected memory apart from 'compress_plan'"),
        ((lens_in_row_0, lens, compress, write, None), "'compress_plan': expected memory apart from 'extend_lens'"),
        ((lens, lens, compress, compress, None), "'write_plan': expected memory apart from 'compress_plan'"),
    ]
    for (extend, seq, compress_plan, write_plan, counts), message in cases:
        with pytest.raises(ValueError, match=message):
            module.plan_online_prefill_counted(place(extend), place(seq), place(compress_plan), place(write_plan),
                                               True, None if counts is None else place(counts))
    if cuda_available():
        torch.cuda.synchronize()
    assert torch.equal(rows, before)


class _SixArguments:
    """The compiled planner's counted export, always called with a trailing ``counts=None``."""

    def __init__(self, module):
        self.module = module

    def plan_online_prefill(self, *args):
        return self.module.plan_online_prefill_counted(*args, None)


def test_counts_with_host_lengths_raise():
    module = kernels()
    lens = torch.tensor([3], dtype=torch.int64)
    plan = torch.zeros(3, ROW_BYTES, dtype=torch.uint8)
    with pytest.raises(ValueError, match="'counts'"):
        module.plan_online_prefill_counted(lens, lens, plan, plan.clone(), True, torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("graph", [False, True])
def test_host_path_with_none_counts_is_the_five_argument_call(graph):
    module = kernels()
    for extend, seq in ([[3, 130, 1], [130, 130, 7]], [[5], [15]], [[], []], [[1000, 1], [1100, 1]]):
        want = plan_with(module, extend, seq, graph, fill_seed=1)
        got = plan_with(_SixArguments(module), extend, seq, graph, fill_seed=1)
        assert got[0] == want[0] and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_the_planner_variant_writes_the_kernel_variants_bytes():
    from flash_compress.c128_online import load_planner

    planner = load_planner(use_pdl=True)
    for graph in (False, True):
        for extend, seq in ([[3, 130, 1], [130, 130, 7]], [[1000, 1], [1100, 1]]):
            want = plan_with(kernels(), extend, seq, graph, fill_seed=2)
            got = plan_with(planner, extend, seq, graph, fill_seed=2)
            assert got[0] == want[0] and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


@pytest.mark.gpu
def test_the_planner_variant_plans_on_the_gpu_as_the_kernel_variants(gpu):
    from flash_compress.c128_online import load_planner

    planner = load_planner(use_pdl=True)
    for extend, seq in (([3, 130, 1], [130, 130, 7]), ([5], [15]), ([0, 4], [4, 4])):
        want = gpu_plan(kernels(), extend, seq, fill_seed=3)
        got = gpu_plan(planner, extend, seq, fill_seed=3)
        assert got[0] == want[0] and got[3] == want[3]
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


@pytest.mark.parametrize(("export", "nargs"), [("plan_online_prefill", n) for n in (0, 4, 6)]
                         + [("plan_online_prefill_counted", n) for n in (0, 5, 7)])
def test_wrong_argument_counts_raise_type_error(export, nargs):
    module = kernels()
    lens = torch.tensor([3], dtype=torch.int64)
    plan = torch.zeros(3, ROW_BYTES, dtype=torch.uint8)
    args = [lens, lens, plan, plan.clone(), True, None, None][:nargs]
    expected = 5 if export == "plan_online_prefill" else 6
    with pytest.raises(TypeError, match=f"Expected {expected} but got {nargs}"):
        getattr(module, export)(*args)


# --- CUDA graphs -------------------------------------------------------------------------------


def random_partition(rng: random.Random, total: int, parts: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def random_states(gen: torch.Generator, slots: int, d: int) -> torch.Tensor:
    """Finite prior states [max | sum | kv] (sum > 0)."""
    m = torch.randn(slots, 1, d, generator=gen)
    s = torch.rand(slots, 1, d, generator=gen) * 3 + 0.5
    kv = torch.randn(slots, 1, d, generator=gen)
    return torch.cat([m, s, kv], dim=2)


@pytest.mark.gpu
@pytest.mark.parametrize("use_pdl", [False, True], ids=["pdl0", "pdl1"])
def test_graph_replays_plan_and_prefill_with_new_lengths(gpu, use_pdl):
    d, slots, batch, m = 128, 12, 5, 700
    module = kernels(d, use_pdl)
    rng = random.Random(int(use_pdl))
    gen = torch.Generator().manual_seed(int(use_pdl))
    dev = "cuda"
    ape = torch.randn(CHUNK_SIZE, d, generator=gen).to(dev)
    slot_of = [3, 0, 7, 5, 9]
    indices = torch.tensor(slot_of, dtype=torch.int32, device=dev)
    extend_lens = torch.zeros(batch, dtype=torch.int64, device=dev)
    seq_lens = torch.zeros(batch, dtype=torch.int64, device=dev)
    compress = torch.empty(m, ROW_BYTES, dtype=torch.uint8, device=dev)
    write = torch.empty(m, ROW_BYTES, dtype=torch.uint8, device=dev)
    counts = torch.zeros(3, dtype=torch.int32, device=dev)
    inp = torch.zeros(m, 2 * d, device=dev)
    out = torch.zeros(m, d, device=dev)
    buf = torch.zeros(slots, 1, 3 * d, device=dev)

    def step():
        module.plan_online_prefill_counted(extend_lens, seq_lens, compress, write, True, counts)
        module.run_prefill(buf, inp, out, ape, indices, compress, write, None)

    extend_lens.fill_(m // batch)
    seq_lens.fill_(m // batch)
    graph, _ = capture(step)

    replays = 0
    for rep in range(8):
        extend = random_partition(rng, m, batch)
        prefix = [rng.choice([0, 1, 127, 128, 129, rng.randint(0, 5000)]) for _ in range(batch)]
        seq = [p + e for p, e in zip(prefix, extend)]
        bad = rep == 4  # one replay with invalid lengths: nothing may be written
        if bad:
            extend[2], seq[2] = 0, prefix[2]
        x = torch.randn(m, 2 * d, generator=gen)
        x[:, d:] *= 3.0
        prior = random_states(gen, slots, d)
        extend_lens.copy_(torch.tensor(extend))
        seq_lens.copy_(torch.tensor(seq))
        inp.copy_(x)
        buf.copy_(prior)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        what = f"replay {rep} (extend {extend}, seq {seq})"

        got_out, got_buf, got_counts = out.cpu(), buf.cpu(), counts.cpu().tolist()
        if bad:
            # extend_lens[2] = 0 also leaves the sum short of M.
            assert got_counts == [0, 0, EXTEND_NOT_POSITIVE | SUM_MISMATCH], f"{what}: counts {got_counts}"
            assert bool(torch.isnan(got_out).all()), f"{what}: output written for invalid lengths"
            assert torch.equal(got_buf, prior), f"{what}: states written for invalid lengths"
            continue
        (_, _), host_c, host_w = plan_with(module, extend, seq, True)
        assert torch.equal(compress.cpu(), host_c) and torch.equal(write.cpu(), host_w), f"{what}: plans differ"
        want_c, want_w = ref.plan_segments(extend, seq)
        assert got_counts == [len(want_c), len(want_w), 0], f"{what}: counts {got_counts}"

        want_out = torch.full((m, d), float("nan"))
        want_buf = prior.clone()
        ref.run_prefill(want_buf, x, want_out, ape.cpu(), indices.cpu(), host_c, host_w, None)
        written = ~torch.isnan(want_out).all(dim=1)
        assert int(written.sum()) == len(want_c)
        oracle.assert_rows_close(got_out[written], want_out[written], f"{what}: output rows")
        assert bool(torch.isnan(got_out[~written]).all()), f"{what}: rows without a closed chunk were written"
        stored = {slot_of[int(row[1])] for row in want_w}
        for slot in range(slots):
            if slot in stored:
                check_state_against(got_buf[slot, 0], want_buf[slot, 0], f"{what}: state of slot {slot}")
            else:
                assert torch.equal(got_buf[slot], prior[slot]), f"{what}: slot {slot} must stay untouched"
        replays += 1
    assert replays == 7


@pytest.mark.gpu
def test_graph_replays_the_planner_alone_at_large_batch(gpu):
    """Multi-tile batches under replay: the partition changes, M and B stay."""
    module = kernels()
    batch, m = 4100, 300_000
    rng = random.Random(5)
    extend_lens = torch.ones(batch, dtype=torch.int32, device="cuda")
    seq_lens = torch.ones(batch, dtype=torch.int64, device="cuda")
    compress = torch.empty(m, ROW_BYTES, dtype=torch.uint8, device="cuda")
    write = torch.empty_like(compress)
    counts = torch.zeros(3, dtype=torch.int32, device="cuda")
    graph, _ = capture(lambda: module.plan_online_prefill_counted(extend_lens, seq_lens, compress, write, True, counts))
    for _ in range(3):
        extend = random_partition(rng, m, batch)
        seq = [e + rng.randint(0, 10**6) for e in extend]
        extend_lens.copy_(torch.tensor(extend, dtype=torch.int32))
        seq_lens.copy_(torch.tensor(seq))
        graph.replay()
        torch.cuda.synchronize()
        (_, _), host_c, host_w = plan_with(module, extend, seq, True)
        assert torch.equal(compress.cpu(), host_c) and torch.equal(write.cpu(), host_w)
        assert counts.tolist()[2] == 0
