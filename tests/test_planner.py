"""The compiled planner (needs nvcc, not a GPU) against the reference planner, byte for byte.

Hand-picked and seeded-random cases; the property-based ones are in ``tests/test_fuzz.py``.

The compiled module is ``flash_compress.load_module(head_dim=128)``; its host
function ``plan_online_prefill`` takes CPU int64 lengths and uint8 ``[M, 16]``
plans and returns a ``tvm_ffi.Array`` of 2 ints. Both planners get plans filled
with the same random bytes first, so bytes either one leaves unwritten show.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flash_compress import reference as ref
from flash_compress.plan_rows import CHUNK_SIZE, ROW_BYTES
from schedule import plan_with
from test_reference import ERROR_CASES, check_plan_invariants

pytestmark = pytest.mark.nvcc

ERRORS = (ValueError, TypeError, RuntimeError)


@pytest.fixture(scope="module")
def module():
    """The compiled head_dim=128 variant (compiled once, then loaded from the cache)."""
    import flash_compress

    return flash_compress.load_module(head_dim=128)


def test_compiling_a_variant_works(module):
    for name in ("run_decode", "run_prefill", "plan_online_prefill"):
        assert callable(getattr(module, name)), name


def assert_same_plans(module, extend, seq, graph, fill_seed=0):
    """Both planners on identical random-filled plans: same counts, same bytes everywhere."""
    got_counts, got_c, got_w = plan_with(module, extend, seq, graph, fill_seed=fill_seed)
    want_counts, want_c, want_w = plan_with(ref, extend, seq, graph, fill_seed=fill_seed)
    where = f"extend_lens={extend[:8]}{'...' if len(extend) > 8 else ''} seq_lens={seq[:8]} graph={graph}"
    assert got_counts == want_counts, f"{where}: counts {got_counts} != reference {want_counts}"
    nc, nw = want_counts
    assert torch.equal(got_c[:nc], want_c[:nc]), f"{where}: compress rows differ"
    assert torch.equal(got_w[:nw], want_w[:nw]), f"{where}: write rows differ"
    # Rows past the counts: untouched without use_cuda_graph (same random bytes), 0xFF padding with it.
    assert torch.equal(got_c, want_c), f"{where}: compress plan bytes past row {nc} differ"
    assert torch.equal(got_w, want_w), f"{where}: write plan bytes past row {nw} differ"
    check_plan_invariants(extend, seq, got_counts, got_c, got_w, graph)


EDGE_CASES = [
    ([5], [15]),  # crossing no chunk boundary
    ([1], [50]),  # extend of 1
    ([1], [1]),  # first token
    ([50], [150]),  # crossing one boundary
    ([300], [300]),  # crossing many
    ([1000], [1100]),
    ([1], [128]),  # prefix ending at 127
    ([1], [129]),  # prefix ending at 128
    ([1], [130]),  # prefix ending at 129
    ([200], [327]),
    ([200], [328]),
    ([200], [329]),
    ([128], [128]),  # full 128-aligned
    ([256], [384]),
    ([127], [127]),
    ([129], [129]),
    ([3, 130, 1], [130, 130, 7]),
    ([128] * 8, [128 * k for k in range(1, 9)]),
    ([3], [1_000_000]),
    ([], []),  # empty batch
]

# Near the uint32 limit (positions are uint32; the longest accepted seq_len is
# 2**32 - 2): the last chunk ends at 2**32, which overflows a uint32 chunk end.
# Run in a subprocess, so a crash fails this test instead of killing the session.
LIMIT_CASES = [
    ([7], [2**32 - 2]),
    ([200], [2**32 - 2]),
    ([1], [2**32 - 129]),
    ([130], [2**32 - 128]),
    ([3, 5], [2**32 - 2, 2**32 - 3]),
]


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("case", range(len(EDGE_CASES)))
def test_edge_cases_match_reference(module, case, graph):
    extend, seq = EDGE_CASES[case]
    assert_same_plans(module, extend, seq, graph, fill_seed=case)


_LIMIT_SCRIPT = """
import sys
sys.path[:0] = [{tests!r}, {python!r}]
import flash_compress
from test_planner import LIMIT_CASES, assert_same_plans
module = flash_compress.load_module(head_dim=128)
for extend, seq in LIMIT_CASES:
    for graph in (False, True):
        print("case", extend, seq, graph, flush=True)
        assert_same_plans(module, extend, seq, graph)
