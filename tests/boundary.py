"""The boundary matrix of the compiled module's raw functions: every bad argument, and what it must say.

For each argument of ``run_decode``, ``run_prefill``, ``plan_online_prefill``
(``docs/SPEC.md`` section 3), ``run_prefill_compact`` (section 10), ``run_verify``
and ``run_commit`` (section 9) a :class:`Case` replaces that one argument of a valid
call with a bad one: wrong dtype, wrong rank, wrong size in each dimension,
a non-contiguous or misaligned view, the wrong device type, another CUDA
device, ``None`` or a non-tensor, plans of the wrong width. Every other
argument stays valid, so every check that runs before the bad one passes.

Kernel arguments live on CUDA. Without a GPU they are *relabelled* host
tensors (:func:`relabel`: the DLPack device field is rewritten to
``cuda:0``), which is enough because every check runs on the host before
any launch, and no case gets that far. The same trick labels a tensor
``cuda:1`` (another device, even on a one-GPU machine) or ``cuda_host``.
With a GPU, kernel arguments are real CUDA tensors; ``cuda:1`` is then a
real ``cuda:0`` allocation relabelled, so a missing check could never touch
memory outside the process's own device allocations.

The C++ checks run in a fixed order (``CHECK_ORDER``), and shared sizes /
devices bind to the first tensor checked: a wrong size in a dimension the
argument binds (``kv_score_input``'s batch size) is reported by the next
argument sharing it, whose message names both. :func:`expected_failure`
encodes that.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from flash_compress import reference as ref
from flash_compress.plan_rows import CHUNK_SIZE, ROW_BYTES

HEAD_DIM = 128
NUM_SLOTS = 5

# DLPack device types (dlpack.h).
DL_CPU, DL_CUDA, DL_CUDA_HOST = 1, 2, 3

__all__ = [
    "APART_ORDER",
    "Arg",
    "CHECK_ORDER",
    "Case",
    "FUNCTIONS",
    "HEAD_DIM",
    "STATE_ARGS",
    "WRITTEN",
    "all_cases",
    "call",
    "overlapping_pairs",
    "relabel",
    "resized",
    "sharing_memory",
    "valid_values",
]


# ---------------------------------------------------------------------------
# Relabelled DLPack tensors.
# ---------------------------------------------------------------------------

_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _Relabelled:
    """A DLPack producer that hands out ``tensor``'s capsule with another device in it."""

    def __init__(self, tensor: torch.Tensor, device_type: int, device_id: int) -> None:
        self.tensor, self.device_type, self.device_id = tensor, device_type, device_id

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device_type, self.device_id

    def __dlpack__(self, **_: Any):
        capsule = self.tensor.__dlpack__()  # the legacy, unversioned DLManagedTensor
        name = _get_name(capsule)
        assert name == b"dltensor", f"unexpected DLPack capsule {name!r}"
        # DLManagedTensor starts with DLTensor { void* data; DLDevice device {int32 type, int32 id}; ... }.
        address = _get_pointer(capsule, name)
        ctypes.c_int32.from_address(address + 8).value = self.device_type
        ctypes.c_int32.from_address(address + 12).value = self.device_id
        return capsule


class _Resized(_Relabelled):
    """``_Relabelled`` whose capsule also claims other sizes (the same rank) over the tensor's memory."""

    def __init__(self, tensor: torch.Tensor, sizes: tuple[int, ...], device_type: int) -> None:
        super().__init__(tensor, device_type, 0)
        self.sizes = sizes

    def __dlpack__(self, **kwargs: Any):
        capsule = super().__dlpack__(**kwargs)
        # DLTensor { void* data; DLDevice device; int32 ndim; DLDataType dtype; int64* shape; ... }.
        shape_at = ctypes.c_void_p.from_address(_get_pointer(capsule, b"dltensor") + 24).value
        shape = ctypes.cast(shape_at, ctypes.POINTER(ctypes.c_int64))
        for i, size in enumerate(self.sizes):
            shape[i] = size
        return capsule


