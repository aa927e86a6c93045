#!/usr/bin/env bash
# What only the dflash_head binary does (argv, exit codes, standard output),
# run on the built binary: each case's exit code and message.
set -uo pipefail

bin="$1"
check_config="$2"
build="$3"  # cuda or cpu: whether this build can run a CUDA head.
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

# fail MESSAGE: counts a failed case.
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

expect 1 "unexpected argument 'extra'" -- "$bin" "${small[@]}" extra
# What an unset shell variable gives (--out=$OUT, --out "$OUT") is an error
# naming the flag, in either form.
for flag in config loss gamma lk kl_scale kl_decay mode chunk_blocks threads \
  seed batch seq anchors block hidden vocab inputs out memory_limit; do
  expect 1 "--$flag: needs a value, got ''" -- "$bin" "${small[@]}" "--$flag="
  expect 1 "--$flag: needs a value, got ''" -- "$bin" "${small[@]}" "--$flag" ''
done
expect 1 "--memory_limit: must be a positive number" -- "$bin" --memory_limit=-5
expect 1 "--chunk_blocks: must be > 0 (chunking.blocks_per_chunk), got 0" -- \
  "$bin" "${small[@]}" --chunk_blocks=0
expect 1 "head.hidden_size: must lie in [1, 2147483647] (the GEMMs take int32 sizes), got 1099511627776" -- \
  "$bin" "${small[@]}" --hidden=1099511627776
# A file-size limit while writing --out: an error naming the file, no
# temporaries left, no death by SIGXFSZ.
mkdir -p "$tmp/fsize"
err=$(bash -c 'ulimit -f 1 && exec "$@"' _ "$bin" "${small[@]}" \
  --out="$tmp/fsize" 2>&1 >/dev/null)
code=$?
[[ $code == 1 && "$err" == *"File too large"* && -z "$(ls -A "$tmp/fsize")" ]] ||
  fail "ulimit -f 1: exit $code, stderr: $err, left: $(ls -A "$tmp/fsize")"
# Thread counts: bounded, and more than the CPUs run on the CPUs, said so.
expect 1 "--threads: must lie in [0, 1024] (0: every usable CPU), got 100000" -- \
  "$bin" "${small[@]}" --threads=100000
expect 1 "--threads: must lie in [0, 1024] (0: every usable CPU), got -3" -- \
  "$bin" "${small[@]}" --threads=-3
expect 0 "dflash_head: note: head.threads is 1024, more than the $(nproc) CPU(s) this process may use: ran on $(nproc)" -- \
  "$bin" "${small[@]}" --threads=1024
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

# Anchor blocks the sequence cannot hold: refused before any work (the
# default H 1024, V 32768 would take seconds), no output written.
expect 1 "--anchors: 64 anchor blocks do not fit a synthetic sequence of 64 tokens (--seq): it holds at most 45" -- \
  "$bin" --seq=64 --anchors=64 --out="$tmp/anchors"
[[ -e "$tmp/anchors/grad_hidden.npy" ]] && fail "--anchors=64: wrote outputs"

# A standard output that cannot be written is an error exit.
err=$("$bin" "${small[@]}" 2>&1 >/dev/full)
if [[ $? == 0 || "$err" != *"No space left on device"* ]]; then
  fail "stdout to /dev/full: $err"
fi

# valid_outputs DIR: the small run's metrics.json and grad_hidden.npy
# [1, 5, 4, 16] of float32 (a 128-byte header and 1280 bytes), nothing else.
valid_outputs() {
  local listing
  listing=$(ls -A "$1" | tr '\n' ' ')
  [[ "$listing" == "grad_hidden.npy metrics.json " ]] &&
    [[ $(stat -c %s "$1/grad_hidden.npy") == 1408 ]] &&
    grep -q '"weighted_rows"' "$1/metrics.json"
}

# The outputs never depend on standard output: with it full, closed or cut
# short they are written, and then one line says what failed.
out="$tmp/stdout_full"
err=$("$bin" "${small[@]}" --out="$out" 2>&1 >/dev/full)
code=$?
[[ $code == 1 && "$err" == "dflash_head: cannot write standard output: No space left on device (the outputs in $out were written)" ]] ||
  fail "stdout to /dev/full with --out: exit $code, stderr: $err"
valid_outputs "$out" || fail "stdout to /dev/full: outputs $(ls -A "$out")"

# A pipe whose reader is gone before the run starts (deterministic, unlike
# a reader that exits while the run writes).
mkfifo "$tmp/pipe"
exec 4<>"$tmp/pipe"  # Read and write, so that the next open does not wait.
exec 5>"$tmp/pipe"
exec 4<&-
out="$tmp/stdout_closed"
err=$("$bin" "${small[@]}" --out="$out" 2>&1 >&5)
code=$?
exec 5>&-
[[ $code == 1 && "$err" == "dflash_head: cannot write standard output: Broken pipe (the outputs in $out were written)" ]] ||
  fail "stdout closed with --out: exit $code, stderr: $err"
valid_outputs "$out" || fail "stdout closed: outputs $(ls -A "$out")"

# | head -c10: the reader may leave before or after the report; either way
# no death by SIGPIPE, the outputs, at most one line.
out="$tmp/stdout_head"
"$bin" "${small[@]}" --out="$out" 2>"$tmp/head.err" | head -c10 >/dev/null
code=${PIPESTATUS[0]}
[[ ($code == 0 || $code == 1) && $(wc -l <"$tmp/head.err") -le 1 ]] ||
  fail "| head -c10: exit $code, stderr: $(cat "$tmp/head.err")"
