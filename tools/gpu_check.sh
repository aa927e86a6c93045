#!/usr/bin/env bash
# The GPU checks of the CUDA backend in one go, in two steps, because the GPU
# machine has neither Bazel nor a network:
#
#   tools/gpu_check.sh pack   here: builds the CUDA tests and benchmark with
#                             the project's libraries linked in, and packs
#                             them with the shared libraries a CUDA image
#                             lacks (abseil, protobuf, OpenBLAS) into out/gpu/.
#   tools/gpu_check.sh run    on the GPU machine, in a working tree that
#                             carries out/gpu/: runs them and prints a summary
#                             (and, with $OUT set, leaves the logs and the
#                             benchmark's JSON there). Under 8 minutes on an
#                             H200.
#
# With the device tool: `tools/gpu_check.sh pack` here, then run
# `tools/gpu_check.sh run` with carry ["out/gpu"].
set -uo pipefail
cd "$(dirname "$0")/.."

tests=(base/cuda_device_test losses/cuda_chunk_loss_test tests/cuda_head_parity_test)
bench=bench/cuda_heads_bench

pack() {
  set -e
  local targets=()
  for t in "${tests[@]}" "$bench"; do targets+=("//${t%/*}:${t##*/}"); done
  tools/bazel build --dynamic_mode=off "${targets[@]}"
  rm -rf out/gpu && mkdir -p out/gpu/bin out/gpu/lib
  for t in "${tests[@]}" "$bench"; do cp -L "bazel-bin/$t" out/gpu/bin/; done
  # Shared libraries from Debian's -dev packages; glibc, libstdc++ and the
  # CUDA libraries come from the GPU machine.
  ldd out/gpu/bin/* | awk '/=> \// {print $3}' | sort -u |
    grep -E 'libabsl|libprotobuf|libopenblas|libgfortran|libquadmath|libbenchmark|libgtest|libgmock|libz\.' |
    xargs -r cp -L -t out/gpu/lib/
  tar -C out/gpu -cJf out/gpu/lib.tar.xz lib && rm -rf out/gpu/lib
  du -sh out/gpu
}

run() {
  local out="${OUT:-/tmp/gpu_check}"
  mkdir -p "$out" /tmp/dflash_lib
  tar -C /tmp/dflash_lib -xJf out/gpu/lib.tar.xz
  local cuda_lib=""
  for d in /usr/local/cuda/lib64 "$(dirname "$(command -v nvcc 2>/dev/null || echo /x/x)")/../lib64"; do
    [ -d "$d" ] && cuda_lib="$cuda_lib:$d"
  done
  export LD_LIBRARY_PATH="/tmp/dflash_lib/lib${cuda_lib}:${LD_LIBRARY_PATH:-}"
  nvidia-smi -L || echo "nvidia-smi: not available"
  local summary=()
  # Here a GPU is expected: a test that cannot use it fails instead of
  # skipping (base/gpu_test.h).
  export DFLASH_REQUIRE_GPU=1
  for t in "${tests[@]}"; do
    local name=${t##*/}
    timeout 180 "out/gpu/bin/$name" --gtest_brief=1 >"$out/$name.log" 2>&1
    local rc=$?
    local counts=()
    for word in PASSED SKIPPED FAILED; do
      local n
      n=$(sed -n "s/^\[  $word *\] \([0-9]*\) tests\?[,.].*/\1/p" "$out/$name.log")
      counts+=("${n:-0}")
    done
    tail -n 30 "$out/$name.log"
    summary+=("$name: exit $rc; passed ${counts[0]}, skipped ${counts[1]}, failed ${counts[2]}")
  done
  timeout 240 "out/gpu/bin/${bench##*/}" --benchmark_counters_tabular=true \
    --benchmark_out="$out/cuda_heads_bench.json" --benchmark_out_format=json \
    2>&1 | tee "$out/cuda_heads_bench.log"
  summary+=("cuda_heads_bench: rc ${PIPESTATUS[0]}")
  echo
  echo "== gpu_check summary =="
  printf '%s\n' "${summary[@]}"
}

case "${1:-}" in
  pack) pack ;;
  run) run ;;
  *) echo "usage: tools/gpu_check.sh pack|run" >&2; exit 2 ;;
esac