def resized(tensor: torch.Tensor, sizes: tuple[int, ...], device_type: int = DL_CUDA):
    """A ``tvm_ffi.Tensor`` over ``tensor``'s memory that claims ``sizes`` (same rank; huge or negative ones
    too) on ``device_type``: for checks that must refuse a call before anything reads it. Host memory
    labelled as a GPU's: never let a call with it reach a launch on a real GPU."""
    import tvm_ffi

    assert len(sizes) == tensor.dim()
    return tvm_ffi.from_dlpack(_Resized(tensor, tuple(sizes), device_type))


def relabel(tensor: torch.Tensor, device_type: int, device_id: int = 0):
    """A ``tvm_ffi.Tensor`` sharing ``tensor``'s memory (and keeping it alive) that claims another device."""
    import tvm_ffi

    return tvm_ffi.from_dlpack(_Relabelled(tensor, device_type, device_id))


# ---------------------------------------------------------------------------
# The functions' arguments.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Arg:
    """One argument: its dims (ints, or a shared size's name), dtype, and whether it lives on the GPU."""

    name: str
    dims: tuple = ()
    dtype: Optional[torch.dtype] = None
    on_gpu: bool = True
    optional: bool = False
    tensor: bool = True


D = HEAD_DIM


def _state(rows: str) -> tuple[Arg, ...]:
    """The four float tensors both kernels take; ``rows`` names their shared row count as the C++ does."""
    return (
        Arg("kv_score_buffer", ("num_slots", 1, 3 * D), torch.float32),
        Arg("kv_score_input", (rows, 2 * D), torch.float32),
        Arg("kv_compressed_output", (rows, D), torch.float32),
        Arg("ape", (CHUNK_SIZE, D), torch.float32),
    )


#: Arguments in signature order; symbolic dims carry the C++ SymbolicSize names.
FUNCTIONS: dict[str, tuple[Arg, ...]] = {
    "run_decode": _state("batch_size")
    + (
        Arg("indices", ("batch_size",), torch.int32),
        Arg("seq_lens", ("batch_size",), torch.int32),
        Arg("extra", optional=True, tensor=False),
    ),
    "run_prefill": _state("num_tokens")
    + (
        Arg("indices", ("batch_size",), torch.int32),
        Arg("compress_plan", ("num_compress_rows", ROW_BYTES), torch.uint8),
        Arg("write_plan", ("num_write_rows", ROW_BYTES), torch.uint8),
        Arg("load_indices", ("batch_size",), torch.int32, optional=True),
    ),
    "run_prefill_compact": (
        Arg("kv_score_buffer", ("num_slots", 1, 3 * D), torch.float32),
        Arg("kv_score_input", ("num_tokens", 2 * D), torch.float32),
        Arg("kv_compressed_output", ("num_compress_rows", D), torch.float32),  # a row per compress-plan row
        Arg("ape", (CHUNK_SIZE, D), torch.float32),
        Arg("indices", ("batch_size",), torch.int32),
        Arg("compress_plan", ("num_compress_rows", ROW_BYTES), torch.uint8),
        Arg("write_plan", ("num_write_rows", ROW_BYTES), torch.uint8),
        Arg("load_indices", ("batch_size",), torch.int32, optional=True),
    ),
    "run_verify": _state("num_tokens")
    + (
        Arg("indices", ("batch_size",), torch.int32),
        Arg("seq_lens", ("batch_size",), torch.int32),
        Arg("prefix_states", ("num_tokens", 3 * D), torch.float32),
    ),
    "run_commit": (
        Arg("kv_score_buffer", ("num_slots", 1, 3 * D), torch.float32),
        Arg("prefix_states", ("num_tokens", 3 * D), torch.float32),
        Arg("indices", ("batch_size",), torch.int32),
        Arg("accept_lens", ("batch_size",), torch.int32),
    ),
    "plan_online_prefill": (
        Arg("extend_lens", ("batch_size",), torch.int64, on_gpu=False),
        Arg("seq_lens", ("batch_size",), torch.int64, on_gpu=False),
        Arg("compress_plan", ("num_tokens", ROW_BYTES), torch.uint8, on_gpu=False),
        Arg("write_plan", ("num_tokens", ROW_BYTES), torch.uint8, on_gpu=False),
        Arg("use_cuda_graph", tensor=False),
    ),
}

