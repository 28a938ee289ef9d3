"""The kernel headers under the real nvcc (no GPU needed): each compiles on its own, and a build for
an arch the kernels cannot run on stops with one clear line, at the boundary and in the compiler."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import flash_compress
from flash_compress import jit
from flash_compress._paths import source_roots
from flash_compress.c128_online import STATE_DTYPES, check_arch_list, spec
from flash_compress.jit.toolchain import find_nvcc

ROOT = Path(__file__).resolve().parents[1]
# Kernel files and the header library, each as a kernel or a user would include it.
HEADERS = sorted(str(path.relative_to(root)) for root, folder in ((ROOT / "csrc", "deepseek_v4"),
                                                                   (ROOT / "include", "sgl_kernel"))
                 for path in (root / folder).rglob("*") if path.suffix in (".h", ".cuh"))

# docs/SPEC.md section 6: the header library, every name used once (host and device).
LIBRARY_SURFACE = """
#include <sgl_kernel/deepseek_v4/compress.cuh>
#include <sgl_kernel/runtime.cuh>
#include <sgl_kernel/tensor.h>
#include <sgl_kernel/tile.cuh>
#include <sgl_kernel/type.cuh>
#include <sgl_kernel/utils.cuh>
#include <sgl_kernel/utils.h>
#include <sgl_kernel/vec.cuh>
#include <sgl_kernel/warp.cuh>

__global__ void surface(const float* in, float* out, device::bf16_t* half_out) {
  using Vec = device::AlignedVector<float, 4>;
  device::PDLWaitPrimary<true>();
  const auto tile = device::tile::Memory<Vec>::cta(blockDim.x);
  Vec v = tile.load(in, 0);
  v[0] = device::warp::reduce_max<8>(v[0]) + device::warp::reduce_sum<device::kWarpThreads>(v[1]);
  tile.store(out, v, 0);
  half_out[threadIdx.x] = device::cast<device::bf16_t>(v[0]);
  // The read-only load at each vector size it maps to a word for: 16, 8, 4 and 2 bytes.
  v.load_read_only(in, threadIdx.x);
  device::AlignedVector<device::bf16_t, 4> halves;
  halves.load_read_only(in, threadIdx.x);
  device::AlignedVector<float, 1> one;
  one.load_read_only(in, threadIdx.x);
  device::AlignedVector<device::bf16_t, 1> half;
  half.load_read_only(in, threadIdx.x);
  out[threadIdx.x] = v[1] + device::cast<float>(halves[2]) + one[0] + device::cast<float>(half[0]);
  device::PDLTriggerSecondary<true>();
}

