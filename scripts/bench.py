"""Benchmark the online c128 kernels on a GPU against pure torch and the copy ceiling.

    python scripts/bench.py [--head-dim 128 256 512] [--json bench.json] [--quick] [--skip-torch]
                            [--state-dtype float32 bfloat16]
                            [--reference ../shared/seed/c128_online.cuh.txt] [--rounds 1]

Times are CUDA-event medians; decode at small batch is timed as CUDA-graph replays of many launches
(launch gaps would dominate otherwise). Prefill rows time one call between events, which includes
the host's call and launch latency (8.0 to 10.7 us per call in docs/PERFORMANCE.md's run); the "in
graph" rows (prefill, and decode at large batch) replay a graph of 10 calls and give the kernels'
own time ("graph-plan" rows run the plans a CUDA graph holds, a row per token, and "graph-plan in
graph" replays them). Those replays read the same tensors call after call, so a case smaller than
the L2 partly runs from it; the "cold" rows replay a graph whose calls cycle through enough copies
of the data to span twice the L2, so each call reads its data from HBM, as an engine's new tokens
are (cases too small to fill that with 256 copies have no cold row). "% of copy" is the bytes that
must cross HBM once (inputs read, outputs and states written, prior states read) over the time,
divided by the rate of a large device-to-device copy measured in the same run (bytes read plus
written); state bytes count at the state dtype's size, so a bfloat16 pool's rows show the bytes it
really moves. Each state dtype is its own implementation row ("flash_compress" float32,
"flash_compress bf16").
With ``--reference``, the reference design (``scripts/reference_design.py``)
runs the same cases on the same data in the same run, planned by its own
planner.

Within a case, the implementations are timed one after another. With ``--rounds R`` every row of a
case is timed R times, in rounds that take the case's rows forwards, then backwards, in turn, and
the table gives the median over rounds: a row timed first in one round is timed last in the next,
so that no implementation always runs before or after the same one (float32 before bfloat16, say)
and drifts of clock or temperature fall on all alike. One round (the default) is a single pass in
the order of the table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import flash_compress  # noqa: E402
from flash_compress.host_planner import plan_tensors  # noqa: E402
from flash_compress.plan_rows import CHUNK_SIZE  # noqa: E402


@dataclass
class Row:
    case: str
    impl: str
    us: float  # the median over rounds
    gbps: float
    pct_copy: float
    us_rounds: list[float]  # each round's time, in the order of the rounds


def median_ms(fn, iters: int = 50, warmup: int = 5, before=None) -> float:
    """Median time of one `fn` call between CUDA events; `before`, if given, runs ahead of each
    timed call, outside the events (an L2 flush, say)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def timed_in_rounds(measures: Sequence[Callable[[], float]], rounds: int,
                    after_round: Callable[[list[list[float]]], None] | None = None) -> list[list[float]]:
    """Each of ``measures``' results in each of ``rounds`` rounds (one list per measure). A round takes
    every measure once, forwards in even rounds and backwards in odd ones, so that no measure always
    follows the same neighbour (whose clocks, L2 contents or heat it would inherit).
    ``after_round``, if given, sees the results so far after each round."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    results: list[list[float]] = [[] for _ in measures]
    for done in range(rounds):
        order = range(len(measures)) if done % 2 == 0 else reversed(range(len(measures)))
        for i in order:
            results[i].append(measures[i]())
        if after_round is not None:
            after_round(results)
    return results


def capture_graph(fn, launches: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `launches` calls of `fn`, captured after 3 warm-up calls on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return graph


def graph_median_ms(fn, launches: int = 100, iters: int = 30) -> float:
    """Median time of one `fn` call, from replays of a graph holding `launches` calls."""
    return median_ms(capture_graph(fn, launches).replay, iters=iters) / launches


def spaced_graph_median_ms(fn, launches: int = 10, iters: int = 20, device: str = "cuda") -> float:
    """Median time of one `fn` call when a small kernel launched without PDL follows each call, as in an
    engine whose next kernel does not launch early: from replays of a graph of `launches` (call, spacer)
    pairs, less a graph of the spacers alone. Back to back, each call's first kernel is placed while the
    call before it finishes (PDL); the spacer, which starts only when the call has completed, takes that
    overlap away."""
    spacer_data = torch.zeros(1, device=device)

    def spacer():
        spacer_data.add_(1)

    def call_then_spacer():
        fn()
        spacer()

    return graph_median_ms(call_then_spacer, launches, iters) - graph_median_ms(spacer, launches, iters)


def l2_bytes() -> int:
    """The GPU's L2 size (50 MiB on an H200, the fallback where torch does not say)."""
    return int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 50 * 2**20))


