"""Which implementation runs a call: a compiled variant for CUDA tensors, the reference for CPU ones.

Both the torch API (:mod:`flash_compress.api`) and the custom ops
(:mod:`flash_compress.ops`) end here. The fast path of a CUDA call is one dict
lookup (the loaded variant) and one tvm-ffi call; everything the C++ side
checks (dtypes, shapes, devices, contiguity, alignment) is left to it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional

import torch

from . import _debug
from ._arguments import check_apart, check_contiguous, check_device
from .c128_online import STATE_DTYPES, is_supported_head_dim, load_module, load_planner
from .jit import JitDisabledError
from .plan_rows import CHUNK_SIZE, continues_chunk

__all__ = ["TORCH_STATE_DTYPES", "commit_into", "decode_into", "planner", "kernels", "new_output", "prefill_into",
           "relocate_states", "verify_into"]

logger = logging.getLogger("flash_compress")

#: Loaded variants by ``(head_dim, use_pdl, state_dtype)`` as the caller passed them (``None`` kept as is).
_modules: dict[tuple[int, Optional[bool], str], Any] = {}
#: A state pool's torch dtype -> its variants' ``state_dtype`` (docs/SPEC.md section 8).
TORCH_STATE_DTYPES: dict[torch.dtype, str] = {getattr(torch, name): name for name in STATE_DTYPES}
#: The arguments each export takes, by their names in the functions below that call it.
_DECODE_NAMES = ("kv_score_buffer", "kv_score_input", "out", "ape", "indices", "seq_lens")
_PREFILL_NAMES = ("kv_score_buffer", "kv_score_input", "out", "ape", "indices", "compress_plan", "write_plan",
                  "load_indices")
_VERIFY_NAMES = ("kv_score_buffer", "kv_score_input", "out", "ape", "indices", "seq_lens", "prefix_states")
_COMMIT_NAMES = ("kv_score_buffer", "prefix_states", "indices", "accept_lens")
#: The loaded planner variant (``use_pdl=None``), once loaded.
_planner: Any = None


def kernels(head_dim: int, use_pdl: Optional[bool], state_dtype: str = "float32") -> Any:
    """The compiled variant for ``head_dim`` (``ape.shape[-1]``) and the pool's dtype: a dict lookup once loaded."""
    module = _modules.get((head_dim, use_pdl, state_dtype))
    if module is None:
        module = _load(head_dim, use_pdl, state_dtype)
    return module


def _load(head_dim: int, use_pdl: Optional[bool], state_dtype: str) -> Any:
    if not is_supported_head_dim(head_dim):
        raise ValueError(
            f"argument 'ape': expected shape [{CHUNK_SIZE}, D] with D a multiple of 64 in [64, 1024], got D = {head_dim}"
        )
    module = load_module(head_dim, use_pdl, state_dtype)
    _modules[(head_dim, use_pdl, state_dtype)] = module
    return module


def planner(*, load: bool = True) -> Any:
    """An object with ``plan_online_prefill``: the compiled planner, or the reference for host lengths.

    With ``load`` the planner variant is loaded (compiled on a cache miss); without
    ``load`` (plans for the CPU reference) and not loaded yet, or where it cannot be
    loaded (no nvcc and no cached build, or ``FLASH_COMPRESS_DISABLE_JIT=1`` and a
    miss), the reference planner, which writes the same bytes, plans instead.
    """
    global _planner
    if _planner is None and load:
        try:
            _planner = load_planner()
        except JitDisabledError as exc:
            logger.info("planning with the reference planner: the compiled planner cannot be loaded (%s)", exc)
    if _planner is not None:
        return _planner
    from . import reference

    return reference


def _not_tensor(**arguments: Any) -> Exception:
    """The error for a call whose arguments are not even tensors (the fast path's attribute access failed)."""
    for name, value in arguments.items():
        if not isinstance(value, torch.Tensor):
            return TypeError(f"argument '{name}': expected a torch.Tensor, got {type(value).__name__}")
        if value.dim() == 0:
            return ValueError(f"argument '{name}': expected a tensor with dimensions, got a 0-D tensor")
    return TypeError("expected torch.Tensor arguments")