valid_outputs "$out" || fail "| head -c10: outputs $(ls -A "$out")"

# An immutable grad_hidden.npy: the run fails before any output changes.
out="$tmp/immutable"
"$bin" "${small[@]}" --out="$out" >/dev/null 2>&1
cp "$out/metrics.json" "$tmp/metrics.before"
cp "$out/grad_hidden.npy" "$tmp/grad_hidden.before"
if chattr +i "$out/grad_hidden.npy" 2>/dev/null; then
  trap 'chattr -i "$out/grad_hidden.npy"' EXIT  # Else Bazel cannot clean up.
  expect 1 "$out/grad_hidden.npy: cannot replace it: Operation not permitted; no file was changed" -- \
    "$bin" "${small[@]}" --seed=9 --out="$out"
  chattr -i "$out/grad_hidden.npy"
  trap - EXIT
  cmp -s "$out/metrics.json" "$tmp/metrics.before" ||
    fail "immutable grad_hidden.npy: metrics.json changed"
  cmp -s "$out/grad_hidden.npy" "$tmp/grad_hidden.before" ||
    fail "immutable grad_hidden.npy: grad_hidden.npy changed"
  valid_outputs "$out" || fail "immutable: left $(ls -A "$out")"
else
  echo "SKIP: chattr +i is refused here; no immutable grad_hidden.npy case"
fi

# What a killed run left (its pid gone) is removed by the next run; a live
# process's file is not.
out="$tmp/leftovers"
mkdir -p "$out"
sh -c 'exit 0' &
dead=$!
wait "$dead"
for name in ".grad_hidden.npy.tmp-$dead-000000000001" \
  ".metrics.json.tmp-$dead-000000000002" \
  ".grad_lm_head.npy.old-$dead-000000000003" \
  ".metrics.json.tmp-$$-000000000004"; do
  echo left >"$out/$name"
done
"$bin" "${small[@]}" --out="$out" >/dev/null 2>&1
listing=$(ls -A "$out" | tr '\n' ' ')
[[ "$listing" == ".metrics.json.tmp-$$-000000000004 grad_hidden.npy metrics.json " ]] ||
  fail "leftovers: $listing"

# Memory that runs out past the checks (a --memory_limit above what the
# process may hold): one line saying so, exit 1, not a crash.
if [[ -n "${ASAN_OPTIONS:-}" ]]; then
  echo "SKIP: ASan's shadow memory does not fit under ulimit -v"
else
  err=$(bash -c 'ulimit -v 1000000 && exec "$@"' _ "$bin" \
    --memory_limit=64G --vocab=200000 --hidden=4096 --seq=256 --anchors=8 \
    --block=4 --threads=1 2>&1 >/dev/null)
  code=$?
  [[ $code == 1 && "$err" == "dflash_head: out of memory: a size passed the checks"* && $(wc -l <<<"$err") == 1 ]] ||
    fail "ulimit -v: exit $code, stderr: $err"
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
# A layout that dflash_head would replace is still checked (--anchors here).
echo 'layout { num_anchors: 0 } head { vocab_size: 100 hidden_size: 8 } loss { dflash {} }' \
  >"$tmp/anchors0.textproto"
expect 1 "layout.num_anchors: must be > 0, got 0" -- \
  "$check_config" --config="$tmp/anchors0.textproto"
expect 1 "layout.num_anchors: must be > 0, got 0" -- \
  "$bin" --config="$tmp/anchors0.textproto" "${small[@]}"
# A CUDA head: refused alike where the build has no CUDA; a CUDA build's
# check_config accepts it (C++ and Python run it), dflash_head runs CPU heads.
echo 'head { vocab_size: 100 hidden_size: 8 backend: CUDA } loss { dflash {} }' \
  >"$tmp/cuda.textproto"
if [[ "$build" == cpu ]]; then
  for program in "$check_config" "$bin"; do
    expect 1 "head.backend: CUDA needs a build with the CUDA toolkit, and this one has none (CPU runs anywhere), got CUDA" -- \
      "$program" --config="$tmp/cuda.textproto"
  done
else
  expect 0 "" -- "$check_config" --config="$tmp/cuda.textproto"
  expect 1 "head.backend: dflash_head runs the CPU backend" -- \
    "$bin" --config="$tmp/cuda.textproto"
fi
echo 'head { vocab_size: 100 hidden_size: 8 } loss { dflash {} }' \
  >"$tmp/good.textproto"
expect 2 "unexpected argument 'extra'" -- \
  "$check_config" --config="$tmp/good.textproto" extra
# A pipe with no reader: one line, not a death by SIGPIPE.
mkfifo "$tmp/pipe2"
exec 4<>"$tmp/pipe2"
exec 5>"$tmp/pipe2"
exec 4<&-
err=$("$check_config" --config="$tmp/good.textproto" 2>&1 >&5)
code=$?
exec 5>&-
[[ $code == 1 && "$err" == "check_config: cannot write standard output: Broken pipe" ]] ||
  fail "check_config to a closed pipe: exit $code, stderr: $err"
err=$("$check_config" --config="$tmp/good.textproto" 2>&1 >/dev/full)
code=$?
[[ $code == 1 && "$err" == "check_config: cannot write standard output: No space left on device" ]] ||
  fail "check_config >/dev/full: exit $code, stderr: $err"

if [[ $failures != 0 ]]; then
  echo "$failures case(s) failed"
  exit 1
fi
echo "all cases passed"
