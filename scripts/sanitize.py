#!/usr/bin/env python3
"""Runs compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over the kernels, PDL off and on.

    python scripts/sanitize.py --out sanitizer-logs            # all 4 tools x PDL 0/1
    python scripts/sanitize.py --out logs --tools memcheck --pdl 1

Each (tool, pdl) run sanitizes one short driver process (this script with
``--driver``) that loads the ``head_dim=128`` variant and runs, through
``tests/device_runner.py`` (host tensors in and out, so the only GPU work is
host<->device copies and our kernels; no torch kernel runs to report on):

1. a fixed schedule of ``tests/schedule.py``'s harness: decode (positions 0,
   mid-chunk and 127), prefill with compress and write rows, a slot move
   through ``load_indices``, a CUDA-graph padded plan, every result checked
   against the float64 oracle;
2. calls with values only the device sees (``tests/device_values.py``):
   slots outside the pool, seq_len < 1, spoilt plan rows, random plan bytes;
3. plans of ~1.2M padding rows around a few real ones, so every warp of a
   prefill pass loops over several batches of rows (on an H200 one round
   covers ~540K rows);
4. the bfloat16 variant (docs/SPEC.md sections 8-10): a schedule with compact
   prefills and speculative verify + commit steps (chunk boundaries inside the
   window), then verify + commit steps with values only the device sees
   (accepted lengths 0 or above T, slots outside the pool, seq_len < T); the
   float32 variant runs the same verify steps;
5. the fewest requests whose write-only step, and then whose compress pass,
   run 32-channel slices (one of the widths ``choose_slice_width`` picks
   from), then the fewest whose compress pass runs 128-channel ones (write
   passes run none that wide);
6. ``head_dim=192``, a head dim that is not a power of two (48 lanes a
   request in decode and verify, so blocks that are not whole warps), both
   state dtypes: a schedule with compact prefills and verify + commit steps
   (its passes of a few rows run 8 or 16-channel slices); then, float32, the
   fewest requests whose passes run 64-channel slices (3 a row), as in step
   5, and the device-only values of step 2.

torch's caching allocator is off in the driver (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``),
so every tensor is its own cudaMalloc and memcheck sees the exact bounds.
The variants are built (or found in the cache) before any sanitizer starts,
and the driver runs with ``FLASH_COMPRESS_DISABLE_JIT=1``, so no compiler runs
under the sanitizer.

Prints one line per run, e.g. ``memcheck pdl=1: 0 errors``, keeps the full
sanitizer log and the driver's output under ``--out``, and exits non-zero if
any run reports an error, the driver fails, or a run times out.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
HEAD_DIM = 128
#: Step 6's head dim: not a power of two.
ODD_HEAD_DIM = 192
DRIVER_OK = "SANITIZE DRIVER OK"

# Tool options: racecheck reports every hazard it sees; memcheck also checks
# device-side API calls. No leak check: torch does not free all of its
# allocations at exit, and leaks are not what this run is after.
TOOL_FLAGS = {
    "memcheck": ["--check-device-heap", "yes"],
    "racecheck": ["--racecheck-report", "all"],
    "initcheck": [],
    "synccheck": [],
}


# ---------------------------------------------------------------------------
# The driver: the GPU work each sanitizer run watches.
# ---------------------------------------------------------------------------


def _bad_values(run, head_dim: int) -> None:
    """Decode and prefill calls mixing good rows with values only the device sees, each checked against
    the reference on the rows the kernels keep (``tests/device_values.py``); ``run`` takes float32 pools."""
    import device_values as dv

    for seed in range(2):
        call = dv.bad_decode_call(seed, head_dim)
        buffer, output = call.buffer.clone(), call.output.clone()
        run.run_decode(buffer, call.inputs, output, call.ape, call.indices, call.seq_lens, None)
        dv.check_against_reference(call, buffer, output, f"head_dim {head_dim} bad decode {seed}")
        call = dv.bad_prefill_call(seed, head_dim)
        buffer, output = call.buffer.clone(), call.output.clone()
        run.run_prefill(*(buffer, call.inputs, output) + call.args()[3:])
        dv.check_against_reference(call, buffer, output, f"head_dim {head_dim} bad prefill {seed}")


def _slice_width_steps(run, head_dim: int, width: int, seed: int) -> None:
    """The fewest requests whose passes run `width`-channel slices: one write row each, then one
    compress and one write row each, against the oracle."""
    import torch

    from schedule import ScheduleHarness, rows_for_slice_width

    count = rows_for_slice_width(head_dim, torch.cuda.get_device_properties(0).multi_processor_count)[width]
    h = ScheduleHarness(run, head_dim=head_dim, device="cpu", seed=seed, num_slots=count + 1, max_requests=count)
    batch = [h.start_request() for _ in range(count)]
    h.prefill_step([(r, 60, None) for r in batch])
    h.prefill_step([(r, 128, None) for r in batch])
    h.check_live_states()
    print(f"head_dim {head_dim}, {width}-channel slices: {count} requests, {h.stats.rows_checked} rows checked",
          flush=True)


def _driver(use_pdl: bool) -> None:
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "python")]
    import torch

    import device_values as dv
    import flash_compress
    from device_runner import DeviceRunner
    from schedule import ScheduleHarness

    module = flash_compress.load_module(head_dim=HEAD_DIM, use_pdl=use_pdl)
    run = DeviceRunner(module)  # no guard zones: exact allocation bounds for memcheck
    bf16_run = DeviceRunner(flash_compress.load_module(head_dim=HEAD_DIM, use_pdl=use_pdl, state_dtype="bfloat16"))

    # 1. A fixed schedule covering every kernel path, checked against the oracle.
    h = ScheduleHarness(run, head_dim=HEAD_DIM, device="cpu", seed=3, num_slots=8)
    a, b, c = (h.start_request() for _ in range(3))
    h.prefill_step([(a, 200, None), (b, 127, None), (c, 1, None)])  # compress + write rows; b ends at 127
    h.decode_step([b, a, c])  # b closes a chunk (pos 127), a stores mid-chunk
    h.decode_step([b])  # b at pos 0: reset
    h.prefill_step([(a, 60, h.free_slots[0]), (c, 300, None)], use_cuda_graph=True)  # move a; padded plans
    h.prefill_step([(b, 5, None)], pass_load_indices=True)
    for _ in range(4):
        h.random_step()
    h.check_live_states()
    print(f"schedule: {h.stats.decode_calls} decode, {h.stats.prefill_calls} prefill calls, "
          f"{h.stats.rows_checked} rows checked", flush=True)

    # 2. Values only the device sees.
    _bad_values(run, HEAD_DIM)
    for seed in range(3):
        call = dv.random_bytes_call(seed, HEAD_DIM)
        run.run_prefill(*(call.buffer.clone(), call.inputs, call.output.clone()) + call.args()[3:])
    print("device-only values: done", flush=True)

    # 3. Plans long enough that every warp loops over several batches of rows.
    call = dv.long_padded_call(0, HEAD_DIM, rows=1_200_000)
    buffer, output = call.buffer.clone(), call.output.clone()
    run.run_prefill(*(buffer, call.inputs, output) + call.args()[3:])
    dv.check_against_reference(call, buffer, output, "long padded plans")

    # 4. bf16 pools, compact output, speculative verify + commit (float32 too).
    for runner, dtype in ((bf16_run, torch.bfloat16), (run, torch.float32)):
        h = ScheduleHarness(runner, head_dim=HEAD_DIM, device="cpu", seed=5, num_slots=10, state_dtype=dtype,
                            compact=True, verify_prob=0.4)
        batch = [h.start_request() for _ in range(4)]
        h.prefill_step([(r, 120 + i, None) for i, r in enumerate(batch)])  # lengths 120..123
        h.verify_step(batch, 8)  # every window crosses a chunk boundary
        h.verify_bad_values_step(batch, 5, kinds=["good", "accept", "slot", "seq_len"])
        for _ in range(6):
            h.random_step()
        h.check_live_states()
        print(f"{dtype}: {h.stats.prefill_calls} prefill ({h.stats.compact_calls} compact), "
              f"{h.stats.decode_calls} decode calls, verify steps done", flush=True)

    # 5. 32-channel slices, and 128-channel ones (compress passes only).
    _slice_width_steps(run, HEAD_DIM, 32, seed=6)
    _slice_width_steps(run, HEAD_DIM, 128, seed=9)

    # 6. A head dim that is not a power of two, both state dtypes.
    odd_runs = {state_dtype: DeviceRunner(flash_compress.load_module(head_dim=ODD_HEAD_DIM, use_pdl=use_pdl,
                                                                     state_dtype=state_dtype))
                for state_dtype in flash_compress.c128_online.STATE_DTYPES}
    for state_dtype, odd in odd_runs.items():
        h = ScheduleHarness(odd, head_dim=ODD_HEAD_DIM, device="cpu", seed=7, num_slots=8,
                            state_dtype=getattr(torch, state_dtype), compact=True, verify_prob=0.3)
        for _ in range(8):
            h.random_step()
        h.check_live_states()
        print(f"head_dim {ODD_HEAD_DIM} {state_dtype}: {h.stats.prefill_calls} prefill, {h.stats.decode_calls} "
              f"decode, {h.stats.verify_calls} verify calls", flush=True)
    _slice_width_steps(odd_runs["float32"], ODD_HEAD_DIM, 64, seed=8)
    _bad_values(odd_runs["float32"], ODD_HEAD_DIM)  # float32 pools: step 2's device-only values
    torch.cuda.synchronize()
    print(DRIVER_OK, flush=True)


# ---------------------------------------------------------------------------
# The runs.
# ---------------------------------------------------------------------------


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "compute-sanitizer").is_file():
            return str(Path(home) / "bin" / "compute-sanitizer")
    return None


def _prebuild(pdl_values: list[int]) -> None:
    """Builds (or finds cached) every variant the runs load, outside any sanitizer."""
    sys.path.insert(0, str(ROOT / "python"))
    import flash_compress

    for pdl in pdl_values:
        for state_dtype in flash_compress.c128_online.STATE_DTYPES:
            for head_dim in (HEAD_DIM, ODD_HEAD_DIM):
                flash_compress.load_module(head_dim=head_dim, use_pdl=bool(pdl), state_dtype=state_dtype)


# racecheck ends with "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)";
# the other tools with "ERROR SUMMARY: N errors". Any hazard counts as an error.
_SUMMARY = re.compile(r"(?:ERROR SUMMARY:\s*(\d+)\s+error|RACECHECK SUMMARY:\s*(\d+)\s+hazard)")


def _run_one(sanitizer: str, tool: str, pdl: int, out: Path, timeout: float, target_processes: str) -> tuple[bool, str]:
    """One sanitized driver run; returns (clean, summary line)."""
    stem = f"{tool}_pdl{pdl}"
    log = out / f"{stem}.log"
    command = [sanitizer, "--tool", tool, "--target-processes", target_processes, "--log-file", str(log),
               *TOOL_FLAGS[tool], sys.executable, str(Path(__file__).resolve()), "--driver", "--pdl", str(pdl)]
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", FLASH_COMPRESS_DISABLE_JIT="1")
    start = time.monotonic()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as expired:
        rc, stdout, stderr = None, expired.stdout or "", expired.stderr or ""
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
        stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
    seconds = time.monotonic() - start
    (out / f"{stem}.stdout").write_text(f"$ {' '.join(command)}\n{stdout}\n--- stderr ---\n{stderr}")
    text = log.read_text(errors="replace") if log.exists() else ""
    match = _SUMMARY.search(text)
    label = f"{tool} pdl={pdl}:"
    if rc is None:
        return False, f"{label} TIMEOUT after {seconds:.0f}s (log {log})"
    if match is None:
        return False, f"{label} no sanitizer summary (exit {rc}; see {log} and {stem}.stdout)"
    errors = int(match.group(1) or match.group(2))
    driver_ok = DRIVER_OK in stdout
    line = f"{label} {errors} errors ({seconds:.0f}s)"
    if not driver_ok or rc != 0:
        line += f"; driver failed (exit {rc}; see {out / (stem + '.stdout')})"
    return errors == 0 and driver_ok and rc == 0, line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="directory for the logs (created)")
    parser.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    parser.add_argument("--pdl", nargs="+", type=int, choices=(0, 1), default=[0, 1])
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per sanitizer run")
    parser.add_argument("--target-processes", default="all", choices=("all", "application-only"))
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.driver:
        _driver(bool(args.pdl[0]))
        return 0
    if args.out is None:
        parser.error("--out is required")
    sanitizer = find_sanitizer()
    if sanitizer is None:
        print("compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    _prebuild(args.pdl)
    clean = True
    lines = []
    for tool in args.tools:
        for pdl in args.pdl:
            ok, line = _run_one(sanitizer, tool, pdl, args.out, args.timeout, args.target_processes)
            print(line, flush=True)
            lines.append(line)
            clean &= ok
    (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("all clean" if clean else "SANITIZER ERRORS (see the logs)", flush=True)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
