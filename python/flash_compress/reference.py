"""Pure-PyTorch reference of the online c128 compressor (``docs/SPEC.md`` sections 1-4 and 8-10).

The functions here have the same names, signatures and in-place semantics as
the compiled tvm-ffi module (``flash_compress.load_module``):

- :func:`run_decode` adds one token per request to its running state;
- :func:`run_prefill` runs a planned chunked prefill (compress pass, then
  write pass);
- :func:`run_prefill_compact` is the same prefill with one output row per
  compress-plan row instead of one per token (SPEC section 10);
- :func:`plan_online_prefill` cuts a prefill into per-chunk segments and
  writes the 16-byte plan rows (the planner is :mod:`flash_compress.host_planner`,
  the row format :mod:`flash_compress.plan_rows`);
- :func:`run_verify` and :func:`run_commit` are speculative decoding (SPEC
  section 9): the state after each of T tokens per request, without touching
  the pool, then the state after the accepted prefix into the slot.

They take tensors on any device (CPU or CUDA) and are written to be plainly
right, not fast: every value is cast to float64, the arithmetic follows the
SPEC's formulas literally, and only the final results are cast back to the
dtype of the tensor they are written to. It is the test oracle's partner and
the CPU fallback.

Softmax state layout, per slot and channel ``d`` (``D = head_dim``)::

    kv_score_buffer[slot, 0] = [ max (D) | sum (D) | kv (D) ]

where ``kv`` is the already normalised weighted mean of the chunk's tokens.

The state pool is float32 or bfloat16 (SPEC section 8); every other float
tensor is float32. A bfloat16 state is read exactly (widened to float64) and
rounded once per store, as the kernels do: within one call a request's tokens
build on the unrounded state, and only what is written to the pool is
rounded. With ``exact_bf16_stores=True`` (the default, the kernels' scheme)
the stored ``max`` is the bfloat16 rounding of the true max and ``sum`` is
re-expressed against that rounded max before it is rounded itself, so
``max + log(sum)`` loses nothing to the rounding of ``max``.
``exact_bf16_stores=False`` is the naive scheme, a plain cast of the three
fields, kept only to compare against (``scripts/bf16_accuracy.py``). Float32
states ignore the switch.

Arguments are checked as the compiled exports check them (dtypes, shapes,
devices), with the same ``argument 'NAME': expected ..., got ...`` errors,
before anything is written. Values the kernels can only see on the device are
not errors: every function skips what its kernel skips (SPEC section 9,
``docs/RELIABILITY.md`` section 2), so a call gives the same result on the CPU
as on the GPU. Decode skips a request whose slot is outside the pool or whose
``seq_len < 1``; prefill skips a plan row that does not fit the call or whose
slot is outside the pool; verify skips a request with a slot outside the pool
or ``seq_len < T``; commit one with a slot outside the pool or an accepted
length outside ``[1, T]``. Nothing of a skipped request or row is written.
(The torch API's debug mode, ``FLASH_COMPRESS_DEBUG=1``, raises for these
values instead.)
"""

from __future__ import annotations

from typing import Optional

import torch

from . import c128_online
from ._arguments import check_apart, check_device, check_flag
from .host_planner import plan_online_prefill, plan_segments
from .plan_rows import (
    CHUNK_SIZE, PADDING_ROW, check_plan_tensor, continues_chunk, decode_rows, live_rows, row_problems,
)

__all__ = [
    "MAX_VERIFY_TOKENS",
    "STATE_DTYPES",
    "plan_segments",
    "plan_online_prefill",
    "run_decode",
    "run_prefill",
    "run_commit",
    "run_prefill_compact",
    "run_verify",
    "state_to_store",
]

#: The dtypes a state pool (``kv_score_buffer``) may have (SPEC section 8).
STATE_DTYPES = tuple(getattr(torch, name) for name in c128_online.STATE_DTYPES)
#: Most tokens per request one verify step takes (SPEC section 9).
MAX_VERIFY_TOKENS = 16


