"""Runs the compiled kernels on host tensors: upload, launch, download, with optional guard zones.

:class:`DeviceRunner` has the three functions of ``docs/SPEC.md`` section 3 with
host (CPU) tensors in and out, so anything written for the CPU reference
(``tests/schedule.py``'s harness with ``device="cpu"``) drives the GPU
kernels unchanged. Every call copies its inputs to the GPU, launches, and
copies the written tensors (state buffer, output) back.

Only copies and the kernels themselves touch the GPU: no torch kernel runs,
so a sanitizer run over it reports on our kernels alone, and every device
byte a kernel may read was written by a host-to-device copy first (initcheck
sees poisoned NaN outputs as initialised, which they are).

With ``guard_elems > 0`` the state buffer and output each sit in the middle
of a larger device allocation whose two guard zones hold a fixed bit pattern;
after every call the zones must be bitwise intact, so a kernel writing out of
bounds fails the call (reads out of bounds are compute-sanitizer memcheck's
job; leave guards off there so the allocation bounds are exact).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

# A NaN with a payload no computation produces: 0x7FC0DEAD.
GUARD_BITS = 0x7FC0DEAD

__all__ = ["DeviceRunner", "GUARD_BITS"]


class DeviceRunner:
    """The compiled ``module``'s functions on host tensors (see the module docstring)."""

    def __init__(self, module: Any, *, guard_elems: int = 0, device: str = "cuda") -> None:
        if guard_elems % 4:
            raise ValueError("guard_elems must keep 16-byte alignment (a multiple of 4)")
        self.module = module
        self.guard_elems = guard_elems
        self.device = torch.device(device)
        self.calls = 0

    # -- transfers -----------------------------------------------------------

    def _upload(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.to(self.device)

    def _upload_guarded(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(whole allocation, view of t's shape inside it)``; the view holds ``t``'s bytes."""
        g = self.guard_elems
        whole_host = torch.empty(2 * g + t.numel(), dtype=torch.float32)
        whole_host.view(torch.int32).fill_(GUARD_BITS)
        whole_host[g : g + t.numel()] = t.reshape(-1)
        whole = whole_host.to(self.device)
        return whole, whole[g : g + t.numel()].view(t.shape)

    def _download_into(self, host: torch.Tensor, whole: torch.Tensor, what: str) -> None:
        g = self.guard_elems
        whole_host = whole.to("cpu")
        if g:
            zones = torch.cat([whole_host[:g], whole_host[g + host.numel() :]]).view(torch.int32)
            if not bool((zones == GUARD_BITS).all()):
                bad = int((zones != GUARD_BITS).sum())
                raise AssertionError(f"call {self.calls}: {bad} guard elements around '{what}' were overwritten")
        host.copy_(whole_host[g : g + host.numel()].view(host.shape))

    # -- the functions -------------------------------------------------------

    def run_decode(self, kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, seq_lens, extra=None):
        buffer_whole, buffer = self._upload_guarded(kv_score_buffer)
        out_whole, out = self._upload_guarded(kv_compressed_output)
        self.module.run_decode(buffer, self._upload(kv_score_input), out, self._upload(ape), self._upload(indices),
                               self._upload(seq_lens), extra)
        self._finish(kv_score_buffer, buffer_whole, kv_compressed_output, out_whole)

    def run_prefill(self, kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, compress_plan,
                    write_plan, load_indices=None):
        buffer_whole, buffer = self._upload_guarded(kv_score_buffer)
        out_whole, out = self._upload_guarded(kv_compressed_output)
        self.module.run_prefill(buffer, self._upload(kv_score_input), out, self._upload(ape), self._upload(indices),
                                self._upload(compress_plan), self._upload(write_plan), self._upload(load_indices))
        self._finish(kv_score_buffer, buffer_whole, kv_compressed_output, out_whole)

    def plan_online_prefill(self, *args):
        """The host planner, as it is (it takes host tensors already)."""
        return self.module.plan_online_prefill(*args)

    def _finish(self, buffer, buffer_whole, out, out_whole) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a kernel fault surfaces here, at this call
        self._download_into(buffer, buffer_whole, "kv_score_buffer")
        self._download_into(out, out_whole, "kv_compressed_output")
        self.calls += 1
