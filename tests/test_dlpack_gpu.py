"""DLPack neutrality on a CUDA GPU: the raw functions on cupy and jax arrays, and stream placement.

- cupy / jax: skipped with a reason where the package (or a GPU backend for it)
  is not installed. cupy arrays go in for every tensor; jax arrays are
  immutable, so jax gives the inputs and torch the buffers written in place.
  Their kernels run on tvm-ffi's environment stream, which
  ``tvm_ffi.use_raw_stream(device, stream.ptr)`` sets (torch tensors in a call
  set it to torch's current stream by themselves).
- Streams: work queued on a non-default stream runs on that stream. A long
  sleep kernel on the stream delays a copy that writes the call's input; a
  call that ran anywhere else would read the old input and fail the check.
"""

from __future__ import annotations

import pytest
import torch

import flash_compress as fc
import oracle
from flash_compress import reference as ref
from flash_compress.plan_rows import CHUNK_SIZE, decode_rows
from schedule import check_state_against

pytestmark = pytest.mark.gpu

D = 128
SLEEP_CYCLES = 200_000_000  # ~0.1 s on an H200: far longer than the host needs to queue the rest


@pytest.fixture(scope="module")
def module():
    return fc.load_module(head_dim=D)


def decode_case(seed: int = 0):
    """CPU tensors for one decode step: 3 requests, resetting (pos 0), mid-chunk and chunk-closing."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "state": torch.randn(4, 1, 3 * D, generator=gen),
        "inp": torch.randn(3, 2 * D, generator=gen),
        "ape": torch.randn(CHUNK_SIZE, D, generator=gen),
        "indices": torch.tensor([2, 0, 3], dtype=torch.int32),
        "seq_lens": torch.tensor([1, 70, 128], dtype=torch.int32),
    }


def reference_decode(case, inp=None):
    """The reference's (state, out) after the step, on the GPU, from CPU ``case``."""
    state = case["state"].cuda()
    out = torch.full((3, D), float("nan"), device="cuda")
    inp = case["inp"] if inp is None else inp
    ref.run_decode(state, inp.cuda(), out, case["ape"].cuda(), case["indices"].cuda(), case["seq_lens"].cuda())
    return state, out


def assert_decode_matches(state, out, want_state, want_out):
    state, out = torch.as_tensor(state, device="cuda"), torch.as_tensor(out, device="cuda")
    oracle.assert_rows_close(out[2], want_out[2], "closing row")
    assert torch.isnan(out[:2]).all(), "rows that close no chunk must stay untouched"
    for slot in (2, 0):
        check_state_against(state[slot, 0], want_state[slot, 0], f"slot {slot}")
    for slot in (1, 3):  # named by no request; stored nothing to (its token closes a chunk)
        assert torch.equal(state[slot], want_state[slot]), f"slot {slot} must stay untouched"


# ---------------------------------------------------------------------------
# cupy and jax.
# ---------------------------------------------------------------------------


