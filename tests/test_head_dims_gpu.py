"""Every kind of supported head_dim on the GPU, beyond the 128, 256 and 512 the other GPU tests run.

A variant builds for any multiple of 64 in [64, 1024] (``is_supported_head_dim``); what changes with
the head dim is how threads map onto channels: decode and verify give a request ``head_dim / 4``
lanes, which is under a warp at 64, not a power of two at 192 and 320 (so bf16 decode does not run
at a full SM of threads there), and 256 (a whole block) at 1024; a prefill pass splits the channels
into 1 to 128 slices of 64, 32, 16 or 8 (a compress pass at 1024 also 8 of 128). One mixed schedule
per (head_dim, state dtype), PDL on:
prefills (exact, CUDA-graph and compact plans, slot moves), decode steps and speculative verify +
commit steps, every row and state against the float64 oracle and, step by step, against the
reference that emulates the pool's stores (``tests/schedule.py``). Its passes are a few rows, so they
run 8- or 16-channel slices (and one 32-channel write pass at 1024); a second test gives each head dim
the fewest requests whose passes run 32 and 64.
"""

from __future__ import annotations

import pytest
import torch

import flash_compress as fc
from flash_compress import reference as ref
from flash_compress.c128_online import STATE_DTYPES, spec
from schedule import ScheduleHarness, prefill_pass, rows_for_slice_width, run_schedule

pytestmark = pytest.mark.gpu

#: 16 lanes a request (under a warp), 48 and 80 (not powers of two), 256 (a whole block).
HEAD_DIMS = (64, 192, 320, 1024)


@pytest.fixture(scope="module")
def variants():
    """The variants, built at once in parallel (one alone takes about a minute) and loaded. (The module's
    ``gpu`` mark skips its tests without a GPU; the ``gpu`` fixture is per test, so not asked for here.)"""
    from flash_compress.jit import cli

    grid = [(f"head_dim={d} state={s}", spec(d, True, s)) for d in HEAD_DIMS for s in STATE_DTYPES]
    assert cli.prebuild(grid) == 0, "a variant failed to build (its log is named above)"
    return {(d, s): fc.load_module(d, True, s) for d in HEAD_DIMS for s in STATE_DTYPES}


@pytest.mark.parametrize("state_dtype", list(STATE_DTYPES))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_mixed_schedule_with_verify_steps(variants, head_dim, state_dtype):
    stats = run_schedule(variants[(head_dim, state_dtype)], head_dim=head_dim, device="cuda", steps=40,
                         seed=900 + head_dim, num_slots=14, max_requests=6, state_dtype=getattr(torch, state_dtype),
                         compact=None, shadow=ref, verify_prob=0.4, verify_bad_prob=0.2)
    assert stats.rows_checked > 0 and stats.states_checked > 0 and stats.prefill_calls > 0
    assert stats.decode_calls > 0 and stats.verify_calls > 0 and stats.commits > 0
    assert stats.shadow_checks == stats.decode_calls + stats.prefill_calls + 2 * stats.verify_calls


@pytest.mark.parametrize("state_dtype", list(STATE_DTYPES))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_32_and_64_channel_slices(variants, head_dim, state_dtype):
    """The fewest requests whose passes run 32 and then 64-channel slices (1 to 32 slices a row here):
    a write-only step of them all, then 128 tokens for the 32-channel count and for all, one compress
    row each (the mirror ``prefill_pass`` says which width runs) and a write row; against the oracle."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = rows_for_slice_width(head_dim, sms)
    h = ScheduleHarness(variants[(head_dim, state_dtype)], head_dim=head_dim, device="cuda", seed=950 + head_dim,
                        num_slots=rows[64] + 1, max_requests=rows[64], state_dtype=getattr(torch, state_dtype))
    batch = [h.start_request() for _ in range(rows[64])]
    h.prefill_step([(r, 60, None) for r in batch])  # write rows only
    reached = {("write", prefill_pass(rows[64], head_dim, sms, write_pass=True)[0])}
    for count in (rows[32], rows[64]):
        h.prefill_step([(r, 128, None) for r in batch[:count]])
        reached.add(("compress", prefill_pass(count, head_dim, sms)[0]))
    h.check_live_states()
    assert reached == {("write", 64), ("compress", 32), ("compress", 64)}, sorted(reached)
    assert h.stats.rows_checked >= rows[32] + rows[64]
