"""Command line: ``python -m flash_compress {demo,prebuild,status,clear}``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from .c128_online import HEAD_DIMS_TESTED, STATE_DTYPES, check_arch_list, planner_spec, resolve_use_pdl, spec

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flash_compress",
        description="flash-compress: DeepSeek-V4's online c128 KV compressor, JIT-compiled with tvm-ffi.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser("demo", help="build the kernels, run a DeepSeek-V4-sized job and check it")
    demo.add_argument("--batch", type=int, default=8, help="requests (default 8)")
    demo.add_argument("--prefill-len", type=int, default=4096, help="new tokens per request (default 4096)")
    demo.add_argument("--decode-steps", type=int, default=300, help="decode steps after the prefill (default 300)")
    demo.add_argument("--seed", type=int, default=0)

    prebuild = commands.add_parser("prebuild", help="compile the planner and a grid of kernel variants into the cache (no GPU needed)")
    prebuild.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS_TESTED),
                          help=f"default: {' '.join(map(str, HEAD_DIMS_TESTED))}")
    prebuild.add_argument("--pdl", type=int, nargs="+", choices=[0, 1], default=None,
                          help="default: 0 1 (0 alone where an arch is older than sm_90, which has no PDL)")
    prebuild.add_argument("--state-dtype", nargs="+", choices=list(STATE_DTYPES), default=list(STATE_DTYPES),
                          help=f"default: {' '.join(STATE_DTYPES)}")
    prebuild.add_argument("--planner-only", action="store_true", help="build the planner alone, no kernel variant")
    prebuild.add_argument("--arch", nargs="+", default=None, help='CUDA archs, e.g. 9.0 10.0 (default: as the loader)')
    prebuild.add_argument("--jobs", type=int, default=None, help="parallel builds (default: CPU count)")
    prebuild.add_argument("--cache-dir", default=None,
                          help="cache folder (default: $FLASH_COMPRESS_CACHE_DIR, else the user cache folder)")

    status = commands.add_parser("status", help="list what the cache holds")
    status.add_argument("--cache-dir", default=None)
    status.add_argument("--state-dtype", choices=list(STATE_DTYPES), default=None,
                        help="only kernel variants of this state dtype")

    clear = commands.add_parser("clear", help="delete cached builds")
    clear.add_argument("--cache-dir", default=None)
    clear.add_argument("--name", default=None, help="only entries whose variant name starts with this")
    clear.add_argument("--state-dtype", choices=list(STATE_DTYPES), default=None,
                       help="only kernel variants of this state dtype")
    return parser


def _state_dtype_filter(state_dtype: str | None):
    """Kernel variant names end in their state dtype's tag (``c128_online_hd512_pdl1_bf16``)."""
    if state_dtype is None:
        return None
    suffix = "_" + STATE_DTYPES[state_dtype][1]
    return lambda name: name.endswith(suffix)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(batch=args.batch, prefill_len=args.prefill_len, decode_steps=args.decode_steps, seed=args.seed)

    from . import jit
    from .jit import cli

    if args.command == "prebuild":
        from .jit.toolchain import normalize_arch_list

        unique = lambda values: list(dict.fromkeys(values))  # noqa: E731 (in the order given, once each)
        try:  # the whole grid, before any build
            targets = normalize_arch_list(args.arch) if args.arch else jit.cuda_arch_list()
            check_arch_list(targets)
            pdls = unique(args.pdl) if args.pdl is not None else [0, 1] if resolve_use_pdl(None, targets) else [0]
            for pdl in pdls:
                resolve_use_pdl(bool(pdl), targets)  # PDL needs sm_90: --pdl 1 with an older arch is refused
            grid = [(f"planner pdl={pdl}", planner_spec(bool(pdl))) for pdl in pdls]
            grid += [
                (f"head_dim={head_dim} pdl={pdl} state={state}", spec(head_dim, bool(pdl), state))
                for head_dim in ([] if args.planner_only else unique(args.head_dim))
                for pdl in pdls
                for state in unique(args.state_dtype)
            ]
        except ValueError as exc:
            print(f"prebuild: {exc}", file=sys.stderr)
            return 2

    try:  # a cache dir that cannot be resolved (no home, a bad FLASH_COMPRESS_CACHE_DIR): its message, no traceback
        if args.command == "prebuild":
            return cli.prebuild(grid, arch_list=targets, jobs=args.jobs, cache_dir=args.cache_dir)
        if args.command == "status":
            return cli.status(cache_dir=args.cache_dir, match=_state_dtype_filter(args.state_dtype))
        return cli.clear(cache_dir=args.cache_dir, name_prefix=args.name, match=_state_dtype_filter(args.state_dtype))
    except (ValueError, jit.JitError) as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