#: Most copies of a case's data a cold graph cycles through; a case smaller than twice the L2 over this is
#: latency-bound, and its cold row is left out.
MOST_COPIES = 256


def cold_copies(case_bytes: int, l2: int) -> int:
    """Copies of a case's data a graph must cycle through so that no call finds its data in L2 from an
    earlier call: enough to span twice the L2 (at least 1); 0 where that takes more than MOST_COPIES."""
    copies = max(1, -(-2 * l2 // max(case_bytes, 1)))
    return copies if copies <= MOST_COPIES else 0


def cold_calls(run, args: tuple, copies: int) -> list:
    """``copies`` calls of ``run(state, input, out, *rest)``: the first on ``args``, each other on its own
    copy of the state, input and output (``rest``, small and read-only, is shared)."""
    state, inputs, out, *rest = args
    sets = [args] + [(state.clone(), inputs.clone(), torch.empty_like(out), *rest) for _ in range(copies - 1)]
    return [lambda call_args=call_args: run(*call_args) for call_args in sets]


def cold_graph_median_ms(calls) -> float:
    """Median time of one call, from replays of a graph whose launches cycle through ``calls``, each on
    its own copy of the data (``cold_copies``), so that each reads its data from HBM as an engine's
    fresh step does, not from L2 where the previous replay left it."""
    position = itertools.count()

    def next_call():
        calls[next(position) % len(calls)]()

    return graph_median_ms(next_call, launches=max(10, len(calls)), iters=20)


def copy_gbps() -> float:
    src = torch.empty(2 * 1024**3 // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


# --- pure torch baselines -------------------------------------------------------------------


def torch_prefill_aligned(kv_score_input, ape, out_rows):
    """Offline chunk softmax over whole chunks (requests start at position 0, 128-aligned)."""
    head_dim = ape.shape[1]
    x = kv_score_input.view(-1, CHUNK_SIZE, 2 * head_dim)
    kv, score = x[..., :head_dim], x[..., head_dim:] + ape
    weights = torch.softmax(score, dim=1)
    out_rows.copy_((weights * kv).sum(dim=1))


def torch_decode(state, kv_score_input, out, ape, indices, seq_lens):
    """Vectorised online update of SPEC section 1 for one token per request."""
    head_dim = ape.shape[1]
    pos = (seq_lens.long() - 1) % CHUNK_SIZE
    slots = indices.long()
    old = state[slots, 0]
    old_max, old_sum, old_kv = old[:, :head_dim], old[:, head_dim : 2 * head_dim], old[:, 2 * head_dim :]
    kv, score = kv_score_input[:, :head_dim], kv_score_input[:, head_dim:] + ape[pos]
    first = (pos == 0).unsqueeze(1)
    new_max = torch.where(first, score, torch.maximum(old_max, score))
    a = torch.where(first, torch.zeros_like(old_sum), old_sum * torch.exp(old_max - new_max))
    e = torch.exp(score - new_max)
    new_sum = a + e
    new_kv = (torch.where(first, torch.zeros_like(old_kv), old_kv) * a + kv * e) / new_sum
    closing = (pos == CHUNK_SIZE - 1).unsqueeze(1)
    # Masked selects rather than boolean indexing, which syncs and cannot be graph-captured.
    out.copy_(torch.where(closing, new_kv, out))
    state[slots, 0] = torch.where(closing, old, torch.cat([new_max, new_sum, new_kv], dim=1))


# --- cases ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """What a call must move across HBM once: float32 bytes, and state values (read plus written)."""

    float_bytes: int
    state_values: int

    def bytes(self, state_dtype: torch.dtype) -> int:
        return self.float_bytes + self.state_values * torch.empty(0, dtype=state_dtype).element_size()


def plan(module, extend_lens, seq_lens, use_cuda_graph, device="cuda"):
    """Both plans of a prefill, made by ``module``'s host planner, on ``device``."""
    compress_plan, write_plan = plan_tensors(module, extend_lens, seq_lens, use_cuda_graph)
    return compress_plan.to(device), write_plan.to(device)


def case_lengths(batch, extend, random_prefix, gen, singles=0) -> tuple[list[int], list[int]]:
    """(prefixes, extends) of `batch` requests of `extend` new tokens (from position 0, or after random
    prefixes), then `singles` one-token requests after random prefixes (decode tokens riding in a prefill)."""
    prefixes = torch.randint(0, 4 * CHUNK_SIZE, (batch,), generator=gen).tolist() if random_prefix else [0] * batch
    prefixes += torch.randint(1, 4 * CHUNK_SIZE, (singles,), generator=gen).tolist()
    return prefixes, [extend] * batch + [1] * singles


def prefill_case(module, head_dim, batch, extend, random_prefix, gen, singles=0, device="cuda"):
    """The tensors, exact and padded plans and bytes of a `case_lengths` case, planned by `module`, on
    `device`. The bytes are those "% of copy" counts (docs/PERFORMANCE.md, Method): token rows, output
    rows, prior states read and states written; ape rows, plan rows and index vectors are left out."""
    prefixes, extends = case_lengths(batch, extend, random_prefix, gen, singles)
    batch += singles
    seq_lens = [p + e for p, e in zip(prefixes, extends)]
    rows = sum(extends)
    slots = batch
    data = {
        "state": torch.randn(slots, 1, 3 * head_dim, device=device),
        "input": torch.randn(rows, 2 * head_dim, device=device),
        "out": torch.empty(rows, head_dim, device=device),
        "ape": torch.randn(CHUNK_SIZE, head_dim, device=device),
        "indices": torch.arange(batch, dtype=torch.int32, device=device),
        "seq_lens": seq_lens,
        "extends": extends,
    }
    exact = plan(module, extends, seq_lens, False, device)
    padded = plan(module, extends, seq_lens, True, device)
    num_closed = exact[0].shape[0]
    prior_reads = sum(1 for p in prefixes if p % CHUNK_SIZE)
    state_writes = exact[1].shape[0]
    return data, exact, padded, Traffic(4 * (rows * 2 * head_dim + num_closed * head_dim),
                                        (prior_reads + state_writes) * 3 * head_dim)


def run_prefill_case(module, data, plans, state=None):
    """`module.run_prefill` on a `prefill_case`'s tensors and `plans` (compress, write), into its
    output; `state` stands in for its float32 pool (the pool in another state dtype). For calls timed
    in graphs or not timed: the eager timings keep the call inline, one Python frame less."""
    module.run_prefill(data["state"] if state is None else state, data["input"], data["out"], data["ape"],
                       data["indices"], *plans, None)


def decode_case(head_dim, batch, device="cuda", seed=0):
    """One decode step of `batch` requests at random positions in random slots: the run_decode
    arguments (extra left out) and the bytes that must cross HBM. Slots and positions come from
    `seed`, so every run times the same step (at B=1, whether the request reads a state or closes its
    chunk changes the time)."""
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(batch, 1, 3 * head_dim, device=device)
    tokens = torch.randn(batch, 2 * head_dim, device=device)
    out = torch.empty(batch, head_dim, device=device)
    ape = torch.randn(CHUNK_SIZE, head_dim, device=device)
    indices = torch.randperm(batch, dtype=torch.int32, generator=gen).to(device)
    seq_lens = torch.randint(2, 100000, (batch,), dtype=torch.int32, generator=gen).to(device)
    pos = (seq_lens.long() - 1) % CHUNK_SIZE
    state_reads = int((pos != 0).sum())
    closing = int((pos == CHUNK_SIZE - 1).sum())
    # Every input row; the state of every request not at a chunk start; a
    # state written back, or for a closing chunk its output row instead.
    traffic = Traffic(4 * head_dim * (2 * batch + closing), 3 * head_dim * (state_reads + batch - closing))
    return (state, tokens, out, ape, indices, seq_lens), traffic


#: (name, requests, new tokens each, random prefixes, one-token requests beside them).
PREFILL_CASES = [("1x32768 from 0", 1, 32768, False, 0), ("8x16384 from 0", 8, 16384, False, 0),
                 ("64x1024 random prefix", 64, 1024, True, 0), ("256x300 random prefix", 256, 300, True, 0),
                 # Few rows per SM: one long request with decode tokens riding along.
                 ("1x8192 + 255x1", 1, 8192, True, 255), ("1x2048 + 63x1", 1, 2048, True, 63),
                 # The floor of a call of two passes: a row each.
                 ("1x128 from 0 + 1x1", 1, 128, False, 1)]
DECODE_BATCHES = [1, 64, 512, 4096, 32768]
STATE_DTYPES = {name: getattr(torch, name) for name in flash_compress.c128_online.STATE_DTYPES}


def implementations(args) -> list[tuple[str, object, torch.dtype]]:
    """(name, module, state dtype) of each implementation to time; ours first (float32 first)."""
    impls = [("flash_compress" + ("" if dtype == "float32" else " bf16"),
              flash_compress.load_module(args.head_dim, state_dtype=dtype), STATE_DTYPES[dtype])
             for dtype in sorted(args.state_dtype, key=list(STATE_DTYPES).index)]
    if args.reference:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from reference_design import load_reference

        impls.append(("reference design", load_reference(args.reference, args.head_dim), torch.float32))
    return impls


@dataclass
class Timing:
    """A row to time: ``measure()`` takes one timing, in ms per call."""

    case: str
    impl: str
    measure: Callable[[], float]
    traffic: Traffic
    state_dtype: torch.dtype = torch.float32


def timed_rows(timings: list[Timing], rounds: int, ceiling_gbps: float) -> list[Row]:
    """A case's rows, timed in ``rounds`` rounds (``timed_in_rounds``): each timing's median over the
    rounds, its rate (the bytes its traffic moves at its state dtype) and that rate's share of the copy
    ceiling, and every round's time."""
    rows = []
    for t, ms in zip(timings, timed_in_rounds([t.measure for t in timings], rounds)):
        median = statistics.median(ms)
        gbps = t.traffic.bytes(t.state_dtype) / (median * 1e-3) / 1e9
        rows.append(Row(t.case, t.impl, median * 1e3, gbps, 100 * gbps / ceiling_gbps,
                        [round(x * 1e3, 3) for x in ms]))
    return rows


def run(args) -> list[Row]:
    head_dim = args.head_dim
    impls = implementations(args)
    planner = flash_compress.c128_online.load_planner()
    gen = torch.Generator().manual_seed(0)
    ceiling = copy_gbps()
    l2 = l2_bytes()
    print(f"device: {torch.cuda.get_device_name()}, copy ceiling {ceiling:.0f} GB/s (read + write), "
          f"L2 {l2 / 2**20:.0f} MiB")
    rows: list[Row] = []

    def time_case(timings: list[Timing]) -> None:
        rows.extend(timed_rows(timings, args.rounds, ceiling))

    prefill_cases = PREFILL_CASES if not args.quick else PREFILL_CASES[:1] + PREFILL_CASES[2:3]
    for name, batch, extend, random_prefix, singles in prefill_cases:
        data, exact, padded, traffic = prefill_case(planner, head_dim, batch, extend, random_prefix, gen, singles)
        d = data
        case = f"prefill {name}"
        timings: list[Timing] = []

        for impl, impl_module, state_dtype in impls:
            # Each implementation runs the plans of its own planner (ours are planned already).
            ours = impl.startswith("flash_compress")
            own_exact, own_padded = (exact, padded) if ours else (
                plan(impl_module, d["extends"], d["seq_lens"], False),
                plan(impl_module, d["extends"], d["seq_lens"], True))
            state = d["state"].to(state_dtype)

            def call(plans, m=impl_module, state=state):
                m.run_prefill(state, d["input"], d["out"], d["ape"], d["indices"], *plans, None)

            def timing(label, measure, state_dtype=state_dtype):
                timings.append(Timing(case, label, measure, traffic, state_dtype))

            timing(impl, lambda call=call, plans=own_exact: median_ms(lambda: call(plans)))
            timing(f"{impl} graph-plan", lambda call=call, plans=own_padded: median_ms(lambda: call(plans)))
            # The kernels alone: a single call's events also hold its host and launch latency.
            timing(f"{impl} in graph", lambda call=call, plans=own_exact: graph_median_ms(
                lambda: call(plans), launches=10, iters=20))
            # What an engine that captures prefill replays: plans padded to a row per token.
            timing(f"{impl} graph-plan in graph", lambda call=call, plans=own_padded: graph_median_ms(
                lambda: call(plans), launches=10, iters=20))
            if args.spaced:
                timing(f"{impl} in graph, spaced", lambda call=call, plans=own_exact: spaced_graph_median_ms(
                    lambda: call(plans)))
            copies = cold_copies(traffic.bytes(state_dtype), l2)
            if copies:
                calls = cold_calls(impl_module.run_prefill,
                                   (state, d["input"], d["out"], d["ape"], d["indices"], *own_exact, None), copies)
                timing(f"{impl} in graph, cold", lambda calls=calls: cold_graph_median_ms(calls))
        if not random_prefix and not singles and not args.skip_torch:
            out_rows = torch.empty(batch * extend // CHUNK_SIZE, head_dim, device="cuda")
            compiled = torch.compile(torch_prefill_aligned)
            timings.append(Timing(case, "torch eager", lambda: median_ms(
                lambda: torch_prefill_aligned(d["input"], d["ape"], out_rows), iters=20), traffic))
            timings.append(Timing(case, "torch.compile", lambda: median_ms(
                lambda: compiled(d["input"], d["ape"], out_rows), iters=20, warmup=3), traffic))
        time_case(timings)
        del data, timings

    decode_batches = DECODE_BATCHES if not args.quick else [1, 32768]
    for batch in decode_batches:
        decode_args, traffic = decode_case(head_dim, batch)

        def eager():
            torch_decode(*decode_args)

        in_graph = batch <= 4096
        case = f"decode B={batch}" + (" (graph)" if in_graph else "")
        timings = []
        for impl, impl_module, state_dtype in impls:
            impl_args = (decode_args[0].to(state_dtype), *decode_args[1:])

            def decode_call(m=impl_module, impl_args=impl_args):
                m.run_decode(*impl_args, None)

            timings.append(Timing(case, impl, (lambda call=decode_call: graph_median_ms(call)) if in_graph else
                                  (lambda call=decode_call: median_ms(call)), traffic, state_dtype))
            if not in_graph:  # the kernel alone, as the prefill rows' "in graph"
                timings.append(Timing(case, f"{impl} in graph", lambda call=decode_call: graph_median_ms(
                    call, launches=10, iters=20), traffic, state_dtype))
            copies = cold_copies(traffic.bytes(state_dtype), l2) if in_graph else 0
            if copies:
                calls = cold_calls(impl_module.run_decode, (*impl_args, None), copies)
                timings.append(Timing(case, f"{impl} cold", lambda calls=calls: cold_graph_median_ms(calls), traffic,
                                      state_dtype))
        if not args.skip_torch:
            timings.append(Timing(case, "torch eager", (lambda: graph_median_ms(eager, launches=10)) if in_graph else
                                  (lambda: median_ms(eager, iters=20)), traffic))
        time_case(timings)
        del timings
    if not args.quick:
        for timings in speculative_timings(impls, head_dim):
            time_case(timings)
    return rows, ceiling


def verify_case(head_dim, batch, window, device="cuda", seed=0):
    """A verify step of `batch` requests of `window` draft tokens each, at random positions in random
    slots, and the commit after it: the run_verify arguments (float32 state pool), the accepted
    lengths, and the bytes each must cross HBM. Slots, positions and accepted lengths come from
    `seed`."""
    gen = torch.Generator().manual_seed(seed)
    tokens = batch * window
    state = torch.randn(batch, 1, 3 * head_dim, device=device)
    inputs = torch.randn(tokens, 2 * head_dim, device=device)
    out = torch.empty(tokens, head_dim, device=device)
    ape = torch.randn(CHUNK_SIZE, head_dim, device=device)
    indices = torch.randperm(batch, dtype=torch.int32, generator=gen).to(device)
    seq_lens = torch.randint(window + 1, 100000, (batch,), dtype=torch.int32, generator=gen).to(device)
    prefix = torch.empty(tokens, 3 * head_dim, device=device)
    accept = torch.randint(1, window + 1, (batch,), dtype=torch.int32, generator=gen).to(device)
    # Verify reads every input row and the committed state of every request whose window does not start
    # a chunk, writes every prefix state and the row of every token that closes a chunk; commit reads one
    # prefix state per request and writes its slot.
    first = (seq_lens.long().cpu() - window) % CHUNK_SIZE
    state_reads = int((first != 0).sum())
    closing = int(sum(((first + j) % CHUNK_SIZE == CHUNK_SIZE - 1).sum() for j in range(window)))
    verify_traffic = Traffic(4 * head_dim * (tokens * 2 + closing), 3 * head_dim * (state_reads + tokens))
    commit_traffic = Traffic(0, 3 * head_dim * 2 * batch)
    return (state, inputs, out, ape, indices, seq_lens, prefix), accept, verify_traffic, commit_traffic


def speculative_timings(impls, head_dim):
    """Verify and commit (T = 4) in CUDA graphs, beside a decode of as many tokens: a list of timings
    per batch, our implementations only (the reference design has no speculative decoding)."""
    window = 4
    for batch in (512, 8192):
        tokens = batch * window
        decode_args, decode_traffic = decode_case(head_dim, tokens)
        verify_args, accept, verify_traffic, commit_traffic = verify_case(head_dim, batch, window)
        state, inputs, out, ape, indices, seq_lens, prefix_f32 = verify_args
        step_traffic = Traffic(verify_traffic.float_bytes, verify_traffic.state_values + commit_traffic.state_values)
        case = f"B={batch} T={window} (graph)"
        timings = []
        for impl, module, state_dtype in impls:
            if not impl.startswith("flash_compress"):
                continue
            pool = state.to(state_dtype)
            prefix = prefix_f32.to(state_dtype)  # the same tensor for float32 states
            decode_state = decode_args[0].to(state_dtype)

            def verify(m=module, pool=pool, prefix=prefix):
                m.run_verify(pool, inputs, out, ape, indices, seq_lens, prefix)

            def commit(m=module, pool=pool, prefix=prefix):
                m.run_commit(pool, prefix, indices, accept)

            def step(verify=verify, commit=commit):
                verify()
                commit()

            def decode(m=module, decode_state=decode_state):
                m.run_decode(decode_state, *decode_args[1:], None)

            for row_case, call, traffic in ((f"decode B={tokens} (graph)", decode, decode_traffic),
                                            (f"verify {case}", verify, verify_traffic),
                                            (f"commit {case}", commit, commit_traffic),
                                            (f"verify+commit {case}", step, step_traffic)):
                timings.append(Timing(row_case, impl, lambda call=call: graph_median_ms(call, launches=20), traffic,
                                      state_dtype))
        yield timings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[512], help="one table per head_dim (default 512)")
    parser.add_argument("--json", default=None, help="write the rows here as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--spaced", action="store_true",
                        help="also time each prefill in a graph with a small non-PDL kernel after every call "
                             "(rows 'in graph, spaced'; the spacer's own time subtracted)")
    parser.add_argument("--skip-torch", action="store_true", help="time only this project and the copy")
    parser.add_argument("--state-dtype", nargs="+", choices=list(STATE_DTYPES), default=list(STATE_DTYPES),
                        help="state dtypes of our kernels to time, each its own implementation (default: both)")
    parser.add_argument("--reference", default=None, metavar="SEED",
                        help="also time the reference design built from this seed file (the upstream contract's seed kernel)")
    parser.add_argument("--rounds", type=int, default=1, metavar="R",
                        help="time each case's rows R times, forwards and backwards in turn, and report medians "
                             "(default 1: one pass in the table's order)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        print("bench.py needs a CUDA GPU", file=sys.stderr)
        return 2
    tables, ceilings = {}, {}
    for head_dim in args.head_dim:
        rows, ceilings[head_dim] = run(argparse.Namespace(**{**vars(args), "head_dim": head_dim}))
        tables[head_dim] = [asdict(r) for r in rows]
        spread = args.rounds > 1  # each row's fastest and slowest round beside the median
        print(f"\nhead_dim {head_dim}\n{'case':34} {'impl':28} {'us':>10} {'GB/s':>8} {'% copy':>7}"
              + (f" {'rounds min-max':>17}" if spread else ""))
        for r in rows:
            print(f"{r.case:34} {r.impl:28} {r.us:10.2f} {r.gbps:8.0f} {r.pct_copy:6.1f}%"
                  + (f" {min(r.us_rounds):8.2f}-{max(r.us_rounds):.2f}" if spread else ""))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_planner import planner_rows

    planner = planner_rows(flash_compress.c128_online.load_planner())
    print(f"\n{'planner case':34} {'impl':28} {'us':>10}")
    for r in planner:
        print(f"{r['case']:34} {r['impl']:28} {r['us']:10.2f}")
    if args.json:
        # Each head_dim's table is measured against the copy rate of its own run.
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbps": ceilings,
                                               "rounds": args.rounds, "tables": tables, "planner": planner},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