#: The run_* functions update their tensors in place and have no gradient, as the kernels: an input that
#: requires grad (an ``nn.Parameter`` ape) must not leave the pool tracking one.
_without_autograd = torch.no_grad()


# ---------------------------------------------------------------------------
# Softmax states in float64.
# ---------------------------------------------------------------------------


def _merge(m1, s1, k1, m2, s2, k2):
    """SPEC 1's merge of two partial states ``(max, sum, kv)``, all float64."""
    m = torch.maximum(m1, m2)
    a = s1 * torch.exp(m1 - m)
    b = s2 * torch.exp(m2 - m)
    total = a + b
    return m, total, (k1 * a + k2 * b) / total


def _add_token(m, total, kv, s, v, reset):
    """SPEC 1's one-token update of ``[R, D]`` float64 states, row-wise; rows where ``reset`` (``[R]`` bool, the
    token is at chunk offset 0) take the fresh state ``(s, 1, v)`` (their old state may be garbage: torch.where
    does not let it leak)."""
    new_m = torch.maximum(m, s)
    a = total * torch.exp(m - new_m)
    e = torch.exp(s - new_m)
    new_total = a + e
    new_kv = (kv * a + v * e) / new_total
    reset = reset[:, None]
    return (torch.where(reset, s, new_m), torch.where(reset, torch.ones_like(new_total), new_total),
            torch.where(reset, v, new_kv))


def _segment_state(kv: torch.Tensor, s: torch.Tensor):
    """The state ``(max, sum, kv)`` of a set of tokens: ``kv``, ``s`` are ``[T, D]`` float64 (s includes ape)."""
    m = s.max(dim=0).values
    w = torch.exp(s - m)
    total = w.sum(dim=0)
    return m, total, (w * kv).sum(dim=0) / total


def state_to_store(m: torch.Tensor, total: torch.Tensor, kv: torch.Tensor, dtype: torch.dtype, *,
                   exact_bf16_stores: bool = True) -> torch.Tensor:
    """The ``[..., 3D]`` state ``[max | sum | kv]`` as it is stored in a pool of ``dtype``.

    ``m``, ``total`` and ``kv`` are float64 ``[..., D]``. For a float32 pool
    each field is rounded to float32. For a bfloat16 pool with
    ``exact_bf16_stores`` (the kernels' scheme, SPEC section 8) the max is
    rounded first, ``m_b = bf16(m)``, the sum is re-expressed against it,
    ``total * exp(m - m_b)``, and only then are sum and kv rounded; without
    it (the naive scheme) the three fields are rounded independently.
    """
    if dtype == torch.bfloat16 and exact_bf16_stores:
        m_b = m.to(torch.bfloat16)
        total = total * torch.exp(m - m_b.to(torch.float64))
        m = m_b
    return torch.cat([m.to(dtype), total.to(dtype), kv.to(dtype)], dim=-1)


