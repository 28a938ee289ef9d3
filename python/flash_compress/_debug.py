"""Debug mode (``FLASH_COMPRESS_DEBUG=1``): host-side checks of the values the kernels trust.

The kernels check shapes, dtypes and devices but not the values inside device
tensors: an index out of range or a malformed plan row is skipped (or worse)
on the GPU, because raising would need a device-to-host sync. In debug mode
the torch API copies those values to the host (a sync per call) and raises
:class:`ValueError` naming the argument before anything is launched.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .plan_rows import PlanError, check_rows, continues_chunk, is_plan_tensor

__all__ = ["check_commit", "check_decode", "check_planner_flag", "check_prefill", "check_verify", "enabled"]

_VAR = "FLASH_COMPRESS_DEBUG"
_OFF = ("", "0", "false", "no", "off")

# os.environ.get costs about 1 us (it encodes the key on every call), more than
# the whole tvm-ffi call; the mapping's own dict of encoded keys is read in
# ~50 ns and is what os.environ (and pytest's monkeypatch) updates.
_environ_data = getattr(os.environ, "_data", None)
if _environ_data is not None:
    _key = os.environ.encodekey(_VAR)
    _off_values = frozenset(os.environ.encodevalue(v) for v in _OFF)

    def enabled() -> bool:
        """True when ``FLASH_COMPRESS_DEBUG`` is set to anything but ``""``/``0``/``false``/``no``/``off``."""
        value = _environ_data.get(_key)
        return value is not None and value.lower() not in _off_values

else:  # not CPython's os.environ: take the portable, slower road

    def enabled() -> bool:
        """True when ``FLASH_COMPRESS_DEBUG`` is set to anything but ``""``/``0``/``false``/``no``/``off``."""
        return os.environ.get(_VAR, "").lower() not in _OFF


def _check_values(values: object, name: str, low: int, high: Optional[int], expected: str,
                  used: Optional[list[bool]] = None) -> None:
    """Every value of the ``[B]`` tensor ``values`` in ``[low, high]`` (``high`` None: no upper bound), or
    ValueError naming the first that is not, saying ``expected ...``; only those whose ``used`` is true
    where that is given (the others the kernels never read)."""
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.numel() == 0:
        return  # the kernels' own checks name a wrong type or rank; an empty batch has nothing to check
    host = values.detach().to("cpu", torch.int64)
    bad = host < low if high is None else (host < low) | (host > high)
    if used is not None:
        if len(used) != len(bad):
            return  # a length the kernels' own checks name
        bad &= torch.tensor(used, dtype=torch.bool)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(f"argument '{name}': expected {expected}, got {name}[{b}] = {int(host[b])}")


def _check_slots(kv_score_buffer: torch.Tensor, indices: torch.Tensor, name: str,
                 used: Optional[list[bool]] = None) -> None:
    """The slots a call reads or writes (``used``, by default all of them) are in the pool."""
    if not isinstance(kv_score_buffer, torch.Tensor) or kv_score_buffer.dim() != 3:
        return  # the kernels' own checks name it
    num_slots = kv_score_buffer.shape[0]
    _check_values(indices, name, 0, num_slots - 1,
                  f"every slot in [0, {num_slots}) (kv_score_buffer has {num_slots} slots)", used)


def _check_distinct(slots: list[int], requests: list[int], name: str, what: str) -> None:
    """``slots[k]`` is the slot of request ``requests[k]``: ValueError naming ``name`` at the first slot two of
    them share (``what`` says why they must not)."""
    first: dict[int, int] = {}
    for slot, b in zip(slots, requests):
        if slot in first:
            raise ValueError(f"argument '{name}': expected a distinct slot per request ({what}), got "
                             f"{name}[{first[slot]}] = {name}[{b}] = {slot}")
        first[slot] = b


def check_decode(
    kv_score_buffer: torch.Tensor,
    indices: torch.Tensor,
    seq_lens: torch.Tensor,
    load_indices: Optional[torch.Tensor],
) -> None:
    """Slots in range (a ``load_indices`` slot where the token continues a chunk: one that starts a chunk
    reads no prior state), every ``seq_len >= 1`` (the new token's position is ``seq_len - 1``), and no slot
    shared by two requests (each reads and writes its own)."""
    _check_slots(kv_score_buffer, indices, "indices")
    _check_values(seq_lens, "seq_lens", 1, None, "every seq_len >= 1")
    if load_indices is not None and isinstance(seq_lens, torch.Tensor) and seq_lens.dim() == 1:
        continues = [continues_chunk(n - 1, 1) for n in seq_lens.tolist()]  # the token at seq_len - 1
        _check_slots(kv_score_buffer, load_indices, "load_indices", continues)
    if isinstance(indices, torch.Tensor) and indices.dim() == 1:
        _check_distinct(indices.tolist(), list(range(indices.shape[0])), "indices",
                        "two requests on one slot race")


def _window(rows: Optional[int], indices: object) -> int:
    """T = rows / B for a verify or commit call, or 0 where the kernels' own checks will refuse the call."""
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or rows is None:
        return 0
    batch = indices.shape[0]
    return rows // batch if batch and rows % batch == 0 else 0


def _rows(tensor: object) -> Optional[int]:
    return tensor.shape[0] if isinstance(tensor, torch.Tensor) and tensor.dim() else None


def check_verify(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, indices: torch.Tensor,
                 seq_lens: torch.Tensor) -> None:
    """Slots in range and every ``seq_len >= T`` (the window's first token is at ``seq_len - T``): the kernel
    skips a request that breaks either."""
    _check_slots(kv_score_buffer, indices, "indices")
    window = _window(_rows(kv_score_input), indices)
    if window:
        _check_values(seq_lens, "seq_lens", window, None, f"every seq_len >= T = {window} (the tokens per request)")


def check_commit(kv_score_buffer: torch.Tensor, prefix_states: torch.Tensor, indices: torch.Tensor,
                 accept_lens: torch.Tensor) -> None:
    """Slots in range and every accepted length in ``[0, T]`` (0 keeps nothing, as for a request verify
    skipped); the kernel skips a request with a slot outside the pool or a length outside ``[1, T]``."""
    _check_slots(kv_score_buffer, indices, "indices")
    window = _window(_rows(prefix_states), indices)
    if window:
        _check_values(accept_lens, "accept_lens", 0, window, f"every accepted length in [0, T = {window}]")
        if isinstance(accept_lens, torch.Tensor) and accept_lens.shape == indices.shape:
            committing = [b for b, a in enumerate(accept_lens.tolist()) if a >= 1]
            slots = indices.tolist()
            _check_distinct([slots[b] for b in committing], committing, "indices",
                            "two requests committing to one slot race")


def _check_plan(plan: torch.Tensor, name: str, num_tokens: int, batch: int, compress: bool) -> Optional[torch.Tensor]:
    """The plan's live rows (decoded) once they fit the call; None where the kernels' own checks name a wrong
    type, dtype or shape."""
    if not is_plan_tensor(plan):
        return None
    return check_rows(plan, name, num_tokens=num_tokens, batch=batch, compress=compress)


def check_prefill(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    indices: torch.Tensor,
    compress_plan: torch.Tensor,
    write_plan: torch.Tensor,
    load_indices: Optional[torch.Tensor],
) -> None:
    """Every non-padding plan row inside the input and the batch, of its pass's kind; the slots its rows use in
    the pool (``indices`` where a write row stores, the slot a row that continues a chunk reads its prior
    state from); no two write rows storing to one slot, and no write row reading a slot another one stores to."""
    if not (isinstance(indices, torch.Tensor) and indices.dim() == 1
            and isinstance(kv_score_input, torch.Tensor) and kv_score_input.dim() == 2):
        return  # the kernels' own checks name them; the rows cannot be judged against the call without them
    batch, num_tokens = indices.shape[0], kv_score_input.shape[0]
    compress_rows = _check_plan(compress_plan, "compress_plan", num_tokens, batch, compress=True)
    write_rows = _check_plan(write_plan, "write_plan", num_tokens, batch, compress=False)
    compress_list = compress_rows.tolist() if compress_rows is not None else []
    write_list = write_rows.tolist() if write_rows is not None else []
    stores_state, reads_state = [False] * batch, [False] * batch  # per request
    for _, b, position, window_len in compress_list + write_list:
        reads_state[b] |= continues_chunk(position, window_len)
    for _, b, _, _ in write_list:
        stores_state[b] = True
    if load_indices is None:
        _check_slots(kv_score_buffer, indices, "indices", [s or r for s, r in zip(stores_state, reads_state)])
    else:
        _check_slots(kv_score_buffer, indices, "indices", stores_state)
        _check_slots(kv_score_buffer, load_indices, "load_indices", reads_state)
    if not write_list:
        return
    # The write pass runs its rows at once: each reads its request's prior state (a segment that starts
    # mid-chunk) while the others store theirs.
    stores = indices.tolist()
    if isinstance(load_indices, torch.Tensor) and load_indices.shape == indices.shape:
        loads = load_indices.tolist()
    else:
        loads = stores  # None (the default), or wrong: the kernels' own checks name it
    writers = [b for _, b, _, _ in write_list]
    _check_distinct([stores[b] for b in writers], writers, "indices", "two write rows storing to one slot race")
    written = {stores[b]: b for b in writers}
    for _, b, position, window_len in write_list:
        if continues_chunk(position, window_len) and written.get(loads[b], b) != b:
            other = written[loads[b]]
            raise ValueError(f"argument 'load_indices': expected no request to read a slot another request of the "
                             f"call writes (the write pass reads and stores at once), got load_indices[{b}] = "
                             f"indices[{other}] = {loads[b]}")


def check_planner_flag(counts: Optional[torch.Tensor]) -> None:
    """A GPU-made plan: the planner's error flag (``counts[2]``) must be 0."""
    if counts is None:
        return
    if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.numel() != 3:
        shape = list(counts.shape) if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise ValueError(f"argument 'plan': expected counts of shape [3] (a GPU-made plan's), got {shape}")
    flag = int(counts[2])
    if flag != 0:
        raise ValueError(
            f"argument 'plan': expected a valid GPU-made plan (error flag 0), got error flag {flag} "
            f"({PlanError(flag).describe()}), so every row is padding"
        )
