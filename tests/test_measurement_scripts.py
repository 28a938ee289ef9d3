"""The CPU side of the GPU measurement scripts: prefill_scaling.py's line fit, and warp_stamps.py's
stamp layout, its reading of the stamps, and its kernel edits, which must keep applying to (and
compiling with) the kernel file as it changes; slice_widths.py, kernel_sass.py, and make_variant.py,
which builds the kernel checkouts they and bench_variants.py read; bench_variants.py's comparison of
results, and bench_shapes.py's call into it. The timing itself needs a GPU."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
from schedule import SLICE_WIDTHS, round_tokens
from test_headers_nvcc import compile_alone, needs_nvcc

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_scaling_fit_recovers_a_line():
    fit_line = load_script("prefill_scaling").fit_line
    megabytes = [8.4, 16.8, 33.7, 67.4, 134.7]
    fixed, slope = fit_line(megabytes, [3.3 + 0.25 * x for x in megabytes])
    assert fixed == pytest.approx(3.3) and slope == pytest.approx(0.25)


@pytest.mark.parametrize("head_dim", [64, 128, 512, 1024])
def test_stamps_never_share_a_word_nor_touch_a_row_the_pass_writes(head_dim):
    """A 1 x N-from-0 compress pass writes output rows 127 mod 128 only; the stamps must fit in the
    other rows of the smallest call the script times (8192 tokens), one 64-bit word each."""
    stamps = load_script("warp_stamps")
    positions = [stamps.stamp_position(i, head_dim) for i in range(stamps.PER_WARP * stamps.STAMP_WARPS + 2)]
    assert len(set(positions)) == len(positions)
    assert all(row % 128 != 127 and row < 8192 and col < head_dim // 2 for row, col in positions)


def test_the_stamp_edits_apply_to_the_kernel_file(tmp_path):
    folder = load_script("warp_stamps").instrumented_kernel(tmp_path / "stamped")
    text = (folder / "c128_prefill.cuh").read_text()
    assert text.count("= global_ns();") == 4  # entry, after the PDL wait, first tokens landed, done


@needs_nvcc
@pytest.mark.nvcc
def test_the_instrumented_kernel_compiles(tmp_path):
    kernels = tmp_path / "stamped" / "deepseek_v4"
    shutil.copytree(ROOT / "csrc" / "deepseek_v4", kernels)
    load_script("warp_stamps").instrumented_kernel(kernels)  # replaces the copy's prefill kernel
    source = ("#include <deepseek_v4/c128_prefill.cuh>\n"
              "void* compress_pass() {\n"
              "  return reinterpret_cast<void*>(&flash_compress::c128::c128_prefill_kernel<128, 64, false, true, float>);\n"
              "}\n")
    flags = ("-std=c++20", "-O0", "--expt-relaxed-constexpr", f"-I{tmp_path / 'stamped'}")
    result = compile_alone(source, "90", tmp_path, flags)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_breakdown_bounds_what_balancing_would_save():
    """Four warps on two SMs: the SM-balanced end is the later SM's mean end, the all-balanced end the
    mean of all; warps without a first landed stamp ran no item and are left out."""
    torch = pytest.importorskip("torch")
    stamps = load_script("warp_stamps")
    head_dim = 128
    out = torch.zeros(8192, head_dim)

    def put(index, value):
        row, col = stamps.stamp_position(index, head_dim)
        out[row].view(torch.int64)[col] = value

    base = 10_000_000
    # (entry, waited, first landed, done, SM) in ns; the last warp ran nothing.
    warps = [(0, 100, 1_000, 5_000, 0), (200, 300, 2_000, 9_000, 0), (300, 400, 1_200, 4_000, 0),
             (400, 500, 1_500, 5_500, 1), (0, 0, 0, 0, 0)]
    for w, values in enumerate(warps):
        ran = values[2] != 0
        for j, value in enumerate(values):
            put(stamps.PER_WARP * w + j, base + value if ran and j < 4 else value)
    put(stamps.PER_WARP * stamps.STAMP_WARPS + 1, base - 700)  # the previous call's last end
    result = stamps.breakdown(out, head_dim)
    assert result["warps"] == 4 and result["SMs"] == 2
    assert result["gap"] == pytest.approx(0.7)
    assert result["end max"] == pytest.approx(9.0)
    assert result["SM-balanced end"] == pytest.approx(6.0)  # SM 0: (5 + 9 + 4) / 3; SM 1: 5.5
    assert result["all-balanced end"] == pytest.approx(23.5 / 4)
    assert result["period"] == pytest.approx(9.7)


def test_slice_widths_prints_every_bench_case_with_a_width_and_a_grid_that_fits(capsys, monkeypatch):
    """slice_widths.py runs bench.py's cases, planned as bench.py plans them, through the width rule's mirror."""
    script = load_script("slice_widths")
    monkeypatch.setattr("sys.argv", ["slice_widths.py", "--head-dim", "512", "--sms", "132"])
    assert script.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("head_dim 512, 1056 resident blocks")
    assert [line.split()[0] for line in lines[1:]] == [name.split()[0] for name, *_ in script.bench.PREFILL_CASES]
    for line in lines[1:]:
        passes = re.findall(r"x (\d+): (\d+) blocks", line)
        assert passes and all(int(w) in SLICE_WIDTHS and 0 < int(b) <= 1056 for w, b in passes), line
        if write := re.search(r"write \d+ x (\d+):.*; longest (\d+) tokens?, (\d+) rounds?$", line):
            width, longest, rounds = map(int, write.groups())
            assert 0 < longest < 128 and rounds == -(-longest // round_tokens(width)), line
        else:
            assert "write" not in line, line
    assert lines[-1].endswith("longest 1 token, 1 round")  # 1 x 128 from 0 + 1 x 1: the one-token request
    # 1 x 8192 + 255 x 1: more requests than chunks, so the compress pass leaves half the GPU to the write pass.
    few_rows = next(line for line in lines if line.split()[0] == "1x8192")
    assert "compress 64 x 32: 512 blocks" in few_rows and "partly beside" in few_rows, few_rows


def test_slice_widths_loads_deal_items_as_the_kernel_does(capsys, monkeypatch):
    """--loads: item i goes to warp i mod warps (the tree) or block i mod blocks (shared evenly by its 8 warps)."""
    script = load_script("slice_widths")
    assert script.item_rounds([128, 9], 64, 128) == [16, 16, 2, 2]  # 2 slices a segment, 8 tokens a round
    assert script.dealt_rounds([5, 1, 1, 1], 2) == (6, 4.0)  # warp 0: 5 + 1, warp 1: 1 + 1
    assert script.shared_rounds([5, 1, 1, 1], 1, block_warps=2) == 4  # 8 rounds over 2 warps
    assert script.shared_rounds([5, 1, 1, 1, 3], 2) == 2  # blocks of 5 + 1 + 3 and 1 + 1 rounds: 9 over 8 warps
    monkeypatch.setattr("sys.argv", ["slice_widths.py", "--head-dim", "512", "--loads"])
    assert script.main() == 0
    lines = capsys.readouterr().out.splitlines()
    passes = [line for line in lines[1:] if not line.startswith("    ")]
    loads = [re.fullmatch(r"    (compress|write) loads: busiest warp (\d+) rounds? \(mean ([\d.]+)\); "
                          r"shared in blocks of 8: (\d+)", line) for line in lines[1:] if line.startswith("    ")]
    assert all(loads) and len(loads) == sum(line.count(" blocks, chain") for line in passes)
    assert all(int(m[2]) >= float(m[3]) and int(m[4]) >= 1 for m in loads)
    # 1 x 32768 from 0: 2048 items of 16 rounds (128 tokens at 64 channels), one a warp however dealt.
    assert loads[0].groups() == ("compress", "16", "16.00", "16")


def test_slice_widths_graph_plans_name_the_ties_their_likely_rows_break(capsys, monkeypatch):
    """--graph-plans: each case's passes with CUDA-graph plans; a compress pass whose tie the likely rows
    broke names the width it had before, always wider (4 x 300 + 1000 x 1 at head_dim 1024: 128 -> 32)."""
    script = load_script("slice_widths")
    monkeypatch.setattr("sys.argv", ["slice_widths.py", "--head-dim", "1024", "--shapes", "--graph-plans"])
    assert script.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("head_dim 1024, CUDA-graph plans")
    passes = [re.fullmatch(r"  (.+?) +(\d+) live compress rows; compress (\d+): (\d+) blocks, chain (\d+)"
                           r"(?: \(without: (\d+), \d+ blocks\))?  write (\d+): (\d+) blocks", line)
              for line in lines[1:]]
    assert all(passes) and len(passes) == 16
    moved = {m[1]: (int(m[6]), int(m[3])) for m in passes if m[6]}
    assert moved["4x300 + 1000x1"] == (128, 32) and all(before > after for before, after in moved.values())
    assert "2x16384 from 0" not in moved  # its bound is near its live rows: no tie to break
    monkeypatch.setattr("sys.argv", ["slice_widths.py", "--graph-plans", "--loads"])
    with pytest.raises(SystemExit):
        script.main()


def test_bench_variants_takes_kernel_files_or_a_whole_checkout(tmp_path):
    """A folder of kernel files replaces the tree's namesakes; a checkout (csrc/deepseek_v4/ and include/, an
    experiment patch applied to a worktree) is built whole, include/ too; anything else is refused by name."""
    import argparse

    script = load_script("bench_variants")
    files = tmp_path / "files"
    files.mkdir()
    (files / "c128_prefill.cuh").write_text("// edited\n")
    checkout = tmp_path / "checkout"
    (checkout / "csrc" / "deepseek_v4").mkdir(parents=True)
    (checkout / "include" / "sgl_kernel").mkdir(parents=True)
    assert script.parse_variant(f"edited={files}") == ("edited", files)
    assert script.parse_variant(f"patched={checkout}") == ("patched", checkout)
    for bad, says in ((f"1x={files}", "NAME=PATH"), (f"edited={tmp_path / 'missing'}", "NAME=PATH"),
                      (f"stray={tmp_path}", "expected files named as in")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            script.parse_variant(bad)

    tree = script.spec(128, True, "float32")
    whole = script.variant_spec("patched", checkout, 128, tmp_path / "sources", "float32")
    assert whole.include_dirs == ((checkout / "csrc").resolve(), (checkout / "include").resolve())
    assert whole.name == f"{tree.name}_variant_patched" and whole.exports == tree.exports
    edited = script.variant_spec("edited", files, 128, tmp_path / "sources", "float32")
    kernels = tmp_path / "sources" / "edited" / "deepseek_v4"
    assert edited.include_dirs == (kernels.parent.resolve(), tree.include_dirs[1])
    assert (kernels / "c128_prefill.cuh").read_text() == "// edited\n"
    assert (kernels / "c128_decode.cuh").read_text() == (script.KERNEL_DIR / "c128_decode.cuh").read_text()


def test_the_bytes_behind_percent_of_copy_match_a_walk_over_the_tokens():
    """PERFORMANCE.md's "% of copy" counts, for every bench.py and bench_shapes.py prefill case and decode
    batch, against a walk over each request's tokens: its token rows, an output row per token that closes a
    chunk, a prior state read where it starts mid-chunk, a state written where it ends mid-chunk (decode: the
    state read unless the token starts a chunk, then the state written or, for a closing token, the row)."""
    import torch

    shapes = load_script("bench_shapes")
    bench = shapes.bench  # imported as a module (its dataclasses need one)
    from flash_compress import reference

    d, chunk = 64, 128  # the counts scale with D; a small D keeps the CPU tensors small
    for cases in (bench.PREFILL_CASES, shapes.SHAPES):
        for name, batch, extend, random_prefix, singles in cases:
            prefixes, extends = bench.case_lengths(batch, extend, random_prefix, torch.Generator().manual_seed(5),
                                                   singles)
            *_, traffic = bench.prefill_case(reference, d, batch, extend, random_prefix,
                                             torch.Generator().manual_seed(5), singles, device="cpu")
            float_bytes = state_values = 0
            for start, count in zip(prefixes, extends):
                closing = sum(q % chunk == chunk - 1 for q in range(start, start + count))
                float_bytes += count * 2 * d * 4 + closing * d * 4
                state_values += 3 * d * ((start % chunk != 0) + ((start + count) % chunk != 0))
            for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
                assert traffic.bytes(dtype) == float_bytes + state_values * size, (name, dtype)
    for batch in bench.DECODE_BATCHES:
        (*_, seq_lens), traffic = bench.decode_case(d, batch, device="cpu")
        float_bytes = state_values = 0
        for position in ((seq_lens.long() - 1) % chunk).tolist():
            float_bytes += 2 * d * 4 + (d * 4 if position == chunk - 1 else 0)
            state_values += 3 * d * ((position != 0) + (position != chunk - 1))
        assert traffic.bytes(torch.float32) == float_bytes + 4 * state_values, batch


def test_a_spaced_graph_row_is_the_call_and_spacer_graph_less_the_spacer_graph(monkeypatch):
    bench = load_script("slice_widths").bench
    graphs = []

    def fake_graph_median_ms(fn, launches, iters):
        events = []
        monkeypatch.setattr(bench, "_record", events.append, raising=False)
        fn()
        graphs.append((launches, iters))
        return 3.0 if len(events) else 1.0  # the call records itself; the spacer does not

    monkeypatch.setattr(bench, "graph_median_ms", fake_graph_median_ms)
    assert bench.spaced_graph_median_ms(lambda: bench._record("call"), device="cpu") == 2.0
    assert graphs == [(10, 20), (10, 20)]


def test_cold_rows_cycle_through_enough_copies_to_span_twice_the_l2():
    bench = load_script("slice_widths").bench  # imported as a module (its dataclasses need one)
    l2 = 50 * 2**20
    assert bench.cold_copies(534_196_224, l2) == 1  # decode B=32768 at head_dim 512: larger than the L2
    assert bench.cold_copies(9_465_856, l2) == 12  # 1 x 2048 + 63 x 1: 12 copies, 113.6 MB
    for case_bytes in (37_863_424, 9_465_856, 500_000):
        copies = bench.cold_copies(case_bytes, l2)
        assert copies * case_bytes >= 2 * l2 > (copies - 1) * case_bytes
    assert bench.cold_copies(2 * l2 // bench.MOST_COPIES - 1, l2) == 0  # too small: latency-bound, no cold row


def test_rounds_take_the_measures_forwards_then_backwards_and_keep_each_ones_results():
    bench = load_script("slice_widths").bench
    order, after = [], []
    measures = [lambda name=name: order.append(name) or 10.0 * len(order) for name in "abc"]
    results = bench.timed_in_rounds(measures, 3, after_round=lambda r: after.append([list(x) for x in r]))
    assert order == list("abccbaabc")  # no measure always first, none always after the same one
    assert results == [[10.0, 60.0, 70.0], [20.0, 50.0, 80.0], [30.0, 40.0, 90.0]]
    assert [len(r[0]) for r in after] == [1, 2, 3] and after[-1] == results
    assert bench.timed_in_rounds(measures[:1], 1) == [[100.0]]  # one round: one pass in order
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        bench.timed_in_rounds(measures, 0)


def test_a_cases_rows_report_each_timings_median_rate_and_rounds():
    """bench.py's rows: the median over rounds, the rate of the bytes the row's state dtype moves."""
    torch = pytest.importorskip("torch")
    bench = load_script("slice_widths").bench
    times = {"float32": iter([0.004, 0.001, 0.002]), "bf16": iter([0.001, 0.003, 0.001])}  # ms, by round
    traffic = bench.Traffic(float_bytes=10**6, state_values=500_000)  # 3 MB in float32, 2 MB in bfloat16
    timings = [bench.Timing("case", "float32", lambda: next(times["float32"]), traffic),
               bench.Timing("case", "bf16", lambda: next(times["bf16"]), traffic, torch.bfloat16)]
    f32, bf16 = bench.timed_rows(timings, 3, ceiling_gbps=1000.0)
    assert (f32.case, f32.impl, bf16.impl) == ("case", "float32", "bf16")
    assert f32.us == pytest.approx(2.0) and f32.us_rounds == [4.0, 1.0, 2.0]
    assert f32.gbps == pytest.approx(1500.0) and f32.pct_copy == pytest.approx(150.0)  # 3 MB in 2 us
    assert bf16.us == pytest.approx(1.0) and bf16.us_rounds == [1.0, 3.0, 1.0]
    assert bf16.gbps == pytest.approx(2000.0)  # 2 MB in 1 us


@pytest.mark.parametrize("script_name", ["bench", "bench_variants"])
def test_the_benchmarks_reject_fewer_than_one_round(script_name, monkeypatch, capsys):
    script = load_script("slice_widths").bench if script_name == "bench" else load_script(script_name)
    monkeypatch.setattr("sys.argv", [f"{script_name}.py", "--rounds", "0"])
    with pytest.raises(SystemExit) as exit_info:
        script.main()
    assert exit_info.value.code == 2 and "--rounds: expected at least 1, got 0" in capsys.readouterr().err


def test_cold_calls_run_each_on_its_own_copy_of_state_input_and_output():
    bench = load_script("slice_widths").bench
    import torch

    seen = []
    state, inputs, out, ape = torch.zeros(2, 3), torch.ones(4, 2), torch.zeros(4, 1), torch.ones(1)
    calls = bench.cold_calls(lambda *args: seen.append(args), (state, inputs, out, ape, None), 3)
    for call in calls:
        call()
    assert len(seen) == 3 and seen[0][0] is state and seen[0][2] is out
    for args in seen[1:]:
        assert args[0] is not state and torch.equal(args[0], state) and torch.equal(args[1], inputs)
        assert args[2].shape == out.shape and args[3] is ape and args[4] is None
    assert len({args[0].data_ptr() for args in seen}) == 3 and len({args[1].data_ptr() for args in seen}) == 3


def test_the_sass_listing_splits_into_functions_by_code_section():
    functions = load_script("kernel_sass").functions
    listing = ("\t.target\tsm_90\n"
               "\t.section\t.text._Z5firstv,\"ax\",@progbits\n_Z5firstv:\n        /*0000*/  LDG.E R2, desc[UR4][R2.64] ;\n"
               "        /*0010*/  EXIT ;\n"
               "//--------------------- .text._Z6secondv --------------------------\n"
               "\t.section\t.text._Z6secondv,\"ax\",@progbits\n_Z6secondv:\n        /*0000*/  EXIT ;\n")
    split = functions(listing)
    assert list(split) == ["_Z5firstv", "_Z6secondv"]
    assert "LDG.E" in split["_Z5firstv"] and "_Z6secondv" not in split["_Z5firstv"]
    assert split["_Z6secondv"].rstrip().endswith("EXIT ;")


@needs_nvcc
@pytest.mark.nvcc
def test_kernel_sass_prints_the_code_of_the_kernels_it_is_asked_for(capsys):
    script = load_script("kernel_sass")
    from flash_compress.jit.toolchain import find_nvcc

    if script.find_nvdisasm(find_nvcc()) is None:
        pytest.skip("no nvdisasm (pip install nvidia-cuda-nvdisasm, in the test extra)")
    assert script.main(["--head-dim", "128", "--state-dtype", "bfloat16", "--kernel", "decode_kernelILl128"]) == 0
    out = capsys.readouterr().out
    names = [line.split()[-1] for line in out.splitlines() if line.startswith("Function : ")]
    assert len(names) == 1 and "c128_decode_kernelILl128ELb1E13__nv_bfloat16" in names[0], names
    assert "LDG.E" in out and "EXIT" in out and "prefill" not in out


def _kernel_patch(path: str, old: str, new: str) -> str:
    return (f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1,2 +1,2 @@\n"
            f" // first line\n-{old}\n+{new}\n")


@pytest.mark.skipif(shutil.which("git") is None, reason="make_variant.py applies patches with git, not installed")
def test_make_variant_applies_only_kernel_hunks_inside_a_repository(tmp_path):
    """make_variant.py copies csrc/ and include/ into a folder under the repository (as
    .variants/ is) and applies a patch's kernel hunks there, not its test hunks; a patch that
    changes no kernel file, or that does not apply, is refused with its name."""
    import subprocess

    make_variant = load_script("make_variant").make_variant
    root = tmp_path / "repo"
    for path in ("csrc/deepseek_v4/k.cuh", "include/sgl_kernel/h.h", "tests/t.py"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("// first line\nint x = 1;\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    both = tmp_path / "both.patch"
    both.write_text(_kernel_patch("csrc/deepseek_v4/k.cuh", "int x = 1;", "int x = 2;")
                    + _kernel_patch("tests/t.py", "int x = 1;", "int x = 3;"))
    folder = root / ".variants" / "ck_both"
    assert make_variant(folder, [both], root=root) == {both: ["csrc/deepseek_v4/k.cuh"]}
    assert (folder / "csrc/deepseek_v4/k.cuh").read_text().endswith("int x = 2;\n")
    assert (folder / "include/sgl_kernel/h.h").is_file() and not (folder / "tests").exists()
    assert (root / "csrc/deepseek_v4/k.cuh").read_text().endswith("int x = 1;\n")  # the tree is untouched

    tests_only = tmp_path / "tests_only.patch"
    tests_only.write_text(_kernel_patch("tests/t.py", "int x = 1;", "int x = 3;"))
    with pytest.raises(ValueError, match=r"tests_only\.patch: changes no file under csrc or include/"):
        make_variant(folder, [tests_only], root=root)
    stale = tmp_path / "stale.patch"
    stale.write_text(_kernel_patch("csrc/deepseek_v4/k.cuh", "int x = 7;", "int x = 8;"))
    with pytest.raises(ValueError, match=r"stale\.patch: does not apply on .*patch does not apply"):
        make_variant(folder, [stale], root=root)
    with pytest.raises(ValueError, match="folder: expected a new folder"):
        make_variant(root, [both], root=root)


def test_bench_variants_check_close_accepts_reordered_sums_only():
    """--check-close (a variant that reorders a chunk's sums): values within a few float32 roundings of
    the tree's pass, NaN must sit exactly where the tree's does, and anything further is DIFFERENT;
    without a tolerance only bitwise equality passes."""
    import torch

    compare = load_script("bench_variants").compare_results
    gen = torch.Generator().manual_seed(0)
    state = torch.randn(6, 3 * 64, generator=gen)
    state[0, :64] = float("-inf")  # a max no token set
    out = torch.randn(9, 64, generator=gen)
    out[4] = float("nan")  # a row the call leaves poisoned
    tree = [state, out]
    assert compare(tree, [state.clone(), out.clone()]) == (True, "identical")

    rounded = [state * (1 + 3e-7), out + 2e-7]  # a reordered sum's few roundings
    same, word = compare(tree, rounded)
    # Every row moved but the poisoned one, which stays NaN; the word says where, and how far.
    assert not same and re.fullmatch(r"DIFFERENT \(state: 6 of 6 rows, max err \S+; out: 8 of 9 rows, max err \S+\)",
                                     word), word
    same, word = compare(tree, rounded, 1e-5)
    assert same and word.startswith("close (max err ")

    for bad, where in (([state, out.nan_to_num(0.0)], "out: 1 of 9 rows, max err inf"),      # a poisoned row written
                       ([state, torch.where(out.isnan(), out, out * 1.01)], "out: 8 of 9 rows"),  # 1% off
                       ([state.flip(0), out], "state: 6 of 6 rows")):                      # states in other slots
        same, word = compare(tree, bad, 1e-5)
        assert not same and word.startswith(f"DIFFERENT ({where}"), word
    prefix = torch.randn(6, 3 * 64, generator=gen)
    same, word = compare([state, prefix, out], [state, prefix.flip(0), out], names=("state", "prefix_states", "out"))
    assert not same and word.startswith("DIFFERENT (prefix_states: 6 of 6 rows"), word


def test_bench_shapes_hands_bench_variants_a_state_dtype_per_implementation(monkeypatch):
    """bench_shapes.py times bench_variants.cases()'s exact-plan prefill rows in graph: its call must keep
    up with that function's arguments (a dtype per implementation since --both-dtypes). The GPU parts are
    stubbed: the modules, and the cases, which are checked and returned empty."""
    import sys
    import types

    import torch

    script = load_script("bench_shapes")
    seen = {}

    def cases(impls, head_dim, decode_only, state_dtypes, *args, **kwargs):
        seen.update(impls=impls, state_dtypes=state_dtypes, kwargs=kwargs)
        return {}

    monkeypatch.setattr(script.bench_variants, "cases", cases)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(script.flash_compress, "load_module", lambda *a, **k: "ours module")
    monkeypatch.setitem(sys.modules, "reference_design",
                        types.SimpleNamespace(load_reference=lambda *a, **k: "reference module"))
    monkeypatch.setattr("sys.argv", ["bench_shapes.py", "--reference", "SEED", "--state-dtype", "bfloat16"])
    assert script.main() == 0
    assert seen["state_dtypes"] == {"ours": torch.bfloat16, "reference": torch.float32}
    assert set(seen["impls"]) == set(seen["state_dtypes"])
    assert seen["kwargs"].get("prefill_only") is True


def test_bench_variants_both_dtypes_adds_the_tree_in_the_other_dtype(monkeypatch, tmp_path):
    """--both-dtypes: one more implementation, the tree built for the other state dtype, whose states the
    cases make in that dtype; variants keep the tree's. The builds and the cases are stubbed (GPU parts)."""
    import torch

    script = load_script("bench_variants")
    files = tmp_path / "files"
    files.mkdir()
    (files / "c128_prefill.cuh").write_text("// edited\n")
    built, seen = [], {}

    def cases(impls, head_dim, decode_only, state_dtypes, *args):
        seen.update(impls=impls, state_dtypes=state_dtypes)
        return {}

    monkeypatch.setattr(script, "cases", cases)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(script.flash_compress, "load_module",
                        lambda head_dim, use_pdl, state_dtype: built.append(state_dtype) or f"tree {state_dtype}")
    monkeypatch.setattr(script, "load_variant", lambda name, *args: f"variant {name} {args[-1]}")
    for tree, other in (("float32", "bfloat16"), ("bfloat16", "float32")):
        built.clear()
        monkeypatch.setattr("sys.argv", ["bench_variants.py", f"edited={files}", "--both-dtypes", "--rounds", "1",
                                         "--state-dtype", tree])
        assert script.main() == 0
        assert sorted(built) == sorted([tree, other])
        assert seen["impls"] == {"tree": f"tree {tree}", f"tree {other}": f"tree {other}",
                                 "edited": f"variant edited {tree}"}
        assert seen["state_dtypes"] == {"tree": getattr(torch, tree), f"tree {other}": getattr(torch, other),
                                        "edited": getattr(torch, tree), "reference": torch.float32}
