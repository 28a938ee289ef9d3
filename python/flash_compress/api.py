"""The torch API: plan a prefill, run decode and prefill steps on a pool of per-slot states.

Typical engine use (``docs/USAGE.md`` has the whole story)::

    import flash_compress as fc

    state = torch.zeros(num_slots, 1, 3 * head_dim, device="cuda")   # the state pool
    plan = fc.plan_prefill(seq_lens, extend_lens, device="cuda")     # once per prefill step
    rows = fc.prefill(state, kv_score_input, ape, indices, plan)      # [N, head_dim]
    rows = fc.decode(state, kv_score_input, ape, indices, seq_lens)  # [B, head_dim]

CUDA tensors run the compiled kernels (the variant is picked by
``ape.shape[-1]`` and loaded on first use); CPU tensors run
:mod:`flash_compress.reference`, the float64 reference, for tests and small
jobs. The C++ side checks dtypes, shapes, devices and contiguity and raises
``ValueError`` / ``TypeError`` naming the argument, so the fast path here adds
only the output allocation. Values inside device tensors (slots in range,
``seq_len >= 1`` or ``>= T``, plan rows, accepted lengths) are not checked: the
kernels skip what does not fit. Set ``FLASH_COMPRESS_DEBUG=1`` to check them on
the host (a sync per call). Under ``torch.compile`` the calls
go through the custom ops of :mod:`flash_compress.ops`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import _dispatch
from ._arguments import check_flag
from . import ops as _ops  # registers torch.ops.flash_compress.{decode,prefill,verify,commit}
from .host_planner import check_lengths, plan_tensors, planned_tokens
from .plan_rows import MAX_LENGTH, ROW_BYTES

__all__ = ["PrefillPlan", "commit", "decode", "plan_prefill", "prefill", "verify"]


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """The two plans of one prefill step, on the device the kernels run on.

    Attributes:
        compress_plan: ``[num_compress, 16]`` uint8, one row per chunk a segment closes.
        write_plan: ``[num_write, 16]`` uint8, one row per request's trailing partial chunk.
        num_compress: rows of ``compress_plan`` (``num_tokens`` in CUDA-graph form).
        num_write: rows of ``write_plan`` (``num_tokens`` in CUDA-graph form).
        use_cuda_graph: both plans have ``num_tokens`` rows, real rows first, then all-0xFF padding
            the kernels skip, so their shapes depend only on the token count.
        counts: for a plan made on the GPU, the planner's ``[3]`` int32 device tensor
            ``(num_compress, num_write, error_flag)``; ``None`` for a host-made plan.
    """

    compress_plan: torch.Tensor
    write_plan: torch.Tensor
    num_compress: int
    num_write: int
    use_cuda_graph: bool
    counts: Optional[torch.Tensor] = None


def _through_ops(kv_score_buffer: object) -> bool:
    """Whether a call goes through the ``torch.ops.flash_compress`` ops rather than straight to the
    kernels: while torch.compile traces it, and for tensors without data (meta, or a subclass such as
    the fake tensors of FakeTensorMode and ``make_fx``), whose fake kernels the ops have. The direct
    path saves the ops' dispatch (a few us of host time) on plain CPU and CUDA tensors."""
    return torch.compiler.is_compiling() or (
        isinstance(kv_score_buffer, torch.Tensor) and (type(kv_score_buffer) is not torch.Tensor
                                                       or kv_score_buffer.is_meta))


