"""The prefill plan row (``docs/SPEC.md`` section 4): its constants, its byte encoding and its rules.

A plan is a ``[M, 16]`` uint8 tensor of rows ``{ragged_id, batch_id, position,
window_len}``, each a little-endian uint32. This module is the Python home of
that format: the reference planner, the reference prefill, the torch API's
debug checks and the tests take the chunk size, the row size, the padding value,
the length limit, the GPU planner's error bits and the row rules from here. The
C++ twin is ``include/sgl_kernel/deepseek_v4/compress.cuh`` (the error bits:
``csrc/deepseek_v4/c128_plan_kernel.cuh``); ``tests/test_headers_nvcc.py``
checks that the two agree.

Only torch is needed (no numpy), so the torch API can import it cheaply.
"""

from __future__ import annotations

import enum
from typing import Final, Sequence, Union

import torch

__all__ = [
    "CHUNK_SIZE",
    "FIELDS",
    "MAX_LENGTH",
    "PADDING_BYTE",
    "PADDING_ROW",
    "PlanError",
    "ROW_BYTES",
    "check_plan_tensor",
    "check_rows",
    "decode_rows",
    "encode_rows",
    "is_plan_tensor",
    "live_rows",
    "row_problems",
]

#: Token positions per compressed chunk; a segment's ``window_len`` is at most this.
CHUNK_SIZE: Final = 128
#: Field names of a row, in memory order.
FIELDS: Final = ("ragged_id", "batch_id", "position", "window_len")
#: Bytes per row: one little-endian uint32 per field.
ROW_BYTES: Final = 4 * len(FIELDS)
#: Every field of a padding row (CUDA-graph plans) holds this value; kernels skip such rows.
PADDING_ROW: Final = 0xFFFFFFFF
#: Every byte of a padding row.
PADDING_BYTE: Final = PADDING_ROW & 0xFF
#: Largest seq_len, largest sum(extend_lens) and most rows a plan can describe: ragged
#: ids and positions are uint32 and the all-ones value is padding.
MAX_LENGTH: Final = PADDING_ROW - 1


class PlanError(enum.IntFlag):
    """The GPU planner's error flag (``counts[2]``, 0 for a valid plan): one bit per broken rule."""

    EXTEND_NOT_POSITIVE = 1  # some extend_len < 1
    EXTEND_EXCEEDS_SEQ = 2  # some extend_len > seq_len
    SEQ_TOO_LONG = 4  # some seq_len > MAX_LENGTH
    SUM_MISMATCH = 8  # sum(extend_lens) != the plans' rows (num_tokens)

    def describe(self) -> str:
        """The broken rules, in words."""
        rules = {
            PlanError.EXTEND_NOT_POSITIVE: "some extend_lens[b] < 1",
            PlanError.EXTEND_EXCEEDS_SEQ: "some extend_lens[b] > seq_lens[b]",
            PlanError.SEQ_TOO_LONG: f"some seq_lens[b] > {MAX_LENGTH}",
            PlanError.SUM_MISMATCH: "sum(extend_lens) != num_tokens",
        }
        return "; ".join(words for bit, words in rules.items() if bit in self)

_BYTE_SHIFTS = (0, 8, 16, 24)

RowsLike = Union[torch.Tensor, Sequence[Sequence[int]]]


def is_plan_tensor(plan: object) -> bool:
    """Whether ``plan`` is a 2-D uint8 tensor of ``ROW_BYTES``-byte rows."""
    return (
        isinstance(plan, torch.Tensor)
        and plan.dtype == torch.uint8
        and plan.dim() == 2
        and plan.shape[1] == ROW_BYTES
    )


def continues_chunk(position, window_len):
    """Whether a row's segment (its last token at ``position``, ``window_len`` tokens) starts mid-chunk, so
    that it continues the request's stored state and reads it. Ints, or int tensors element-wise."""
    return position % CHUNK_SIZE + 1 > window_len


def check_plan_tensor(plan: object, name: str) -> None:
    """Raises TypeError (not a tensor, not uint8) or ValueError (shape) naming argument ``name``
    unless ``plan`` is a plan tensor (:func:`is_plan_tensor`)."""
    if is_plan_tensor(plan):
        return
    if not isinstance(plan, torch.Tensor):
        raise TypeError(f"argument '{name}': expected a torch.Tensor, got {type(plan).__name__}")
    if plan.dtype != torch.uint8:
        raise TypeError(f"argument '{name}': expected dtype uint8, got {plan.dtype}")
    raise ValueError(f"argument '{name}': expected shape [M, {ROW_BYTES}], got {list(plan.shape)}")


