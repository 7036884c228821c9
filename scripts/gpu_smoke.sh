#!/usr/bin/env bash
# Every GPU command the README shows, with short settings, so that a change to the training path is seen to run
# on a GPU (CUDA graphs, compile modes and kernels exist only there). About 14 minutes on one H200 from empty
# compiler caches, one step at a time. Exits non-zero, naming the command, at the first that fails. Needs the token
# cache data/cache/gutenberg (python data/prepare.py --source ../shared/data/gutenberg --out data/cache/gutenberg).
#     bash scripts/gpu_smoke.sh [RESULTS_FILE] [FIRST] [LAST]   # default out/smoke/results.json, every step
# (from any folder: the steps run from the repository root; a relative RESULTS_FILE is taken from where it started)
# Each step prints its number: after a failure or a time limit, go on from that step with the same results file
# (a step needs the runs of those before it: sample the first train's, train from the export). A step that runs
# past STEP_LIMIT seconds (default 400, well above the longest step's time) is stopped and named as failed, so that
# a hang is seen as one.
# JOBS=N (default 1) runs up to N steps at once, for a GPU whose compiles leave it idle: each step's output goes to
# logs/STEP.log beside the results file and is reported when the step ends (a failed step's last lines printed, the
# steps still running stopped); a step that needs an earlier one's run starts after it has ended, and the first
# runs alone, filling the compiler caches that most steps then read.
set -uo pipefail
export PYTHONUNBUFFERED=1
R=${1:-out/smoke/results.json}
FIRST=${2:-1}
LAST=${3:-999}
STEP_LIMIT=${STEP_LIMIT:-400}
JOBS=${JOBS:-1}
above_zero() {  # above_zero NAME VALUE WHAT: a whole number above 0, else one line saying what is wanted (exit 2)
  case $2 in
    ''|*[!0-9]*|0) echo "$1 must be a whole number $3 above 0, got '$2'" >&2; exit 2 ;;
  esac
}
above_zero FIRST "$FIRST" "(the step to start at)"
above_zero LAST "$LAST" "(the step to end at)"
above_zero STEP_LIMIT "$STEP_LIMIT" "of seconds"
above_zero JOBS "$JOBS" "of steps (1 runs them one at a time)"
if [ "$FIRST" -gt "$LAST" ]; then
  echo "FIRST ($FIRST) must not be above LAST ($LAST): no step would run" >&2; exit 2
fi
mkdir -p "$(dirname "$R")"
R=$(cd "$(dirname "$R")" && pwd)/$(basename "$R")  # the results file as given from here; the steps run from the root
cd "$(dirname "$0")/.."
LOGS=$(dirname "$R")/logs
REF=config/20m_gh200.py
SHORT_TRAIN="--epochs=1 --train_subset_tokens=655361 --val_subset_tokens=65536 --log_interval=5 --overwrite=True"
SHORT_BENCH="--warmup=3 --steps=5 --windows=1"
start=$SECONDS
passed=0
step=0
running=()           # the steps in flight (JOBS > 1)
declare -A label_of command_of pid_of started_at

ended() {  # ended STEP LABEL STATUS SECONDS COMMAND: one line saying it passed, or which failed and why (then exit)
  local status=$3
  if [ "$status" -eq 0 ]; then
    passed=$((passed + 1))
    echo "=== ok: step $1, $2 ($4 s)"
    return
  fi
  if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "=== FAILED: step $1, $2 (stopped after its $STEP_LIMIT s limit): $5"
  else
    echo "=== FAILED: step $1, $2 (exit $status): $5"
  fi
  if [ "$JOBS" -gt 1 ]; then
    echo "=== the last lines of $LOGS/$1.log:"; tail -n 40 "$LOGS/$1.log"
    stop_running
  fi
  exit 1
}

stop_running() {  # ends the steps still in flight: their timeout passes the signal on to the command
  local s
  for s in "${running[@]}"; do
    [ -f "$LOGS/$s.status" ] && continue
    echo "=== stopped: step $s, ${label_of[$s]}"
    until [ -s "$LOGS/$s.pid" ]; do sleep 0.1; done  # written as the step starts
    kill -TERM "$(cat "$LOGS/$s.pid")" 2> /dev/null
  done
  wait
}

