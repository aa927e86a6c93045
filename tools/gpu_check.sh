#!/usr/bin/env bash
# The GPU checks of the CUDA backend in one go, in two steps, because the GPU
# machine has neither Bazel nor a network:
#
#   tools/gpu_check.sh pack   here: builds the CUDA tests and benchmark with
#                             the project's libraries linked in, and packs
#                             them with the shared libraries a CUDA image
#                             lacks (abseil, protobuf, OpenBLAS) into out/gpu/.
#   tools/gpu_check.sh run    on the GPU machine, in a working tree that
#                             carries out/gpu/: a preflight (nvidia-smi, the
#                             device, memory pools, a 1 GiB stream-ordered
#                             allocation), the tests with DFLASH_REQUIRE_GPU=1
#                             (an unusable GPU fails them instead of skipping),
#                             compute-sanitizer's four tools on small cases,
#                             the benchmark; a summary, and exit 1 if anything
#                             failed (with $OUT set, the logs and the
#                             benchmark's JSON stay there). Meant to stay
#                             under 10 minutes on an H200; not yet run on one.
#
# With the device tool: `tools/gpu_check.sh pack` here, then run
# `tools/gpu_check.sh run` with carry ["out/gpu"].
set -uo pipefail
cd "$(dirname "$0")/.."

preflight=base/gpu_preflight
tests=(base/cuda_device_test losses/cuda_chunk_loss_test tests/cuda_head_parity_test
       tests/cuda_correction_test)
bench=bench/cuda_heads_bench

pack() {
  set -e
  local targets=()
  for t in "$preflight" "${tests[@]}" "$bench"; do targets+=("//${t%/*}:${t##*/}"); done
  tools/bazel build --dynamic_mode=off "${targets[@]}"
  rm -rf out/gpu && mkdir -p out/gpu/bin out/gpu/lib
  for t in "$preflight" "${tests[@]}" "$bench"; do cp -L "bazel-bin/$t" out/gpu/bin/; done
  # Shared libraries from Debian's -dev packages; glibc, libstdc++ and the
  # CUDA libraries come from the GPU machine.
  ldd out/gpu/bin/* | awk '/=> \// {print $3}' | sort -u |
    grep -E 'libabsl|libprotobuf|libopenblas|libdnnl|libgomp|libgfortran|libquadmath|libbenchmark|libgtest|libgmock|libz\.' |
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
  nvidia-smi || echo "nvidia-smi: not available"
  # A GPU is expected here: an unusable one fails the run at once.
  if ! "out/gpu/bin/${preflight##*/}"; then
    echo "== gpu_check summary =="
    echo "preflight FAILED: the GPU cannot run dflash (see above)"
    return 1
  fi
  local summary=() failed=0
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
    [ "$rc" -eq 0 ] || failed=1
  done
  # compute-sanitizer on small cases, one tool each, where the toolkit has it.
  local sanitizer
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [ -x "$sanitizer" ]; then
    local filter='*Float32MatchesTheCpuInFloat64/dflash:*Float32MatchesTheCpuInFloat64/dspark:*BadInputs*:*NonFinite*:*SixtyFour*:*Compacted*'
    for tool in memcheck racecheck synccheck initcheck; do
      timeout 120 "$sanitizer" --tool "$tool" --error-exitcode 1 \
        out/gpu/bin/cuda_chunk_loss_test --gtest_filter="$filter" \
        >"$out/sanitizer_$tool.log" 2>&1
      local rc=$?
      tail -n 5 "$out/sanitizer_$tool.log"
      summary+=("compute-sanitizer $tool: exit $rc")
      [ "$rc" -eq 0 ] || failed=1
    done
  else
    summary+=("compute-sanitizer: not found on this machine")
  fi
  timeout 240 "out/gpu/bin/${bench##*/}" --benchmark_counters_tabular=true \
    --benchmark_out="$out/cuda_heads_bench.json" --benchmark_out_format=json \
    2>&1 | tee "$out/cuda_heads_bench.log"
  summary+=("cuda_heads_bench: rc ${PIPESTATUS[0]}")
  echo
  echo "== gpu_check summary =="
  printf '%s\n' "${summary[@]}"
  return "$failed"
}

case "${1:-}" in
  pack) pack ;;
  run) run ;;
  *) echo "usage: tools/gpu_check.sh pack|run" >&2; exit 2 ;;
esac
