"""Property-based tests (hypothesis): the planners, and the reference against the float64 oracle.

The one place for the suite's random-input properties:

- the compiled planner (needs nvcc, not a GPU) against the reference planner,
  byte for byte, on random batches of 0 to 512 requests with lengths up to
  ~1e6, with and without CUDA-graph padding;
- plans exactly sized succeed; one row short (either plan, or both) or one row
  long must raise in both planners and write nothing;
- the reference planner's invariants (every new token covered once, rows
  well formed and in order);
- the reference kernels against the float64 offline oracle over random
  engine-like schedules (``tests/schedule.py``), head_dim 64 for speed.

Examples are derandomized in CI (conftest's ``ci`` profile); set
``FLASH_COMPRESS_HYPOTHESIS_PROFILE=long`` for many more, random ones. Example
counts below are per-test fractions of the profile's, so that the CI run of
this file stays around 30 s.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flash_compress import reference as ref
from flash_compress.plan_rows import ROW_BYTES
from schedule import plan_with, run_schedule
from test_reference import check_plan_invariants

ERRORS = (ValueError, TypeError, RuntimeError)
BOUNDARY_PREFIXES = [0, 1, 127, 128, 129, 255, 256, 257]


def examples(fraction: float):
    """``settings`` with ``fraction`` of the active profile's example count (at least 5)."""
    return settings(max_examples=max(5, int(settings.default.max_examples * fraction)))


@st.composite
def prefill_batches(draw, max_batch=12, max_extend=400, max_prefix=600, max_long_extend=0):
    """Random batches ``(extend_lens, seq_lens)``; with ``max_long_extend``, one request may be that long."""
    n = draw(st.integers(0, max_batch))
    extend = draw(st.lists(st.one_of(st.integers(1, max_extend), st.sampled_from([1, 127, 128, 129, 256])),
                           min_size=n, max_size=n))
    if n and max_long_extend and draw(st.booleans()):
        extend[draw(st.integers(0, n - 1))] = draw(st.integers(1, max_long_extend))
    prefix = draw(st.lists(st.one_of(st.integers(0, max_prefix), st.sampled_from(BOUNDARY_PREFIXES)),
                           min_size=n, max_size=n))
    return extend, [e + p for e, p in zip(extend, prefix)]


@pytest.fixture(scope="module")
def module():
    """The compiled head_dim=128 variant (compiled once, then loaded from the cache)."""
    import flash_compress

    return flash_compress.load_module(head_dim=128)


# ---------------------------------------------------------------------------
# The compiled planner against the reference planner.
# ---------------------------------------------------------------------------


@pytest.mark.nvcc
@examples(0.3)
@given(batch=prefill_batches(max_batch=512, max_extend=300, max_prefix=10**6), graph=st.booleans())
def test_compiled_planner_matches_reference(module, batch, graph):
    from test_planner import assert_same_plans

    extend, seq = batch
    assert_same_plans(module, extend, seq, graph, fill_seed=len(extend))


@pytest.mark.nvcc
@examples(0.1)
@given(batch=prefill_batches(max_batch=8, max_extend=300, max_prefix=10**6, max_long_extend=10**6),
       graph=st.booleans())
def test_compiled_planner_matches_reference_on_long_extends(module, batch, graph):
    """Requests of up to 1e6 new tokens (and up to ~2e6 total length)."""
    from test_planner import assert_same_plans

    extend, seq = batch
    assert_same_plans(module, extend, seq, graph, fill_seed=len(extend))


def _plans(rows_compress: int, rows_write: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (rows_compress, ROW_BYTES), dtype=torch.uint8, generator=gen),
            torch.randint(0, 256, (rows_write, ROW_BYTES), dtype=torch.uint8, generator=gen))


def _wrong_sizes(m: int) -> list[tuple[int, int]]:
    """(compress rows, write rows) one row off the ``m`` both plans need."""
    sizes = [(m + 1, m + 1), (m, m + 1), (m + 1, m)]
    if m:
        sizes += [(m - 1, m - 1), (m, m - 1), (m - 1, m)]
    return sizes


@examples(0.15)
@given(batch=prefill_batches(max_batch=64, max_extend=300, max_prefix=10**6), graph=st.booleans())
def test_reference_planner_refuses_plans_one_row_off(batch, graph):
    _check_one_row_off(ref, batch, graph)


@pytest.mark.nvcc
@examples(0.15)
@given(batch=prefill_batches(max_batch=64, max_extend=300, max_prefix=10**6), graph=st.booleans())
def test_compiled_planner_refuses_plans_one_row_off(module, batch, graph):
    _check_one_row_off(module, batch, graph)


