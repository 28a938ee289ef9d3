"""Every bad argument of the raw compiled functions, and of the reference, is refused with a clear error.

The matrix is ``tests/boundary.py``. Each case must raise the documented
Python exception (TypeError for a dtype or a non-tensor, ValueError for the
rest) whose message names the argument and says what was expected and what
came, and must write nothing. Needs nvcc, not a GPU: without one, kernel
tensors are host tensors relabelled as CUDA (every check runs before any
launch); with one, they are real CUDA tensors and nothing-written is checked
on the device too.
"""

from __future__ import annotations

import pytest
import torch

import boundary
from conftest import cuda_available
from flash_compress import _dispatch
from flash_compress import reference as ref
from flash_compress.plan_rows import CHUNK_SIZE, ROW_BYTES

REAL_GPU = cuda_available()
# Both variants' kernels (a variant takes only its own state dtype); the planner once.
CASES = boundary.all_cases() + boundary.all_cases(torch.bfloat16)
_variants: dict[torch.dtype, object] = {}


def variant(state_dtype: torch.dtype = torch.float32):
    """The compiled head_dim=128 variant of ``state_dtype`` (compiled once, then loaded from the cache)."""
    if state_dtype not in _variants:
        import flash_compress

        _variants[state_dtype] = flash_compress.load_module(head_dim=boundary.HEAD_DIM,
                                                            state_dtype=boundary.dtype_name(state_dtype))
    return _variants[state_dtype]


@pytest.fixture(scope="module")
def module():
    """The float32 variant."""
    return variant()


@pytest.mark.nvcc
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_argument_is_refused_clearly(case):
    values = boundary.valid_values(case.state_dtype)[case.function]
    with pytest.raises(Exception) as caught:
        boundary.call(variant(case.state_dtype), case, case.function, values, REAL_GPU)
    error = caught.value
    message = str(error)
    assert type(error) is case.error, f"{case.id}: raised {type(error).__name__}({message!r}), want {case.error.__name__}"
    low = message.lower()
    assert "expected" in low and "got" in low, f"{case.id}: message lacks expected/got: {message!r}"
    assert "expected expected" not in low, f"{case.id}: garbled message: {message!r}"
    for name in case.names:
        assert f"argument '{name}'" in message, f"{case.id}: message does not name '{name}': {message!r}"
    for fragment in case.fragments:
        assert fragment in message, f"{case.id}: message lacks {fragment!r}: {message!r}"


@pytest.mark.nvcc
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=boundary.dtype_name)
@pytest.mark.parametrize("function", sorted(boundary.FUNCTIONS))
def test_valid_baseline_passes_every_check(function, state_dtype):
    """The matrix's starting point is valid: on a GPU it runs; without one it gets as far as the launch."""
    module = variant(state_dtype)
    values = boundary.valid_values(state_dtype)[function]
    if function == "plan_online_prefill" or REAL_GPU:
        result, _ = boundary.call(module, None, function, values, REAL_GPU)
        if function == "plan_online_prefill":
            assert tuple(int(x) for x in result) == (1, 3)
        return
    with pytest.raises(RuntimeError) as caught:
        boundary.call(module, None, function, values, REAL_GPU)
    assert "argument" not in str(caught.value), f"a host check refused the valid call: {caught.value}"


@pytest.mark.nvcc
@pytest.mark.parametrize("pinned_names", [("extend_lens", "seq_lens", "compress_plan", "write_plan"), ("extend_lens",),
                                          ("seq_lens", "write_plan"), ("compress_plan",)], ids="+".join)
def test_planner_takes_pinned_host_tensors_alone_or_mixed(module, pinned_names):
    """cuda_host (pinned) lengths and plans are as good as CPU ones, and each may be pinned or plain on its
    own (docs/SPEC.md: host tensors, CPU or pinned): an engine pins what it copies asynchronously. The plans
    come out as the reference writes them. With a GPU the pinned ones are torch's own pinned tensors;
    without, relabelled host memory stands in."""
    values = {name: v.pin_memory() if REAL_GPU and name in pinned_names else v
              for name, v in boundary.valid_values()["plan_online_prefill"].items()}
    mixed = {name: boundary.relabel(v, boundary.DL_CUDA_HOST) if name in pinned_names and not REAL_GPU else v
             for name, v in values.items()}
    got = module.plan_online_prefill(*(mixed[a.name] for a in boundary.FUNCTIONS["plan_online_prefill"]))
    want_plans = boundary.valid_values()["plan_online_prefill"]
    want = ref.plan_online_prefill(*(want_plans[a.name] for a in boundary.FUNCTIONS["plan_online_prefill"]))
    assert tuple(int(x) for x in got) == tuple(want)
    assert torch.equal(values["compress_plan"], want_plans["compress_plan"])
    assert torch.equal(values["write_plan"], want_plans["write_plan"])