def _check_state_tensors(kv_score_buffer, kv_score_input, kv_compressed_output, ape,
                         output_rows: Optional[tuple[int, str]] = None) -> int:
    """Checks the tensors shared by the run functions; returns head_dim.

    ``output_rows`` is ``(rows, what)`` when ``kv_compressed_output`` has
    ``rows`` rows described as ``what`` (compact prefill); by default it has
    one row per ``kv_score_input`` row.
    """
    tensors = {
        "kv_score_buffer": kv_score_buffer,
        "kv_score_input": kv_score_input,
        "kv_compressed_output": kv_compressed_output,
        "ape": ape,
    }
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"argument '{name}': expected a torch.Tensor, got {type(t).__name__}")
    _check_state_dtype(kv_score_buffer)
    for name, t in tensors.items():
        if name != "kv_score_buffer" and t.dtype != torch.float32:
            raise TypeError(f"argument '{name}': expected dtype float32, got {t.dtype}")
    if ape.dim() != 2 or ape.shape[0] != CHUNK_SIZE:
        raise ValueError(f"argument 'ape': expected shape [{CHUNK_SIZE}, D], got {list(ape.shape)}")
    d = ape.shape[1]
    if kv_score_buffer.dim() != 3 or kv_score_buffer.shape[1] != 1 or kv_score_buffer.shape[2] != 3 * d:
        raise ValueError(
            f"argument 'kv_score_buffer': expected shape [S, 1, {3 * d}], got {list(kv_score_buffer.shape)}"
        )
    if kv_score_input.dim() != 2 or kv_score_input.shape[1] != 2 * d:
        raise ValueError(f"argument 'kv_score_input': expected shape [N, {2 * d}], got {list(kv_score_input.shape)}")
    if output_rows is None:
        rows, expected = kv_score_input.shape[0], f"[{kv_score_input.shape[0]}, {d}]"
    else:
        rows, what = output_rows
        expected = f"[{what}, D] = [{rows}, {d}]"
    if kv_compressed_output.dim() != 2 or list(kv_compressed_output.shape) != [rows, d]:
        raise ValueError(
            f"argument 'kv_compressed_output': expected shape {expected}, "
            f"got {list(kv_compressed_output.shape)}"
        )
    for name, t in tensors.items():
        check_device(t, name, kv_score_buffer.device)
    return d


def _check_state_dtype(kv_score_buffer: torch.Tensor) -> None:
    """The pool's dtype is a state dtype (SPEC section 8), or TypeError naming it, as the exports raise."""
    if kv_score_buffer.dtype not in STATE_DTYPES:
        raise TypeError(
            f"argument 'kv_score_buffer': expected dtype {' or '.join(c128_online.STATE_DTYPES)} (the state dtype), "
            f"got {kv_score_buffer.dtype}"
        )


def _index_vector(t, name: str, device, batch: Optional[int] = None, *, like: str = "") -> int:
    """Checks a ``[B]`` int32 index tensor on ``device`` with ``B = batch`` when given (``like``
    names where B comes from); returns B."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"argument '{name}': expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"argument '{name}': expected dtype int32, got {t.dtype}")
    if t.dim() != 1 or (batch is not None and t.shape[0] != batch):
        want = "[B]" if batch is None else f"[{batch}]" + (f" like {like}" if like else "")
        raise ValueError(f"argument '{name}': expected shape {want}, got {list(t.shape)}")
    check_device(t, name, device)
    return t.shape[0]


def _in_pool(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Which of the ``[B]`` slot indices address the pool; the kernels skip the rest."""
    return (slots >= 0) & (slots < num_slots)


# ---------------------------------------------------------------------------
# Decode.
# ---------------------------------------------------------------------------


