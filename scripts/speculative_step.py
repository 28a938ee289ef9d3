#!/usr/bin/env python3
"""An engine's speculative decoding (MTP) steps end to end: prefill, then rounds of verify + accept + commit.

    python scripts/speculative_step.py [--device cuda|cpu] [--head-dim 512] [--window 4] [--rounds 16]
                                       [--state-dtype float32|bfloat16] [--cuda-graph]

Four requests are prefilled, then every round feeds T = ``--window`` tokens per
request (the last accepted token and T - 1 drafts) to ``fc.verify``, lets a
stand-in for the target model decide on the device how many of them it
accepts, and commits that many with ``fc.commit``; the next round's
``seq_lens`` are advanced on the device as well, so a round needs nothing
from the host. With ``--cuda-graph`` (CUDA only) the round is captured once
and replayed. The host reads the accepted lengths back after each round only
to keep the emitted rows and the accepted tokens for the final check: every
compressed row and every slot's open-chunk state must match a float64
recomputation from the accepted tokens alone (rejected drafts must leave no
trace). Prints OK and exits 0 when they do. docs/USAGE.md ("Speculative
decoding (MTP)") walks through it; docs/SPEC.md section 9 is the contract.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))  # usage_example's offline rows
try:
    import flash_compress as fc
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(SCRIPTS.parent / "python"))
    import flash_compress as fc

from flash_compress.plan_rows import CHUNK_SIZE  # noqa: E402
from usage_example import offline_rows  # noqa: E402

PROMPTS = [300, 57, 126, 1]  # prompt lengths; 126: the first window closes a chunk
SLOTS = [3, 0, 6, 1]  # request b's slot in a pool of 8
#: Largest per-row relative error (max over channels / max |row|) against float64, by pool dtype: float32 arithmetic,
#: and for bfloat16 one rounding of the state per commit (tests/oracle.py has the measured bounds).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 9e-2}


def accepted_lengths(kv_score_input: torch.Tensor, window: int) -> torch.Tensor:
    """The target model's verdict, computed on the device: draft ``j`` of request ``b`` "agrees" when the first
    kv channel of its token is above -0.5 (about 70% of drafts); the accepted length is 1 (the last accepted
    token, always kept) plus the drafts that agree before the first that does not."""
    drafts = kv_score_input.view(-1, window, kv_score_input.shape[-1])[:, 1:, 0]
    agree = (drafts > -0.5).to(torch.int32)
    return agree.cumprod(dim=1).sum(dim=1).add(1).clamp(1, window).to(torch.int32)


def open_chunk_error(state: torch.Tensor, tokens: torch.Tensor, ape: torch.Tensor, d: int) -> float:
    """Relative error of a slot's ``kv`` and absolute error of its ``max + log(sum)`` against the open chunk's
    float64 softmax (the larger of the two)."""
    n = tokens.shape[0] % CHUNK_SIZE
    t = tokens[-n:].double()
    logits = t[:, d:] + ape[:n].double()
    top = logits.max(dim=0).values
    weights = torch.exp(logits - top)
    total = weights.sum(dim=0)
    kv = (weights * t[:, :d]).sum(dim=0) / total
    s = state.double().flatten()
    kv_error = float((s[2 * d :] - kv).abs().max() / kv.abs().max())
    lse_error = float((s[:d] + torch.log(s[d : 2 * d]) - top - torch.log(total)).abs().max())
    return max(kv_error, lse_error)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--head-dim", type=int, default=512)
    parser.add_argument("--window", type=int, default=4, help="T: tokens per request and round, 1..16")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--state-dtype", choices=list(fc.c128_online.STATE_DTYPES), default="float32")
    parser.add_argument("--cuda-graph", action="store_true", help="capture one round, replay it (CUDA only)")
    args = parser.parse_args(argv)
    device, d, t = torch.device(args.device), args.head_dim, args.window
    dtype = getattr(torch, args.state_dtype)
    if args.cuda_graph and device.type != "cuda":
        parser.error("--cuda-graph needs --device cuda")
    gen = torch.Generator().manual_seed(0)
    b = len(PROMPTS)

    def new_tokens(n: int) -> torch.Tensor:
        return torch.cat([torch.randn(n, d, generator=gen), 2 * torch.randn(n, d, generator=gen)], dim=1)

    # The pool and a model weight; every request's prompt goes through one chunked prefill.
    pool = torch.empty(8, 1, 3 * d, dtype=dtype, device=device)
    ape = torch.randn(CHUNK_SIZE, d, generator=gen).to(device)
    idx = torch.tensor(SLOTS, dtype=torch.int32, device=device)
    prompt = new_tokens(sum(PROMPTS))
    plan = fc.plan_prefill(torch.tensor(PROMPTS), torch.tensor(PROMPTS), device=device)
    out = fc.prefill(pool, prompt.to(device), ape, idx, plan)
    history = [[p] for p in prompt.split(PROMPTS)]  # accepted tokens per request (for the check)
    rows: list[list[torch.Tensor]] = [[] for _ in range(b)]  # compressed rows per request, in chunk order
    for ragged, batch, _, _ in plan.compress_plan.view(torch.int32)[: plan.num_compress].tolist():
        rows[batch].append(out[ragged].cpu())

    # Static tensors of a round: the graph (or the eager loop) reads and writes these.
    inp = torch.empty(b * t, 2 * d, device=device)
    seq_lens = torch.tensor([n + t for n in PROMPTS], dtype=torch.int32, device=device)  # counting all T tokens
    out = torch.empty(b * t, d, device=device)
    prefix_states = torch.empty(b * t, 3 * d, dtype=dtype, device=device)

    def speculative_round() -> torch.Tensor:
        fc.verify(pool, inp, ape, idx, seq_lens, out=out, prefix_states=prefix_states)
        accept = accepted_lengths(inp, t)  # in an engine: from the target model's logits
        fc.commit(pool, prefix_states, idx, accept)
        seq_lens.add_(accept)  # the next window starts after the accepted tokens
        return accept

    if args.cuda_graph:
        inp.copy_(new_tokens(b * t))
        saved_pool, saved_lens = pool.clone(), seq_lens.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            speculative_round()  # warm-up outside the capture (loads the kernels)
        torch.cuda.current_stream().wait_stream(side)
        pool.copy_(saved_pool)
        seq_lens.copy_(saved_lens)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_accept = speculative_round()

    accepted_counts = []
    for _ in range(args.rounds):
        tokens = new_tokens(b * t)
        inp.copy_(tokens)
        lens_before = seq_lens.tolist()  # for the bookkeeping below only (a sync the engine does not need)
        if args.cuda_graph:
            graph.replay()
            accept = graph_accept
        else:
            accept = speculative_round()
        accepted = accept.tolist()
        accepted_counts.append(accepted)
        for r in range(b):
            keep = tokens[r * t : r * t + accepted[r]]
            first = lens_before[r] - t  # position of token 0
            for j in range(accepted[r]):  # rows of rejected tokens are written too, and dropped here
                if (first + j) % CHUNK_SIZE == CHUNK_SIZE - 1:
                    rows[r].append(out[r * t + j].to("cpu", copy=True))  # out is reused next round
            history[r].append(keep)

    worst_row = worst_state = 0.0
    host_pool = pool.cpu()
    for r in range(b):
        accepted_tokens = torch.cat(history[r])
        want = offline_rows(accepted_tokens, ape.cpu(), d)
        got = torch.stack(rows[r]).double() if rows[r] else torch.zeros(0, d, dtype=torch.float64)
        if got.shape != want.shape:
            print(f"FAIL: request {r}: {got.shape[0]} rows, want {want.shape[0]}")
            return 1
        if len(want):
            worst_row = max(worst_row, float(((got - want).abs().amax(1) / want.abs().amax(1)).max()))
        if accepted_tokens.shape[0] % CHUNK_SIZE:
            worst_state = max(worst_state, open_chunk_error(host_pool[SLOTS[r], 0], accepted_tokens, ape.cpu(), d))
    lengths = [sum(len(x) for x in h) for h in history]
    tol = TOLERANCE[dtype]
    total_rows = sum(map(len, rows))
    print(f"speculative steps on {device} ({args.state_dtype} pool, T = {t}, {args.rounds} rounds"
          f"{', CUDA graph' if args.cuda_graph else ''}): accepted per round {accepted_counts[:4]} ..., "
          f"lengths {PROMPTS} -> {lengths}")
    print(f"{total_rows} compressed rows, max relative error {worst_row:.1e}; "
          f"open-chunk states, max error {worst_state:.1e} (tolerance {tol:g})")
    if worst_row > tol or worst_state > tol:
        print("FAIL")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