@pytest.mark.nvcc
@pytest.mark.parametrize("case", [c for c in CASES if c.function == "plan_online_prefill" and not c.positional],
                         ids=lambda c: c.id)
def test_refused_planner_call_writes_nothing(module, case):
    values = boundary.valid_values()["plan_online_prefill"]
    before = {name: values[name].clone() for name in ("compress_plan", "write_plan")}
    with pytest.raises((TypeError, ValueError)):
        boundary.call(module, case, "plan_online_prefill", values, REAL_GPU)
    for name, old in before.items():
        assert torch.equal(values[name], old), f"{case.id}: {name} written before the error"


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if c.function != "plan_online_prefill" and not c.positional],
                         ids=lambda c: c.id)
def test_refused_kernel_call_writes_nothing_on_gpu(gpu, case):
    """On the device: the state buffer, the output and the prefix states are bitwise unchanged after a
    refused call."""
    module = variant(case.state_dtype)
    values = boundary.valid_values(case.state_dtype)[case.function]
    cuda = {name: v.cuda() if isinstance(v, torch.Tensor) else v for name, v in values.items()}
    watched = {name: cuda[name].clone() for name in ("kv_score_buffer", "kv_compressed_output", "prefix_states")
               if name in cuda}
    # The case's own argument is placed by `call`; every other one is these CUDA tensors, watched afterwards.
    with pytest.raises((TypeError, ValueError)):
        boundary.call(module, case, case.function, cuda, True)
    torch.cuda.synchronize()
    for name, old in watched.items():
        if name != case.arg:
            assert torch.equal(cuda[name].view(torch.int32), old.view(torch.int32)), f"{case.id}: {name} written"


# The torch API's functions that call each export, and the name each of the export's arguments has there.
_DISPATCH = {
    "run_decode": ("decode_into", {}),
    "run_prefill": ("prefill_into", {}),
    "run_prefill_compact": ("prefill_into", {"compact": True}),
    "run_verify": ("verify_into", {}),
    "run_commit": ("commit_into", {}),
}
_NOT_TENSORS = [(function, arg.name, bad) for function in _DISPATCH for arg in boundary.FUNCTIONS[function]
                if arg.tensor for bad in ([None, [1, 2]] if not arg.optional else [[1, 2]])]


def _dispatch_call(function: str, values: dict) -> None:
    into, options = _DISPATCH[function]
    named = {("out" if name == "kv_compressed_output" else name): value for name, value in values.items()
             if name != "extra"}
    getattr(_dispatch, into)(**named, **options)


@pytest.mark.nvcc
@pytest.mark.parametrize("function,name,bad", _NOT_TENSORS,
                         ids=[f"{f}-{n}-{type(b).__name__}" for f, n, b in _NOT_TENSORS])
def test_torch_api_names_a_non_tensor_that_tvm_ffi_refuses_by_position(module, monkeypatch, function, name, bad):
    """On CUDA the torch API hands most arguments to the export as they come, and tvm-ffi refuses a None or a
    list there naming only its position; the API re-raises that naming the argument. (CPU tensors and the
    compiled module: tvm-ffi converts every argument before the export's own checks run.)"""
    monkeypatch.setattr(_dispatch, "_compiled", lambda *_: module)
    monkeypatch.setattr(_dispatch, "_variant", lambda *_: module)
    values = {**boundary.valid_values()[function], name: bad}
    api_name = "out" if name == "kv_compressed_output" else name
    with pytest.raises(TypeError) as caught:
        _dispatch_call(function, values)
    assert str(caught.value) == f"argument '{api_name}': expected a torch.Tensor, got {type(bad).__name__}"
    with pytest.raises(TypeError) as raw:
        getattr(module, function)(*(values[arg.name] for arg in boundary.FUNCTIONS[function]))
    assert f"argument '{name}'" not in str(raw.value)  # what the API improves on


