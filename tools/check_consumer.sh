#!/usr/bin/env bash
# Builds examples/consumer (a separate workspace using @dflash//proto:config)
# and checks that its dependency closure reaches neither heads nor CUDA.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bazel=${BAZEL_REAL:-/usr/bin/bazel-4}
cd "$root/examples/consumer"
"$bazel" build //:consumer
"$bazel" run //:consumer
closure=$("$bazel" query 'deps(//:consumer)' 2>/dev/null)
if grep -E '^@dflash//(heads|losses)|local_config_cuda|cuda' <<<"$closure"; then
  echo "check_consumer: the closure above must not reach heads, losses or CUDA" >&2
  exit 1
fi
echo "check_consumer: OK ($(grep -c '^@dflash//' <<<"$closure") dflash targets, no heads, no CUDA)"