def decode_rows(plan: torch.Tensor) -> torch.Tensor:
    """``[M, 16]`` uint8 (any device) -> ``[M, 4]`` int64 CPU tensor of the uint32 fields.

    Bytes are read little-endian whatever the host's byte order, so a padding
    row decodes to four ``PADDING_ROW`` values.
    """
    raw = plan.detach().to("cpu", torch.int64).reshape(-1, len(FIELDS), 4)
    fields = raw[..., 0].clone()
    for k, shift in enumerate(_BYTE_SHIFTS[1:], start=1):
        fields |= raw[..., k] << shift
    return fields


def encode_rows(rows: RowsLike) -> torch.Tensor:
    """Rows ``(ragged_id, batch_id, position, window_len)`` -> ``[M, 16]`` uint8 CPU tensor.

    ``rows`` is anything ``torch.as_tensor`` reads as ``M`` rows of 4 integers
    (an empty list gives ``[0, 16]``). Raises :class:`ValueError` when a field
    does not fit in a uint32.
    """
    fields = torch.as_tensor(rows, dtype=torch.int64).reshape(-1, len(FIELDS))
    if fields.numel() and (int(fields.min()) < 0 or int(fields.max()) > PADDING_ROW):
        raise ValueError("encode_rows: every field must fit in a uint32")
    shifts = torch.tensor(_BYTE_SHIFTS, dtype=torch.int64)
    raw = (fields[..., None] >> shifts) & 0xFF
    return raw.to(torch.uint8).reshape(-1, ROW_BYTES)


def live_rows(rows: torch.Tensor) -> torch.Tensor:
    """Decoded rows without the padding rows (those whose ``ragged_id`` is ``PADDING_ROW``)."""
    return rows[rows[:, 0] != PADDING_ROW]


def row_problems(rows: torch.Tensor, *, num_tokens: int, batch: int,
                 compress: bool) -> list[tuple[torch.Tensor, str]]:
    """The row rules of ``docs/SPEC.md`` section 4, one ``(violated, what)`` pair per rule.

    ``rows`` are decoded non-padding rows ``[R, 4]`` int64; ``violated`` is an
    ``[R]`` bool mask of the rows that break the rule. ``num_tokens`` is the
    row count of ``kv_score_input``, ``batch`` the number of requests and
    ``compress`` says which pass the rows are for. Rules come in the order a
    row is best explained by.
    """
    ragged, batch_id, position, window = rows.unbind(1)
    offset = position % CHUNK_SIZE
    closes = offset == CHUNK_SIZE - 1
    return [
        ((window < 1) | (window > CHUNK_SIZE), f"window_len not in [1, {CHUNK_SIZE}]"),
        ((ragged >= num_tokens) | (ragged - window + 1 < 0), f"ragged rows outside kv_score_input's {num_tokens} rows"),
        (batch_id >= batch, f"batch_id outside the batch of {batch} (indices)"),
        (offset - window + 1 < 0, "window_len reaches back past the chunk start"),
        (~closes, f"a compress row must close a chunk (position % {CHUNK_SIZE} == {CHUNK_SIZE - 1})") if compress
        else (closes, f"a write row must not close a chunk (position % {CHUNK_SIZE} < {CHUNK_SIZE - 1})"),
    ]


def check_rows(plan: torch.Tensor, name: str, *, num_tokens: int, batch: int, compress: bool) -> torch.Tensor:
    """Decodes plan ``name``, drops its padding rows and checks the rest against the call.

    Returns the live rows (``[R, 4]`` int64, CPU). Raises :class:`ValueError`
    naming the argument, the first offending row and the rule it breaks.
    """
    rows = live_rows(decode_rows(plan))
    for violated, what in row_problems(rows, num_tokens=num_tokens, batch=batch, compress=compress):
        if bool(violated.any()):
            row = tuple(rows[int(violated.nonzero()[0, 0])].tolist())
            raise ValueError(
                f"argument '{name}': expected rows {{{', '.join(FIELDS)}}} that fit the call, got {row}: {what}"
            )
    return rows