@pytest.mark.nvcc
def test_torch_api_passes_other_type_errors_on_as_they_came(module, monkeypatch):
    """A TypeError the export raises about a tensor (here a float64 state pool) reaches the caller unchanged."""
    monkeypatch.setattr(_dispatch, "_compiled", lambda *_: module)
    values = boundary.valid_values()["run_decode"]
    values["kv_score_buffer"] = values["kv_score_buffer"].double()
    with pytest.raises(TypeError) as raw:
        module.run_decode(*(values[arg.name] for arg in boundary.FUNCTIONS["run_decode"]))
    with pytest.raises(TypeError) as caught:
        _dispatch_call("run_decode", values)
    assert str(caught.value) == str(raw.value)
    assert str(caught.value) == "argument 'kv_score_buffer': expected dtype float32, got dtype float64"


OVERLAPS = [(function, earlier, later) for function in boundary.FUNCTIONS
            for earlier, later in boundary.overlapping_pairs(function)]


def _overlap_message_ok(message: str, function: str, earlier: str, later: str) -> None:
    written = boundary.WRITTEN[function]
    writes = "both" if earlier in written and later in written else f"'{later if later in written else earlier}'"
    want = (f"argument '{later}': expected memory apart from '{earlier}' (the call writes {writes}), "
            "got a tensor that overlaps it")
    assert message == want, f"{function} {earlier}/{later}: {message!r}, want {want!r}"


def _call_sharing(run, function: str, earlier: str, later: str, state_dtype: torch.dtype, real_gpu: bool):
    """Calls ``run(values)`` with ``earlier`` and ``later`` sharing memory (on the device where they live);
    returns the message of the ValueError it must raise, after checking that nothing was written."""
    values = boundary.valid_values(state_dtype)[function]
    on_gpu = {a.name: a.on_gpu for a in boundary.FUNCTIONS[function]}
    device = "cuda" if real_gpu and on_gpu[earlier] else "cpu"
    if real_gpu:
        values = {name: v.to(device) if isinstance(v, torch.Tensor) and on_gpu[name] else v
                  for name, v in values.items()}
    values = boundary.sharing_memory(values, earlier, later, device)
    before = {name: v.clone() for name, v in values.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError) as caught:
        run(values)
    if real_gpu:
        torch.cuda.synchronize()
    for name, old in before.items():
        assert torch.equal(values[name].view(torch.uint8), old.view(torch.uint8)), f"{name} written before the error"
    return str(caught.value)


# Both variants' kernels; the planner, which does not depend on the state dtype, once.
_OVERLAP_CASES = [pytest.param(*overlap, dtype, id="-".join((boundary.dtype_name(dtype), *overlap)))
                  for dtype in (torch.float32, torch.bfloat16) for overlap in OVERLAPS
                  if dtype == torch.float32 or overlap[0] != "plan_online_prefill"]


@pytest.mark.nvcc
@pytest.mark.parametrize("function, earlier, later, state_dtype", _OVERLAP_CASES)
def test_arguments_sharing_written_memory_are_refused(function, earlier, later, state_dtype):
    """A call that writes one of two arguments whose memory overlaps would read what it writes, or store
    one result over another: refused before any launch, naming both."""
    module = variant(state_dtype)
    message = _call_sharing(lambda values: boundary.call(module, None, function, values, REAL_GPU),
                            function, earlier, later, state_dtype, REAL_GPU)
    _overlap_message_ok(message, function, earlier, later)


@pytest.mark.parametrize("function, earlier, later", OVERLAPS, ids=["-".join(o) for o in OVERLAPS])
def test_reference_refuses_arguments_sharing_written_memory(function, earlier, later):
    """The reference refuses what the exports refuse, with the same message."""
    def run(values):
        getattr(ref, function)(*(values[a.name] for a in boundary.FUNCTIONS[function]))
    _overlap_message_ok(_call_sharing(run, function, earlier, later, torch.float32, False), function, earlier, later)