on_signal() {  # Ctrl-C or a TERM: timeout keeps its step out of the terminal's signals, so they are ended here
  echo "=== stopped by a signal at step $step"
  [ -z "$current" ] || kill -TERM "$current" 2> /dev/null
  stop_running
  exit 130
}
current=""  # the step in flight with JOBS=1: its timeout's pid
trap on_signal INT TERM
# A signal between a step's start and the script's note of its pid waits for the note (hold_signals, then
# release_signals): on_signal before it would miss the step, then wait out the step's whole run.
deferred=""
hold_signals() {
  deferred=""
  trap 'deferred=1' INT TERM
}
release_signals() {
  trap on_signal INT TERM
  [ -z "$deferred" ] || on_signal
}

reap() {  # waits until a step in flight ends, then reports it
  local s done_step="" rest=()
  while [ -z "$done_step" ]; do
    for s in "${running[@]}"; do [ -f "$LOGS/$s.status" ] && { done_step=$s; break; }; done
    [ -n "$done_step" ] || sleep 0.2
  done
  for s in "${running[@]}"; do [ "$s" = "$done_step" ] || rest+=("$s"); done
  running=("${rest[@]}")
  wait "${pid_of[$done_step]}"
  ended "$done_step" "${label_of[$done_step]}" "$(cat "$LOGS/$done_step.status")" \
    $((SECONDS - started_at[$done_step])) "${command_of[$done_step]}"
}

after_earlier() {  # the steps that follow need the runs of those before: wait for every step in flight
  while [ "${#running[@]}" -gt 0 ]; do reap; done
}

run() {  # run LABEL COMMAND...: the command's output, then one line saying it passed or which one failed
  local label=$1; shift
  step=$((step + 1))
  if [ "$step" -lt "$FIRST" ] || [ "$step" -gt "$LAST" ]; then echo "=== step $step skipped: $label"; return; fi
  if [ "$JOBS" -eq 1 ]; then
    local t=$SECONDS status
    echo "=== $(date +%T) step $step, $label: $*"
    hold_signals
    timeout --kill-after=30 "$STEP_LIMIT" "$@" &  # in the background, so that a signal reaches on_signal at once
    current=$!
    release_signals
    wait "$current"; status=$?
    current=""
    ended "$step" "$label" $status $((SECONDS - t)) "$*"
    return
  fi
  while [ "${#running[@]}" -ge "$JOBS" ]; do reap; done
  mkdir -p "$LOGS"
  rm -f "$LOGS/$step.status" "$LOGS/$step.pid"
  echo "=== $(date +%T) step $step started, $label: $*"
  # the step's timeout, its pid written for stop_running, and its exit status when it ends (whole, by a rename)
  hold_signals
  ( timeout --kill-after=30 "$STEP_LIMIT" "$@" > "$LOGS/$step.log" 2>&1 &
    echo $! > "$LOGS/$step.pid"; wait $!; echo $? > "$LOGS/$step.ended"; mv "$LOGS/$step.ended" "$LOGS/$step.status" ) &
  pid_of[$step]=$!
  label_of[$step]=$label
  command_of[$step]="$*"
  started_at[$step]=$SECONDS
  running+=("$step")
  release_signals
}

run "train, the reference recipe" python train.py $REF --name=smoke-train --results_file="$R" $SHORT_TRAIN
after_earlier  # alone: it fills the compiler caches with the reference's kernels, which most steps then read
# stop_after_updates exits 3 (interrupted, checkpointed); the resume reads the checkpoint onto the GPU
run "train, stopped and resumed" bash -c "python train.py $REF --name=smoke-resume --results_file='$R' $SHORT_TRAIN \
  --stop_after_updates=5; [ \$? -eq 3 ] && python train.py --name=smoke-resume --resume=True --results_file='$R'"
run "train, micro-batch 16 (CUDA graphs with accumulation)" python train.py $REF --micro_batch_size=16 \
  --name=smoke-train-mb16 --results_file="$R" $SHORT_TRAIN