def _check_one_row_off(planner, batch, graph) -> None:
    """Exactly sized plans are accepted; every size one row off raises and leaves both plans as they were."""
    extend, seq = batch
    m = sum(extend)
    lens = torch.tensor(extend, dtype=torch.int64), torch.tensor(seq, dtype=torch.int64)
    planner.plan_online_prefill(*lens, *_plans(m, m, 0), graph)
    for rows in _wrong_sizes(m):
        compress_plan, write_plan = _plans(*rows, seed=sum(rows))
        before = compress_plan.clone(), write_plan.clone()
        with pytest.raises(ERRORS):
            planner.plan_online_prefill(*lens, compress_plan, write_plan, graph)
        assert torch.equal(compress_plan, before[0]) and torch.equal(write_plan, before[1]), (
            f"rows {rows} for m={m}: plans written before the error"
        )


# ---------------------------------------------------------------------------
# The reference planner's invariants.
# ---------------------------------------------------------------------------


@examples(0.5)
@given(batch=prefill_batches(max_batch=512, max_extend=300, max_prefix=10**6), graph=st.booleans())
def test_reference_planner_invariants(batch, graph):
    extend, seq = batch
    counts, cp, wp = plan_with(ref, extend, seq, graph, fill_seed=len(extend))
    check_plan_invariants(extend, seq, counts, cp, wp, graph)


# ---------------------------------------------------------------------------
# The reference kernels against the float64 offline oracle.
# ---------------------------------------------------------------------------


@examples(0.15)
@given(
    seed=st.integers(0, 2**31 - 1),
    decode_prob=st.sampled_from([0.0, 0.5, 0.9]),
    cuda_graph=st.sampled_from([None, False, True]),
    relocate_prob=st.sampled_from([0.0, 0.3, 0.8]),
    max_requests=st.integers(1, 6),
)
def test_reference_matches_oracle_on_random_schedules(seed, decode_prob, cuda_graph, relocate_prob, max_requests):
    """Every emitted row, every written state and every live state of a random schedule match the oracle."""
    run_schedule(ref, head_dim=64, steps=12, seed=seed, decode_prob=decode_prob, cuda_graph=cuda_graph,
                 relocate_prob=relocate_prob, max_requests=max_requests, num_slots=max_requests + 4,
                 max_step_tokens=400)


# ---------------------------------------------------------------------------
# The memory check of the reference (and the torch API's decode move).
# ---------------------------------------------------------------------------


def _element_bytes(view: torch.Tensor, base: torch.Tensor) -> set[int]:
    """The byte offsets (into ``base``'s storage) of every element of ``view``."""
    index = torch.arange(base.numel(), dtype=torch.int64).as_strided(view.shape, view.stride(),
                                                                      view.storage_offset())
    size = view.element_size()
    return {int(i) * size + k for i in index.flatten().tolist() for k in range(size)}


_views = st.tuples(st.integers(0, 40), st.integers(1, 6), st.integers(1, 6), st.integers(0, 9),
                   st.integers(0, 9), st.sampled_from(["contiguous", "strided", "expanded"]))


def _view(base: torch.Tensor, spec) -> torch.Tensor:
    offset, rows, cols, row_step, col_step, kind = spec
    if kind == "contiguous":
        return base[offset:offset + rows * cols].view(rows, cols)
    if kind == "expanded":
        return base[offset:offset + cols].unsqueeze(0).expand(rows, cols)
    return base.as_strided((rows, cols), (row_step, col_step), offset)


@examples(1.0)
@given(first=_views, second=_views, second_written=st.booleans())
@example(first=(0, 2, 3, 0, 0, "contiguous"), second=(6, 1, 2, 0, 0, "contiguous"), second_written=True)  # touch
@example(first=(0, 2, 3, 0, 0, "contiguous"), second=(5, 1, 2, 0, 0, "contiguous"), second_written=False)
def test_check_apart_never_misses_shared_memory(first, second, second_written):
    """Against the element sets: two views sharing a byte where one is written are always refused, a
    written view that repeats an element is always refused, and contiguous views are refused exactly when
    they share a byte (strided ones may be refused for interleaving)."""
    from flash_compress._arguments import check_apart

    base = torch.zeros(200)
    a, b = _view(base, first), _view(base, second)
    a_bytes, b_bytes = _element_bytes(a, base), _element_bytes(b, base)
    repeats = lambda view, view_bytes: len(view_bytes) < view.numel() * view.element_size()  # noqa: E731
    try:
        check_apart([("first", a, True), ("second", b, second_written)])
        refused = False
    except ValueError:
        refused = True
    if repeats(a, a_bytes) or (second_written and repeats(b, b_bytes)) or a_bytes & b_bytes:
        assert refused
    elif a.is_contiguous() and b.is_contiguous():
        assert not refused