@pytest.mark.nvcc
def test_arguments_only_read_may_share_memory(module):
    """Two read-only arguments may be one tensor: a fresh prefill's lengths, a prefill's slots."""
    lengths = torch.tensor([3, 2], dtype=torch.int64)
    plans = [torch.zeros(5, ROW_BYTES, dtype=torch.uint8) for _ in range(2)]
    assert tuple(int(x) for x in module.plan_online_prefill(lengths, lengths, *plans, False)) == (0, 2)
    assert ref.plan_online_prefill(lengths, lengths, *[p.clone() for p in plans], False) == (0, 2)
    values = boundary.valid_values()["run_prefill"]
    values["load_indices"] = values["indices"]
    if REAL_GPU:
        boundary.call(module, None, "run_prefill", values, True)
        return
    with pytest.raises(RuntimeError) as caught:  # every check passed: the launch itself fails without a GPU
        boundary.call(module, None, "run_prefill", values, False)
    assert "argument" not in str(caught.value), f"a host check refused the valid call: {caught.value}"


# The pool's last float32 under the output; the compress plan's last byte under the write plan.
_EDGES = [("run_decode", "kv_score_buffer", "kv_compressed_output", 4),
          ("plan_online_prefill", "compress_plan", "write_plan", 1)]


@pytest.mark.parametrize("function, first, second, overlap", _EDGES)
def test_memory_check_edges_reference(function, first, second, overlap):
    """One element (one byte for the uint8 plans) of overlap is refused; tensors that only touch are apart."""
    run = lambda values: getattr(ref, function)(*(values[a.name] for a in boundary.FUNCTIONS[function]))  # noqa: E731
    with pytest.raises(ValueError, match=f"argument '{second}': expected memory apart from '{first}'"):
        run(boundary.sharing_memory(boundary.valid_values()[function], first, second, overlap=overlap))
    run(boundary.sharing_memory(boundary.valid_values()[function], first, second, overlap=0))


@pytest.mark.nvcc
@pytest.mark.parametrize("function, first, second, overlap", _EDGES)
def test_memory_check_edges_compiled(module, function, first, second, overlap):
    """As the reference, with 16 bytes of overlap (the exports want 16-byte aligned tensors); kernel
    tensors are CUDA ones on a GPU, relabelled host ones without."""
    device = "cuda" if REAL_GPU and function != "plan_online_prefill" else "cpu"
    run = lambda values: boundary.call(module, None, function, values, REAL_GPU)  # noqa: E731
    with pytest.raises(ValueError, match=f"argument '{second}': expected memory apart from '{first}'"):
        run(boundary.sharing_memory(boundary.valid_values()[function], first, second, device, overlap=16))
    if function == "plan_online_prefill" or REAL_GPU:
        run(boundary.sharing_memory(boundary.valid_values()[function], first, second, device, overlap=0))
        return
    with pytest.raises(RuntimeError) as caught:  # every check passed: the launch fails without a GPU
        run(boundary.sharing_memory(boundary.valid_values()[function], first, second, device, overlap=0))
    assert "argument" not in str(caught.value), caught.value


# Sizes no real tensor here could have: host memory claiming them, labelled as CUDA memory. Every case
# must be refused (or pass every check) before anything reads it; on a GPU a missed check would launch on
# host pointers, so these run where none is visible.
needs_no_gpu = pytest.mark.skipif(REAL_GPU, reason="points CUDA-labelled tensors at host memory")


def _call_resized(module, function: str, sizes: dict):
    values = boundary.valid_values()[function]
    args = []
    for arg in boundary.FUNCTIONS[function]:
        value = values[arg.name]
        if isinstance(value, torch.Tensor):
            on = boundary.DL_CUDA if arg.on_gpu or function == "plan_online_prefill_counted" else boundary.DL_CPU
            value = boundary.resized(value, sizes.get(arg.name, tuple(value.shape)), on)
        args.append(value)
    return getattr(module, function)(*args)


@pytest.mark.nvcc
@needs_no_gpu
@pytest.mark.parametrize("function, name, sizes", [
    ("run_decode", "indices", (-1,)),
    ("run_prefill", "indices", (-1,)),
    ("run_prefill", "write_plan", (-1, ROW_BYTES)),
    ("run_prefill_compact", "kv_score_input", (-1, 2 * boundary.HEAD_DIM)),
    ("run_commit", "prefix_states", (-3, 3 * boundary.HEAD_DIM)),
    ("plan_online_prefill", "extend_lens", (-1,)),
])
def test_a_negative_size_is_refused(module, function, name, sizes):
    """DLPack sizes are signed: a producer's negative one passed every upper bound and wrapped to 2^32 - 1
    in a kernel's unsigned count (found by an audit's probes)."""
    with pytest.raises(ValueError, match=f"argument '{name}': expected non-negative sizes, got shape"):
        _call_resized(module, function, {name: sizes})


