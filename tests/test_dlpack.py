"""DLPack neutrality on the CPU: the compiled planner on numpy arrays (needs nvcc, not a GPU).

tvm-ffi takes any object with ``__dlpack__``, so the raw module's
``plan_online_prefill`` plans straight into numpy buffers, without torch
tensors in the call. The reference planner (torch) gives the bytes to match.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flash_compress import reference as ref
from flash_compress.plan_rows import ROW_BYTES

pytestmark = pytest.mark.nvcc


@pytest.fixture(scope="module")
def module():
    """The compiled head_dim=128 variant (compiled once, then loaded from the cache)."""
    import flash_compress

    return flash_compress.load_module(head_dim=128)


@pytest.mark.parametrize("graph", [False, True])
def test_planner_plans_into_numpy_arrays(module, graph):
    extend, seq = [300, 1, 57, 129], [300, 128, 1000, 129]
    m = sum(extend)
    compress, write = np.zeros((m, ROW_BYTES), np.uint8), np.zeros((m, ROW_BYTES), np.uint8)
    counts = module.plan_online_prefill(np.array(extend, np.int64), np.array(seq, np.int64), compress, write, graph)
    want_c, want_w = torch.zeros(m, ROW_BYTES, dtype=torch.uint8), torch.zeros(m, ROW_BYTES, dtype=torch.uint8)
    want = ref.plan_online_prefill(torch.tensor(extend), torch.tensor(seq), want_c, want_w, graph)
    assert tuple(int(n) for n in counts) == tuple(want)
    assert np.array_equal(compress, want_c.numpy()) and np.array_equal(write, want_w.numpy())


def test_planner_refuses_numpy_arrays_of_the_wrong_dtype_naming_them(module):
    plans = np.zeros((5, ROW_BYTES), np.uint8), np.zeros((5, ROW_BYTES), np.uint8)
    with pytest.raises(TypeError, match="extend_lens"):
        module.plan_online_prefill(np.array([5], np.int32), np.array([5], np.int64), *plans, False)
    with pytest.raises(ValueError, match="compress_plan"):
        module.plan_online_prefill(np.array([5], np.int64), np.array([5], np.int64), np.zeros((4, ROW_BYTES), np.uint8),
                                   np.zeros((4, ROW_BYTES), np.uint8), False)
