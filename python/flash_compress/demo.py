"""``python -m flash_compress demo``: build, run and check one DeepSeek-V4-sized job.

On a GPU it runs a chunked prefill (random prefixes, so segments start
mid-chunk) followed by decode steps through the compiled kernels, and checks
every emitted row and every live state against :mod:`flash_compress.reference`
run on the same GPU. Without a GPU it still builds the kernels (when a CUDA
toolkit is there), checks the compiled planner against the reference planner,
runs the reference on the CPU, and says what it skipped.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from .plan_rows import CHUNK_SIZE, decode_rows

__all__ = ["run_demo"]

HEAD_DIM = 512  # DeepSeek-V4's compressed KV width
TOLERANCE = 2e-5  # relative L2 error allowed against the float64 reference


def _say(message: str) -> None:
    print(message, flush=True)


def _load_kernels(head_dim: int):
    """Builds the variant on a cache miss (the loader reports the compile), then loads it;
    returns ``(module, seconds, "built" or "cache hit")``."""
    from . import jit
    from .c128_online import check_arch_list, resolve_use_pdl, spec

    arch = jit.cuda_arch_list()
    check_arch_list(arch)
    variant = spec(head_dim, resolve_use_pdl(None, arch))
    started = time.perf_counter()
    outcome = jit.ensure_built(variant, arch_list=arch)
    module = jit.load(variant, arch_list=arch)
    return module, time.perf_counter() - started, "built" if outcome.status == "built" else "cache hit"


@dataclass
class _Step:
    """One batched call: a prefill (extend_lens given) or a decode step."""

    seq_lens: list[int]
    extend_lens: list[int] | None
    tokens: Any  # [rows, 2*HEAD_DIM] float32


@dataclass
class _Schedule:
    ape: Any
    initial_state: Any
    steps: list[_Step] = field(default_factory=list)


def _make_schedule(torch, batch: int, prefill_len: int, decode_steps: int, seed: int) -> _Schedule:
    gen = torch.Generator().manual_seed(seed)
    schedule = _Schedule(
        ape=torch.randn(CHUNK_SIZE, HEAD_DIM, generator=gen),
        initial_state=torch.randn(batch, 1, 3 * HEAD_DIM, generator=gen),
    )
    prefixes = [int(x) for x in torch.randint(1, 3 * CHUNK_SIZE, (batch,), generator=gen)]
    lens = list(prefixes)
    schedule.steps.append(_Step(lens, list(prefixes), torch.randn(sum(prefixes), 2 * HEAD_DIM, generator=gen)))
    lens = [n + prefill_len for n in lens]
    schedule.steps.append(_Step(lens, [prefill_len] * batch, torch.randn(batch * prefill_len, 2 * HEAD_DIM, generator=gen)))
    for _ in range(decode_steps):
        lens = [n + 1 for n in lens]
        schedule.steps.append(_Step(lens, None, torch.randn(batch, 2 * HEAD_DIM, generator=gen)))
    return schedule


def _plan(impl, step: _Step):
    from .host_planner import plan_tensors

    return plan_tensors(impl, step.extend_lens, step.seq_lens)


def _emitted_rows(step: _Step, compress_plan) -> list[int]:
    if step.extend_lens is not None:
        return decode_rows(compress_plan)[:, 0].tolist()
    return [b for b, n in enumerate(step.seq_lens) if n % CHUNK_SIZE == 0]


def _run(impl, torch, schedule: _Schedule, device) -> tuple[list[Any], Any]:
    """Runs every step with `impl`; returns the emitted rows of each step and the final state."""
    state = schedule.initial_state.to(device)
    ape = schedule.ape.to(device)
    indices = torch.arange(state.shape[0], dtype=torch.int32, device=device)
    emitted = []
    for step in schedule.steps:
        tokens = step.tokens.to(device)
        out = torch.full((tokens.shape[0], HEAD_DIM), float("nan"), device=device)
        if step.extend_lens is None:
            seq_lens = torch.tensor(step.seq_lens, dtype=torch.int32, device=device)
            impl.run_decode(state, tokens, out, ape, indices, seq_lens, None)
            rows = _emitted_rows(step, None)
        else:
            compress_plan, write_plan = _plan(impl, step)
            impl.run_prefill(state, tokens, out, ape, indices, compress_plan.to(device), write_plan.to(device), None)
            rows = _emitted_rows(step, compress_plan)
        emitted.append(out[rows])
    return emitted, state


def _relative_error(got, want) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def _time_prefill(module, torch, schedule: _Schedule, device, iters: int = 20) -> float:
    """Median seconds of the main prefill (both passes) by CUDA events."""
    step = schedule.steps[1]
    state = schedule.initial_state.to(device)
    ape = schedule.ape.to(device)
    indices = torch.arange(state.shape[0], dtype=torch.int32, device=device)
    tokens = step.tokens.to(device)
    out = torch.empty(tokens.shape[0], HEAD_DIM, device=device)
    plans = [p.to(device) for p in _plan(module, step)]

    def call():
        module.run_prefill(state, tokens, out, ape, indices, *plans, None)

    for _ in range(3):
        call()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def run_demo(*, batch: int = 8, prefill_len: int = 4096, decode_steps: int = 300, seed: int = 0) -> int:
    """Runs the demo and prints a short report; returns 0 when every check passed."""
    import torch

    from . import reference
    from .c128_online import resolve_use_pdl
    from .jit import cuda_arch_list, find_nvcc

    has_gpu = torch.cuda.is_available()
    skipped: list[str] = []
    if not has_gpu:
        prefill_len, decode_steps = min(prefill_len, 2 * CHUNK_SIZE + 17), min(decode_steps, 130)
        skipped.append("GPU kernels (no CUDA GPU visible): the reference ran on the CPU instead")
    device = torch.device("cuda" if has_gpu else "cpu")
    where = torch.cuda.get_device_name() if has_gpu else "cpu"
    _say(f"flash-compress demo on {where}: head_dim {HEAD_DIM}, {batch} requests, "
         f"prefill {prefill_len} tokens each after random prefixes, then {decode_steps} decode steps")

    module = None
    if has_gpu or find_nvcc() is not None:
        arch = cuda_arch_list()
        _say(f"  variant: head_dim={HEAD_DIM} use_pdl={resolve_use_pdl(None, arch)} arch={' '.join(arch)}"
             " (first use compiles, about a minute; later runs load from the cache)")
        module, seconds, how = _load_kernels(HEAD_DIM)
        _say(f"  kernels: {how}, ready in {seconds:.2f} s")
    else:
        skipped.append("kernel build and compiled planner (no CUDA toolkit found)")

    schedule = _make_schedule(torch, batch, prefill_len, decode_steps, seed)
    if module is not None:
        for step in schedule.steps[:2]:
            same = all(torch.equal(a, b) for a, b in zip(_plan(reference, step), _plan(module, step)))
            if not same:
                _say("  planner: compiled plan differs from the reference plan -> FAIL")
                return 1
        _say("  planner: compiled plans == reference plans, byte for byte")

    started = time.perf_counter()
    ref_emitted, ref_state = _run(reference, torch, schedule, device)
    ref_seconds = time.perf_counter() - started
    num_rows = sum(len(rows) for rows in ref_emitted)
    if not has_gpu:
        ok = not any(torch.isnan(rows).any() for rows in ref_emitted) and not torch.isnan(ref_state).any()
        _say(f"  reference on cpu: {num_rows} compressed rows in {ref_seconds:.2f} s -> {'PASS' if ok else 'FAIL'}")
    else:
        emitted, state = _run(module, torch, schedule, device)
        torch.cuda.synchronize()
        if any(torch.isnan(rows).any() for rows in emitted):
            _say("  a row that must be written is NaN -> FAIL")
            return 1
        row_error = max(_relative_error(a, b) for a, b in zip(emitted, ref_emitted) if len(b))
        state_error = _relative_error(state, ref_state)
        ok = max(row_error, state_error) < TOLERANCE
        _say(f"  check: {num_rows} compressed rows, max relative error {row_error:.1e}; "
             f"states {state_error:.1e} (limit {TOLERANCE:.0e}) -> {'PASS' if ok else 'FAIL'}")
        seconds = _time_prefill(module, torch, schedule, device)
        tokens = batch * prefill_len
        moved = tokens * 2 * HEAD_DIM * 4 + (tokens // CHUNK_SIZE) * HEAD_DIM * 4 + 2 * batch * 3 * HEAD_DIM * 4
        _say(f"  throughput: prefill of {tokens} tokens in {seconds * 1e6:.1f} us = "
             f"{tokens / seconds / 1e6:.0f} M tokens/s, {moved / seconds / 1e9:.0f} GB/s (CUDA events, median of 20)")
    for line in skipped:
        _say(f"  skipped: {line}")
    _say(f"demo: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1