@pytest.mark.nvcc
@needs_no_gpu
def test_batches_the_kernels_cannot_count_are_refused(module):
    """Decode counts requests in 32 bits, a plan row's batch_id is 32-bit: larger batches were cut to their
    low 32 bits (prefill: 2^32 + 1 requests ran as 1)."""
    big = 2**31
    with pytest.raises(ValueError, match=f"argument 'indices': expected at most {2**31 - 1} requests, got {big}"):
        _call_resized(module, "run_decode", {"kv_score_input": (big, 2 * boundary.HEAD_DIM),
                                              "kv_compressed_output": (big, boundary.HEAD_DIM),
                                              "indices": (big,), "seq_lens": (big,)})
    with pytest.raises(ValueError, match=f"argument 'indices': expected at most 4294967294 requests, got {2**32 + 1}"):
        _call_resized(module, "run_prefill", {"indices": (2**32 + 1,), "load_indices": (2**32 + 1,)})


@pytest.mark.nvcc
@needs_no_gpu
def test_the_gpu_planner_takes_plans_over_2_to_the_31_rows_without_counts(module):
    """Only int32 counts limit the rows to 2^31 - 1 (docs/SPEC.md section 3); without counts the limit is
    2^32 - 2. Whatever refuses these fake 32 GiB plans later (they overlap in memory), it is not the counts."""
    lengths = torch.tensor([3], dtype=torch.int64)
    plans = [torch.zeros(3, ROW_BYTES, dtype=torch.uint8) for _ in range(2)]
    args = [boundary.resized(t, tuple(t.shape)) for t in (lengths, lengths)]
    args += [boundary.resized(p, (2**31, ROW_BYTES)) for p in plans]
    with pytest.raises((ValueError, RuntimeError)) as caught:
        module.plan_online_prefill_counted(*args, True, None)
    assert "counts" not in str(caught.value), caught.value


# The planner wants contiguous plans anyway, and the compact output of the matrix has one row.
_REPEATABLE = [(f, w) for f, names in boundary.WRITTEN.items() for w in names
               if f != "plan_online_prefill" and (f, w) != ("run_prefill_compact", "kv_compressed_output")]


@pytest.mark.parametrize("function, name", _REPEATABLE)
def test_reference_refuses_a_written_tensor_that_repeats_elements(function, name):
    """The reference takes any layout, but an expanded (stride-0) view that it writes would take several
    results in one element."""
    values = boundary.valid_values()[function]
    valid = values[name]
    assert valid.shape[0] > 1
    values[name] = valid[:1].expand(valid.shape)
    with pytest.raises(ValueError, match=f"argument '{name}': expected a tensor whose elements are apart"):
        getattr(ref, function)(*(values[a.name] for a in boundary.FUNCTIONS[function]))


# ---------------------------------------------------------------------------
# The reference: the same functions in PyTorch, the same kind of messages.
# ---------------------------------------------------------------------------

# A wrong dtype of another kind than the one expected (the reference checks dtypes as the exports do, but
# not layouts: it computes in float64 and indexes with torch, so any strides work).
_REFERENCE_DTYPES = {torch.float32: torch.int32, torch.int32: torch.float32, torch.int64: torch.float64,
                     torch.uint8: torch.int8}


_STATE_TENSORS = ("kv_score_buffer", "kv_score_input", "kv_compressed_output", "ape")


def _reference_cases():
    values = boundary.valid_values()
    cases = []
    for function, args in boundary.FUNCTIONS.items():
        for arg in args:
            if not arg.tensor:
                continue
            valid = values[function][arg.name]
            shared = tuple(a.name for a in args if a.tensor and set(a.dims) & set(arg.dims) - {1, ROW_BYTES, CHUNK_SIZE})
            if arg.name in _STATE_TENSORS:  # the reference reads head_dim off ape, then checks the others
                shared += _STATE_TENSORS
            bad = {"dtype": (valid.to(_REFERENCE_DTYPES[arg.dtype]), TypeError),
                   "rank_plus_1": (valid.unsqueeze(-1), ValueError)}
            if not arg.optional:
                bad["none"] = (None, TypeError)
            if arg.dtype != torch.uint8 or function == "plan_online_prefill":
                bad["not_a_tensor"] = ([1, 2, 3], TypeError)
            if arg.dtype == torch.uint8:
                bad["width_17"] = (torch.zeros(valid.shape[0], 17, dtype=torch.uint8), ValueError)
            for i, dim in enumerate(arg.dims):
                if dim in ("num_slots", "num_compress_rows", "num_write_rows"):
                    continue  # free sizes
                if isinstance(dim, str) and sum(dim in a.dims for a in args) == 1:
                    continue  # no other tensor shares it (compact prefill's tokens, commit's rows): free too
                if function == "run_prefill" and dim == "batch_size" and arg.name == "indices":
                    continue  # binds the batch; load_indices would report it (covered from that side)
                shape = list(valid.shape)
                shape[i] += 1
                bad[f"dim{i}_size"] = (torch.zeros(shape, dtype=valid.dtype), ValueError)
            for kind, (value, error) in bad.items():
                # A size shared with other tensors may be reported by whichever is checked against it.
                names = (arg.name,) if kind in ("dtype", "none", "not_a_tensor") else (arg.name, *shared)
                cases.append(pytest.param(function, arg.name, value, error, names, id=f"{function}-{arg.name}-{kind}"))
    return cases