def plan_prefill(
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    *,
    device: Union[torch.device, str],
    use_cuda_graph: bool = False,
    num_tokens: Optional[int] = None,
) -> PrefillPlan:
    """Plans one chunked-prefill step for :func:`prefill`.

    Args:
        seq_lens: ``[B]`` int32 or int64, each request's length INCLUDING its new tokens.
        extend_lens: ``[B]`` int32 or int64, new tokens per request, ``1 <= extend_len <= seq_len``.
        device: where the plans go (the kernels' device; ``"cpu"`` for the reference).
        use_cuda_graph: pad both plans to ``num_tokens`` rows, so that a captured
            :func:`prefill` replays with any plan of the same token count.
        num_tokens: ``sum(extend_lens)``, the rows of ``kv_score_input``. Needed only
            to plan on the GPU without a sync; checked when given.

    Lengths on the CPU (or anywhere, when ``device`` is the CPU) are planned on
    the host, in pinned memory when ``device`` is a CUDA device, and the plans
    are copied with ``non_blocking=True`` (by the compiled planner; for a CPU
    ``device`` by the compiled planner once something loaded it, else by the reference planner, which
    writes the same bytes); lengths on a CUDA device (and a CUDA
    ``device``) are planned there by the GPU planner, with no host round trip, and
    the plan is always in CUDA-graph form with its counts on the device.

    Raises:
        TypeError / ValueError: naming the argument, for wrong tensors or lengths
            (``not 0 < extend_len <= seq_len``, ``num_tokens != sum(extend_lens)``).
    """
    check_lengths(seq_lens, "seq_lens")
    check_lengths(extend_lens, "extend_lens")
    if seq_lens.shape != extend_lens.shape:
        raise ValueError(
            f"argument 'seq_lens': expected shape {list(extend_lens.shape)} like extend_lens, "
            f"got {list(seq_lens.shape)}"
        )
    use_cuda_graph = check_flag(use_cuda_graph, "use_cuda_graph")
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"argument 'device': expected a torch.device or a device string, got {type(device).__name__}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and extend_lens.is_cuda and seq_lens.is_cuda:
        return _plan_on_gpu(seq_lens, extend_lens, device, num_tokens)
    return _plan_on_host(seq_lens, extend_lens, device, use_cuda_graph, num_tokens)


def _plan_on_host(
    seq_lens: torch.Tensor, extend_lens: torch.Tensor, device: torch.device, use_cuda_graph: bool,
    num_tokens: Optional[int],
) -> PrefillPlan:
    # The compiled planner reads int64 host tensors.
    extend = extend_lens.to("cpu", torch.int64)
    seq = seq_lens.to("cpu", torch.int64)
    total = int(extend.sum())
    if extend.numel() and not (int(extend.min()) > 0 and 0 < total <= MAX_LENGTH):
        planned_tokens(extend.tolist(), seq.tolist())  # raises: lengths no plan can be sized for
    if num_tokens is not None and num_tokens != total:
        raise ValueError(f"argument 'num_tokens': expected sum(extend_lens) = {total}, got {num_tokens}")
    pinned = device.type == "cuda"
    compress, write = plan_tensors(_dispatch.planner(load=pinned), extend, seq, use_cuda_graph, pin_memory=pinned,
                                   rows=total)
    num_compress, num_write = compress.shape[0], write.shape[0]
    if device.type != "cpu":
        compress = compress.to(device, non_blocking=True)
        write = write.to(device, non_blocking=True)
    return PrefillPlan(compress, write, num_compress, num_write, use_cuda_graph)


def _plan_on_gpu(
    seq_lens: torch.Tensor, extend_lens: torch.Tensor, device: torch.device, num_tokens: Optional[int]
) -> PrefillPlan:
    # The GPU planner reads int32 or int64 lengths (they may differ) on the plans' device.
    extend = extend_lens.to(device, non_blocking=True).contiguous()
    seq = seq_lens.to(device, non_blocking=True).contiguous()
    total = int(extend.sum()) if num_tokens is None else num_tokens  # the sum syncs; pass num_tokens to avoid it
    if not 0 <= total <= MAX_LENGTH:
        name = "extend_lens" if num_tokens is None else "num_tokens"
        raise ValueError(f"argument '{name}': expected a token count in [0, {MAX_LENGTH}], got {total}")
    compress = torch.empty((total, ROW_BYTES), dtype=torch.uint8, device=device)
    write = torch.empty((total, ROW_BYTES), dtype=torch.uint8, device=device)
    counts = torch.empty(3, dtype=torch.int32, device=device)
    planner = _dispatch.planner()
    if not hasattr(planner, "plan_online_prefill_counted"):  # the reference: no compiled planner could load
        raise NotImplementedError(
            "plan_prefill: CUDA lengths need the compiled GPU planner, which cannot be loaded here; "
            "pass seq_lens and extend_lens on the CPU"
        )
    planner.plan_online_prefill_counted(extend, seq, compress, write, True, counts)
    return PrefillPlan(compress, write, total, total, True, counts)


