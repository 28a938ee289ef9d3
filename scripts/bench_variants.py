"""Time edited copies of the kernel header against the tree (and the reference design) in one process.

    python scripts/bench_variants.py NAME=PATH ... [--reference SEED] [--rounds 5] [--decode-only]
                                     [--state-dtype bfloat16] [--per-pass] [--prefill-only] [--shapes]
                                     [--check | --check-close] [--both-dtypes] [--decode-batches B ...]

(``--decode-batches`` takes every word after it, so the variants go before it.)

Each NAME=PATH is a variant of the kernel sources, built as its own JIT variant
with the tree's build spec (exports, template values). PATH is either a folder
whose files replace their namesakes in ``csrc/deepseek_v4/`` (e.g. an edited
``c128_prefill.cuh``, or ``c128_online.cuh`` with another launch rule), built
beside the tree's other kernel files against the tree's ``include/``; or another
checkout, a folder with ``csrc/deepseek_v4/`` and ``include/`` (a worktree with
an experiment of ``docs/experiments/`` applied, say), whose ``csrc/`` and
``include/`` are built whole. Every implementation runs the bench.py
cases on the same tensors, in rounds that visit every implementation in turn,
forwards then backwards (bench.py's ``timed_in_rounds``), so that drifts of
clock and temperature hit all of them alike and none always runs first; the table shows
the median and the minimum over rounds (us). Decode and verify steps (T=4) run
in CUDA graphs up to B=4096 (verify always). Prefill cases are timed four
ways: one call with exact plans between events, the same in a CUDA graph of 10
calls (kernels alone), and both again with ``use_cuda_graph`` plans. This is
how the sweeps of docs/PERFORMANCE.md were measured. ``--shapes`` runs bench_shapes.py's
prefill shapes instead of bench.py's prefill cases, for a change whose rule picks
other widths or grids on shapes bench.py does not have.

``--both-dtypes`` adds the tree built for the other state dtype as one more column
("tree bfloat16" beside a float32 tree), timed in the same rounds: the way to
compare the two dtypes, which bench.py times one after the other.

``--check`` first runs every variant and the tree once on each case (prefill
with exact and padded plans, twice in a row, plus a case that reads its prior
states from other slots through ``load_indices``; decode; verify then commit) from the same states
into NaN-poisoned outputs, and compares states and outputs bit for bit: a
variant meant to change speed only must match the tree exactly. It exits 1 on
any difference, and names where it lies: which results (state, output, prefix
states), how many of their rows (slots, output rows) and the largest error.
``--check-close`` accepts, instead, values within a rounding or so of the
tree's (``CLOSE_RTOL``, float32 states) and NaN where the tree's are: for a
variant that changes which warps sum which tokens (a slice-width rule), which
reorders a chunk's sums. Each variant's prefills run on its own planner's plans,
and decode on the batches ``--decode-batches`` times.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402
import flash_compress  # noqa: E402
from flash_compress import jit  # noqa: E402
from flash_compress.c128_online import spec  # noqa: E402
from make_variant import checkout_include_dirs, is_checkout  # noqa: E402

KERNEL_DIR = ROOT / "csrc" / "deepseek_v4"


def variant_spec(name: str, files: Path, head_dim: int, source_root: Path, state_dtype: str) -> jit.JitSpec:
    """The tree's build spec with the sources of variant ``name``: the checkout ``files``'s ``csrc/`` and
    ``include/``, or the tree's kernel files with those in the folder ``files`` replacing theirs (copied
    under ``source_root``)."""
    tree = spec(head_dim, True, state_dtype)
    if is_checkout(files):
        include_dirs = checkout_include_dirs(files)
    else:
        folder = source_root / name / "deepseek_v4"
        shutil.copytree(KERNEL_DIR, folder)
        for edited in files.iterdir():
            shutil.copy(edited, folder / edited.name)
        include_dirs = (folder.parent, *tree.include_dirs[1:])
    return dataclasses.replace(tree, name=f"{tree.name}_variant_{name}", include_dirs=include_dirs)


def load_variant(name: str, files: Path, head_dim: int, source_root: Path, state_dtype: str):
    """The module built from variant ``name``'s sources (``variant_spec``)."""
    return jit.load(variant_spec(name, files, head_dim, source_root, state_dtype))


