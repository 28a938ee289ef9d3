"""The torch API and the custom ops behind the raw-module interface that ``tests/schedule.py`` drives.

``ScheduleHarness`` calls ``impl.run_decode(buffer, input, out, ape, indices,
seq_lens, None)``, ``impl.run_prefill(..., compress_plan, write_plan,
load_indices)`` and ``impl.plan_online_prefill(...)``. These adapters route
those calls through :func:`flash_compress.decode` / :func:`flash_compress.prefill`
(``ApiImpl``) or ``torch.ops.flash_compress.*`` (``OpsImpl``), so every check of
the harness (NaN-poisoned outputs, untouched slots, the float64 oracle) applies
to them. Planning stays with ``planner`` (the reference by default).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import flash_compress
import flash_compress.ops  # noqa: F401  (registers torch.ops.flash_compress.*)
from flash_compress import reference

__all__ = ["ApiImpl", "OpsImpl"]


class ApiImpl:
    """``run_decode`` / ``run_prefill`` through the torch API, with ``out`` given (the harness poisons it)."""

    def __init__(self, planner: Any = reference, use_pdl: Optional[bool] = None) -> None:
        self.planner = planner
        self.use_pdl = use_pdl

    def plan_online_prefill(self, *args: Any) -> Any:
        return self.planner.plan_online_prefill(*args)

    def run_decode(self, buffer, inp, out, ape, indices, seq_lens, extra=None) -> None:
        got = flash_compress.decode(buffer, inp, ape, indices, seq_lens, out=out, use_pdl=self.use_pdl)
        assert got is out, "decode must return the out it was given"

    def run_prefill(self, buffer, inp, out, ape, indices, compress_plan, write_plan, load_indices=None) -> None:
        plan = flash_compress.PrefillPlan(compress_plan, write_plan, compress_plan.shape[0], write_plan.shape[0],
                                          False)
        got = flash_compress.prefill(buffer, inp, ape, indices, plan, out=out, load_indices=load_indices,
                                     use_pdl=self.use_pdl)
        assert got is out, "prefill must return the out it was given"


class OpsImpl(ApiImpl):
    """``run_decode`` / ``run_prefill`` through ``torch.ops.flash_compress.{decode,prefill}``."""

    def run_decode(self, buffer, inp, out, ape, indices, seq_lens, extra=None) -> None:
        torch.ops.flash_compress.decode(buffer, inp, out, ape, indices, seq_lens, None, self.use_pdl)

    def run_prefill(self, buffer, inp, out, ape, indices, compress_plan, write_plan, load_indices=None) -> None:
        torch.ops.flash_compress.prefill(buffer, inp, out, ape, indices, compress_plan, write_plan, load_indices,
                                         self.use_pdl)