#: The order the C++ export checks its tensors (load_indices before the plans).
CHECK_ORDER: dict[str, tuple[str, ...]] = {
    "run_decode": ("kv_score_buffer", "kv_score_input", "kv_compressed_output", "ape", "indices", "seq_lens"),
    "run_prefill": ("kv_score_buffer", "kv_score_input", "kv_compressed_output", "ape", "indices", "load_indices",
                    "compress_plan", "write_plan"),
    # The compact output's row count comes from the compress plan, so that plan is checked first.
    "run_prefill_compact": ("compress_plan", "kv_score_buffer", "kv_score_input", "kv_compressed_output", "ape",
                            "indices", "load_indices", "write_plan"),
    "run_verify": ("kv_score_buffer", "kv_score_input", "kv_compressed_output", "ape", "indices", "seq_lens",
                   "prefix_states"),
    "run_commit": ("kv_score_buffer", "prefix_states", "indices", "accept_lens"),
    "plan_online_prefill": ("extend_lens", "seq_lens", "compress_plan", "write_plan"),
}

#: The tensors each function writes (docs/SPEC.md sections 3, 9 and 10); it only reads the others.
WRITTEN: dict[str, tuple[str, ...]] = {
    "run_decode": ("kv_score_buffer", "kv_compressed_output"),
    "run_prefill": ("kv_score_buffer", "kv_compressed_output"),
    "run_prefill_compact": ("kv_score_buffer", "kv_compressed_output"),
    "run_verify": ("kv_compressed_output", "prefix_states"),
    "run_commit": ("kv_score_buffer",),
    "plan_online_prefill": ("compress_plan", "write_plan"),
}

#: The order the exports compare arguments' memory (after every other check): of two that overlap, the
#: later one is named.
APART_ORDER: dict[str, tuple[str, ...]] = {
    **CHECK_ORDER,
    "run_prefill_compact": CHECK_ORDER["run_prefill"],
}

# A prefill of 3 requests whose plans have compress and write rows.
PREFILL_EXTEND = [3, 2, 2]
PREFILL_SEQ = [3, 129, 130]
# Verify and commit: 2 requests of this many tokens (T).
VERIFY_TOKENS = 3


#: The arguments in the variant's state dtype (docs/SPEC.md section 8); every other float tensor is float32.
STATE_ARGS = ("kv_score_buffer", "prefix_states")


def valid_values(state_dtype: torch.dtype = torch.float32) -> dict[str, dict[str, Any]]:
    """A valid call of each function to the variant of ``state_dtype``, as host (CPU) values; runnable on a
    GPU as they are."""
    return {function: {name: value.to(state_dtype) if name in STATE_ARGS else value
                       for name, value in values.items()}
            for function, values in _float32_values().items()}


