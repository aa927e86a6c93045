#!/usr/bin/env bash
# Fuzzes every //fuzz target for SECONDS each (default 60) with libFuzzer
# under ASan + UBSan, starting from its committed corpus, and prints the
# executions each made. New interesting inputs go to a scratch corpus
# (out/fuzz/NAME), not the committed one; a crash leaves its input in
# out/fuzz/ and fails the run. Installs clang and its runtimes from Debian
# when missing.
#   tools/fuzz/run.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/../.."

seconds=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(config_fuzz npy_fuzz chunking_fuzz chunk_loss_fuzz)

missing=()
for p in clang libclang-rt-14-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

labels=()
for t in "${targets[@]}"; do labels+=("//fuzz:$t"); done
tools/bazel build --config=fuzz "${labels[@]}"
bin=$(tools/bazel info --config=fuzz bazel-bin 2>/dev/null)

for t in "${targets[@]}"; do
  mkdir -p "out/fuzz/$t"
  log="out/fuzz/$t.log"
  if ! "$bin/fuzz/$t" -max_total_time="$seconds" -print_final_stats=1 \
      -artifact_prefix="out/fuzz/$t-" "out/fuzz/$t" "fuzz/corpus/$t" \
      >"$log" 2>&1; then
    tail -n 40 "$log"
    echo "fuzz: $t crashed; the input is in out/fuzz/" >&2
    exit 1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  echo "fuzz: $t: $execs executions in ${seconds} s, no crash"
done