int64_t host_surface(int64_t n) {
  int64_t total = 0;
  for (auto i : host::irange(n)) total += i;
  for (auto i : host::irange(2, n)) total += i;
  host::RuntimeCheck(total >= 0, "total ", total);
  if (n < 0) host::Panic("negative n ", n);
  return total + sizeof(device::compress::PrefillPlan) + host::compress::kPrefillPlanDim;
}
"""

needs_nvcc = pytest.mark.skipif(find_nvcc() is None,
                                reason="no nvcc found ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda, nvcc on PATH)")


def compile_alone(source: str, arch: str, tmp_path: Path,
                  flags: tuple[str, ...] = ("-std=c++20", "-O0", "--expt-relaxed-constexpr"),
                  executable: bool = False) -> subprocess.CompletedProcess:
    """Compiles `source` as one translation unit for `arch` (e.g. "90"): an object, or with
    `executable` a program at `tmp_path / "unit"`."""
    import tvm_ffi.libinfo

    unit = tmp_path / "unit.cu"
    unit.write_text(source)
    includes = [f"-I{path}" for path in (*source_roots(), *tvm_ffi.libinfo.include_paths())]
    command = [str(find_nvcc()), *(() if executable else ("-c",)), f"-gencode=arch=compute_{arch},code=sm_{arch}",
               *flags, *includes, str(unit), "-o", str(tmp_path / ("unit" if executable else "unit.o"))]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def run_program(source: str, tmp_path: Path, stdin: str = "") -> list[tuple[int, ...]]:
    """Compiles `source` as a host program, runs it on `stdin` and returns its output lines as ints."""
    result = compile_alone(source, "90", tmp_path, executable=True)
    assert result.returncode == 0, result.stdout + result.stderr
    run = subprocess.run([str(tmp_path / "unit")], input=stdin, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return [tuple(int(x) for x in line.split()) for line in run.stdout.splitlines()]


def ptxas_usage(report: str) -> dict[str, tuple[int, int]]:
    """Mangled entry-function name -> (registers, bytes of spill stores), from `--resource-usage`."""
    usage: dict[str, tuple[int, int]] = {}
    entry, spills = None, 0
    for line in report.splitlines():
        if found := re.search(r"Compiling entry function '([^']+)'", line):
            entry, spills = found.group(1), 0
        elif entry and (found := re.search(r"(\d+) bytes spill stores", line)):
            spills = int(found.group(1))
        elif entry and (found := re.search(r"Used (\d+) registers", line)):
            usage[entry] = (int(found.group(1)), spills)
            entry = None
    return usage


@needs_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("header", HEADERS)
def test_each_header_compiles_on_its_own(header, tmp_path):
    """Each file includes what it uses, so a kernel file can be read, edited and benchmarked alone."""
    result = compile_alone(f"#include <{header}>\n", "90", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_nvcc
@pytest.mark.nvcc
def test_the_header_library_surface_compiles(tmp_path):
    """Every helper the contract names for the header library, used once: the kernels use only some."""
    result = compile_alone(LIBRARY_SURFACE, "90", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# RuntimeCheck and Panic in every form the contract allows, one call a line.
CHECKS_PROGRAM = """#include <sgl_kernel/utils.h>
#include <atomic>
#include <cstdio>
#include <vector>
struct Flag { bool set; operator bool() const { return set; } };
template <class F> void report(F f) {
  try { f(); std::printf("no error\\n"); }
  catch (const tvm::ffi::Error& e) { std::printf("%s|%s\\n", e.kind().c_str(), e.message().c_str()); }
}
int main() {
  bool ok = false; const int* null = nullptr; std::string text = "a message";
  std::atomic<bool> atomic{false}; std::vector<bool> bits(1, false); Flag flag{false};
  report([&] { host::RuntimeCheck(ok); });
  report([&] { host::RuntimeCheck((ok), "x=", 3); });
  report([&] { host::RuntimeCheck(null, "pointer"); });
  report([&] { host::RuntimeCheck(!ok, "never"); });
  report([&] { host::RuntimeCheck(atomic, "atomic"); });
  report([&] { host::RuntimeCheck(bits[0], "bit"); });
  report([&] { host::RuntimeCheck(flag, "flag"); });
  report([&] { host::Panic(text); });
  report([&] { host::Panic("n=", 5, ' ', 2.5); });
  report([&] { host::Panic(); });
}
"""
CHECKS_FIRST_LINE = next(n for n, line in enumerate(CHECKS_PROGRAM.splitlines(), 1) if "report([&]" in line)


@needs_nvcc
@pytest.mark.nvcc
def test_runtime_check_and_panic_take_every_argument_form_and_name_the_callers_line(tmp_path):
    """A lone condition or message compiles (as class templates, `RuntimeCheck(ok);` declared a variable),
    so does any condition a `bool` parameter takes, and each error names the line of its call."""
    import tvm_ffi.libinfo

    lib_dir = Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent
    flags = ("-std=c++20", "-O0", f"-L{lib_dir}", "-ltvm_ffi", f"-Xlinker=-rpath,{lib_dir}")
    result = compile_alone(CHECKS_PROGRAM, "90", tmp_path, flags=flags, executable=True)
    assert result.returncode == 0, result.stdout + result.stderr
    run = subprocess.run([str(tmp_path / "unit")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    where = [f" [{tmp_path / 'unit.cu'}:{CHECKS_FIRST_LINE + i}]" for i in range(10)]
    assert run.stdout.splitlines() == [
        "RuntimeError|" + where[0], "RuntimeError|x=3" + where[1], "RuntimeError|pointer" + where[2], "no error",
        "RuntimeError|atomic" + where[4], "RuntimeError|bit" + where[5], "RuntimeError|flag" + where[6],
        "RuntimeError|a message" + where[7], "RuntimeError|n=5 2.5" + where[8], "RuntimeError|" + where[9]]


@needs_nvcc
@pytest.mark.nvcc
def test_an_arch_without_cp_async_stops_with_one_clear_line(tmp_path):
    result = compile_alone("#include <sgl_kernel/async_copy.cuh>\n__global__ void k() {}\n", "75", tmp_path)
    assert result.returncode != 0
    first_error = next(line for line in (result.stdout + result.stderr).splitlines() if "error" in line)
    assert "cp.async needs sm_80 or newer" in first_error, first_error


def kernel_usage(head_dim: int, tmp_path: Path) -> dict[str, tuple[int, int]]:
    """ptxas's (registers, spill bytes) for every kernel of both state dtypes' PDL variants at ``head_dim``,
    built with the loader's flags; each of the four kernels must be there for both dtypes."""
    instances = "".join(f"template struct flash_compress::c128::C128Online<{head_dim}, true, {cxx}>;\n"
                        for cxx, _ in STATE_DTYPES.values())
    flags = (*spec(head_dim, True).extra_cuda_cflags, "--resource-usage")
    result = compile_alone("#include <deepseek_v4/c128_online.cuh>\n" + instances, "90", tmp_path, flags)
    assert result.returncode == 0, result.stdout + result.stderr
    usage = ptxas_usage(result.stdout + result.stderr)
    for kernel in ("c128_decode_kernel", "c128_prefill_kernel", "c128_verify_kernel", "c128_commit_kernel"):
        assert sum(kernel in name for name in usage) >= 2, (kernel, sorted(usage))
    return usage