def _float32_values() -> dict[str, dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    state = lambda rows: {  # noqa: E731
        "kv_score_buffer": torch.randn(NUM_SLOTS, 1, 3 * D, generator=gen),
        "kv_score_input": torch.randn(rows, 2 * D, generator=gen),
        "kv_compressed_output": torch.full((rows, D), float("nan")),
        "ape": torch.randn(CHUNK_SIZE, D, generator=gen),
    }
    total = sum(PREFILL_EXTEND)
    compress_plan = torch.zeros(total, ROW_BYTES, dtype=torch.uint8)
    write_plan = torch.zeros(total, ROW_BYTES, dtype=torch.uint8)
    num_compress, num_write = ref.plan_online_prefill(
        torch.tensor(PREFILL_EXTEND), torch.tensor(PREFILL_SEQ), compress_plan, write_plan, False
    )
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    prefill = {
        **state(total),
        "indices": i32(0, 1, 2),
        "compress_plan": compress_plan[:num_compress].clone(),
        "write_plan": write_plan[:num_write].clone(),
        "load_indices": i32(3, 1, 4),
    }
    verify_rows = 2 * VERIFY_TOKENS
    return {
        "run_decode": {**state(3), "indices": i32(0, 2, 4), "seq_lens": i32(1, 128, 300), "extra": None},
        "run_prefill": prefill,
        "run_prefill_compact": {**prefill, "kv_compressed_output": torch.full((num_compress, D), float("nan"))},
        "run_verify": {**state(verify_rows), "indices": i32(0, 3), "seq_lens": i32(5, 130),
                       "prefix_states": torch.full((verify_rows, 3 * D), float("nan"))},
        "run_commit": {"kv_score_buffer": torch.randn(NUM_SLOTS, 1, 3 * D, generator=gen),
                       "prefix_states": torch.randn(verify_rows, 3 * D, generator=gen),
                       "indices": i32(0, 3), "accept_lens": i32(1, VERIFY_TOKENS)},
        "plan_online_prefill": {
            "extend_lens": torch.tensor(PREFILL_EXTEND, dtype=torch.int64),
            "seq_lens": torch.tensor(PREFILL_SEQ, dtype=torch.int64),
            "compress_plan": torch.full((total, ROW_BYTES), 7, dtype=torch.uint8),
            "write_plan": torch.full((total, ROW_BYTES), 7, dtype=torch.uint8),
            "use_cuda_graph": False,
        },
    }


# ---------------------------------------------------------------------------
# Placing values: where each tensor lives when the function is called.
# ---------------------------------------------------------------------------

#: A placement: "default" (CUDA for kernel tensors, CPU for planner tensors),
#: "cpu", "cuda", "cuda_host" or "cuda:1".
Placement = str


def _to_torch_device(value: torch.Tensor, placement: str, arg: Arg, real_gpu: bool) -> torch.Tensor:
    wants_cuda = placement in ("cuda", "cuda:1") or (placement == "default" and arg.on_gpu)
    if wants_cuda:
        return value.cuda() if real_gpu else value.cpu()
    if placement == "cuda_host" and real_gpu:
        return value.cpu().pin_memory()  # device-accessible, so a missed check could not fault
    return value.cpu()


def _label(tensor: torch.Tensor, placement: str, arg: Arg, real_gpu: bool):
    if placement == "cuda:1":
        return relabel(tensor, DL_CUDA, 1)
    if placement == "cuda_host":
        return relabel(tensor, DL_CUDA_HOST, 0)
    wants_cuda = placement == "cuda" or (placement == "default" and arg.on_gpu)
    if wants_cuda and not real_gpu:
        return relabel(tensor, DL_CUDA, 0)
    return tensor


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The same shape and values with every other element of the last dimension skipped."""
    base = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = base[..., ::2]
    view.copy_(t)
    assert not view.is_contiguous()
    return view


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same shape and values, contiguous, starting one element past an aligned address."""
    flat = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "non_contiguous": _non_contiguous,
    "misaligned": _misaligned,
}


@dataclass
class Case:
    """One argument of one function replaced by a bad value; what the error must be and say."""

    function: str
    arg: str
    kind: str
    value: Any  # the replacement (host value), or ``KEEP`` for the valid one
    placement: Placement = "default"
    layout: Optional[str] = None
    error: type = ValueError
    names: tuple[str, ...] = ()  # the argument the message must name
    fragments: tuple[str, ...] = ()  # further substrings the message must contain
    positional: bool = False  # tvm-ffi's own type error ("argument #i"), not our checks
    state_dtype: torch.dtype = torch.float32  # the variant's: of the pool and the prefix states

    @property
    def id(self) -> str:
        variant = "" if self.state_dtype == torch.float32 else f"{dtype_name(self.state_dtype)}-"
        return f"{variant}{self.function}-{self.arg}-{self.kind}"


KEEP = object()


def call(module, case: Optional[Case], function: str, values: dict[str, Any], real_gpu: bool):
    """Places every value (the case's argument as the case says), calls ``module.<function>``.

    Returns ``(result, placed)``, placed being the torch tensors as passed
    (before any relabelling), so a caller can check nothing was written.
    """
    args, placed = [], {}
    for arg in FUNCTIONS[function]:
        value = values[arg.name]
        placement, layout = "default", None
        if case is not None and case.arg == arg.name:
            value = value if case.value is KEEP else case.value
            placement, layout = case.placement, case.layout
        if isinstance(value, torch.Tensor):
            value = _to_torch_device(value, placement, arg, real_gpu)
            if layout is not None:
                value = LAYOUTS[layout](value)
            placed[arg.name] = value
            value = _label(value, placement, arg, real_gpu)
        args.append(value)
    return getattr(module, function)(*args), placed


