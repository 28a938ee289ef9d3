#!/usr/bin/env python3
"""The worked example of docs/USAGE.md: two requests through chunked prefill, a slot move and decode.

    python scripts/usage_example.py [--device cuda|cpu] [--head-dim 512]

On a CUDA device it runs the compiled kernels (the first run compiles them);
on the CPU it runs the same calls on flash_compress.reference. At the end every
compressed row is checked against the offline chunk softmax of the raw tokens,
which the example keeps only for that check. Exits 0 when all rows match.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

try:
    import flash_compress as fc
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    import flash_compress as fc

from flash_compress.plan_rows import CHUNK_SIZE  # noqa: E402


def offline_rows(tokens: torch.Tensor, ape: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Every closed chunk's row from all its raw tokens at once (float64): what the online state must give."""
    closed = tokens.shape[0] // CHUNK_SIZE
    t = tokens[: closed * CHUNK_SIZE].double().reshape(closed, CHUNK_SIZE, 2 * head_dim)
    weights = torch.softmax(t[..., head_dim:] + ape.double(), dim=1)
    return (weights * t[..., :head_dim]).sum(dim=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--head-dim", type=int, default=512)
    args = parser.parse_args(argv)
    device, d = torch.device(args.device), args.head_dim
    gen = torch.Generator().manual_seed(0)

    # The state pool: one [1, 3*D] float32 slot per live request (max | sum | kv), sized
    # for the most requests the engine keeps at once. Slots need no initialisation.
    num_slots = 8
    state = torch.empty(num_slots, 1, 3 * d, device=device)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen).to(device)  # a model weight: score bias by position in chunk

    slots = [3, 5]  # request b's slot
    history = [[], []]  # raw tokens per request, kept only for the final check
    rows = [[], []]  # compressed rows per request, in chunk order

    def new_tokens(n: int) -> torch.Tensor:
        return torch.randn(n, 2 * d, generator=gen).to(device)  # | kv (D) | score (D) |

    def prefill(extend: list[int], *, move_to: list[int] | None = None, use_cuda_graph: bool = False) -> None:
        """One chunked-prefill step: `extend[b]` new tokens for request b (optionally moving slots)."""
        seq = [sum(len(t) for t in history[b]) + extend[b] for b in range(2)]
        plan = fc.plan_prefill(torch.tensor(seq), torch.tensor(extend), device=device, use_cuda_graph=use_cuda_graph)
        tokens = new_tokens(sum(extend))
        load = torch.tensor(slots, dtype=torch.int32, device=device)
        if move_to is not None:
            slots[:] = move_to  # read the prior state from the old slot, write the new one
        indices = torch.tensor(slots, dtype=torch.int32, device=device)
        out = fc.prefill(state, tokens, ape, indices, plan, load_indices=load if move_to else None)
        # The compress plan names the rows of `out` that were written: {ragged_id, batch_id, ...}.
        fields = plan.compress_plan.view(torch.int32)[: plan.num_compress].tolist()
        for ragged, batch, _, _ in (f for f in fields if f[0] != -1):  # -1: cuda-graph padding
            rows[batch].append(out[ragged])
        for b, piece in enumerate(tokens.split(extend)):
            history[b].append(piece)

    def decode() -> None:
        """One decode step: one new token for each request."""
        seq = [sum(len(t) for t in history[b]) + 1 for b in range(2)]
        tokens = new_tokens(2)
        indices = torch.tensor(slots, dtype=torch.int32, device=device)
        out = fc.decode(state, tokens, ape, indices, torch.tensor(seq, dtype=torch.int32, device=device))
        for b in range(2):
            if seq[b] % CHUNK_SIZE == 0:  # this token closed a chunk: row b of out is its compressed row
                rows[b].append(out[b])
            history[b].append(tokens[b : b + 1])

    prefill([300, 57])  # a prompt is cut into chunks of 128 at any offset
    prefill([40, 200], move_to=[3, 6], use_cuda_graph=True)  # request 1 moves from slot 5 to slot 6
    for _ in range(150):  # decode until both requests close more chunks
        decode()

    worst = 0.0
    for b in range(2):
        want = offline_rows(torch.cat(history[b]).cpu(), ape.cpu(), d)
        got = torch.stack(rows[b]).double().cpu()
        assert got.shape == want.shape, f"request {b}: {got.shape[0]} rows, want {want.shape[0]}"
        worst = max(worst, float(((got - want).abs().amax(1) / want.abs().amax(1)).max()))
    ok = worst < 2e-5
    print(f"usage example on {device}: {sum(map(len, rows))} compressed rows, "
          f"max relative error {worst:.1e} -> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