@needs_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("head_dim", [64, 128, 192, 512, 1024])
def test_kernels_fit_the_registers_their_launch_shapes_assume(head_dim, tmp_path):
    """No kernel spills at the build's flags, at head dims that are powers of two and at one that
    is not (192: 48 lanes a request in decode and verify, slices that do not fill powers of two),
    and bfloat16 decode fits 32 registers: its `__launch_bounds__` asks for 2048 threads per SM,
    which is what made it faster (PERF_LOG.md). Every kernel builds at both state dtypes
    (`kernel_usage`). (Until the twenty-third session the prefill spilled 16 bytes at head_dim 192
    and in head_dim 64's write pass; selects instead of branches in `absorb_tokens` freed the
    registers.)"""
    usage = kernel_usage(head_dim, tmp_path)
    spilling = {name: spills for name, (_, spills) in usage.items() if spills}
    assert not spilling, spilling
    bf16_decode = {name: regs for name, (regs, _) in usage.items()
                   if "c128_decode_kernel" in name and "bfloat16" in name}
    if head_dim & (head_dim - 1) == 0:  # DecodeLayout::kFullOccupancy
        assert bf16_decode and max(bf16_decode.values()) <= 32, bf16_decode


# The end of a host program whose `print_layouts<kHeadDim>()` prints a line per supported head dim: it is
# called at 64, 128, ..., 1024, in order.
EVERY_HEAD_DIM_MAIN = """
template <int64_t... kSteps>
void print_all(std::integer_sequence<int64_t, kSteps...>) {
  (print_layouts<64 * (kSteps + 1)>(), ...);
}

int main() {
  print_all(std::make_integer_sequence<int64_t, 16>{});
  return 0;
}
"""


# Prints, per supported head dim, the thread layouts of decode, verify and commit:
# "head_dim lanes verify_threads verify_requests decode_max_threads decode_min_requests decode_max_requests
#  commit_threads_per_row_f32 commit_threads_per_row_bf16".
LAYOUT_PROGRAM = """
#include <deepseek_v4/c128_decode.cuh>
#include <deepseek_v4/c128_verify.cuh>

#include <cstdio>
#include <utility>

using namespace flash_compress::c128;

template <int64_t kHeadDim>
void print_layouts() {
  using Decode = DecodeLayout<kHeadDim, float>;
  using Verify = VerifyLayout<kHeadDim>;
  std::printf("%lld %u %u %u %u %u %u %u %u\\n", static_cast<long long>(kHeadDim), Verify::kLanes, Verify::kThreads,
              Verify::kRequestsPerBlock, Decode::kMaxThreads, Decode::kMinRequestsPerBlock,
              Decode::kMaxRequestsPerBlock, CommitLayout<kHeadDim, float>::kThreadsPerRow,
              CommitLayout<kHeadDim, device::bf16_t>::kThreadsPerRow);
}
"""


