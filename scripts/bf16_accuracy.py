"""How much accuracy a bfloat16 state pool costs (docs/SPEC.md section 8; numbers quoted in docs/USAGE.md).

Runs the CPU reference (float64 arithmetic, bf16 stores emulated) with a
bfloat16 state pool over the schedules of ``tests/accuracy.py`` and prints,
per schedule kind and store scheme, the error against the float64 offline
chunk softmax: per emitted row ``max_d |got - want| / max_d |want|`` (max and
99th percentile over the rows), and per stored state the error of ``kv`` (same
measure) and of ``max + log(sum)`` (absolute). Two schemes:

- ``exact``: the kernels' scheme (``exact_bf16_stores=True``): the max is
  rounded to bf16 first and the sum re-expressed against it before rounding;
- ``naive``: each of max, sum and kv cast to bf16 on its own, for comparison.

It ends with the rate at which a float32-arithmetic stand-in for the kernels
(``tests/float32_model.py``) stores bf16 states that are not bitwise those of
the reference (what the schedule harness's ``shadow`` check allows).

CPU only, deterministic (fixed seeds), about 10 s on two cores::

    python scripts/bf16_accuracy.py                 # head_dim 64 and 512
    python scripts/bf16_accuracy.py --head-dim 512 --seeds 6
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests")]

import torch  # noqa: E402

import accuracy  # noqa: E402
import oracle  # noqa: E402
from flash_compress import reference  # noqa: E402
from float32_model import Float32Model  # noqa: E402
from schedule import ScheduleHarness  # noqa: E402

#: Upstream's published errors for the same kinds (naive scheme), which the exact scheme must beat.
UPSTREAM = {"extend": 8.3e-3, "decode_1": 5.9e-3}


def flip_rate(head_dim: int, seeds: int) -> tuple[int, int]:
    """(differing, compared) bf16 state elements: the float32 stand-in against the reference, mixed schedules."""
    flips = elements = 0
    for seed in range(seeds):
        h = ScheduleHarness(Float32Model(), head_dim=head_dim, seed=seed, state_dtype=torch.bfloat16, compact=None,
                            shadow=reference, decode_prob=0.7, tolerances=oracle.Tolerances.unchecked())
        stats = h.run(60)
        flips, elements = flips + stats.shadow_flips, elements + stats.shadow_state_elements
    return flips, elements


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--seeds", type=int, default=None, help="seeds per case (default: each case's own)")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    schemes = {"exact": reference, "naive": accuracy.naive_reference()}
    start = time.perf_counter()
    worst: dict[str, dict[str, float]] = {}
    print(f"{'case':12} {'scheme':6} {'D':>4} {'rows':>5} {'row max':>9} {'row p99':>9} "
          f"{'kv max':>9} {'lse max':>9} {'lse p99':>9}")
    for d in args.head_dim:
        for name, case in accuracy.CASES.items():
            for scheme, impl in schemes.items():
                s = case.measure(impl, head_dim=d, seeds=args.seeds).summary()
                print(f"{name:12} {scheme:6} {d:4} {s['n_rows']:5} {s['rows_max']:9.2e} {s['rows_p99']:9.2e} "
                      f"{s['kv_max']:9.2e} {s['lse_max']:9.2e} {s['lse_p99']:9.2e}")
                w = worst.setdefault(f"{name}/{scheme}", {})
                for key in ("rows_max", "rows_p99", "kv_max", "lse_max"):
                    w[key] = max(w.get(key, 0.0), s[key])
    print("\nworst over head_dims (exact vs naive), upstream's naive number where it published one:")
    for name in accuracy.CASES:
        e, n = worst[f"{name}/exact"], worst[f"{name}/naive"]
        up = f"   upstream {UPSTREAM[name]:.1e}" if name in UPSTREAM else ""
        print(f"  {name:12} row max {e['rows_max']:.2e} vs {n['rows_max']:.2e}   "
              f"row p99 {e['rows_p99']:.2e} vs {n['rows_p99']:.2e}   lse max {e['lse_max']:.2e} vs "
              f"{n['lse_max']:.2e}{up}")
    bounds = oracle.BFLOAT16
    print(f"\ntest bounds (tests/oracle.py): row {bounds.row_rtol:.1e}, state kv {bounds.kv_rtol:.1e}, "
          f"lse {bounds.lse_tol:.1e}; per case (max, p99): "
          + ", ".join(f"{k} ({b.max:.1e}, {b.p99:.1e})" for k, b in oracle.BF16_ROW_BOUNDS.items()))
    flips, elements = flip_rate(min(args.head_dim), 3)
    print(f"float32 stand-in vs reference: {flips} of {elements} bf16 state elements differ "
          f"({flips / max(elements, 1):.1e}; the shadow check allows 1e-3)")
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