def decode(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    load_indices: Optional[torch.Tensor] = None,
    use_pdl: Optional[bool] = None,
) -> torch.Tensor:
    """One decode step: folds one new token per request into its slot's state.

    Args:
        kv_score_buffer: ``[slots, 1, 3*D]`` float32 or bfloat16 state pool, updated in place;
            its dtype picks the variant.
        kv_score_input: ``[B, 2*D]`` float32, request ``b``'s token as ``| kv | score |``.
        ape: ``[128, D]`` float32 score bias by position in the chunk; ``D`` picks the variant.
        indices: ``[B]`` int32, the slot request ``b`` writes (and, by default, reads).
        seq_lens: ``[B]`` int32, lengths INCLUDING the new token (>= 1).
        out: ``[B, D]`` float32 to write into; allocated (uninitialised) when None.
        load_indices: ``[B]`` int32 slots to read the prior states from (a request moving to
            ``indices[b]``); costs one gather and one scatter of those states before the kernel,
            without a host sync. A request whose ``load_indices`` slot is outside the pool is
            skipped when it needs its prior state (its token does not start a chunk). A request
            whose token closes a chunk also moves its prior state, which then stays in
            ``indices[b]``: the kernel writes no state there, and the next token starts a chunk.
        use_pdl: the variant's programmatic dependent launch (None: on for sm_90+).

    Returns:
        ``out``. Row ``b`` is written only when the token closes a chunk
        (``seq_lens[b] % 128 == 0``); other rows are left as they were.
    """
    if out is None:
        out = _dispatch.new_output(kv_score_input, ape)
    if _through_ops(kv_score_buffer):
        torch.ops.flash_compress.decode(kv_score_buffer, kv_score_input, out, ape, indices, seq_lens, load_indices,
                                        use_pdl)
    else:
        _dispatch.decode_into(kv_score_buffer, kv_score_input, out, ape, indices, seq_lens, load_indices, use_pdl)
    return out


def prefill(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    indices: torch.Tensor,
    plan: PrefillPlan,
    *,
    out: Optional[torch.Tensor] = None,
    load_indices: Optional[torch.Tensor] = None,
    use_pdl: Optional[bool] = None,
    compact: bool = False,
) -> torch.Tensor:
    """One chunked-prefill step: folds every request's new tokens into its slot's state.

    Args:
        kv_score_buffer: ``[slots, 1, 3*D]`` float32 or bfloat16 state pool, updated in place;
            its dtype picks the variant.
        kv_score_input: ``[N, 2*D]`` float32 ragged new tokens, request after request.
        ape: ``[128, D]`` float32; ``D`` picks the variant.
        indices: ``[B]`` int32, the slot request ``b``'s state is written to.
        plan: from :func:`plan_prefill` for this step's lengths.
        out: ``[N, D]`` float32 (``[plan.compress_plan rows, D]`` when ``compact``) to write into;
            allocated (uninitialised) when None.
        load_indices: ``[B]`` int32 slots to read the prior states from (default ``indices``),
            for a request that moves slots. A request may read and write one slot; a slot that one
            request reads and another writes in the same call races (``docs/USAGE.md`` section 4).
        use_pdl: the variant's programmatic dependent launch (None: on for sm_90+).
        compact: one output row per compress-plan row instead of one per token
            (``docs/SPEC.md`` section 10): an N-token step allocates about N/128 rows.

    Returns:
        ``out``. Without ``compact``, row ``i`` is written only when token ``i`` closes a
        chunk (its position is ``127 mod 128``); the plan's compress rows name them.
        With ``compact``, row ``i`` holds the chunk of compress-plan row ``i`` (its
        ``ragged_id`` says which token closed it); padding rows leave theirs untouched.
    """
    try:
        compress_plan, write_plan = plan.compress_plan, plan.write_plan
    except AttributeError:
        raise TypeError(f"argument 'plan': expected a PrefillPlan, got {type(plan).__name__}") from None
    compact = check_flag(compact, "compact")
    if out is None:
        out = _dispatch.new_output(kv_score_input, ape, compress_plan.shape[0] if compact else None)
    # A GPU-made plan's counts go along for debug mode's check of the planner's error flag.
    if _through_ops(kv_score_buffer):
        torch.ops.flash_compress.prefill(kv_score_buffer, kv_score_input, out, ape, indices, compress_plan, write_plan,
                                         load_indices, use_pdl, compact, plan.counts)
        return out
    _dispatch.prefill_into(kv_score_buffer, kv_score_input, out, ape, indices, compress_plan, write_plan,
                           load_indices, use_pdl, compact, plan.counts)
    return out