@needs_nvcc
@pytest.mark.nvcc
def test_decode_and_verify_blocks_tile_their_requests_at_every_head_dim(tmp_path):
    """A request's lanes (head_dim / 4 threads, 4 channels each) never straddle blocks and no thread is left
    over to fall onto the next block's request, at every supported head dim; a decode block is at least a
    warp; commit's threads split a row into whole pieces."""
    rows = run_program(LAYOUT_PROGRAM + EVERY_HEAD_DIM_MAIN, tmp_path)
    assert [row[0] for row in rows] == list(range(64, 1025, 64))
    for head_dim, lanes, threads, requests, decode_max, decode_min, decode_most, commit_f32, commit_bf16 in rows:
        assert lanes == head_dim // 4
        assert requests >= 1 and threads == requests * lanes <= 1024, (head_dim, threads, requests)
        assert decode_min * lanes >= 32 and decode_most * lanes <= decode_max <= 1024, head_dim
        assert 3 * head_dim * 4 == commit_f32 * 4 * 16 and 3 * head_dim * 2 == commit_bf16 * 4 * 16, head_dim


# Prints, per supported head dim and prefill slice width a pass there may run (`slice_fits`): "head_dim
# slice_dim ring_bytes threads min_blocks_per_sm".
PREFILL_RING_PROGRAM = """
#include <deepseek_v4/c128_slice_width.cuh>

#include <cstdio>
#include <utility>

using namespace flash_compress::c128;

template <int64_t kHeadDim>
void print_layouts() {
  per_slice_width([]<class Width>(Width) {
    if constexpr (slice_fits<kHeadDim, /*kWritePass=*/false>(Width::kDim)) {
      using Layout = PrefillLayout<kHeadDim, Width::kDim>;
      std::printf("%lld %u %u %u %u\\n", static_cast<long long>(kHeadDim), Width::kDim, Layout::kRingBytes,
                  Layout::kThreads, Layout::kMinBlocksPerSM);
    }
    return 0;
  });
}
"""

#: An sm_90 SM's shared memory (H100, H200) and what each resident block reserves of it.
SM90_SHARED_BYTES, SM90_RESERVED_PER_BLOCK = 228 * 1024, 1024


@needs_nvcc
@pytest.mark.nvcc
def test_prefill_rings_let_the_blocks_the_width_rule_counts_fit(tmp_path):
    """The host counts at most `kMinBlocksPerSM` prefill blocks an SM for the width rule, as the GPU
    tests' mirror does (8 blocks of 2 warps, `schedule.prefill_pass`); their token rings must let that
    many fit an sm_90 SM, or the rule would plan grids the hardware cannot hold at once (a ring that
    also holds the bias rows, `kBiasInRing`, is 24 KiB: 8 fit, with 28 KiB to spare). Where they fit,
    `C128Online::ring_smem` pads each block's shared memory up to an SM's over 8, so that no ninth
    block fits either."""
    from schedule import slice_widths

    rows = run_program(PREFILL_RING_PROGRAM + EVERY_HEAD_DIM_MAIN, tmp_path)
    assert {(row[0], row[1]) for row in rows} == {(h, w) for h in range(64, 1025, 64) for w in slice_widths(h)}
    for head_dim, slice_dim, ring_bytes, threads, blocks in rows:
        assert blocks == 8 and threads == 64, (head_dim, slice_dim)
        assert blocks * (ring_bytes + SM90_RESERVED_PER_BLOCK) <= SM90_SHARED_BYTES, (head_dim, slice_dim, ring_bytes)


