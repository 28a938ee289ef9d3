#!/usr/bin/env bash
# Checks this checkout against apache-tvm-ffi releases, one after another, in one fresh venv (torch
# 2.13.0 first, as .ci/run installs it): for each release, the CPU tests that build, load and call a
# variant and the planner, then a prebuild of head_dim 512 into an empty cache. A line per release.
#
#   bash scripts/tvm_ffi_releases.sh 0.1.9 0.1.12 0.1.15.post1     (work folder: $WORK, default /tmp/tvm-ffi-releases)
set -uo pipefail
cd "$(dirname "$0")/.."
WORK="${WORK:-/tmp/tvm-ffi-releases}"
rm -rf "$WORK" && mkdir -p "$WORK"
python3 -m venv "$WORK/venv" && . "$WORK/venv/bin/activate"
python -m pip install -q torch==2.13.0 && python -m pip install -q -e ".[test]" || exit 1
git log --oneline -1
for release in "$@"; do
  python -m pip install -q "apache-tvm-ffi==$release" || { echo "$release: could not install"; continue; }
  imported=$(python -c "import tvm_ffi; print(tvm_ffi.__version__)")
  tests=$(FLASH_COMPRESS_CACHE_DIR="$WORK/cache-$release" python -m pytest -q -p no:cacheprovider \
    tests/test_jit_units.py tests/test_jit_exports.py tests/test_jit_nvcc.py tests/test_planner.py \
    tests/test_gpu_planner.py tests/test_api.py tests/test_dlpack.py 2>&1 | tail -1)
  status=$?
  prebuild=$(FLASH_COMPRESS_CACHE_DIR="$WORK/prebuild-$release" python -m flash_compress prebuild --head-dim 512 \
    --pdl 1 --arch 9.0 2>/dev/null | tail -1)
  echo "$release (imported $imported): $tests (status $status) | $prebuild"
  rm -rf "$WORK/cache-$release" "$WORK/prebuild-$release"
done
