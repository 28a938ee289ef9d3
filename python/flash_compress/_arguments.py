"""Argument checks that the reference and the torch API share: flags, layout, device, and memory that
a call writes shared with another argument.

Memory: the compiled exports (``include/sgl_kernel/tensor.h``, ``verify_apart``)
refuse two arguments whose bytes overlap when the call writes either; their
tensors are contiguous, so a tensor's bytes are one range. The reference takes
any layout, so here a tensor's range runs from its lowest to its highest byte
(a view that interleaves with another without sharing an element counts as
overlapping), and a written tensor must not repeat an element itself (an
expanded view would take several results in one place).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["check_apart", "check_contiguous", "check_flag"]


def check_flag(value: object, name: str) -> bool:
    """A bool argument (numpy bools too), or TypeError naming it: a string or a tensor is not taken for its
    truth value."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"argument '{name}': expected a bool, got {type(value).__name__}")
    return bool(value)


def check_contiguous(tensor: torch.Tensor, name: str) -> None:
    """ValueError naming argument ``name`` unless ``tensor`` is contiguous, worded as the compiled exports word it."""
    if not tensor.is_contiguous():
        raise ValueError(f"argument '{name}': expected a contiguous tensor, "
                         f"got a non-contiguous view with strides {list(tensor.stride())}")


def check_device(tensor: torch.Tensor, name: str, device: torch.device, like: str = "kv_score_buffer") -> None:
    """ValueError naming argument ``name`` unless ``tensor`` is on ``device``, the device of argument ``like``,
    worded as the compiled exports word it."""
    if tensor.device != device:
        raise ValueError(f"argument '{name}': expected device {device} like {like}, got {tensor.device}")


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)``, the bytes from the tensor's lowest element to its highest; empty without elements."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return 0, 0
    try:
        start = tensor.data_ptr()
    except RuntimeError:  # a fake tensor: no memory to share
        return 0, 0
    low = high = 0
    for size, stride in zip(tensor.shape, tensor.stride()):
        reach = (size - 1) * stride
        low, high = low + min(reach, 0), high + max(reach, 0)
    return start + low * tensor.element_size(), start + (high + 1) * tensor.element_size()


def _repeats_elements(tensor: torch.Tensor) -> bool:
    """Whether two index tuples may address one element: strides that do not nest (a zero stride, or a
    dimension that steps inside the reach of the smaller ones). Never misses a repeat; it can refuse only a
    hand-made ``as_strided`` layout, never a view built by slicing, permuting or reshaping."""
    dims = sorted((abs(stride), size) for size, stride in zip(tensor.shape, tensor.stride()) if size > 1)
    reach = 0  # elements the dimensions so far span, minus one
    for stride, size in dims:
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def check_apart(arguments: Sequence[tuple[str, Optional[torch.Tensor], bool]]) -> None:
    """``(name, tensor or None, written)`` in argument order: ValueError naming the later of two arguments
    whose memory overlaps where the call writes either, or a written tensor that repeats an element."""
    for name, tensor, written in arguments:
        if written and tensor is not None and _repeats_elements(tensor):
            raise ValueError(f"argument '{name}': expected a tensor whose elements are apart (the call writes it), "
                             f"got a view of shape {list(tensor.shape)} with strides {list(tensor.stride())} "
                             "that repeats elements")
    for j, (later, later_tensor, later_written) in enumerate(arguments):
        if later_tensor is None:
            continue
        later_begin, later_end = _byte_range(later_tensor)
        for earlier, earlier_tensor, earlier_written in arguments[:j]:
            if earlier_tensor is None or not (earlier_written or later_written):
                continue
            begin, end = _byte_range(earlier_tensor)
            if begin < end and later_begin < later_end and begin < later_end and later_begin < end:
                writes = "both" if earlier_written and later_written else f"'{later if later_written else earlier}'"
                raise ValueError(f"argument '{later}': expected memory apart from '{earlier}' (the call writes "
                                 f"{writes}), got a tensor that overlaps it")