@_without_autograd
def run_decode(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    kv_compressed_output: torch.Tensor,
    ape: torch.Tensor,
    indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extra: None = None,
    *,
    exact_bf16_stores: bool = True,
) -> None:
    """One decode step: adds token ``b`` (row ``b`` of ``kv_score_input``) to slot ``indices[b]``.

    The token sits at position ``seq_lens[b] - 1`` (``seq_lens`` include it);
    ``j = position % 128``, ``s = score + ape[j]``, ``v = kv``. Then, exactly as
    SPEC 1 and 3 say:

    - ``j == 0``: the slot's state becomes ``(s, 1, v)`` (the old one is not read);
    - ``j == 127``: ``kv_compressed_output[b]`` gets the chunk's normalised kv,
      the state is left alone;
    - otherwise: the slot gets the updated state, ``kv_compressed_output[b]`` is untouched.

    ``extra`` is unused. Shapes: buffer ``[S, 1, 3D]`` float32 or bfloat16,
    input ``[B, 2D]``, output ``[B, D]``, ape ``[128, D]``, indices and seq_lens
    ``[B]`` int32. Each stored state is rounded once (:func:`state_to_store`;
    ``exact_bf16_stores`` picks the bfloat16 scheme). A request whose slot is
    outside ``[0, S)`` or whose ``seq_len < 1`` is skipped, as the kernel skips
    it: its output row and every slot stay as they were. Returns None.
    """
    d = _check_state_tensors(kv_score_buffer, kv_score_input, kv_compressed_output, ape)
    exact = check_flag(exact_bf16_stores, "exact_bf16_stores")
    batch = kv_score_input.shape[0]
    device = kv_score_buffer.device
    _index_vector(indices, "indices", device, batch, like="kv_score_input rows")
    _index_vector(seq_lens, "seq_lens", device, batch, like="kv_score_input rows")
    check_apart([("kv_score_buffer", kv_score_buffer, True), ("kv_score_input", kv_score_input, False),
                 ("kv_compressed_output", kv_compressed_output, True), ("ape", ape, False),
                 ("indices", indices, False), ("seq_lens", seq_lens, False)])
    live = (_in_pool(indices, kv_score_buffer.shape[0]) & (seq_lens >= 1)).nonzero().flatten()
    if not len(live):
        return
    slots = indices[live].to(torch.int64)
    j = (seq_lens[live].to(torch.int64) - 1) % CHUNK_SIZE

    x = kv_score_input[live].to(torch.float64)
    v = x[:, :d]
    s = x[:, d:] + ape.to(torch.float64)[j]
    state = kv_score_buffer[slots, 0].to(torch.float64)
    new_m, new_total, new_kv = _add_token(state[:, :d], state[:, d : 2 * d], state[:, 2 * d :], s, v, j == 0)

    closes = j == CHUNK_SIZE - 1
    if bool(closes.any()):
        kv_compressed_output[live[closes]] = new_kv[closes].to(kv_compressed_output.dtype)
    keep = ~closes
    if bool(keep.any()):
        kv_score_buffer[slots[keep], 0] = state_to_store(
            new_m[keep], new_total[keep], new_kv[keep], kv_score_buffer.dtype, exact_bf16_stores=exact
        )


# ---------------------------------------------------------------------------
# Prefill.
# ---------------------------------------------------------------------------


