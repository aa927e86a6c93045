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
#                             under 10 minutes on an H200: each step gets at
#                             most what is left of DFLASH_GPU_CHECK_SECONDS.
#
# With the device tool: `tools/gpu_check.sh pack` here, then run
# `tools/gpu_check.sh run` with carry ["out/gpu"].
set -uo pipefail
cd "$(dirname "$0")/.."

preflight=base/gpu_preflight
tests=(base/cuda_device_test heads/cuda_projection_test losses/cuda_chunk_loss_test
       tests/cuda_head_parity_test tests/cuda_correction_test
       tests/cuda_split_head_test tests/cuda_device_rows_test
       tests/cuda_device_results_test tests/cuda_vocab_parallel_loss_test
       tests/cuda_vocab_parallel_test python/native/cuda_objective_test)
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
  # Compressed, the binaries and libraries fit the device tool's 64 MiB carry.
  strip --strip-debug out/gpu/bin/*
  tar -C out/gpu -cJf out/gpu/gpu_check.tar.xz bin lib && rm -rf out/gpu/bin out/gpu/lib
  du -sh out/gpu
}

# Seconds left before the run's deadline (DFLASH_GPU_CHECK_SECONDS after it
# started, default 540), at most $1: each step gets what is left, so the
# summary and the logs are written however slow a step is.
step_seconds() {
  local left=$((deadline - SECONDS))
  [ "$left" -gt "$1" ] && left=$1
  [ "$left" -lt 1 ] && left=1
  echo "$left"
}

run() {
  local out="${OUT:-/tmp/gpu_check}"
  local logs=/tmp/gpu_check_logs
  local unpacked=/tmp/dflash_gpu
  deadline=$((SECONDS + ${DFLASH_GPU_CHECK_SECONDS:-540}))
  rm -rf "$logs" && mkdir -p "$out" "$logs" "$unpacked"
  tar -C "$unpacked" -xJf out/gpu/gpu_check.tar.xz
  local cuda_lib=""
  for d in /usr/local/cuda/lib64 "$(dirname "$(command -v nvcc 2>/dev/null || echo /x/x)")/../lib64"; do
    [ -d "$d" ] && cuda_lib="$cuda_lib:$d"
  done
  export LD_LIBRARY_PATH="$unpacked/lib${cuda_lib}:${LD_LIBRARY_PATH:-}"
  nvidia-smi || echo "nvidia-smi: not available"
  # A GPU is expected here: an unusable one fails the run at once.
  if ! "$unpacked/bin/${preflight##*/}"; then
    echo "== gpu_check summary =="
    echo "preflight FAILED: the GPU cannot run dflash (see above)"
    return 1
  fi
  local summary=() failed=0
  # Here a GPU is expected: a test that cannot use it fails instead of
  # skipping (base/gpu_test.h).
  export DFLASH_REQUIRE_GPU=1
  for t in "${tests[@]}"; do
    local name=${t##*/} began=$SECONDS
    timeout "$(step_seconds 180)" "$unpacked/bin/$name" --gtest_brief=1 >"$logs/$name.log" 2>&1
    local rc=$?
    local counts=()
    for word in PASSED SKIPPED FAILED; do
      local n
      n=$(sed -n "s/^\[  $word *\] \([0-9]*\) tests\?[,.].*/\1/p" "$logs/$name.log")
      counts+=("${n:-0}")
    done
    tail -n 30 "$logs/$name.log"
    summary+=("$name: exit $rc in $((SECONDS - began)) s; passed ${counts[0]}, skipped ${counts[1]}, failed ${counts[2]}")
    [ "$rc" -eq 0 ] || failed=1
  done
  # compute-sanitizer on small cases, one tool each, where the toolkit has it.
  local sanitizer
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [ -x "$sanitizer" ]; then
    local filter='*Float32MatchesTheCpuInFloat64/dflash:*Float32MatchesTheCpuInFloat64/dspark:*BadInputs*:*NonFinite*:*SixtyFour*:*Compacted*'
    for tool in memcheck racecheck synccheck initcheck; do
      local began=$SECONDS
      timeout "$(step_seconds 90)" "$sanitizer" --tool "$tool" --error-exitcode 1 \
        "$unpacked/bin/cuda_chunk_loss_test" --gtest_filter="$filter" \
        >"$logs/sanitizer_$tool.log" 2>&1
      local rc=$?
      tail -n 5 "$logs/sanitizer_$tool.log"
      summary+=("compute-sanitizer $tool: exit $rc in $((SECONDS - began)) s")
      [ "$rc" -eq 0 ] || failed=1
    done
  else
    summary+=("compute-sanitizer: not found on this machine")
  fi
  # The benchmark gets what is left, less 15 s to write the summary.
  local bench_seconds=$(( $(step_seconds 240) - 15 ))
  [ "$bench_seconds" -lt 1 ] && bench_seconds=1
  timeout "$bench_seconds" "$unpacked/bin/${bench##*/}" --benchmark_counters_tabular=true \
    --benchmark_out="$out/cuda_heads_bench.json" --benchmark_out_format=json \
    2>&1 | tee "$logs/cuda_heads_bench.log"
  summary+=("cuda_heads_bench: rc ${PIPESTATUS[0]}")
  {
    echo
    echo "== gpu_check summary =="
    printf '%s\n' "${summary[@]}"
  } | tee "$logs/summary.txt"
  # One archive: the device tool brings back at most 8 files.
  tar -C "$logs" -czf "$out/gpu_check_logs.tar.gz" .
  return "$failed"
}

case "${1:-}" in
  pack) pack ;;
  run) run ;;
  *) echo "usage: tools/gpu_check.sh pack|run" >&2; exit 2 ;;
esac
