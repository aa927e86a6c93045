#!/usr/bin/env bash
# dflash_head's memory prediction (what --memory_limit is checked against)
# against the peak resident memory the run adds to its process, over modes,
# weight layouts, dtypes and shapes: each run in a fresh process, both
# figures from its metrics.json. The prediction must cover the measurement
# and stay within 10% + 64 MiB of it (a prediction that is only ever large
# would refuse runs that fit).
set -uo pipefail

bin="$1"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
if [[ -n "${ASAN_OPTIONS:-}" ]]; then
  echo "SKIP: ASan's shadow memory and quarantine are not the run's memory"
  exit 0
fi
failures=0
slack=$((64 << 20))

# The integer value of an int64 field of metrics.json (printed as a string).
field() {
  sed -n "s/.*\"$1\": \"\{0,1\}\([0-9]*\)\"\{0,1\},\{0,1\}$/\1/p" "$2"
}

config() {
  local name="$1"
  shift
  echo "layout { block_size: 16 } head { vocab_size: 16384 hidden_size: 512 $* } loss { dflash { gamma: 7 } }" \
    >"$tmp/$name.textproto"
  echo "$tmp/$name.textproto"
}

check() {
  rm -rf "$tmp/out"
  if ! err=$("$bin" "$@" --out="$tmp/out" 2>&1 >/dev/null); then
    echo "FAIL: $*: $err"
    failures=$((failures + 1))
    return
  fi
  local predicted measured
  predicted=$(field predicted_bytes "$tmp/out/metrics.json")
  measured=$(field resident_peak_bytes "$tmp/out/metrics.json")
  if [[ -z "$measured" || "$measured" == 0 ]]; then
    echo "SKIP: no resident memory figures here (/proc/self/status)"
    exit 0
  fi
  printf '%8.1f MiB predicted, %8.1f MiB measured: %s\n' \
    "$(bc -l <<<"$predicted / 1048576")" "$(bc -l <<<"$measured / 1048576")" \
    "${*//$tmp\//}"
  if ((predicted < measured || predicted > measured + measured / 10 + slack)); then
    echo "FAIL: $*: predicted $predicted bytes, measured $measured"
    failures=$((failures + 1))
  fi
}

# Two threads unless a case says otherwise: the libraries' share of the
# prediction grows with the thread count, and what they touch is measured
# here on two.
shape=(--seq=512 --anchors=32 --threads=2)
packed=$(config packed)
for mode in materialize save checkpoint selective fused; do
  check "${shape[@]}" --config="$packed" --mode="$mode"
done
check --seq=512 --anchors=32 --threads=1 --config="$packed"
check "${shape[@]}" --config="$(config blas pack_weight: false)"
check "${shape[@]}" --config="$(config blas pack_weight: false)" --mode=checkpoint
check "${shape[@]}" --config="$(config filter gradient_filter: 0.01)"
check "${shape[@]}" --config="$(config trainable trainable: true)"
check "${shape[@]}" --config="$(config double dtype: FLOAT64)" --mode=save
check "${shape[@]}" --config="$packed" --loss=dspark
check "${shape[@]}" --config="$packed" --compare_modes
check --seq=2048 --anchors=128 --threads=2 --config="$packed" --mode=materialize
check --seq=1024 --anchors=64 --threads=2 --config="$packed" --vocab=50000 --hidden=256
check --seq=64 --anchors=4 --threads=2 --config="$packed" --vocab=97 --hidden=16

# The limit is checked against the whole prediction: 97 MiB cannot hold
# this run's weight, its two laid-out copies and the rest (it peaks at
# about 240 MiB).
err=$("$bin" --seq=512 --anchors=32 --hidden=1024 --vocab=16384 \
  --memory_limit=102064928 2>&1 >/dev/null)
if [[ $? != 1 || "$err" != *"weight layout 128.0 MiB"*"are available (--memory_limit)"* ]]; then
  echo "FAIL: --memory_limit=102064928: $err"
  failures=$((failures + 1))
fi

if [[ $failures != 0 ]]; then
  echo "$failures case(s) failed"
  exit 1
fi
echo "all cases passed"