run "train, the declared fast track (bf16 residual, FP8 head)" python train.py $REF --residual_dtype=bfloat16 \
  --lm_head_fp8=True --name=smoke-fast-track --results_file="$R" $SHORT_TRAIN
run "train, the Muon + WSD recipe, to a target" python train.py config/20m_muon_wsd.py --name=smoke-muon-wsd \
  --results_file="$R" $SHORT_TRAIN --eval_interval=10 --target_loss=8.5
run "train, compile_scope=model (the whole model one graph, torch's CUDA graphs)" python train.py $REF \
  --compile_scope=model --name=smoke-model-scope --results_file="$R" $SHORT_TRAIN
run "train, the speed candidate (contexts in whole rows, value embeddings)" python train.py config/20m_speed.py \
  --name=smoke-speed --results_file="$R" $SHORT_TRAIN --eval_interval=10
run "train, the quality candidate (passes, the weights' average)" python train.py config/20m_quality.py \
  --name=smoke-quality --results_file="$R" $SHORT_TRAIN --epochs=2 --eval_interval=10
run "bench" python bench.py $REF --name=smoke-bench --results_file="$R" $SHORT_BENCH --profile=True --partial_probe=True
run "bench, micro-batch 16" python bench.py $REF --micro_batch_size=16 --name=smoke-bench-mb16 --results_file="$R" \
  $SHORT_BENCH
# eager: the presets' shapes and kernels without three more compiles (bench.py's compiled presets are timed apart)
run "bench, presets" python bench.py $REF --presets=20m,50m,90m --name=smoke-presets --results_file="$R" $SHORT_BENCH \
  --compile=False
# two minutes: with flash-attn-4 installed each run starts about 25 s later (its import and kernels), and a
# one-minute budget left no room to confirm the incumbent
run "tune" python tune.py $REF --budget=2 --name=smoke-tune --results_file="$R" --tuned_dir=out/smoke/tuned
run "compare, time to a target" python compare.py config/20m_muon_wsd.py --mode=time-to-target --seeds=3 \
  --target_loss=8.5 --eval_interval=10 --target_baseline=$REF --name=smoke-ttq --results_file="$R" \
  --plot=out/smoke/ttq.png --train_subset_tokens=655361 --epochs=1
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  run "torchrun, 2 GPUs" torchrun --nproc_per_node=2 train.py $REF --micro_batch_size=16 --name=smoke-ddp \
    --results_file="$R" $SHORT_TRAIN
else
  echo "=== skipped: torchrun on 2 GPUs (this machine has one)"
fi
after_earlier  # tune's selected config, which the tuned compare reads
run "compare, the tuned config" python compare.py $REF --tuned=True --name=smoke-compare --results_file="$R" \
  --plot=out/smoke/compare.png --train_subset_tokens=655361 --val_subset_tokens=65536 --epochs=1 --rerun=True
run "sample" python sample.py $REF --name=smoke-train --prompt="It was a dark and stormy night" --max_new_tokens=32
run "export" python sample.py $REF --name=smoke-train --export_hf=out/smoke/hf
run "evaluate the checkpoint" python evaluate.py --init_from=out/smoke-train --name=smoke-eval --results_file="$R"
after_earlier  # the export
run "evaluate the export" python evaluate.py --init_from=out/smoke/hf --data_dir=data/cache/gutenberg \
  --name=smoke-eval-export --results_file="$R"
run "train from the export" python train.py $REF --init_from=out/smoke/hf --name=smoke-init --results_file="$R" \
  $SHORT_TRAIN
after_earlier  # every run in the results file
run "plot runs" python scripts/plot_runs.py "$R" --out=out/smoke/runs.png
after_earlier
if [ "$passed" -eq 0 ]; then  # FIRST past the last step (or only a step this machine skips): nothing was checked
  echo "=== gpu smoke ran no command: steps $FIRST to $LAST select none of this machine's $step steps" >&2
  exit 2
fi
echo "=== gpu smoke passed: $passed commands (steps $FIRST to $((LAST < step ? LAST : step))) in $((SECONDS - start)) s"