def _runnable_rows(plan: torch.Tensor, *, compress: bool, num_tokens: int, indices: torch.Tensor,
                   load_indices: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``plan`` a prefill pass runs, and their indices in the plan.

    As the kernels' ``decode_segment``: padding rows, rows that break a rule of
    SPEC section 4 against this call (``plan_rows.row_problems``), rows that
    need a prior state from a ``load_indices`` slot outside the pool and, in
    the write pass, rows whose ``indices`` slot is outside the pool are skipped.
    """
    rows = decode_rows(plan)
    where = (rows[:, 0] != PADDING_ROW).nonzero().flatten()
    rows = live_rows(rows)
    keep = torch.ones(len(rows), dtype=torch.bool)
    for violated, _ in row_problems(rows, num_tokens=num_tokens, batch=len(indices), compress=compress):
        keep &= ~violated
    if not bool(keep.any()):  # also every row of an empty batch
        return rows[keep], where[keep]
    batch_id = torch.where(keep, rows[:, 1], 0)  # in range wherever keep holds
    keep &= ~continues_chunk(rows[:, 2], rows[:, 3]) | _in_pool(load_indices.cpu()[batch_id], num_slots)
    if not compress:
        keep &= _in_pool(indices.cpu()[batch_id], num_slots)
    return rows[keep], where[keep]


def _prefill_row_state(row, x: torch.Tensor, ape64: torch.Tensor, kv_score_buffer: torch.Tensor, load_slot: int,
                       d: int):
    """The state after segment ``row``: its tokens' softmax, merged with the state in ``load_slot`` unless it
    starts a chunk (the slot is read only then: a row that needs no prior state runs whatever its slot)."""
    ragged, _, position, window = (int(v) for v in row)
    end = position % CHUNK_SIZE
    start = end - window + 1
    tokens = x[ragged - window + 1 : ragged + 1]
    state = _segment_state(tokens[:, :d], tokens[:, d:] + ape64[start : end + 1])
    if start > 0:
        prior64 = kv_score_buffer[load_slot, 0].to(torch.float64)
        state = _merge(prior64[:d], prior64[d : 2 * d], prior64[2 * d :], *state)
    return state


@_without_autograd
def run_prefill(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    kv_compressed_output: torch.Tensor,
    ape: torch.Tensor,
    indices: torch.Tensor,
    compress_plan: torch.Tensor,
    write_plan: torch.Tensor,
    load_indices: Optional[torch.Tensor] = None,
    *,
    exact_bf16_stores: bool = True,
) -> None:
    """A planned chunked prefill; updates ``kv_compressed_output`` and ``kv_score_buffer`` in place.

    ``kv_score_input`` holds the ragged new tokens of all requests ``[N, 2D]``;
    ``indices[b]`` is the slot request ``b`` writes its state to and
    ``load_indices[b]`` (default: ``indices[b]``) the slot its prior state is
    read from. Plans are ``[M, 16]`` uint8 rows from :func:`plan_online_prefill`
    (sliced to the returned counts, or padded with sentinel rows, which are
    skipped). For every row, the segment is the ``window_len`` tokens ending at
    ragged row ``ragged_id`` / chunk offset ``position % 128``; its state is the
    per-channel softmax over them of ``score + ape[offset]``, merged (SPEC 1)
    with the prior state of ``load_indices[batch_id]`` when the segment does not
    start at offset 0.

    1. Compress pass, all rows first: ``kv_compressed_output[ragged_id]`` = the
       state's kv. The buffer is never written.
    2. Write pass: every row's prior state is read, then ``kv_score_buffer[indices[batch_id], 0]``
       = ``[max | sum | kv]``, rounded once to the pool's dtype (float32 or
       bfloat16; :func:`state_to_store`, ``exact_bf16_stores`` picks the
       bfloat16 scheme).

    Rows the kernels skip are skipped (nothing of them written): padding rows,
    rows that do not fit the call (SPEC section 4's rules against the input's
    rows and the batch) and rows whose slot is outside ``[0, S)``
    (``load_indices`` for a segment that starts mid-chunk, ``indices`` for a
    write row).
    """
    _prefill(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, compress_plan, write_plan,
             load_indices, compact=False, exact_bf16_stores=exact_bf16_stores)


@_without_autograd
def run_prefill_compact(
    kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, kv_compressed_output: torch.Tensor,
    ape: torch.Tensor, indices: torch.Tensor, compress_plan: torch.Tensor, write_plan: torch.Tensor,
    load_indices: Optional[torch.Tensor] = None, *, exact_bf16_stores: bool = True,
) -> None:
    """:func:`run_prefill` with a compact output (SPEC section 10).

    ``kv_compressed_output`` is ``[M_c, D]`` with ``M_c = compress_plan.size(0)``:
    the row of compress-plan row ``i`` goes to output row ``i`` (that plan
    row's ``ragged_id`` and ``position`` say which token and chunk it belongs
    to). Output rows of padding plan rows are left untouched; a plan of zero
    rows takes a ``[0, D]`` output. The state pool is written exactly as by
    :func:`run_prefill`. Raises :class:`ValueError` naming
    ``kv_compressed_output`` when it does not have ``M_c`` rows.
    """
    _prefill(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, compress_plan, write_plan,
             load_indices, compact=True, exact_bf16_stores=exact_bf16_stores)


def _prefill(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, compress_plan, write_plan,
             load_indices, *, compact: bool, exact_bf16_stores: bool) -> None:
    """The body of both prefills; ``compact`` picks where a compress row's result goes."""
    output_rows = None
    if compact:
        check_plan_tensor(compress_plan, "compress_plan")  # its row count sizes the output
        output_rows = (compress_plan.shape[0], "compress_plan rows")
    d = _check_state_tensors(kv_score_buffer, kv_score_input, kv_compressed_output, ape, output_rows)
    exact = check_flag(exact_bf16_stores, "exact_bf16_stores")
    num_tokens, num_slots = kv_score_input.shape[0], kv_score_buffer.shape[0]
    device = kv_score_buffer.device
    batch = _index_vector(indices, "indices", device)
    if load_indices is not None:
        _index_vector(load_indices, "load_indices", device, batch, like="indices")
    for name, plan in (("compress_plan", compress_plan), ("write_plan", write_plan)):
        check_plan_tensor(plan, name)
        check_device(plan, name, device)
    check_apart([("kv_score_buffer", kv_score_buffer, True), ("kv_score_input", kv_score_input, False),
                 ("kv_compressed_output", kv_compressed_output, True), ("ape", ape, False),
                 ("indices", indices, False), ("load_indices", load_indices, False),
                 ("compress_plan", compress_plan, False), ("write_plan", write_plan, False)])
    if load_indices is None:
        load_indices = indices
    runnable = dict(num_tokens=num_tokens, indices=indices, load_indices=load_indices, num_slots=num_slots)
    compress_rows, compress_where = _runnable_rows(compress_plan, compress=True, **runnable)
    write_rows, _ = _runnable_rows(write_plan, compress=False, **runnable)
    if not len(compress_rows) and not len(write_rows):
        return
    # A compact output has a row per plan row; otherwise a compress row's result goes to its ragged row.
    targets = (compress_where if compact else compress_rows[:, 0]).tolist()

    x = kv_score_input.to(torch.float64)
    ape64 = ape.to(torch.float64)
    load_list = load_indices.tolist()
    store_list = indices.tolist()

    # 1. Compress pass: reads prior states, writes only output rows.
    outputs = []
    for row, target in zip(compress_rows, targets):
        _, _, kv = _prefill_row_state(row, x, ape64, kv_score_buffer, load_list[int(row[1])], d)
        outputs.append((target, kv))
    for target, kv in outputs:
        kv_compressed_output[target] = kv.to(kv_compressed_output.dtype)

    # 2. Write pass: every prior state is read before any state is stored.
    states = []
    for row in write_rows:
        b = int(row[1])
        m, total, kv = _prefill_row_state(row, x, ape64, kv_score_buffer, load_list[b], d)
        states.append((store_list[b], state_to_store(m, total, kv, kv_score_buffer.dtype, exact_bf16_stores=exact)))
    for slot, state in states:
        kv_score_buffer[slot, 0] = state