def overlapping_pairs(function: str) -> list[tuple[str, str]]:
    """Every ``(earlier, later)`` pair of tensor arguments, in ``APART_ORDER``, of which the call writes one or
    both: the pairs that must not share memory."""
    order = APART_ORDER[function]
    return [(earlier, later) for j, later in enumerate(order) for earlier in order[:j]
            if earlier in WRITTEN[function] or later in WRITTEN[function]]


def sharing_memory(values: dict[str, Any], first: str, second: str, device: str = "cpu",
                   overlap: Optional[int] = None) -> dict[str, Any]:
    """``values`` with ``first`` and ``second`` replaced by views of one buffer on ``device``: ``first`` at
    its first byte, ``second`` from ``overlap`` bytes before ``first``'s end (None: also at the first byte;
    0: right after ``first``), ``second``'s values written last; every other value as it was."""
    a, b = values[first], values[second]
    a_bytes, b_bytes = a.numel() * a.element_size(), b.numel() * b.element_size()
    second_at = 0 if overlap is None else a_bytes - overlap
    buffer = torch.empty(max(a_bytes, second_at + b_bytes), dtype=torch.uint8, device=device)
    shared = dict(values)
    for name, value, at in ((first, a, 0), (second, b, second_at)):
        view = buffer[at:at + value.numel() * value.element_size()].view(value.dtype).view(value.shape)
        view.copy_(value)
        shared[name] = view
    return shared


# ---------------------------------------------------------------------------
# The matrix.
# ---------------------------------------------------------------------------

_WRONG_DTYPES = {
    torch.float32: (torch.float64, torch.float16, torch.int32),
    torch.bfloat16: (torch.float32, torch.float16),
    torch.int32: (torch.int64, torch.float32, torch.uint8),
    torch.int64: (torch.int32, torch.float64),
    torch.uint8: (torch.int8, torch.int32),
}


def dtype_name(dtype: torch.dtype) -> str:
    """The name tensor.h prints: float32, int64, uint8, bfloat16, ..."""
    return str(dtype).removeprefix("torch.")


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _next_sharing(function: str, arg: Arg, symbol: str) -> Optional[str]:
    """The first argument checked after ``arg`` whose dims use ``symbol``, or None."""
    order = CHECK_ORDER[function]
    dims = {a.name: a.dims for a in FUNCTIONS[function]}
    later = order[order.index(arg.name) + 1 :]
    return next((name for name in later if symbol in dims[name]), None)


def _binds(function: str, arg: Arg, symbol: str) -> bool:
    dims = {a.name: a.dims for a in FUNCTIONS[function]}
    first = next(name for name in CHECK_ORDER[function] if symbol in dims[name])
    return first == arg.name


