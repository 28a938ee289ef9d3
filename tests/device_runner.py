"""Runs the compiled kernels on host tensors: upload, launch, download, with optional guard zones.

:class:`DeviceRunner` has the functions of ``docs/SPEC.md`` sections 3, 9 and
10 (``run_decode``, ``run_prefill``, ``run_prefill_compact``, ``run_verify``,
``run_commit``, and the host planner) with host (CPU) tensors in and out, so
anything written for the CPU reference (``tests/schedule.py``'s harness with
``device="cpu"``) drives the GPU kernels unchanged. Every call copies its
inputs to the GPU, launches, and copies the tensors it may write (state
buffer, output, prefix states) back. State buffers and prefix states may be
float32 or bfloat16 (section 8).

Only copies and the kernels themselves touch the GPU: no torch kernel runs,
so a sanitizer run over it reports on our kernels alone, and every device
byte a kernel may read was written by a host-to-device copy first (initcheck
sees poisoned NaN outputs as initialised, which they are).

With ``guard_elems > 0`` every tensor a call may write (state buffer, output,
prefix states) sits in the middle of a larger device allocation whose two
guard zones of ``guard_elems`` elements hold a fixed bit pattern (a NaN
payload no computation produces, :data:`GUARD_BITS` for 4-byte elements,
:data:`GUARD_BITS_16` for 2-byte ones); after every call the zones must be
bitwise intact, so a kernel writing out of bounds fails the call (reads out
of bounds are compute-sanitizer memcheck's job; leave guards off there so the
allocation bounds are exact). ``guard_elems`` must keep 16-byte alignment for
every element size used: a multiple of 8 covers both.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

# NaNs with a payload no computation produces: 0x7FC0DEAD (float32), 0x7FDE (bfloat16).
GUARD_BITS = 0x7FC0DEAD
GUARD_BITS_16 = 0x7FDE
_GUARDS = {4: (torch.int32, GUARD_BITS), 2: (torch.int16, GUARD_BITS_16)}

__all__ = ["DeviceRunner", "GUARD_BITS", "GUARD_BITS_16"]


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
        as_int, pattern = _GUARDS[t.element_size()]
        if g * t.element_size() % 16:
            raise ValueError(f"guard_elems = {g} breaks 16-byte alignment for {t.dtype} tensors")
        whole_host = torch.empty(2 * g + t.numel(), dtype=t.dtype)
        whole_host.view(as_int).fill_(pattern)
        whole_host[g : g + t.numel()] = t.reshape(-1)
        whole = whole_host.to(self.device)
        return whole, whole[g : g + t.numel()].view(t.shape)

    def _download_into(self, host: torch.Tensor, whole: torch.Tensor, what: str) -> None:
        g = self.guard_elems
        whole_host = whole.to("cpu")
        if g:
            as_int, pattern = _GUARDS[host.element_size()]
            zones = torch.cat([whole_host[:g], whole_host[g + host.numel() :]]).view(as_int)
            if not bool((zones == pattern).all()):
                bad = int((zones != pattern).sum())
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
        self._prefill("run_prefill", kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices,
                      compress_plan, write_plan, load_indices)

    def run_prefill_compact(self, kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices,
                            compress_plan, write_plan, load_indices=None):
        self._prefill("run_prefill_compact", kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices,
                      compress_plan, write_plan, load_indices)

    def _prefill(self, name, kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, compress_plan,
                 write_plan, load_indices):
        buffer_whole, buffer = self._upload_guarded(kv_score_buffer)
        out_whole, out = self._upload_guarded(kv_compressed_output)
        getattr(self.module, name)(buffer, self._upload(kv_score_input), out, self._upload(ape),
                                   self._upload(indices), self._upload(compress_plan), self._upload(write_plan),
                                   self._upload(load_indices))
        self._finish(kv_score_buffer, buffer_whole, kv_compressed_output, out_whole)

    def run_verify(self, kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, seq_lens,
                   prefix_states):
        """Verify only reads the pool; it is guarded and downloaded anyway, so that a stray write shows."""
        buffer_whole, buffer = self._upload_guarded(kv_score_buffer)
        out_whole, out = self._upload_guarded(kv_compressed_output)
        prefix_whole, prefix = self._upload_guarded(prefix_states)
        self.module.run_verify(buffer, self._upload(kv_score_input), out, self._upload(ape), self._upload(indices),
                               self._upload(seq_lens), prefix)
        self._finish(kv_score_buffer, buffer_whole, kv_compressed_output, out_whole,
                     (prefix_states, prefix_whole, "prefix_states"))

    def run_commit(self, kv_score_buffer, prefix_states, indices, accept_lens):
        """Commit only reads ``prefix_states``; it is guarded and downloaded anyway, so that a stray write shows."""
        buffer_whole, buffer = self._upload_guarded(kv_score_buffer)
        prefix_whole, prefix = self._upload_guarded(prefix_states)
        self.module.run_commit(buffer, prefix, self._upload(indices), self._upload(accept_lens))
        self._finish(kv_score_buffer, buffer_whole, prefix_states, prefix_whole, out_name="prefix_states")

    def plan_online_prefill(self, *args):
        """The host planner, as it is (it takes host tensors already)."""
        return self.module.plan_online_prefill(*args)

    def _finish(self, buffer, buffer_whole, out, out_whole, *more, out_name: str = "kv_compressed_output") -> None:
        """Waits for the call, then downloads every written tensor: ``(host, whole, name)`` in ``more`` too."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a kernel fault surfaces here, at this call
        self._download_into(buffer, buffer_whole, "kv_score_buffer")
        self._download_into(out, out_whole, out_name)
        for host, whole, name in more:
            self._download_into(host, whole, name)
        self.calls += 1