# ---------------------------------------------------------------------------
# Speculative decoding: verify and commit (SPEC section 9).
# ---------------------------------------------------------------------------


def _check_prefix_states(prefix_states, kv_score_buffer: torch.Tensor, rows: int) -> None:
    """``prefix_states``: ``[rows, 3D]`` (``rows = B*T``) in the pool's dtype, on the pool's device."""
    if not isinstance(prefix_states, torch.Tensor):
        raise TypeError(f"argument 'prefix_states': expected a torch.Tensor, got {type(prefix_states).__name__}")
    if prefix_states.dtype != kv_score_buffer.dtype:
        raise TypeError(
            f"argument 'prefix_states': expected dtype {kv_score_buffer.dtype} like kv_score_buffer "
            f"(the state dtype), got {prefix_states.dtype}"
        )
    width = kv_score_buffer.shape[-1]
    if prefix_states.dim() != 2 or list(prefix_states.shape) != [rows, width]:
        raise ValueError(
            f"argument 'prefix_states': expected shape [B*T, 3D] = [{rows}, {width}], "
            f"got {list(prefix_states.shape)}"
        )
    check_device(prefix_states, "prefix_states", kv_score_buffer.device)


def _tokens_per_request(rows: int, batch: int, name: str) -> int:
    """T = rows / B, which must divide evenly, with 1 <= T <= 16; 0 for an empty batch (which needs 0 rows)."""
    if batch == 0:
        if rows:
            raise ValueError(f"argument '{name}': expected 0 rows for an empty batch (no indices), got {rows}")
        return 0
    if rows % batch:
        raise ValueError(
            f"argument '{name}': expected B*T rows with B = {batch} requests (indices), got {rows} rows, "
            f"not a multiple of {batch}"
        )
    window = rows // batch
    if not 1 <= window <= MAX_VERIFY_TOKENS:
        raise ValueError(
            f"argument '{name}': expected T = rows / B in [1, {MAX_VERIFY_TOKENS}] tokens per request, got T = {window}"
        )
    return window