def _tensor_cases(function: str, arg: Arg, valid: torch.Tensor) -> list[Case]:
    cases: list[Case] = []
    add = lambda kind, value, **kw: cases.append(Case(function, arg.name, kind, value, **kw))  # noqa: E731
    here = (arg.name,)

    for dtype in _WRONG_DTYPES[arg.dtype]:
        add(f"dtype_{dtype_name(dtype)}", valid.to(dtype), error=TypeError, names=here,
            fragments=(f"expected dtype {dtype_name(arg.dtype)}", f"got dtype {dtype_name(dtype)}"))

    rank = valid.dim()
    lower = valid.reshape(*valid.shape[:-2], -1) if rank > 1 else valid[0]
    for kind, bad in (("rank_plus_1", valid.unsqueeze(-1)), ("rank_minus_1", lower)):
        add(kind, bad, names=here, fragments=(f"expected a {rank}-D tensor", f"got a {bad.dim()}-D tensor"))

    for i, dim in enumerate(arg.dims):
        shape = list(valid.shape)
        shape[i] += 1
        bad = torch.zeros(shape, dtype=valid.dtype)
        if isinstance(dim, int):
            add(f"dim{i}_size", bad, names=here, fragments=(f"dimension {i} is {dim}", f"got shape {_shape(bad)}"))
        elif _binds(function, arg, dim):
            reporter = _next_sharing(function, arg, dim)
            if reporter is None:
                continue  # the only tensor with this size: any size is valid
            add(f"dim{i}_size", bad, names=(reporter,),
                fragments=(f"bound to {shape[i]} by '{arg.name}'", "got shape"))
        else:
            add(f"dim{i}_size", bad, names=here,
                fragments=(f"dimension {i} is {dim}", "bound to", f"got shape {_shape(bad)}"))

    if arg.dtype == torch.uint8:  # plan rows of the wrong width
        rows = valid.shape[0]
        for width in (15, 17, 32):
            add(f"width_{width}", torch.zeros(rows, width, dtype=torch.uint8), names=here,
                fragments=(f"dimension 1 is {ROW_BYTES}", f"got shape [{rows}, {width}]"))
        add("as_int32_rows", valid.view(torch.int32) if rows else torch.zeros(0, 4, dtype=torch.int32), names=here,
            fragments=(f"dimension 1 is {ROW_BYTES}", f"got shape [{rows}, 4]"))

    add("non_contiguous", KEEP, layout="non_contiguous", names=here,
        fragments=("expected a contiguous tensor", "got a non-contiguous view"))
    if arg.dtype in (torch.float32, torch.bfloat16, torch.uint8) and valid.numel():  # the vector-loaded tensors
        align = 16
        offset = valid.element_size()
        add("misaligned", KEEP, layout="misaligned", names=here,
            fragments=(f"expected data aligned to {align} bytes", f"got a pointer offset by {offset} bytes"))

    if arg.on_gpu:
        add("on_cpu", KEEP, placement="cpu", names=here,
            fragments=("expected a tensor on cuda", "got a tensor on cpu"))
        add("on_cuda_host", KEEP, placement="cuda_host", names=here,
            fragments=("expected a tensor on cuda", "got a tensor on cuda_host"))
        if arg.name == CHECK_ORDER[function][0]:  # binds the device: the next tensor disagrees
            add("on_cuda1", KEEP, placement="cuda:1", names=(CHECK_ORDER[function][1],),
                fragments=(f"the device of '{arg.name}'", "expected a tensor on cuda:1", "got a tensor on cuda:0"))
        else:
            add("on_cuda1", KEEP, placement="cuda:1", names=here,
                fragments=("expected a tensor on cuda:0", "got a tensor on cuda:1"))
    elif arg.name == "extend_lens":
        # CUDA extend_lens select the GPU planner, which then wants every tensor on that device.
        add("on_cuda", KEEP, placement="cuda", names=("seq_lens",),
            fragments=("expected a tensor on cuda", "got a tensor on cpu"))
    else:
        add("on_cuda", KEEP, placement="cuda", names=here,
            fragments=("expected a tensor on cpu or cuda_host", "got a tensor on cuda:0"))
    return cases


def _positional_cases(function: str, position: int, arg: Arg) -> list[Case]:
    """Non-tensors: tvm-ffi's argument conversion refuses them, naming the position (it has no names)."""
    bad_values = {"none": None, "float": 1.5, "list": [1, 2]}
    if arg.optional:
        del bad_values["none"]  # None is the documented default
    if not arg.tensor and not arg.optional:
        bad_values = {"none": None, "str": "yes"}  # use_cuda_graph: a bool
    return [
        Case(function, arg.name, f"not_a_tensor_{kind}" if arg.tensor or arg.optional else kind, value,
             error=TypeError, positional=True, fragments=(f"argument #{position}", "Expected", "but got"))
        for kind, value in bad_values.items()
    ]


def all_cases(state_dtype: torch.dtype = torch.float32) -> list[Case]:
    """Every case of every function of the variant of ``state_dtype`` (the planner's only for float32: it
    does not depend on the state dtype)."""
    values = valid_values(state_dtype)
    cases: list[Case] = []
    for function, args in FUNCTIONS.items():
        if function == "plan_online_prefill" and state_dtype != torch.float32:
            continue
        for position, arg in enumerate(args):
            arg_cases = _positional_cases(function, position, arg)
            if arg.tensor:
                if arg.name in STATE_ARGS:
                    arg = dataclasses.replace(arg, dtype=state_dtype)
                arg_cases += _tensor_cases(function, arg, values[function][arg.name])
            cases += [dataclasses.replace(case, state_dtype=state_dtype) for case in arg_cases]
    return cases
