#!/usr/bin/env bash
# Builds examples/consumer (a separate workspace using dflash libraries) and
# checks their dependency closures: the config library (with the components'
# validators) reaches no head code, loss kernels or CUDA; the core libraries (chunk planner, checkpoint context, batch
# layout) reach no protobuf either.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bazel=${BAZEL_REAL:-/usr/bin/bazel-4}
cd "$root/examples/consumer"
"$bazel" build //:consumer //:core_consumer
"$bazel" run //:consumer
"$bazel" run //:core_consumer

# check TARGET PATTERN WHAT: TARGET's closure must not match PATTERN.
check() {
  local closure
  closure=$("$bazel" query "deps($1)" 2>/dev/null)
  if grep -E "$2" <<<"$closure"; then
    echo "check_consumer: $1's closure (above) must not reach $3" >&2
    exit 1
  fi
  echo "check_consumer: $1 OK ($(grep -c '^@dflash//' <<<"$closure") dflash" \
    "targets, no $3)"
}
check //:consumer \
  '^@dflash//heads:(cpu_|cuda_|head_run|head_plan|head_types|projection|row_compaction)|^@dflash//losses:(chunk_loss|row_kernels|cuda)|local_config_cuda|cuda' \
  "head code (only its config check), loss kernels or CUDA"
check //:core_consumer \
  '^@dflash//(heads|proto)|^@dflash//losses:(chunk_loss|cuda)|local_config_cuda|cuda|protobuf' \
  "protobuf, heads, loss configs or CUDA"
