#!/usr/bin/env bash
# What only the dflash_head binary does (argv, exit codes, standard output),
# run on the built binary: each case's exit code and message.
set -uo pipefail

bin="$1"
check_config="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
small=(--hidden=16 --vocab=97 --seq=64 --anchors=5 --block=4 --threads=1)
failures=0

# expect CODE SUBSTRING -- COMMAND...: the exit code, and stderr holding
# SUBSTRING; every command is bounded in time (a hang is a failure).
expect() {
  local code="$1" want="$2"
  shift 3
  local err got
  err=$(timeout 60 "$@" 2>&1 >/dev/null)
  got=$?
  if [[ "$got" != "$code" || "$err" != *"$want"* ]]; then
    echo "FAIL: $* -> exit $got, stderr: $err (wanted exit $code, '$want')"
    failures=$((failures + 1))
  fi
}

expect 1 "unexpected argument 'extra'" -- "$bin" "${small[@]}" extra
expect 1 "--gamma: needs a value, got ''" -- "$bin" "${small[@]}" --gamma=
expect 1 "--memory_limit: must be a positive number" -- "$bin" --memory_limit=-5
expect 1 "--config: $tmp: is a directory" -- "$bin" --config="$tmp"
expect 1 "are available (--memory_limit)" -- \
  "$bin" --vocab=1000000 --hidden=8192 --memory_limit=8G

# Inputs: a FIFO is refused at once; synthetic flags are errors with them.
inputs="$tmp/inputs"
mkdir -p "$inputs"
"$bin" "${small[@]}" --out="$tmp/ignored" >/dev/null 2>&1
expect 1 "hidden.npy: cannot open: No such file" -- "$bin" --inputs="$inputs"
mkfifo "$inputs/hidden.npy"
expect 1 "hidden.npy: is a FIFO (named pipe), expected a regular file" -- \
  "$bin" --inputs="$inputs"
expect 1 "--vocab: shapes the synthetic batch" -- \
  "$bin" --inputs="$inputs" --vocab=10

# A standard output that cannot be written is an error exit.
err=$("$bin" "${small[@]}" 2>&1 >/dev/full)
if [[ $? == 0 || "$err" != *"No space left on device"* ]]; then
  echo "FAIL: stdout to /dev/full: $err"
  failures=$((failures + 1))
fi

# A good run: exit 0, its outputs, and nothing on stderr.
err=$("$bin" "${small[@]}" --out="$tmp/out/new" 2>&1 >/dev/null)
if [[ $? != 0 || -n "$err" || ! -s "$tmp/out/new/grad_hidden.npy" ]]; then
  echo "FAIL: a good run: $err"
  failures=$((failures + 1))
fi

# check_config and dflash_head agree on what they refuse.
echo 'head { vocab_size: 100 hidden_size: 8 dtype: BFLOAT16 } loss { dflash {} }' \
  >"$tmp/bf16.textproto"
expect 1 "head.dtype: BFLOAT16 is not supported on the CPU backend" -- \
  "$check_config" --config="$tmp/bf16.textproto"
expect 1 "head.dtype: BFLOAT16 is not supported on the CPU backend" -- \
  "$bin" --config="$tmp/bf16.textproto"
expect 1 "config file $tmp: is a directory" -- "$check_config" --config="$tmp"

if [[ $failures != 0 ]]; then
  echo "$failures case(s) failed"
  exit 1
fi
echo "all cases passed"