def _raise_if_not_tensors(names: tuple[str, ...], arguments: dict[str, Any]) -> None:
    """Raises the named error for the first of ``names`` in ``arguments`` that is not a tensor (nor a
    ``None`` ``load_indices``).

    Called where an export raised TypeError: tvm-ffi refuses a ``None`` or a
    non-tensor where an export takes a tensor, naming it only by position
    (exported functions carry no parameter names). Returns for any other
    TypeError, which the caller re-raises as it came.
    """
    for name in names:
        value = arguments[name]
        if not isinstance(value, torch.Tensor) and not (value is None and name == "load_indices"):
            raise _not_tensor(**{name: value}) from None


#: The exports' argument names that differ from the names the functions below (and the torch API) take.
_EXPORT_NAMES = {"kv_compressed_output": "out"}


@contextlib.contextmanager
def _naming_arguments(names: tuple[str, ...], arguments: dict[str, Any]) -> Iterator[None]:
    """Around an export's call: a TypeError it raises becomes ``_raise_if_not_tensors``'s, where that names
    an argument; an error naming an export's argument (``kv_compressed_output``) names the caller's (``out``)."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        if isinstance(exc, TypeError):
            _raise_if_not_tensors(names, arguments)
        _raise_renamed(exc)
        raise


def _raise_renamed(exc: Exception) -> None:
    """Raises ``exc``'s message with the caller's names for the arguments it names, where the names differ."""
    message = str(exc)
    if not message.startswith("argument '"):
        return
    renamed = message
    for export_name, name in _EXPORT_NAMES.items():
        renamed = renamed.replace(f"'{export_name}'", f"'{name}'")
    if renamed != message:
        raise (TypeError if isinstance(exc, TypeError) else ValueError)(renamed) from None


def new_output(kv_score_input: torch.Tensor, ape: torch.Tensor, rows: Optional[int] = None) -> torch.Tensor:
    """An uninitialised ``[rows, D]`` output like the input (``D = ape.shape[-1]``, ``rows`` by default
    the input's)."""
    try:
        return kv_score_input.new_empty((kv_score_input.shape[0] if rows is None else rows, ape.shape[-1]))
    except (AttributeError, IndexError):
        raise _not_tensor(kv_score_input=kv_score_input, ape=ape) from None


def _check_move_arguments(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, out: torch.Tensor,
                          ape: torch.Tensor, indices: torch.Tensor, load_indices: torch.Tensor,
                          seq_lens: torch.Tensor) -> None:
    """What a decode move reads, and the shapes a dry call of the kernel sees only without rows: ``[B]`` int32
    tensors on the pool's device, and ``[B, 2D]`` input and ``[B, D]`` output rows."""
    for name, t in (("indices", indices), ("load_indices", load_indices), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"argument '{name}': expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise TypeError(f"argument '{name}': expected dtype int32, got {str(t.dtype).removeprefix('torch.')}")
        if t.dim() != 1 or t.shape != indices.shape:
            raise ValueError(f"argument '{name}': expected shape [B] like indices ({list(indices.shape)}), "
                             f"got {list(t.shape)}")
        check_device(t, name, kv_score_buffer.device)
        if t.is_cuda:  # the dry call sees it empty, which passes any layout: the move reads it in full
            check_contiguous(t, name)
    # An ape the export would refuse is left to its dry call, which names it.
    head_dim = ape.shape[-1] if isinstance(ape, torch.Tensor) and ape.dim() == 2 else None
    for name, t, width in (("kv_score_input", kv_score_input, 2), ("out", out, 1)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"argument '{name}': expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0 or t.shape[0] != indices.shape[0]:
            raise ValueError(f"argument '{name}': expected {indices.shape[0]} rows like indices, "
                             f"got shape {list(t.shape)}")
        if head_dim is not None and list(t.shape[1:]) != [width * head_dim]:
            raise ValueError(f"argument '{name}': expected shape [{indices.shape[0]}, {width * head_dim}] "
                             f"(D = {head_dim}, ape's width), got {list(t.shape)}")
        if not t.is_cuda:
            continue  # the reference, which takes any layout
        # The export's dry call sees these tensors with no rows, and an empty view passes any layout check.
        check_contiguous(t, name)
        if t.data_ptr() % 16:
            raise ValueError(f"argument '{name}': expected data aligned to 16 bytes, "
                             f"got a pointer offset by {t.data_ptr() % 16} bytes")
    # The move writes the pool before the kernel runs, so the kernel's own check of the memory it writes
    # comes too late for the pool, and sees the input and output with no rows.
    check_apart([("kv_score_buffer", kv_score_buffer, True), ("kv_score_input", kv_score_input, False),
                 ("out", out, True), ("indices", indices, False), ("load_indices", load_indices, False),
                 ("seq_lens", seq_lens, False)])


def relocate_states(kv_score_buffer: torch.Tensor, indices: torch.Tensor, load_indices: torch.Tensor,
                    seq_lens: torch.Tensor) -> torch.Tensor:
    """Moves decode's prior states from ``load_indices`` to ``indices`` and returns the slots to run it on.

    The decode kernel reads and writes one slot, so a move copies the prior
    states first, gathered in full before any is written (a permutation is
    safe). Without a sync, as the kernels: a request whose token starts a
    chunk needs no prior state and moves nothing; one whose ``load_indices``
    slot is outside the pool, and that needs a prior state, is skipped (its
    returned slot is -1, which the kernel skips, as a prefill skips such a
    row); a target outside the pool is skipped by the kernel itself. Nothing
    outside the pool is read or written, nor any slot the call does not name
    (but slot 0, where it names none in the pool), which another stream may own.
    """
    num_slots = kv_score_buffer.shape[0]
    fresh = ~continues_chunk(seq_lens.to(torch.int64) - 1, 1)  # the token at seq_len - 1 starts a chunk
    load_ok = (load_indices >= 0) & (load_indices < num_slots)
    in_pool = (indices >= 0) & (indices < num_slots)
    move = load_ok & in_pool & ~fresh & (seq_lens >= 1)  # what the kernel runs
    if num_slots and indices.numel():
        # Requests that move nothing copy what another move copies (the same bytes to the same slot, so the
        # duplicate writes agree); when none moves, a slot of this call (slot 0 only if it names none) onto
        # itself, so that no other request's slot is written: every index stays in the pool. Tensor
        # indices: slicing with them would sync.
        first_move = torch.argmax(move.to(torch.int32)).reshape(1)
        own = torch.where(in_pool.any(), indices[torch.argmax(in_pool.to(torch.int32)).reshape(1)],
                          torch.zeros_like(indices[:1]))
        any_move = move.any()
        target = torch.where(move, indices, torch.where(any_move, indices[first_move], own))
        source = torch.where(move, load_indices, torch.where(any_move, load_indices[first_move], own))
        kv_score_buffer.index_copy_(0, target.to(torch.int64), kv_score_buffer[source.to(torch.int64)])
    return torch.where(load_ok | fresh, indices, torch.full_like(indices, -1))


def _compiled(kv_score_buffer: torch.Tensor, ape: torch.Tensor, use_pdl: Optional[bool]) -> Any:
    """What runs a call: the compiled variant for CUDA tensors, the reference module for CPU ones."""
    try:
        head_dim = ape.shape[-1]
    except (AttributeError, IndexError):
        raise _not_tensor(kv_score_buffer=kv_score_buffer, ape=ape) from None
    return _variant(kv_score_buffer, head_dim, use_pdl)


def _variant(kv_score_buffer: torch.Tensor, head_dim: int, use_pdl: Optional[bool]) -> Any:
    """The compiled variant for ``head_dim`` and the pool's dtype; the reference module for a CPU pool."""
    try:
        on_cuda = kv_score_buffer.is_cuda
        state_dtype = TORCH_STATE_DTYPES.get(kv_score_buffer.dtype)
    except AttributeError:
        raise _not_tensor(kv_score_buffer=kv_score_buffer) from None
    if state_dtype is None:
        raise TypeError(f"argument 'kv_score_buffer': expected dtype {' or '.join(STATE_DTYPES)} (the state dtype), "
                        f"got {str(kv_score_buffer.dtype).removeprefix('torch.')}")
    if kv_score_buffer.requires_grad:
        raise ValueError("argument 'kv_score_buffer': expected a tensor that does not require grad (the calls "
                         "update it in place and have no gradient), got requires_grad=True")
    if on_cuda:
        return kernels(head_dim, use_pdl, state_dtype)
    from . import reference

    return reference


def decode_into(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    out: torch.Tensor,
    ape: torch.Tensor,
    indices: torch.Tensor,
    seq_lens: torch.Tensor,
    load_indices: Optional[torch.Tensor] = None,
    use_pdl: Optional[bool] = None,
) -> None:
    """One decode step into ``out``, by the compiled kernel (CUDA) or the reference (CPU)."""
    module = _compiled(kv_score_buffer, ape, use_pdl)
    if _debug.enabled():
        _debug.check_decode(kv_score_buffer, indices, seq_lens, load_indices)
    if load_indices is not None:
        _check_move_arguments(kv_score_buffer, kv_score_input, out, ape, indices, load_indices, seq_lens)
        # The export's own checks of every other argument, before the move writes the pool: with no
        # request (B = 0) it checks and returns without a launch.
        with _naming_arguments(_DECODE_NAMES, locals()):
            module.run_decode(kv_score_buffer, kv_score_input[:0], out[:0], ape, indices[:0], seq_lens[:0], None)
        indices = relocate_states(kv_score_buffer, indices, load_indices, seq_lens)
    with _naming_arguments(_DECODE_NAMES, locals()):
        module.run_decode(kv_score_buffer, kv_score_input, out, ape, indices, seq_lens, None)


def prefill_into(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    out: torch.Tensor,
    ape: torch.Tensor,
    indices: torch.Tensor,
    compress_plan: torch.Tensor,
    write_plan: torch.Tensor,
    load_indices: Optional[torch.Tensor] = None,
    use_pdl: Optional[bool] = None,
    compact: bool = False,
    plan_counts: Optional[torch.Tensor] = None,
) -> None:
    """A planned prefill into ``out`` (``[N, D]``, or ``[compress_plan rows, D]`` when ``compact``), by the
    compiled kernels (CUDA) or the reference (CPU). ``plan_counts``: a GPU-made plan's counts, which debug
    mode checks for the planner's error flag."""
    module = _compiled(kv_score_buffer, ape, use_pdl)
    if _debug.enabled():
        _debug.check_planner_flag(plan_counts)
        _debug.check_prefill(kv_score_buffer, kv_score_input, indices, compress_plan, write_plan, load_indices)
    run = module.run_prefill_compact if compact else module.run_prefill
    with _naming_arguments(_PREFILL_NAMES, locals()):
        run(kv_score_buffer, kv_score_input, out, ape, indices, compress_plan, write_plan, load_indices)


def verify_into(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    out: torch.Tensor,
    ape: torch.Tensor,
    indices: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_states: torch.Tensor,
    use_pdl: Optional[bool] = None,
) -> None:
    """A verify step into ``out`` and ``prefix_states``, by the compiled kernel (CUDA) or the reference (CPU)."""
    module = _compiled(kv_score_buffer, ape, use_pdl)
    if _debug.enabled():
        _debug.check_verify(kv_score_buffer, kv_score_input, indices, seq_lens)
    with _naming_arguments(_VERIFY_NAMES, locals()):
        module.run_verify(kv_score_buffer, kv_score_input, out, ape, indices, seq_lens, prefix_states)


def commit_into(
    kv_score_buffer: torch.Tensor,
    prefix_states: torch.Tensor,
    indices: torch.Tensor,
    accept_lens: torch.Tensor,
    use_pdl: Optional[bool] = None,
) -> None:
    """Commits the accepted prefixes' states into their slots (compiled kernel for CUDA, reference for CPU)."""
    try:
        width = kv_score_buffer.shape[-1]
    except (AttributeError, IndexError):
        raise _not_tensor(kv_score_buffer=kv_score_buffer) from None
    head_dim = width // 3
    if width % 3:
        raise ValueError(f"argument 'kv_score_buffer': expected shape [slots, 1, 3*D], got {list(kv_score_buffer.shape)}")
    # Only a compiled variant needs a supported head dim: the CPU reference commits any D, as it verifies any.
    if getattr(kv_score_buffer, "is_cuda", False) and not is_supported_head_dim(head_dim):
        raise ValueError(f"argument 'kv_score_buffer': expected shape [slots, 1, 3*D] with D a multiple of 64 in "
                         f"[64, 1024], got {list(kv_score_buffer.shape)}")
    module = _variant(kv_score_buffer, head_dim, use_pdl)
    if _debug.enabled():
        _debug.check_commit(kv_score_buffer, prefix_states, indices, accept_lens)
    with _naming_arguments(_COMMIT_NAMES, locals()):
        module.run_commit(kv_score_buffer, prefix_states, indices, accept_lens)