def verify(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    prefix_states: Optional[torch.Tensor] = None,
    use_pdl: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A speculative verify step: T tokens per request, the pool left alone (``docs/SPEC.md`` section 9).

    Args:
        kv_score_buffer: ``[slots, 1, 3*D]`` float32 or bfloat16 state pool, only read.
        kv_score_input: ``[B*T, 2*D]`` float32; request ``b``'s token ``j`` is row ``b*T + j``
            (the last accepted token, then ``T - 1`` drafts), ``1 <= T <= 16``.
        ape: ``[128, D]`` float32; ``D`` picks the variant.
        indices: ``[B]`` int32, the slot holding request ``b``'s committed state.
        seq_lens: ``[B]`` int32, lengths counting all ``T`` tokens.
        out: ``[B*T, D]`` float32 for the compressed rows; allocated (uninitialised) when None.
        prefix_states: ``[B*T, 3*D]`` in the pool's dtype for the state after each token;
            allocated when None.
        use_pdl: the variant's programmatic dependent launch (None: on for sm_90+).

    Returns:
        ``(out, prefix_states)``. Row ``b*T + j`` of ``out`` is written only when token ``j``
        closes a chunk; pass ``prefix_states`` and the accepted lengths to :func:`commit`.
    """
    if out is None:
        out = _dispatch.new_output(kv_score_input, ape)
    if prefix_states is None:
        try:
            prefix_states = kv_score_buffer.new_empty((kv_score_input.shape[0], kv_score_buffer.shape[-1]))
        except (AttributeError, IndexError):
            raise TypeError("arguments 'kv_score_buffer' and 'kv_score_input': expected tensors") from None
    if _through_ops(kv_score_buffer):
        torch.ops.flash_compress.verify(kv_score_buffer, kv_score_input, out, ape, indices, seq_lens, prefix_states,
                                        use_pdl)
    else:
        _dispatch.verify_into(kv_score_buffer, kv_score_input, out, ape, indices, seq_lens, prefix_states, use_pdl)
    return out, prefix_states


def commit(
    kv_score_buffer: torch.Tensor,
    prefix_states: torch.Tensor,
    indices: torch.Tensor,
    accept_lens: torch.Tensor,
    *,
    use_pdl: Optional[bool] = None,
) -> torch.Tensor:
    """Keeps the state after each request's accepted prefix (``docs/SPEC.md`` section 9).

    Args:
        kv_score_buffer: ``[slots, 1, 3*D]`` state pool, updated in place.
        prefix_states: ``[B*T, 3*D]`` from :func:`verify`, in the pool's dtype.
        indices: ``[B]`` int32, the slot each request's state goes to.
        accept_lens: ``[B]`` int32 on the device, accepted tokens per request: for
            ``1 <= a <= T`` slot ``indices[b]`` gets ``prefix_states[b*T + a - 1]``; other
            values leave the slot alone. No host synchronisation.
        use_pdl: the variant's programmatic dependent launch (None: on for sm_90+).

    Returns:
        ``kv_score_buffer``.
    """
    if _through_ops(kv_score_buffer):
        torch.ops.flash_compress.commit(kv_score_buffer, prefix_states, indices, accept_lens, use_pdl)
    else:
        _dispatch.commit_into(kv_score_buffer, prefix_states, indices, accept_lens, use_pdl)
    return kv_score_buffer