def parse_variant(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name.isidentifier() or not Path(path).is_dir():
        raise argparse.ArgumentTypeError(
            f"expected NAME=PATH to a folder of kernel files or a checkout, got {text!r}")
    if is_checkout(Path(path)):
        return name, Path(path)
    unknown = sorted(f.name for f in Path(path).iterdir() if not (KERNEL_DIR / f.name).is_file())
    if unknown:
        raise argparse.ArgumentTypeError(f"{path}: expected files named as in {KERNEL_DIR} (or a checkout with "
                                         f"csrc/deepseek_v4/ and include/), got {', '.join(unknown)}")
    return name, Path(path)


#: Verify steps timed beside decode. On an H200: 64 requests fit the GPU at once; 512 fill over half
#: of it at head_dim 512 (float32: 5 blocks of one request per SM), 1536 at head_dim 128; 8192 run in
#: several waves.
VERIFY_BATCHES = [64, 512, 1536, 8192]
VERIFY_WINDOW = 4


def cases(impls: dict, head_dim: int, decode_only: bool, state_dtypes: dict[str, torch.dtype],
          per_pass: bool = False, decode_batches: list[int] = bench.DECODE_BATCHES,
          prefill_only: bool = False) -> dict[str, dict[str, tuple]]:
    """case -> impl -> (call, timed in a graph, launches per graph); each impl's states in its
    ``state_dtypes`` entry. ``prefill_only`` leaves out decode and verify (their inputs are not
    even made)."""
    out: dict[str, dict[str, tuple]] = {}
    gen = torch.Generator().manual_seed(0)
    tree = next(iter(impls.values()))
    for name, batch, extend, random_prefix, singles in ([] if decode_only else bench.PREFILL_CASES):
        d, _, _, _ = bench.prefill_case(tree, head_dim, batch, extend, random_prefix, gen, singles)
        for impl, m in impls.items():
            exact = bench.plan(m, d["extends"], d["seq_lens"], False)
            padded = bench.plan(m, d["extends"], d["seq_lens"], True)
            state = d["state"].to(state_dtypes[impl])

            def call(plans, m=m, d=d, state=state):
                m.run_prefill(state, d["input"], d["out"], d["ape"], d["indices"], *plans, None)

            out.setdefault(f"prefill {name}", {})[impl] = (lambda c=call, p=exact: c(p), False, 0)
            out.setdefault(f"prefill {name} in graph", {})[impl] = (lambda c=call, p=exact: c(p), True, 10)
            out.setdefault(f"prefill {name} graph-plan", {})[impl] = (lambda c=call, p=padded: c(p), False, 0)
            out.setdefault(f"prefill {name} graph-plan in graph", {})[impl] = (lambda c=call, p=padded: c(p), True, 10)
            if per_pass:  # each pass alone (the other given an empty plan), kernels only
                for plans, kind in ((exact, ""), (padded, " graph-plan")):
                    compress_only, write_only = (plans[0], plans[1][:0]), (plans[0][:0], plans[1])
                    out.setdefault(f"prefill {name}{kind} compress pass", {})[impl] = (
                        lambda c=call, p=compress_only: c(p), True, 10)
                    out.setdefault(f"prefill {name}{kind} write pass", {})[impl] = (
                        lambda c=call, p=write_only: c(p), True, 10)
    if prefill_only:
        return out
    for batch in decode_batches:
        args, _ = bench.decode_case(head_dim, batch)
        for impl, m in impls.items():
            a = (args[0].to(state_dtypes[impl]), *args[1:])
            out.setdefault(f"decode B={batch}", {})[impl] = (lambda m=m, a=a: m.run_decode(*a, None), batch <= 4096,
                                                             100)
    for batch in VERIFY_BATCHES:
        args, _, _, _ = bench.verify_case(head_dim, batch, VERIFY_WINDOW)
        for impl, m in impls.items():
            if impl == "reference":  # the reference design has no speculative decoding
                continue
            a = (args[0].to(state_dtypes[impl]), *args[1:6], args[6].to(state_dtypes[impl]))
            out.setdefault(f"verify B={batch} T={VERIFY_WINDOW}", {})[impl] = (lambda m=m, a=a: m.run_verify(*a), True,
                                                                               20)
    return out


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int32 if tensor.element_size() == 4 else torch.int16)