print("ALL OK", flush=True)
"""


def test_lengths_near_uint32_limit_match_reference(module):
    """All LIMIT_CASES in one subprocess; its output names the case it was on if it dies."""
    tests = Path(__file__).resolve().parent
    script = _LIMIT_SCRIPT.format(tests=str(tests), python=str(tests.parent / "python"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    last = ([line for line in proc.stdout.splitlines() if line.startswith("case")] or ["(before any case)"])[-1]
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, (
        f"planner subprocess exited {proc.returncode} on {last}\n{proc.stderr[-1500:]}"
    )


@pytest.mark.parametrize("flag", [0, 1, 2, -1, 2**63 - 1, True, np.int64(1), np.int32(0)])
def test_an_int_use_cuda_graph_is_its_truth_value_in_both_planners(module, flag):
    """tvm-ffi hands the export an integer (Python or numpy, int64-sized) as a bool; the reference takes
    it the same way."""
    counts = []
    for impl in (module, ref):
        compress, write = (torch.zeros(5, ROW_BYTES, dtype=torch.uint8) for _ in range(2))
        result = impl.plan_online_prefill(torch.tensor([3, 2]), torch.tensor([5, 2]), compress, write, flag)
        counts.append((tuple(int(x) for x in result), compress, write))
    (got, got_c, got_w), (want, want_c, want_w) = counts
    assert got == want == ((5, 5) if flag else (0, 2))
    assert torch.equal(got_c, want_c) and torch.equal(got_w, want_w)


@pytest.mark.parametrize("flag", [np.bool_(True), 1.0, None, "yes", 2**63], ids=repr)
def test_a_use_cuda_graph_tvm_ffi_refuses_is_refused_by_both_planners(module, flag):
    for impl in (module, ref):
        compress, write = (torch.zeros(5, ROW_BYTES, dtype=torch.uint8) for _ in range(2))
        with pytest.raises((TypeError, OverflowError)):  # tvm-ffi 0.1.4 raises OverflowError for 2**63
            impl.plan_online_prefill(torch.tensor([3, 2]), torch.tensor([5, 2]), compress, write, flag)
        assert not compress.any() and not write.any()


@pytest.mark.parametrize("graph", [False, True])
def test_random_cases_match_reference(module, graph):
    rng = random.Random(1234)
    for i in range(200):
        n = rng.randint(0, 16)
        extend = [rng.choice([1, rng.randint(1, 16), rng.randint(1, 300), 128, 256]) for _ in range(n)]
        seq = [e + rng.choice([0, 127, 128, 129, rng.randint(0, 1000), rng.randint(0, 10**6)]) for e in extend]
        assert_same_plans(module, extend, seq, graph, fill_seed=i)


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
@pytest.mark.parametrize("graph", [False, True])
def test_errors_raise_and_write_nothing(module, case, graph):
    """Each bad input raises a Python exception (never crashes) and leaves the plans untouched."""
    extend, seq, cp, wp = ERROR_CASES[case]()
    before = (cp.clone(), wp.clone())
    with pytest.raises(ERRORS):
        module.plan_online_prefill(extend, seq, cp, wp, graph)
    assert torch.equal(cp, before[0]) and torch.equal(wp, before[1]), f"{case}: plan bytes written before the error"


def test_more_error_cases(module):
    lens = torch.tensor([3], dtype=torch.int64)
    plan = lambda m=3, w=ROW_BYTES: torch.zeros(m, w, dtype=torch.uint8)  # noqa: E731
    bad = {
        "extend int32": (lens.int(), lens, plan(), plan()),
        "seq int32": (lens, lens.int(), plan(), plan()),
        "extend float64": (lens.double(), lens, plan(), plan()),
        "2-D lengths": (lens.reshape(1, 1), lens.reshape(1, 1), plan(), plan()),
        "plan one row short": (lens, lens, plan(2), plan(2)),
        "plan 15 columns": (lens, lens, plan(3, 15), plan(3, 15)),
        "plan 17 columns": (lens, lens, plan(3, 17), plan(3, 17)),
        "write plan short": (lens, lens, plan(), plan(2)),
        "transposed plan": (lens, lens, torch.zeros(ROW_BYTES, 3, dtype=torch.uint8).t(), plan()),
        "3-D plan": (lens, lens, plan().reshape(3, 16, 1), plan()),
    }
    for name, args in bad.items():
        try:
            module.plan_online_prefill(*args, False)
        except ERRORS:
            continue
        pytest.fail(f"{name}: accepted without an error")


@pytest.mark.gpu
def test_cuda_device_lengths_raise(module, gpu):
    lens = torch.tensor([3], dtype=torch.int64)
    plan = torch.zeros(3, ROW_BYTES, dtype=torch.uint8)
    with pytest.raises(ERRORS):
        module.plan_online_prefill(lens.cuda(), lens.cuda(), plan, plan.clone(), False)
    with pytest.raises(ERRORS):
        module.plan_online_prefill(lens, lens, plan.cuda(), plan.cuda(), False)


def test_kernels_given_cpu_tensors_raise(module):
    """No GPU needed: the device checks run on the host before any launch and name the tensor."""
    d = 128
    buf, inp, out = torch.zeros(4, 1, 3 * d), torch.zeros(2, 2 * d), torch.zeros(2, d)
    ape, idx = torch.zeros(CHUNK_SIZE, d), torch.zeros(2, dtype=torch.int32)
    plan = torch.zeros(0, ROW_BYTES, dtype=torch.uint8)
    with pytest.raises(ERRORS, match="kv_score_buffer"):
        module.run_decode(buf, inp, out, ape, idx, idx + 1, None)
    with pytest.raises(ERRORS, match="kv_score_buffer"):
        module.run_prefill(buf, inp, out, ape, idx, plan, plan, None)