@_without_autograd
def run_verify(
    kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, kv_compressed_output: torch.Tensor,
    ape: torch.Tensor, indices: torch.Tensor, seq_lens: torch.Tensor, prefix_states: torch.Tensor, *,
    exact_bf16_stores: bool = True,
) -> None:
    """A speculative verify step (SPEC section 9): T tokens per request, the pool only read.

    ``B = indices.size(0)`` requests, ``T = kv_score_input.size(0) / B``
    (``1 <= T <= 16``; ``B = 0`` takes 0 rows and does nothing). Request ``b``'s
    token ``j`` is row ``b*T + j`` of ``kv_score_input``, at position
    ``seq_lens[b] - T + j``. The state before token 0 is fresh when
    ``(seq_lens[b] - T) % 128 == 0``, else the one in slot ``indices[b]``;
    each token updates it as :func:`run_decode` does (offset 0 starts afresh),
    in float64, without rounding in between. Then:

    - ``prefix_states[b*T + j]`` = the state after token ``j``, rounded once to
      the pool's dtype (:func:`state_to_store`; ``exact_bf16_stores`` picks
      the bfloat16 scheme); after a chunk-closing token it is that full
      chunk's state;
    - when token ``j`` closes a chunk (position ``% 128 == 127``),
      ``kv_compressed_output[b*T + j]`` = the chunk's row; other rows are not
      written.

    ``kv_score_buffer`` is never written. A request whose slot is outside
    ``[0, S)`` or whose ``seq_len < T`` is skipped: nothing of it is written.
    Shapes: buffer ``[S, 1, 3D]`` float32 or bfloat16, input ``[B*T, 2D]``,
    output ``[B*T, D]``, ape ``[128, D]``, indices and seq_lens ``[B]`` int32,
    prefix_states ``[B*T, 3D]`` in the buffer's dtype. Wrong arguments raise
    :class:`TypeError` / :class:`ValueError` naming them, before anything is written.
    """
    d = _check_state_tensors(kv_score_buffer, kv_score_input, kv_compressed_output, ape)
    exact = check_flag(exact_bf16_stores, "exact_bf16_stores")
    device = kv_score_buffer.device
    batch = _index_vector(indices, "indices", device)
    _index_vector(seq_lens, "seq_lens", device, batch, like="indices")
    rows = kv_score_input.shape[0]
    _check_prefix_states(prefix_states, kv_score_buffer, rows)
    window = _tokens_per_request(rows, batch, "kv_score_input")
    check_apart([("kv_score_buffer", kv_score_buffer, False), ("kv_score_input", kv_score_input, False),
                 ("kv_compressed_output", kv_compressed_output, True), ("ape", ape, False),
                 ("indices", indices, False), ("seq_lens", seq_lens, False), ("prefix_states", prefix_states, True)])
    num_slots = kv_score_buffer.shape[0]
    slots, lens = indices.tolist(), seq_lens.tolist()
    live = (_in_pool(indices, num_slots) & (seq_lens >= window)).nonzero().flatten().tolist()
    if not live:
        return

    live_t = torch.tensor(live, dtype=torch.int64, device=device)
    start = torch.tensor([(lens[b] - window) % CHUNK_SIZE for b in live], dtype=torch.int64, device=device)
    x = kv_score_input.to(torch.float64)
    ape64 = ape.to(torch.float64)
    prior = kv_score_buffer[[slots[b] for b in live], 0].to(torch.float64)  # read only when start != 0
    m, total, kv = prior[:, :d], prior[:, d : 2 * d], prior[:, 2 * d :]
    states, closed = [], []
    for j in range(window):
        offset = (start + j) % CHUNK_SIZE
        token = x[live_t * window + j]
        m, total, kv = _add_token(m, total, kv, token[:, d:] + ape64[offset], token[:, :d], offset == 0)
        states.append(state_to_store(m, total, kv, prefix_states.dtype, exact_bf16_stores=exact))
        closes = offset == CHUNK_SIZE - 1
        if bool(closes.any()):
            closed.append((live_t[closes] * window + j, kv[closes]))
    for j, state in enumerate(states):
        prefix_states[live_t * window + j] = state
    for out_rows, row in closed:
        kv_compressed_output[out_rows] = row.to(kv_compressed_output.dtype)