#: --check-close: how far a variant that sums in another order may land from the tree: a few float32
#: roundings, relative to the value, or to 1 where the value is smaller (a mean of values of either
#: sign can cancel to near 0). Float32 states only: in a bfloat16 state a reordered sum can flip the
#: rounding of `max`, and `sum`, re-expressed against it, then moves by exp(one ulp of max), several
#: per cent; the order of the sums does not depend on the state dtype.
CLOSE_RTOL = 1e-5


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest ``|a - b| / max(|a|, 1)``, ``a`` the tree's: equal values (infinities too) and NaN
    against NaN (a row both left poisoned) are 0 apart; an infinity or NaN against anything else is
    infinitely far."""
    a64, b64 = a.double(), b.double()
    error = (a64 - b64).abs() / a64.abs().clamp_min(1.0)
    alike = (a64 == b64) | (a64.isnan() & b64.isnan())
    error = torch.where(alike, 0.0, error.nan_to_num(nan=float("inf")))
    return error.max().item() if error.numel() else 0.0


def _where_they_differ(expected: list[torch.Tensor], got: list[torch.Tensor], names: Sequence[str]) -> str:
    """For each result that is not bitwise the tree's: how many of its rows (first dimension: slots,
    output rows) differ, and the largest error among them; so that a failed check says what to look at."""
    parts = []
    for name, a, b in zip(names, expected, got):
        rows = (_bits(a) != _bits(b)).reshape(a.shape[0], -1).any(dim=1)
        if rows.any():
            parts.append(f"{name}: {int(rows.sum())} of {a.shape[0]} rows, max err {_max_error(a, b):.1e}")
    return "; ".join(parts)


def compare_results(expected: list[torch.Tensor], got: list[torch.Tensor], rtol: Optional[float] = None,
                    names: Sequence[str] = ("state", "out")) -> tuple[bool, str]:
    """Whether ``got`` matches ``expected`` (the results of one case, named by ``names``), and the word
    for it: "identical" bit for bit; with ``rtol``, "close (max err X)" where every value is within
    ``rtol * max(|value|, 1)`` of the tree's and NaN (an untouched, poisoned row) exactly where the
    tree's is; else "DIFFERENT (...)", naming the results that differ and in how many rows."""
    if all(torch.equal(_bits(a), _bits(b)) for a, b in zip(expected, got)):
        return True, "identical"
    different = (False, f"DIFFERENT ({_where_they_differ(expected, got, names)})")
    if rtol is None or any(not torch.equal(a.isnan(), b.isnan()) for a, b in zip(expected, got)):
        return different
    worst = max(_max_error(a, b) for a, b in zip(expected, got))
    return (True, f"close (max err {worst:.1e})") if worst <= rtol else different