def shared_facts_program() -> str:
    """A unit that compiles only where the C++ homes of the facts Python also needs hold Python's values."""
    from flash_compress.c128_online import is_supported_head_dim
    from flash_compress.plan_rows import CHUNK_SIZE, MAX_LENGTH, PADDING_ROW, ROW_BYTES, PlanError
    from flash_compress.reference import MAX_VERIFY_TOKENS

    checks = [
        ("device::compress::kC128ChunkSize", CHUNK_SIZE),
        ("device::compress::kPrefillPlanBytes", ROW_BYTES),
        ("device::compress::kPlanSentinel", PADDING_ROW),
        ("device::compress::kMaxPlanLength", MAX_LENGTH),
        ("flash_compress::c128::kMaxVerifyTokens", MAX_VERIFY_TOKENS),
        *((f"flash_compress::c128::kPlanError{''.join(w.title() for w in bit.name.split('_'))}", int(bit))
          for bit in PlanError),
        *((f"flash_compress::c128::kSupportedHeadDim<{d}>", int(is_supported_head_dim(d))) for d in range(0, 1281, 32)),
    ]
    asserts = "".join(f'static_assert({name} == {value}LL, "{name} != {value}");\n' for name, value in checks)
    return "#include <deepseek_v4/c128_online.cuh>\n" + asserts


