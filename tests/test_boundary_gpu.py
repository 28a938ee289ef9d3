"""Values the host cannot check (slots outside the pool, seq_len < 1, plan rows that do not fit) on the GPU.

The kernels skip such rows (``docs/RELIABILITY.md``). Each call here mixes
good rows with bad ones and runs through ``DeviceRunner`` with guard zones
around the state buffer and the output, then checks: no fault, nothing
written outside the tensors, every skipped row's output still NaN and its
slot bitwise untouched, every kept row equal to the reference run on the
kept rows alone (``tests/device_values.py`` states the skip rule).
Skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch

import device_values as dv
from device_runner import DeviceRunner
from schedule import ScheduleHarness

pytestmark = pytest.mark.gpu

PDL = (False, True)
_modules: dict[tuple[int, bool], object] = {}


def runner(head_dim: int, use_pdl: bool) -> DeviceRunner:
    """The compiled variant behind guard zones of 1024 floats on each side."""
    key = (head_dim, use_pdl)
    if key not in _modules:
        import flash_compress

        _modules[key] = flash_compress.load_module(head_dim=head_dim, use_pdl=use_pdl)
    return DeviceRunner(_modules[key], guard_elems=1024)


@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
@pytest.mark.parametrize("head_dim", [128, 512])
def test_decode_skips_requests_with_bad_slot_or_seq_len(gpu, head_dim, use_pdl):
    run = runner(head_dim, use_pdl)
    checked = {"rows": 0, "slots": 0}
    for seed in range(12):
        call = dv.bad_decode_call(seed, head_dim)
        buffer, output = call.buffer.clone(), call.output.clone()
        run.run_decode(buffer, call.inputs, output, call.ape, call.indices, call.seq_lens, None)
        counts = dv.check_against_reference(call, buffer, output, f"decode seed {seed}")
        checked["rows"] += counts["rows"]
        checked["slots"] += counts["slots"]
    assert checked["rows"] > 0 and checked["slots"] > 0


@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
def test_decode_with_every_request_bad_writes_nothing(gpu, use_pdl):
    run = runner(128, use_pdl)
    call = dv.bad_decode_call(0, 128)
    slots = call.buffer.shape[0]
    call.indices = torch.tensor([[-1, slots, dv.INT32_MAX, dv.INT32_MIN][b % 4] for b in range(len(call.indices))],
                                dtype=torch.int32)
    buffer, output = call.buffer.clone(), call.output.clone()
    run.run_decode(buffer, call.inputs, output, call.ape, call.indices, call.seq_lens, None)
    assert torch.equal(buffer.view(torch.int32), call.buffer.view(torch.int32)) and bool(torch.isnan(output).all())


@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
@pytest.mark.parametrize("head_dim", [128, 512])
def test_prefill_skips_spoilt_plan_rows_and_bad_slots(gpu, head_dim, use_pdl):
    run = runner(head_dim, use_pdl)
    checked = {"rows": 0, "slots": 0, "spoilt": 0}
    for seed in range(16):
        call = dv.bad_prefill_call(seed, head_dim)
        buffer, output = call.buffer.clone(), call.output.clone()
        run.run_prefill(buffer, call.inputs, output, call.ape, call.indices, call.compress_plan, call.write_plan,
                        call.load_indices)
        counts = dv.check_against_reference(call, buffer, output, f"prefill seed {seed}")
        checked["rows"] += counts["rows"]
        checked["slots"] += counts["slots"]
        checked["spoilt"] += dv.spoilt_row_count(call)
    assert checked["rows"] > 0 and checked["slots"] > 0 and checked["spoilt"] > 0


@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
def test_random_plan_bytes_and_slots_are_memory_safe(gpu, use_pdl):
    """Garbage plans and slots: no fault, nothing outside the tensors written (the runner checks the guards)."""
    run = runner(128, use_pdl)
    for seed in range(40):
        call = dv.random_bytes_call(seed, 128)
        buffer, output = call.buffer.clone(), call.output.clone()
        run.run_prefill(buffer, call.inputs, output, call.ape, call.indices, call.compress_plan, call.write_plan,
                        call.load_indices)
        # Only slots some in-pool index names may change.
        named = {s for s in call.indices.tolist() if 0 <= s < buffer.shape[0]}
        for slot in range(buffer.shape[0]):
            if slot not in named:
                assert torch.equal(buffer[slot].view(torch.int32), call.buffer[slot].view(torch.int32)), (
                    f"seed {seed}: slot {slot} written though no index names it"
                )


@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
@pytest.mark.parametrize(("head_dim", "rows"), [(128, 1_200_000), (512, 3000)], ids=["wide", "narrow"])
def test_long_padded_plans_loop_every_block(gpu, use_pdl, head_dim, rows):
    """Real rows at random places among padding rows, most of them past the rows a pass splits into
    channel slices (as many as a planned plan can have live): 1.2M rows make every block walk several
    batches of rows on wide slices; 3000 rows run on narrow ones."""
    run = runner(head_dim, use_pdl)
    call = dv.long_padded_call(1, head_dim, rows=rows)
    buffer, output = call.buffer.clone(), call.output.clone()
    run.run_prefill(buffer, call.inputs, output, call.ape, call.indices, call.compress_plan, call.write_plan,
                    call.load_indices)
    counts = dv.check_against_reference(call, buffer, output, "long padded plans")
    assert counts["rows"] == 3 and counts["slots"] == 3


@pytest.mark.parametrize("use_pdl", PDL, ids=["pdl0", "pdl1"])
def test_valid_schedule_stays_inside_its_tensors(gpu, use_pdl):
    """The ordinary random schedule, with guard zones checked after every call."""
    run = runner(256, use_pdl)
    harness = ScheduleHarness(run, head_dim=256, device="cpu", seed=40 + int(use_pdl), num_slots=12)
    stats = harness.run(steps=30)
    assert stats.rows_checked > 0 and stats.relocations > 0 and run.calls == stats.decode_calls + stats.prefill_calls