def test_raw_functions_on_cupy_arrays_on_a_cupy_stream(gpu, module):
    cupy = pytest.importorskip("cupy", reason="cupy is not installed: the cupy DLPack test did not run")
    import tvm_ffi

    case = decode_case(1)
    want_state, want_out = reference_decode(case)
    arrays = {name: cupy.asarray(t.numpy()) for name, t in case.items()}
    out = cupy.full((3, D), cupy.nan, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()  # the fills above ran on cupy's null stream, which ours does not wait for
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream, tvm_ffi.use_raw_stream(tvm_ffi.device("cuda:0"), stream.ptr):
        module.run_decode(arrays["state"], arrays["inp"], out, arrays["ape"], arrays["indices"], arrays["seq_lens"],
                          None)
    stream.synchronize()
    assert_decode_matches(torch.from_dlpack(arrays["state"]), torch.from_dlpack(out), want_state, want_out)

    # A prefill with plans made on the host, as cupy arrays too.
    plan = fc.plan_prefill(torch.tensor([300]), torch.tensor([200]), device="cpu")
    inp = torch.randn(200, 2 * D)
    state = torch.randn(2, 1, 3 * D)
    want_state2, want_out2 = state.clone(), torch.full((200, D), float("nan"))
    idx = torch.tensor([1], dtype=torch.int32)
    ref.run_prefill(want_state2, inp, want_out2, case["ape"], idx, plan.compress_plan, plan.write_plan, None)
    c_state, c_out = cupy.asarray(state.numpy()), cupy.full((200, D), cupy.nan, dtype=cupy.float32)
    module.run_prefill(c_state, cupy.asarray(inp.numpy()), c_out, arrays["ape"], cupy.asarray(idx.numpy()),
                       cupy.asarray(plan.compress_plan.numpy()), cupy.asarray(plan.write_plan.numpy()), None)
    cupy.cuda.Device().synchronize()
    rows = decode_rows(plan.compress_plan)[:, 0].tolist()
    got_out2 = torch.from_dlpack(c_out).cpu()
    oracle.assert_rows_close(got_out2[rows], want_out2[rows], "prefill rows")
    unwritten = torch.ones(200, dtype=torch.bool)
    unwritten[rows] = False
    assert torch.isnan(got_out2[unwritten]).all(), "rows that close no chunk must stay untouched"
    check_state_against(torch.from_dlpack(c_state)[1, 0], want_state2[1, 0], "prefill state")
    assert torch.equal(torch.from_dlpack(c_state)[0].cpu(), state[0]), "slot 0 must stay untouched"


def test_raw_functions_on_jax_arrays(gpu, module):
    jax = pytest.importorskip("jax", reason="jax is not installed: the jax DLPack test did not run")
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError as exc:
        pytest.skip(f"jax has no GPU backend here ({exc}): the jax DLPack test did not run")
    case = decode_case(2)
    want_state, want_out = reference_decode(case)
    inputs = {name: jax.device_put(case[name].numpy(), device) for name in ("inp", "ape", "indices", "seq_lens")}
    for array in inputs.values():
        array.block_until_ready()  # jax computes on its own streams
    state = case["state"].cuda()
    out = torch.full((3, D), float("nan"), device="cuda")
    module.run_decode(state, inputs["inp"], out, inputs["ape"], inputs["indices"], inputs["seq_lens"], None)
    torch.cuda.synchronize()
    assert_decode_matches(state, out, want_state, want_out)


# ---------------------------------------------------------------------------
# Streams.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["raw", "api"])
def test_work_queued_on_a_torch_stream_runs_on_that_stream(gpu, module, call):
    case = decode_case(3)
    new_inp = torch.randn(3, 2 * D, generator=torch.Generator().manual_seed(4))
    want_state, want_out = reference_decode(case, new_inp)
    state, ape = case["state"].cuda(), case["ape"].cuda()
    indices, seq_lens = case["indices"].cuda(), case["seq_lens"].cuda()
    inp = case["inp"].cuda()  # the OLD tokens: the delayed copy below replaces them
    new_inp_gpu = new_inp.cuda()
    out = torch.full((3, D), float("nan"), device="cuda")
    fc.decode(state.clone(), inp, ape, indices, seq_lens)  # loads the variant before the timed part
    torch.cuda.synchronize()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    done = torch.cuda.Event()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        inp.copy_(new_inp_gpu)  # runs only after the sleep, on `side`
        if call == "raw":
            module.run_decode(state, inp, out, ape, indices, seq_lens, None)
        else:
            fc.decode(state, inp, ape, indices, seq_lens, out=out)
        done.record(side)
    assert not done.query(), "the call blocked the host (or the sleep was too short to tell)"
    assert torch.cuda.default_stream().query(), "work landed on the default stream"
    done.synchronize()
    assert_decode_matches(state, out, want_state, want_out)
