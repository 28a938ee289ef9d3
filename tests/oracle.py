"""The float64 OFFLINE chunk softmax: what the online compressor must agree with.

Nothing here is online: a chunk's row is computed from all of its raw tokens
at once, ``out[d] = sum_j softmax_j(score[128k+j, d] + ape[j, d]) * kv[128k+j, d]``,
with ``torch.softmax`` in float64, so it shares no code path (and no merge
formula) with :mod:`flash_compress.reference` or the kernels.

Tolerances (used by ``tests/schedule.py``), chosen so that a float32-correct
implementation passes and a wrong one fails:

- emitted rows and state ``kv``: per row, ``max_d |got - want| / max_d |want| <= 2e-5``
  (the max-abs relative error of the row, so near-zero channels are judged on the
  row's scale). A float32 online softmax over one 128-token chunk, with its state
  rounded to float32 after every decode step, stays below ~1e-5 in the worst case
  (127 roundings of ~6e-8 each, weighted by factors < 1) and typically near 1e-6;
  anything that drops, repeats or mis-weights a token, uses the wrong ape row or
  the wrong prior state is off by 1e-3 or (much) more.
- state ``max``: ``|got - want| <= 1e-6 * (1 + |want|)``: it is the float32 rounding of
  ``score + ape``, the same number in every correct implementation up to an ulp.
- state ``sum``: compared after rescaling to the oracle's max
  (``sum_got * exp(max_got - max_want)``), relative ``<= 2e-5``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flash_compress.plan_rows import CHUNK_SIZE

ROW_RTOL = 2e-5
MAX_TOL = 1e-6
SUM_RTOL = 2e-5

__all__ = [
    "MAX_TOL",
    "ROW_RTOL",
    "SUM_RTOL",
    "PartialState",
    "assert_rows_close",
    "assert_state_close",
    "chunk_output",
    "chunk_outputs",
    "partial_state",
    "row_relative_error",
]


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


def chunk_output(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, k: int) -> torch.Tensor:
    """Compressed row ``[D]`` float64 of closed chunk ``k`` of a request's history.

    ``kv`` and ``score`` are the request's full token history ``[L, D]``
    (position ``t`` at row ``t``, ``L >= 128(k+1)``), ``ape`` is ``[128, D]``.
    """
    lo, hi = CHUNK_SIZE * k, CHUNK_SIZE * (k + 1)
    if kv.shape[0] < hi:
        raise ValueError(f"chunk {k} is not closed: history has {kv.shape[0]} tokens")
    logits = _f64(score[lo:hi]) + _f64(ape)
    weights = torch.softmax(logits, dim=0)
    return (weights * _f64(kv[lo:hi])).sum(dim=0)


def chunk_outputs(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Rows ``[L // 128, D]`` float64 of every closed chunk of the history."""
    rows = [chunk_output(kv, score, ape, k) for k in range(kv.shape[0] // CHUNK_SIZE)]
    if not rows:
        return torch.zeros(0, kv.shape[1], dtype=torch.float64)
    return torch.stack(rows)


@dataclass
class PartialState:
    """The softmax state of the open chunk's tokens: ``max``, ``sum`` (relative to ``max``), normalised ``kv``."""

    max: torch.Tensor
    sum: torch.Tensor
    kv: torch.Tensor


def partial_state(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor) -> PartialState | None:
    """State of the open (partial) chunk after ``L`` tokens, or None when ``L % 128 == 0`` (no open chunk).

    Computed offline over the open chunk's tokens ``128*(L//128) .. L-1``.
    """
    length = kv.shape[0]
    n = length % CHUNK_SIZE
    if n == 0:
        return None
    lo = length - n
    logits = _f64(score[lo:]) + _f64(ape[:n])
    m = logits.max(dim=0).values
    w = torch.exp(logits - m)
    total = w.sum(dim=0)
    return PartialState(max=m, sum=total, kv=(w * _f64(kv[lo:])).sum(dim=0) / total)


def row_relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row: ``max_d |got - want| / max_d |want|`` (inf where got has a NaN/inf). Accepts ``[D]`` or ``[R, D]``."""
    got64, want64 = _f64(got), _f64(want)
    if got64.dim() == 1:
        got64, want64 = got64[None], want64[None]
    err = (got64 - want64).abs().amax(dim=1)
    scale = want64.abs().amax(dim=1).clamp_min(1e-30)
    rel = err / scale
    bad = ~torch.isfinite(got64).all(dim=1)
    return torch.where(bad, torch.full_like(rel, float("inf")), rel)


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, what: str = "rows", rtol: float = ROW_RTOL) -> None:
    """Fails with the worst row when any row's max-abs relative error exceeds ``rtol``."""
    rel = row_relative_error(got, want)
    if rel.numel() and not bool((rel <= rtol).all()):
        worst = int(rel.argmax())
        raise AssertionError(
            f"{what}: {int((~(rel <= rtol)).sum())} of {rel.numel()} rows exceed rtol {rtol}; "
            f"worst row {worst}: relative error {float(rel[worst]):.3e}"
        )


def assert_state_close(state: torch.Tensor, want: PartialState, what: str = "state") -> None:
    """Checks a stored ``[3D]`` state ``[max | sum | kv]`` against the oracle's partial state."""
    s = _f64(state).reshape(-1)
    d = want.max.numel()
    m, total, kv = s[:d], s[d : 2 * d], s[2 * d :]
    if not bool(torch.isfinite(s).all()):
        raise AssertionError(f"{what}: non-finite values in a live state")
    max_err = (m - want.max).abs() / (1.0 + want.max.abs())
    if not bool((max_err <= MAX_TOL).all()):
        raise AssertionError(f"{what}: max off by {float(max_err.max()):.3e} (tol {MAX_TOL})")
    rescaled = total * torch.exp(m - want.max)
    sum_err = ((rescaled - want.sum).abs() / want.sum).max()
    if not float(sum_err) <= SUM_RTOL:
        raise AssertionError(f"{what}: sum off by {float(sum_err):.3e} relative (tol {SUM_RTOL})")
    assert_rows_close(kv, want.kv, f"{what} kv")