@needs_nvcc
@pytest.mark.nvcc
def test_python_and_cpp_agree_on_the_shared_facts(tmp_path):
    """One home per fact in each language (plan_rows.py, compress.cuh): the chunk size, the plan row's
    size, padding value and length limit, the GPU planner's error bits, the most verify tokens and
    the head dims a variant builds for."""
    program = shared_facts_program()
    assert program.count("static_assert") == 9 + 41
    result = compile_alone(program, "90", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# Prints choose_slice_width's (width, grid, chain) for each line of stdin, "head_dim rows likely_rows
# padding resident write_pass beside_rows leave_half" (write_pass 0: a compress pass; beside_rows 0: no
# compress pass beside; else its rows, all likely, no padding; leave_half: that of the compress pass,
# the line's or the one beside).
SLICE_WIDTH_PROGRAM = """
#include <deepseek_v4/c128_slice_width.cuh>

#include <array>
#include <cstdio>

using flash_compress::c128::SliceOption;

template <int64_t kHeadDim>
SliceOption choose(bool write_pass, long long rows, long long likely, long long padding, long long resident,
                   const SliceOption* beside, bool leave_half) {
  std::array<int64_t, flash_compress::c128::kNumSliceDims> every_width;
  every_width.fill(resident);
  return write_pass ? flash_compress::c128::choose_slice_width<kHeadDim, true>(rows, likely, padding, every_width,
                                                                               beside, false)
                    : flash_compress::c128::choose_slice_width<kHeadDim, false>(rows, likely, padding, every_width,
                                                                                beside, leave_half);
}

SliceOption choose(long long head_dim, bool write_pass, long long rows, long long likely, long long padding,
                   long long resident, const SliceOption* beside, bool leave_half) {
  switch (head_dim) {
    case 192: return choose<192>(write_pass, rows, likely, padding, resident, beside, leave_half);
    case 320: return choose<320>(write_pass, rows, likely, padding, resident, beside, leave_half);
    case 128: return choose<128>(write_pass, rows, likely, padding, resident, beside, leave_half);
    case 256: return choose<256>(write_pass, rows, likely, padding, resident, beside, leave_half);
    case 512: return choose<512>(write_pass, rows, likely, padding, resident, beside, leave_half);
    default: return choose<1024>(write_pass, rows, likely, padding, resident, beside, leave_half);
  }
}

int main() {
  long long head_dim, rows, likely, padding, resident, write_pass, beside_rows, leave_half;
  while (std::scanf("%lld %lld %lld %lld %lld %lld %lld %lld", &head_dim, &rows, &likely, &padding, &resident,
                    &write_pass, &beside_rows, &leave_half) == 8) {
    const SliceOption compress =
        choose(head_dim, false, beside_rows, beside_rows, 0, resident, nullptr, leave_half != 0);
    const SliceOption pass = choose(head_dim, write_pass != 0, rows, likely, padding, resident,
                                    beside_rows > 0 ? &compress : nullptr, leave_half != 0);
    std::printf("%u %lld %lld\\n", pass.slice_dim, static_cast<long long>(pass.blocks),
                static_cast<long long>(pass.chain));
  }
  return 0;
}
"""


@needs_nvcc
@pytest.mark.nvcc
def test_the_slice_width_rule_matches_the_tests_mirror(tmp_path):
    """The GPU tests pick row counts that reach each prefill slice width through
    `schedule.prefill_pass`, a Python mirror of `choose_slice_width`: here both run on the same
    passes (compress passes, write passes alone and beside a compress pass, with and without CUDA-graph
    padding, with all rows likely live or few, the compress pass leaving half the GPU to the write pass or
    not) and must agree."""
    from schedule import WIDEST_WRITE_SLICE, prefill_pass

    passes = [(False, 0), *((True, beside) for beside in (0, 1, 16, 64, 593))]
    cases = [(head_dim, rows, likely, padding, sms, write_pass, beside, leave_half)
             for head_dim in (128, 192, 256, 320, 512, 1024) for sms in (132, 78)
             for rows in (*range(1, 300, 7), 333, 529, 593, 1024, 4096) for likely in {rows, -(-rows // 60)}
             for padding in (0, 1000, 400_000) for write_pass, beside in passes for leave_half in (False, True)]
    stdin = "".join(f"{h} {r} {k} {p} {8 * s} {int(w)} {b} {int(lh)}\n" for h, r, k, p, s, w, b, lh in cases)
    compiled = run_program(SLICE_WIDTH_PROGRAM, tmp_path, stdin)
    mirrored = [prefill_pass(r, h, s, prefill_pass(b, h, s, leave_half=lh) if b else None, padding_rows=p,
                             write_pass=w, likely_rows=k, leave_half=lh and not w)
                for h, r, k, p, s, w, b, lh in cases]
    assert len(compiled) == len(cases)
    differ = [(case, c, m) for case, c, m in zip(cases, compiled, mirrored) if c != m]
    assert not differ, f"{len(differ)} of {len(cases)} differ, first: {differ[:3]}"
    assert {c[0] for c in compiled} == {128, 64, 32, 16, 8}
    by_case = {(h, r, k == r, p, s, w, b, lh): c for (h, r, k, p, s, w, b, lh), c in zip(cases, compiled)}
    # Few likely live rows break some ties in chain toward a narrower width, never a wider one, and
    # never change the chain.
    retied = [(key, all_live, few_live) for key, few_live in by_case.items() if not key[2] and not key[7]
              for all_live in [by_case[key[:2] + (True,) + key[3:]]] if few_live != all_live]
    assert retied and all(few[0] < every[0] and few[2] == every[2] for _, every, few in retied), retied[:3]
    # A compress pass that leaves half the GPU runs a grid of at most half where its choice without
    # that filled more, and only then moves; some do move.
    moved = [(key, free, halved) for key, halved in by_case.items() if key[7] and not key[5]
             for free in [by_case[key[:7] + (False,)]] if halved != free]
    assert moved and all(2 * free[1] > 8 * key[4] >= 2 * halved[1] for key, free, halved in moved), moved[:3]
    # 128-channel slices only where they divide head_dim, and never in a write pass.
    assert all(c[0] != 128 for (head_dim, *_), c in zip(cases, compiled) if head_dim % 128)
    assert all(c[0] <= WIDEST_WRITE_SLICE for (*_, write_pass, _, _), c in zip(cases, compiled) if write_pass)


@needs_nvcc
@pytest.mark.nvcc
def test_a_padded_tie_goes_to_short_runs_only_where_the_likely_items_are_few(tmp_path):
    """A padded plan's compress pass is bounded at more rows than it likely has, and at the bound 32 and
    16 channels tie in chain. 16 channels (64-byte runs) halve the likely rows' chain, and win where
    those rows' items fill at most half the warps: head_dim 512, 1 x 2048 + 63 x 1 tokens (80 rows
    bound, 17 likely: 544 items for 2112 warps), 9.60 -> 8.40 us on an H100. Where they would fill
    every warp the pass streams and keeps 32 channels: head_dim 1024, 1 x 4096 + 31 x 1 (64 bound, 33
    likely: 2112 items), 13.50 -> 15.41 us at 16 (docs/PERF_LOG.md, "Ties in chain through the
    short-run rule"). With every row likely live, both keep 32."""
    cases = ["512 80 17 2031", "512 80 80 2031", "1024 64 33 4063", "1024 64 64 4063"]
    compiled = run_program(SLICE_WIDTH_PROGRAM, tmp_path, "".join(f"{case} {8 * 132} 0 0 0\n" for case in cases))
    assert [width for width, _, _ in compiled] == [16, 32, 32, 32]
    assert compiled[0][2] == compiled[1][2]  # a tie in chain at the bound, broken by the likely rows


# Prints pass_rows's (split, likely) and leaves_room_for_write_pass for each line of stdin, "write_pass
# num_rows num_tokens batch_size".
PASS_ROWS_PROGRAM = """
#include <deepseek_v4/c128_slice_width.cuh>

#include <cstdio>

int main() {
  long long write_pass, num_rows, num_tokens, batch_size;
  while (std::scanf("%lld %lld %lld %lld", &write_pass, &num_rows, &num_tokens, &batch_size) == 4) {
    const auto rows = write_pass != 0 ? flash_compress::c128::pass_rows<true>(num_rows, num_tokens, batch_size)
                                      : flash_compress::c128::pass_rows<false>(num_rows, num_tokens, batch_size);
    const bool room = flash_compress::c128::leaves_room_for_write_pass(num_rows, num_tokens, batch_size);
    std::printf("%lld %lld %d\\n", static_cast<long long>(rows.split), static_cast<long long>(rows.likely),
                room ? 1 : 0);
  }
  return 0;
}
"""


@needs_nvcc
@pytest.mark.nvcc
def test_pass_rows_match_the_tests_mirror(tmp_path):
    """The live-row bound and the likely rows a launch gives the width rule (`pass_rows`), against
    `schedule.pass_rows`, which `graph_plan_passes` (and so the GPU test of padded plans) counts with:
    exact plans (fewer rows than tokens) and plans of a row per token, both passes; and whether a
    compress pass leaves room for its write pass (`leaves_room_for_write_pass`), which
    `exact_plan_passes` mirrors."""
    from schedule import leaves_room_for_write_pass, pass_rows

    cases = [(write_pass, rows, tokens, batch) for write_pass in (0, 1)
             for tokens, batch in ((1, 1), (129, 2), (2200, 1004), (24013, 16), (131072, 8), (512, 512))
             for rows in {1, batch, tokens // 128 + 1, tokens}]
    compiled = run_program(PASS_ROWS_PROGRAM, tmp_path, "".join(f"{w} {r} {t} {b}\n" for w, r, t, b in cases))
    assert compiled == [(*pass_rows(bool(w), r, t, b), int(leaves_room_for_write_pass(r, t, b)))
                        for w, r, t, b in cases]
    # Room for the write pass: exact plans with more requests than chunks of tokens only.
    assert {r for _, r, t, b in cases if leaves_room_for_write_pass(r, t, b)} == {1, 2, 5, 18, 1004}
    assert not leaves_room_for_write_pass(2200, 2200, 1004) and not leaves_room_for_write_pass(1, 24013, 16)
    # 4 x 300 + 1000 x 1 in a CUDA-graph plan: a bound of 1021 compress rows, 18 likely.
    assert pass_rows(False, 2200, 2200, 1004) == (1021, 18) and pass_rows(True, 2200, 2200, 1004) == (1004, 1004)


def test_the_arch_check_names_the_archs_to_drop():
    check_arch_list(("8.0", "9.0a", "10.0"))
    with pytest.raises(ValueError, match=r"arch_list: .*sm_80 or newer.*got 7\.5 9\.0; drop 7\.5"):
        check_arch_list(("7.5", "9.0"))


def test_load_module_refuses_an_old_arch_before_any_build(monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("load_module built for an arch it cannot run on")

    monkeypatch.setattr(jit, "load", no_build)
    monkeypatch.setattr(jit, "cuda_arch_list", lambda: ("7.5",))
    with pytest.raises(ValueError, match="sm_80 or newer"):
        flash_compress.load_module(128)


def test_prebuild_refuses_an_old_arch_for_the_kernels_before_any_build(monkeypatch, capsys):
    from flash_compress.__main__ import main
    from flash_compress.jit import cli

    def no_build(*args, **kwargs):
        raise AssertionError("prebuild built for an arch the kernels cannot run on")

    monkeypatch.setattr(cli, "prebuild", no_build)
    assert main(["prebuild", "--head-dim", "128", "--arch", "7.5", "9.0"]) == 2
    assert "sm_80 or newer" in capsys.readouterr().err
