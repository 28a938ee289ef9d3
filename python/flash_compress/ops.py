"""``torch.library`` custom ops, so that ``torch.compile`` and CUDA graphs see the kernels as one op each.

- ``torch.ops.flash_compress.decode(kv_score_buffer, kv_score_input, out, ape, indices, seq_lens,
  load_indices=None, use_pdl=None) -> ()``
- ``torch.ops.flash_compress.prefill(kv_score_buffer, kv_score_input, out, ape, indices, compress_plan,
  write_plan, load_indices=None, use_pdl=None, compact=False, plan_counts=None) -> ()``

- ``torch.ops.flash_compress.verify(kv_score_buffer, kv_score_input, out, ape, indices, seq_lens,
  prefix_states, use_pdl=None) -> ()``
- ``torch.ops.flash_compress.commit(kv_score_buffer, prefix_states, indices, accept_lens, use_pdl=None) -> ()``

Each mutates its outputs in place (decode and prefill: ``kv_score_buffer`` and
``out``; verify: ``out`` and ``prefix_states``, never the pool; commit:
``kv_score_buffer``) and returns nothing (an op may not return an alias of its
input), so their fake kernels have nothing to describe; they check only that every tensor is on the
pool's device (a meta pool with real inputs would otherwise pass as a no-op). Their bodies are
:mod:`flash_compress._dispatch`'s, whose signatures are the schemas. :func:`flash_compress.decode` /
:func:`flash_compress.prefill` call the ops when traced by ``torch.compile`` and the kernels directly
in eager mode, where a custom op's dispatch would cost several microseconds per call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from . import _dispatch
from ._arguments import check_device

__all__ = ["commit", "decode", "prefill", "verify"]

_MUTATED = ("kv_score_buffer", "out")

decode = torch.library.custom_op("flash_compress::decode", _dispatch.decode_into, mutates_args=_MUTATED)
prefill = torch.library.custom_op("flash_compress::prefill", _dispatch.prefill_into, mutates_args=_MUTATED)
verify = torch.library.custom_op("flash_compress::verify", _dispatch.verify_into,
                                 mutates_args=("out", "prefix_states"))
commit = torch.library.custom_op("flash_compress::commit", _dispatch.commit_into, mutates_args=("kv_score_buffer",))


def _in_place_only(impl: Callable[..., None]) -> Callable[..., None]:
    """The fake kernel of ``impl``'s op: the op creates no tensor, so there is no output to describe, but
    its tensors must share the pool's device (its first argument), as the real kernels check."""
    signature = inspect.signature(impl)

    def fake(*args: object, **kwargs: object) -> None:
        (pool_name, pool), *others = signature.bind(*args, **kwargs).arguments.items()
        for name, value in others:
            if isinstance(value, torch.Tensor):
                check_device(value, name, pool.device, like=pool_name)

    return fake


for _op, _impl in ((decode, _dispatch.decode_into), (prefill, _dispatch.prefill_into),
                   (verify, _dispatch.verify_into), (commit, _dispatch.commit_into)):
    _op.register_fake(_in_place_only(_impl))