@pytest.mark.parametrize("function, name, value, error, names", _reference_cases())
def test_reference_refuses_bad_argument_clearly(function, name, value, error, names):
    values = boundary.valid_values()[function]
    watched = {k: v.clone() for k, v in values.items() if k in ("kv_score_buffer", "kv_compressed_output",
                                                                   "compress_plan", "write_plan", "prefix_states")}
    values[name] = value
    args = [values[a.name] for a in boundary.FUNCTIONS[function]]
    with pytest.raises(error) as caught:
        getattr(ref, function)(*args)
    message = str(caught.value)
    assert "expected" in message and "got" in message, f"message lacks expected/got: {message!r}"
    assert any(f"argument '{n}'" in message for n in names), f"message names none of {names}: {message!r}"
    for key, old in watched.items():
        if key != name:
            assert torch.equal(values[key].view(torch.uint8), old.view(torch.uint8)), f"{key} written before the error"


@pytest.mark.parametrize("function", ["run_decode", "run_prefill"])
@pytest.mark.parametrize("name", ["kv_compressed_output", "ape", "indices"])
def test_reference_refuses_tensors_on_another_device(function, name):
    """A meta tensor among CPU ones stands in for a second device."""
    values = boundary.valid_values()[function]
    values[name] = values[name].to("meta")
    with pytest.raises(ValueError, match=f"argument '{name}': expected device cpu like kv_score_buffer, got meta"):
        getattr(ref, function)(*(values[a.name] for a in boundary.FUNCTIONS[function]))


@pytest.mark.parametrize("name", ["compress_plan", "write_plan"])
def test_reference_planner_keeps_plans_of_host_lengths_on_the_host(name):
    """As the compiled host planner: a plan on another device (meta standing in for CUDA) is refused by name,
    and neither plan is written."""
    values = boundary.valid_values()["plan_online_prefill"]
    values[name] = values[name].to("meta")
    other = "write_plan" if name == "compress_plan" else "compress_plan"
    before = values[other].clone()
    with pytest.raises(ValueError, match=f"argument '{name}': expected a host \\(CPU or pinned\\) tensor, got device meta"):
        ref.plan_online_prefill(*(values[a.name] for a in boundary.FUNCTIONS["plan_online_prefill"]))
    assert torch.equal(values[other], before)


@pytest.mark.nvcc
@pytest.mark.parametrize("name", ["extend_lens", "seq_lens", "compress_plan", "write_plan"])
def test_both_host_planners_refuse_strided_tensors(module, name):
    """Lengths and plans are contiguous tensors (docs/SPEC.md section 2) for the compiled host planner and
    the reference alike: every other element (lengths) or the first 16 bytes of 32-byte rows (plans) are
    refused by name, in the same words."""
    values = boundary.valid_values()["plan_online_prefill"]
    if values[name].dim() == 1:
        values[name] = values[name].repeat_interleave(2)[::2]
    else:
        values[name] = values[name].repeat(1, 2)[:, :values[name].shape[1]]
    assert not values[name].is_contiguous()
    messages = []
    for planner in (module, ref):
        with pytest.raises(ValueError, match=f"argument '{name}'.*contiguous") as raised:
            planner.plan_online_prefill(*(values[a.name] for a in boundary.FUNCTIONS["plan_online_prefill"]))
        messages.append(str(raised.value))
    assert messages[0] == messages[1]