def check_variants(impls: dict, head_dim: int, state_dtype: torch.dtype, close: bool = False,
                   decode_batches: Sequence[int] = bench.DECODE_BATCHES) -> int:
    """Runs the tree and every variant on the same inputs, each prefill on the plans of its own planner
    (as ``cases`` times it); prints, per case and variant, whether states and outputs are bitwise
    identical (or, with ``close``, within ``CLOSE_RTOL``); returns the number of differing (case, variant)."""
    variants = {name: m for name, m in impls.items() if name not in ("tree", "reference")}
    gen = torch.Generator().manual_seed(1)
    differing = 0

    def compare(case: str, run, names: Sequence[str] = ("state", "out")) -> None:
        nonlocal differing
        expected = run(impls["tree"])
        for name, m in variants.items():
            same, word = compare_results(expected, run(m), CLOSE_RTOL if close else None, names)
            differing += not same
            print(f"check {case:40} {name}: {word}", flush=True)

    # The bench cases, then one that reads every prior state from a slot no request writes, in
    # another order (load_indices).
    prefill_cases = [(case, False) for case in bench.PREFILL_CASES] + [(("7x333 + 5x1 other slots", 7, 333, True, 5),
                                                                        True)]
    for (name, batch, extend, random_prefix, singles), other_slots in prefill_cases:
        d, _, _, _ = bench.prefill_case(impls["tree"], head_dim, batch, extend, random_prefix, gen, singles)
        requests = len(d["extends"])
        load_indices = None
        if other_slots:
            d["state"] = torch.randn(2 * requests, 1, 3 * head_dim, device="cuda")
            load_indices = (requests + torch.randperm(requests, generator=gen)).to(torch.int32).cuda()
        for padded in (False, True):
            def run(m, d=d, padded=padded, load_indices=load_indices):
                plans = bench.plan(m, d["extends"], d["seq_lens"], padded)
                state = d["state"].to(state_dtype, copy=True)
                out = torch.full_like(d["out"], float("nan"))
                for _ in range(2):  # the second call starts from the states the first one stored
                    m.run_prefill(state, d["input"], out, d["ape"], d["indices"], *plans, load_indices)
                torch.cuda.synchronize()
                return state, out

            compare(f"prefill {name}" + (" graph-plan" if padded else ""), run)
    for batch in decode_batches:
        args, _ = bench.decode_case(head_dim, batch)

        def run(m, args=args):
            state, out = args[0].to(state_dtype, copy=True), torch.full_like(args[2], float("nan"))
            m.run_decode(state, args[1], out, *args[3:], None)
            torch.cuda.synchronize()
            return state, out

        compare(f"decode B={batch}", run)
    for batch in VERIFY_BATCHES:
        args, accept, _, _ = bench.verify_case(head_dim, batch, VERIFY_WINDOW)

        def run(m, args=args, accept=accept):
            state, prefix = args[0].to(state_dtype, copy=True), torch.full_like(args[6], float("nan"), dtype=state_dtype)
            out = torch.full_like(args[2], float("nan"))
            m.run_verify(state, args[1], out, *args[3:6], prefix)
            m.run_commit(state, prefix, args[4], accept)
            torch.cuda.synchronize()
            return state, prefix, out

        compare(f"verify + commit B={batch} T={VERIFY_WINDOW}", run, ("state", "prefix_states", "out"))
    return differing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", type=parse_variant, metavar="NAME=PATH")
    parser.add_argument("--head-dim", type=int, default=512)
    parser.add_argument("--reference", default=None, metavar="SEED", help="also time the reference design")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode-only", action="store_true")
    parser.add_argument("--state-dtype", choices=list(bench.STATE_DTYPES), default="float32")
    parser.add_argument("--per-pass", action="store_true",
                        help="also time each prefill pass alone, in graph, of exact and of padded plans")
    parser.add_argument("--prefill-only", action="store_true")
    parser.add_argument("--shapes", action="store_true", help="bench_shapes.py's prefill shapes, not bench.py's cases")
    parser.add_argument("--check", action="store_true", help="first compare every variant with the tree, bitwise")
    parser.add_argument("--check-close", action="store_true",
                        help="as --check, but within a rounding or so of each value: for a variant that sums in "
                             "another order (a slice-width rule)")
    parser.add_argument("--both-dtypes", action="store_true",
                        help="also time the tree with the other state dtype, in the same rounds (column 'tree DTYPE')")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=bench.DECODE_BATCHES, metavar="B",
                        help=f"decode batch sizes to time (default {' '.join(map(str, bench.DECODE_BATCHES))})")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    if args.check_close and args.state_dtype != "float32":
        parser.error("--check-close compares float32 states (see CLOSE_RTOL); run it with --state-dtype float32")
    if not torch.cuda.is_available():
        print("bench_variants.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.shapes:
        import bench_shapes

        bench.PREFILL_CASES = bench_shapes.SHAPES
    loaders = {"tree": lambda: flash_compress.load_module(args.head_dim, use_pdl=True, state_dtype=args.state_dtype)}
    state_dtypes = {"tree": bench.STATE_DTYPES[args.state_dtype], "reference": torch.float32}
    if args.both_dtypes:
        other = next(name for name in bench.STATE_DTYPES if name != args.state_dtype)
        loaders[f"tree {other}"] = lambda: flash_compress.load_module(args.head_dim, use_pdl=True, state_dtype=other)
        state_dtypes[f"tree {other}"] = bench.STATE_DTYPES[other]
    with tempfile.TemporaryDirectory(prefix="flash-compress-variants-") as source_root:
        for name, files in args.variants:
            state_dtypes[name] = state_dtypes["tree"]
            loaders[name] = lambda n=name, f=files: load_variant(n, f, args.head_dim, Path(source_root),
                                                                 args.state_dtype)
        if args.reference:
            from reference_design import load_reference

            loaders["reference"] = lambda: load_reference(args.reference, args.head_dim)
        with ThreadPoolExecutor() as pool:  # the builds are nvcc processes: run them side by side
            futures = {name: pool.submit(load) for name, load in loaders.items()}
            impls = {name: future.result() for name, future in futures.items()}
    same_dtype = {name: m for name, m in impls.items() if state_dtypes[name] == state_dtypes["tree"]}
    check = args.check or args.check_close
    if check and check_variants(same_dtype, args.head_dim, state_dtypes["tree"], close=args.check_close,
                                decode_batches=args.decode_batches):
        print("check: variants differ from the tree (above); nothing timed", file=sys.stderr)
        return 1
    timed = cases(impls, args.head_dim, args.decode_only, state_dtypes, args.per_pass,
                  args.decode_batches, args.prefill_only)
    rows = [(case, impl, call, in_graph, launches) for case, per_impl in timed.items()
            for impl, (call, in_graph, launches) in per_impl.items()]

    def measure(call, in_graph, launches) -> float:
        return 1e3 * (bench.graph_median_ms(call, launches=launches, iters=20) if in_graph else bench.median_ms(call))

    round_numbers = iter(range(1, args.rounds + 1))

    def print_table(results: list[list[float]]) -> None:
        """The table so far after every round, so that a run cut short still leaves its figures."""
        print(f"\n# after round {next(round_numbers)} of {args.rounds}: median (min) us per call")
        print(f"{'case':42} " + " ".join(f"{name:>18}" for name in impls))
        per_case: dict[str, list[list[float]]] = {}
        for (case, *_), times in zip(rows, results):
            per_case.setdefault(case, []).append(times)
        for case, per_impl in per_case.items():
            print(f"{case:42} " + " ".join(f"{statistics.median(v):9.2f} ({min(v):6.2f})" for v in per_impl),
                  flush=True)

    bench.timed_in_rounds([lambda row=row: measure(*row[2:]) for row in rows], args.rounds, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