@_without_autograd
def run_commit(
    kv_score_buffer: torch.Tensor,
    prefix_states: torch.Tensor,
    indices: torch.Tensor,
    accept_lens: torch.Tensor,
) -> None:
    """Commits each request's accepted prefix (SPEC section 9): slot ``indices[b]`` = ``prefix_states[b*T + a - 1]``.

    ``B = indices.size(0)``, ``T = prefix_states.size(0) / B`` (the checks of
    :func:`run_verify`), ``a = accept_lens[b]``. The row is copied as it is
    (bit for bit: it was rounded to the pool's dtype when verify stored it).
    A request with ``a < 1``, ``a > T`` or a slot outside ``[0, S)`` is
    skipped. Two requests committing to one slot is the caller's error (which
    one wins is unspecified). Shapes: buffer ``[S, 1, 3D]`` float32 or
    bfloat16, prefix_states ``[B*T, 3D]`` in the buffer's dtype, indices and
    accept_lens ``[B]`` int32.
    """
    if not isinstance(kv_score_buffer, torch.Tensor):
        raise TypeError(f"argument 'kv_score_buffer': expected a torch.Tensor, got {type(kv_score_buffer).__name__}")
    _check_state_dtype(kv_score_buffer)
    shape = list(kv_score_buffer.shape)
    if len(shape) != 3 or shape[1] != 1 or shape[2] % 3 or not shape[2]:
        raise ValueError(f"argument 'kv_score_buffer': expected shape [S, 1, 3D], got {shape}")
    if not isinstance(prefix_states, torch.Tensor):
        raise TypeError(f"argument 'prefix_states': expected a torch.Tensor, got {type(prefix_states).__name__}")
    rows = prefix_states.shape[0] if prefix_states.dim() else 0
    _check_prefix_states(prefix_states, kv_score_buffer, rows)
    device = kv_score_buffer.device
    batch = _index_vector(indices, "indices", device)
    _index_vector(accept_lens, "accept_lens", device, batch, like="indices")
    window = _tokens_per_request(rows, batch, "prefix_states")
    check_apart([("kv_score_buffer", kv_score_buffer, True), ("prefix_states", prefix_states, False),
                 ("indices", indices, False), ("accept_lens", accept_lens, False)])
    num_slots = shape[0]
    slots, accepted = indices.tolist(), accept_lens.tolist()
    keep = (_in_pool(indices, num_slots) & (accept_lens >= 1) & (accept_lens <= window)).nonzero().flatten().tolist()
    if keep:
        chosen = prefix_states[[b * window + accepted[b] - 1 for b in keep]]
        kv_score_buffer[[slots[b] for b in keep], 0] = chosen
