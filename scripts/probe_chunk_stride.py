#!/usr/bin/env python3
"""Does the distance between chunks read at once change DRAM bandwidth? (needs a CUDA GPU)

    python scripts/probe_chunk_stride.py

A one-wave prefill pass reads 256 chunks at once, each 128 token rows of 2 * head_dim floats,
the chunks a power of two of bytes apart. This sums the 128 rows of each chunk with torch
(threads over a row's floats, a loop over its tokens: the same order of reads) with the chunks
`pad` floats further apart, the L2 cache flushed before each timing; medians of 30 runs
(`bench.median_ms`). If power-of-two strides collided in DRAM, a padded layout would read
faster. docs/PERF_LOG.md (thirteenth session) has the result.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

CHUNKS, CHUNK_SIZE = 256, 128


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("probe_chunk_stride.py needs a CUDA GPU")
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")  # larger than L2
    for head_dim in (128, 256, 512):
        row = 2 * head_dim
        chunk = CHUNK_SIZE * row
        for pad in (0, 32, 64, 128, 512, 4096):
            storage = torch.randn(CHUNKS * (chunk + pad), device="cuda")
            chunks = storage.as_strided((CHUNKS, CHUNK_SIZE, row), (chunk + pad, row, 1))
            out = torch.empty(CHUNKS, row, device="cuda")
            torch.sum(chunks, dim=1, out=out)
            us = 1e3 * bench.median_ms(lambda: torch.sum(chunks, dim=1, out=out), iters=30, warmup=0,
                                       before=flush.zero_)
            print(f"head_dim {head_dim} pad {pad:5d} floats: {us:8.2f} us {CHUNKS * chunk * 4 / us / 1e3:7.1f} GB/s")


if __name__ == "__main__":
    main()
