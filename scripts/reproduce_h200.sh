#!/usr/bin/env bash
# Reproduces the figures of docs/PERFORMANCE.md (and TIME_TO_QUALITY.md's lever screens, COLD_START.md's bench rows)
# on one H200, each under the results entry the document cites.
#     bash scripts/reproduce_h200.sh PART... [-- RESULTS_FILE]      # default RESULTS_FILE: out/h200/results.json
# Parts, in the document's order, with their time on one H200 (warm compiler caches; cold adds about 20 s per
# compiled shape): ceilings (1 min), current (8 min), accumulation (2 min), loss (2 min), matched (5 min, then
# compare.py with no GPU), tune (15 min), levers (9 min), quack (6 min), push (10 min), cold (10 min; a fresh
# machine for its first profile), static (5 min), early (6 min), speedrun (about 70 min: docs/TIME_TO_QUALITY.md's
# runs, in parts that also run alone: screens, the kept levers' screens; speed, the speed candidate's seeds and
# verdict; contexts, the contexts in one shape and the verdict with them; speed6, the six-block candidate's screens
# and verdict; quality320, the width 320 quality candidate's seeds beside the recipe before it; quality4, four passes
# at 32,768 tokens an update and their verdict at 1024 throughout; quality, the width 384 candidate's verdict, then
# its seeds before muon_split_projections), all (about 151 min).
# Merge the results file into results/h200.json with scripts/merge_results.py (parts quack's and push's into
# results/h200-levers.json, cold's, static's and early's into results/h200-cold-start.json). Needs data/cache/gutenberg;
# requirements-gpu.txt for the fa4 and quack rows, which are skipped without it. The rows of choices no longer in the
# code (docs/PERFORMANCE.md, "Levers tried and not kept") are measured by this script in the tree that had them,
# git 8e61ae0. Runs from any folder (a relative RESULTS_FILE from there); exits 1 when a command failed, after the rest.
set -uo pipefail
export PYTHONUNBUFFERED=1
PARTS="ceilings current accumulation loss matched tune levers quack push cold static early speedrun all"
PARTS+=" screens speed contexts speed6 quality320 quality4 quality"  # speedrun's parts, each alone
usage() { echo "usage: bash scripts/reproduce_h200.sh PART... [-- RESULTS_FILE]; parts: $PARTS" >&2; exit 2; }
parts=()
R=out/h200/results.json
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then
    [ $# -ge 2 ] || usage
    R=$2; shift 2
  else
    case " $PARTS " in *" $1 "*) parts+=("$1") ;; *) echo "unknown part '$1'" >&2; usage ;; esac
    shift
  fi
done
[ ${#parts[@]} -gt 0 ] || usage
mkdir -p "$(dirname "$R")"
R=$(cd "$(dirname "$R")" && pwd)/$(basename "$R")  # the results file as given from here; the parts run from the root
cd "$(dirname "$0")/.."
failed=0
set -E
trap 'failed=1' ERR  # a command that fails (outside a test such as `if has_fa4`) fails the script, after the rest
REF=config/20m_gh200.py
bench() { timeout 300 python bench.py "$@" --results_file="$R"; }
has_quack() {  # quack's kernels run here; else why not, on stderr
  python -c "from model_kernels.quack_ops import quack_problem; import torch, sys; p = quack_problem(torch.device('cuda')); sys.exit(p and f'quack-kernels cannot run here ({p}): its rows are skipped')"
}
has_fa4() { python -c "from model_kernels.attention import fa4_problem; import torch, sys; sys.exit(fa4_problem(torch.device('cuda')) is not None)"; }

ceilings() {
  python scripts/ceilings.py --name=ceilings --results_file="$R"
}
current() {  # the current-figures table
  bench $REF --name=20m-default
  bench $REF --name=20m-default-2
  bench $REF --name=20m-default-profile --profile=True
  bench $REF --name=20m-eager-mb8 --compile=False --micro_batch_size=8 --loss_impl=full
  bench $REF --name=20m-blocks-cold --compile_scope=blocks --cold=True
  bench config/50m.py --name=50m-default
  bench config/90m.py --name=90m-default
  bench $REF --name=20m-bf16-residual --residual_dtype=bfloat16
  bench $REF --name=20m-fp8-head --lm_head_fp8=True
  bench $REF --name=20m-fast-track --residual_dtype=bfloat16 --lm_head_fp8=True
  bench $REF --name=20m-fast-track-profile --residual_dtype=bfloat16 --lm_head_fp8=True --profile=True
  bench config/50m.py --name=50m-fast-track --residual_dtype=bfloat16 --lm_head_fp8=True
  bench config/90m.py --name=90m-fast-track --residual_dtype=bfloat16 --lm_head_fp8=True
  if has_fa4; then
    bench $REF --name=20m-sdpa --attention_backend=sdpa
    bench config/50m.py --name=50m-sdpa --attention_backend=sdpa
    bench config/90m.py --name=90m-sdpa --attention_backend=sdpa
  fi
}
accumulation() {
  python scripts/accumulation_check.py $REF --results_file="$R"
}
loss() {
  for dim in 320 512 768; do
    python scripts/loss_microbench.py --dim=$dim --name=loss-microbench-$dim --results_file="$R"
  done
}
matched() {  # the recipe to the end; the verdicts are compare.py's, which needs no GPU
  python train.py $REF --name=matched-default --results_file="$R" --log_interval=500 --overwrite=True
  python train.py $REF --name=matched-bf16-residual --residual_dtype=bfloat16 --results_file="$R" \
    --log_interval=500 --overwrite=True
  python train.py $REF --name=matched-fast-track --residual_dtype=bfloat16 --lm_head_fp8=True --results_file="$R" \
    --log_interval=500 --overwrite=True
}
tune() {
  python tune.py $REF --budget=15 --name=tune-20m --results_file="$R"
}
levers() {  # the levers tried and not kept that are still in the code, each beside the default in the same call
  bench $REF --name=lever-baseline
  bench $REF --name=lever-no-cudagraphs --compile_mode=default
  bench $REF --name=lever-full-loss --loss_impl=full
  bench $REF --name=lever-loss-slice-4096 --loss_chunk_tokens=4096
  bench $REF --name=lever-loss-one-slice --loss_chunk_tokens=32768
  bench $REF --name=lever-memory-budget-0.8 --activation_memory_budget=0.8
  bench $REF --name=lever-memory-budget-0.6 --activation_memory_budget=0.6
  bench $REF --name=lever-regional-compile --compile_scope=blocks
  TORCHINDUCTOR_ENABLE_PDL=1 bench $REF --name=lever-pdl
  TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 bench $REF --name=lever-coordinate-descent
  TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 bench $REF --name=lever-matmul-autotune
}

quack() {  # quack-kernels' choices and update_graph, each beside the default of the same call
  bench $REF --name=lever-update-graph-baseline
  bench $REF --name=lever-update-graph --update_graph=True
  bench $REF --name=lever-muon-update-graph-baseline --optimizer=muon
  bench $REF --name=lever-muon-update-graph --optimizer=muon --update_graph=True
  has_quack || return 0
  bench $REF --name=lever-quack-baseline
  bench $REF --name=lever-quack-mlp --mlp_impl=quack
  for dim in 320 512 768; do
    python scripts/loss_microbench.py --dim=$dim --name=loss-microbench-quack-$dim --results_file="$R"
  done
  timeout 900 python scripts/mlp_microbench.py --results_file="$R"  # quack autotunes each shape: minutes
}

push() {  # the third push beside the tree before it (68eb922, a worktree under out/), the fa4 profile, 50m and 90m
  local before=out/h200/tree-68eb922 results
  results=$(realpath -m "$R")
  git cat-file -e 68eb922^{commit} 2>/dev/null || { echo "part push needs commit 68eb922 (git fetch --unshallow)" >&2; return 1; }
  [ -f $before/bench.py ] || git worktree add --detach $before 68eb922 || return 1
  (cd $before && R=$results bench $REF --name=lever-before-push --data_dir="$OLDPWD/data/cache/gutenberg")
  bench $REF --name=lever-after-push
  bench $REF --name=lever-default-profile --profile=True
  bench $REF --name=lever-update-graph-first-update --update_graph=True
  bench config/50m.py --name=lever-50m-baseline
  bench config/90m.py --name=lever-90m-baseline
  has_quack || return 0
  bench $REF --name=lever-quack-chunked --loss_impl=quack_chunked
  bench config/50m.py --name=lever-50m-quack-chunked --loss_impl=quack_chunked
  bench config/50m.py --name=lever-50m-quack-mlp --mlp_impl=quack
  bench config/90m.py --name=lever-90m-quack-mlp --mlp_impl=quack
}
cold() {  # docs/COLD_START.md: the first update by phase, cold and warm; each compile scope from empty caches (twice),
  # then blocks in one set of empty caches and warm; 50m with each scope; the kernels of each scope; train.py's Muon
  # recipe from empty caches; a loaded compile cache. Rows of older code ran at the commits the document names.
  python scripts/cold_start_profile.py $REF --cold=True --compile_scope=model --name=cold-start-20m-model \
    --results_file="$R"
  python scripts/cold_start_profile.py $REF --cold=True --name=cold-start-20m-blocks --results_file="$R"
  local g
  for g in g1 g2; do
    bench $REF --cold=True --compile_scope=blocks --name=cold-bench-20m-blocks-grads-in-graph-$g
    bench $REF --cold=True --compile_scope=model --name=cold-bench-20m-model-$g
  done
  local caches; caches=$(mktemp -d)
  export TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton
  export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$caches/fa4
  bench $REF --compile_scope=blocks --name=empty-cache-bench-20m-blocks-grads-in-graph
  bench $REF --compile_scope=blocks --name=warm-bench-20m-blocks-grads-in-graph-1
  bench $REF --compile_scope=blocks --name=warm-bench-20m-blocks-grads-in-graph-2
  python scripts/cold_start_profile.py $REF --compile_scope=blocks --name=warm-start-profile-20m-blocks --results_file="$R"
  unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR FLASH_ATTENTION_CUTE_DSL_CACHE_DIR
  bench config/50m.py --cold=True --compile_scope=blocks --name=cold-bench-50m-blocks-grads-in-graph
  bench config/50m.py --cold=True --compile_scope=model --name=cold-bench-50m-model
  bench config/90m.py --cold=True --compile_scope=blocks --name=cold-bench-90m-blocks-early-helpers
  bench $REF --compile_scope=model --profile=True --name=20m-model-kernels
  bench $REF --compile_scope=blocks --profile=True --name=20m-blocks-kernels
  local scope fresh
  for scope in model:model-early-helpers blocks:blocks-grads-in-graph; do  # inside blocks' captured update Muon is eager
    fresh=$(mktemp -d)
    TORCHINDUCTOR_CACHE_DIR=$fresh/i TRITON_CACHE_DIR=$fresh/t FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$fresh/f \
      timeout 300 python train.py config/20m_muon_wsd.py --compile_scope=${scope%%:*} --train_subset_tokens=1310721 \
      --val_subset_tokens=65536 --epochs=1 --overwrite=True --results_file="$R" \
      --name=cold-train-20m-muon-wsd-${scope#*:}
  done
  bench $REF --cold=True --compile_cache=$caches/20m.compile --name=cold-bench-20m-blocks-cache-save --warmup=3 \
    --steps=5 --windows=1
  bench $REF --cold=True --compile_cache=$caches/20m.compile --name=cache-load-bench-20m-blocks
  local train="python train.py config/20m_muon_wsd.py --train_subset_tokens=1310721 --val_subset_tokens=65536
    --epochs=1 --overwrite=True --results_file=$R --compile_cache=$caches/muon.compile"
  for name in cold-train-20m-muon-wsd-blocks-cache-save cache-load-train-20m-muon-wsd-blocks; do
    fresh=$(mktemp -d)
    TORCHINDUCTOR_CACHE_DIR=$fresh/i TRITON_CACHE_DIR=$fresh/t FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$fresh/f \
      timeout 300 $train --name=$name
  done
  TORCHINDUCTOR_CACHE_DIR=$fresh/i TRITON_CACHE_DIR=$fresh/t FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$fresh/f \
    timeout 300 $train --name=warm-train-20m-muon-wsd-blocks  # the caches the loaded run filled
}
static() {  # docs/COLD_START.md, static_launch_user_kernels off and on: each from empty caches saving a compile cache,
  # warm twice on those caches, then loaded into other empty caches (each entry's first_update_graphs counts the
  # kernels its cached graphs launched from their binaries; the Triton cache's entries after each run are printed,
  # with the binaries they hold: kernels' .cubin, launchers' .so). A process importing what a run imports goes first,
  # so that the first run timed is not also the first to read the packages from disk.
  local on name saved run
  python -c "import bench" || return 1
  for on in False True; do
    name=20m-static-launch-$([ $on = True ] && echo on || echo off)
    saved=$(mktemp -d)
    for run in cold warm1 warm2 load; do
      (
        caches=$saved file=
        [ $run = load ] && caches=$(mktemp -d)
        case $run in cold | load) file=--compile_cache=$saved/20m.compile ;; esac  # written, then read
        export TORCHINDUCTOR_CACHE_DIR=$caches/i TRITON_CACHE_DIR=$caches/t FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$caches/f
        bench $REF --static_launch_user_kernels=$on $file --name=$run-bench-$name
        status=$?
        echo "$run-bench-$name: $(ls "$TRITON_CACHE_DIR" | wc -l) entries in Triton's cache:" \
          "$(cd "$TRITON_CACHE_DIR" && ls ./*/ | grep -E '[.](cubin|so)$' | sort | uniq -c | awk '{printf "%s:%s ", $2, $1}')"
        exit $status  # the subshell's status is the bench's: its ERR trap's failed=1 stays in the subshell
      )
    done
  done
}
early() {  # docs/COLD_START.md, the helper children started at the process's start against at the plan, alternating,
  # twice each: a script run as itself starts them before it imports torch (first_calls.start_early); called through
  # its main(), as here with python -c, at the plan. Each run in new, empty cache folders.
  local config how i fresh
  local main='import sys, importlib; sys.exit(importlib.import_module(sys.argv[1]).main(sys.argv[2:]))'
  for config in 20m_gh200 90m; do
    for i in 1 2; do
      bench config/$config.py --cold=True --name=cold-bench-${config%_gh200}-helpers-early-$i
      timeout 300 python -c "$main" bench config/$config.py --cold=True --results_file="$R" \
        --name=cold-bench-${config%_gh200}-helpers-at-plan-$i
    done
  done
  for i in 1 2; do
    for how in early at-plan; do
      fresh=$(mktemp -d)
      export TORCHINDUCTOR_CACHE_DIR=$fresh/i TRITON_CACHE_DIR=$fresh/t FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$fresh/f
      local run=(train.py)
      [ $how = early ] || run=(-c "$main" train)
      timeout 300 python "${run[@]}" config/20m_muon_wsd.py --train_subset_tokens=1310721 --val_subset_tokens=65536 \
        --epochs=1 --overwrite=True --results_file="$R" --name=cold-train-20m-muon-wsd-helpers-$how-$i
    done
  done
  unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR FLASH_ATTENTION_CUTE_DSL_CACHE_DIR
}
# TIME_TO_QUALITY.md's runs. SPLIT: the context schedule's contexts split as they ran before context_windows (the
# rows below but the verdict with the contexts in one shape). NARROW: the width 320 candidate's keys on today's
# config/20m_quality.py (the docs' NARROW; tests/test_settings.py holds the two to one list). EIGHT: the speed
# candidate's recipe as its rows below ran, before six blocks with muon_split_projections (the preset's eight blocks,
# Muon on whole projections).
SPLIT=--context_windows=False
EIGHT="--n_layers=0 --muon_split_projections=False"
NARROW="--dim=320 --n_heads=5 --hidden_dim=896 --seq_len_schedule=256:0.3,512:0.6 --tokens_per_update=16384
  --micro_batch_size=16 --muon_lr=0.003 --muon_split_projections=False"
screens() {  # "The speedrun's levers, screened": each kept lever on the shipped recipe, then its cost; the levers not
  # kept left the code, and their rows ran this part at commit 94da7b6
  local recipe=config/20m_muon_wsd.py name args
  while read -r name args; do
    timeout 300 python train.py $recipe $args --name=screen-$name --results_file="$R" --overwrite=True
    case $name in context-ramp) ;; *) bench $recipe $args --name=cost-$name --warmup=10 --steps=50 --windows=3 ;; esac
  done <<'LEVERS'
base
qk-norm --qk_norm=True
value-emb2 --value_embeddings=2
normuon --normuon=True
ema-0.98 --ema=0.98
context-ramp --seq_len_schedule=256:0.3,512:0.6
LEVERS
}
speed() {  # "The speed candidate": its three seeds, each alone (the first fills the caches of its three contexts), and
  # its 5-seed verdict beside the reference's 3 seeds
  local s
  for s in 1337 1338 1339; do
    timeout 300 python train.py config/20m_speed.py $EIGHT $SPLIT --seed=$s --target_loss=4.2462 --overwrite=True \
      --name=20m-speed-winners-14m-seed$s --results_file="$R"
  done
  timeout 600 python compare.py config/20m_speed.py $EIGHT $SPLIT --mode=time-to-target --seeds=5 \
    --target_loss=4.2462 --target_baseline=config/20m_gh200.py --target_baseline_seeds=3 --name=20m-speed-winners \
    --results_file="$R"
}
contexts() {  # "The contexts in one shape": seed 1339 split (once to fill its caches, then warm), then in whole rows;
  # then the 5-seed verdict with the contexts in one shape (the candidate's settings now), beside the reference's 3
  local name
  for name in split-cold split windows; do
    timeout 300 python train.py config/20m_speed.py $EIGHT $([ $name = windows ] || echo $SPLIT) --seed=1339 \
      --target_loss=4.2462 --overwrite=True --name=20m-speed-seed1339-$name --results_file="$R"
  done
  python compare.py --baseline=20m-speed-seed1339-split --optimized=20m-speed-seed1339-windows --results_file="$R"
  timeout 900 python compare.py config/20m_speed.py $EIGHT --mode=time-to-target --seeds=5 --target_loss=4.2462 \
    --target_baseline=config/20m_gh200.py --target_baseline_seeds=3 --name=20m-speed-context-windows --results_file="$R"
}
wait_each() {  # each background run's status, so that a failed one trips the ERR trap as a plain command does
  local p
  for p in "$@"; do wait "$p"; done
}
speed6() {  # "The speed candidate" now: with muon_split_projections, eight blocks on 13M tokens and on 14M, then six
  # blocks and seven, four runs at once (the losses compare); then its 5-seed verdict beside the reference's 3 seeds
  # after a short run that compiles the reference's graphs
  local s pids=()
  for s in 1337 1338 1339; do  # the preset's eight blocks on 13M tokens, and on 14M beside them
    timeout 200 python train.py config/20m_speed.py --n_layers=0 --train_subset_tokens=13000000 --seed=$s \
      --target_loss=4.2462 --overwrite=True --name=screen-speed-13m-split-s$s --results_file="$R" & pids+=($!)
  done
  timeout 200 python train.py config/20m_speed.py --n_layers=0 --seed=1337 --target_loss=4.2462 --overwrite=True \
    --name=screen-speed-14m-split-s1337 --results_file="$R" & pids+=($!)
  wait_each "${pids[@]}"; pids=()
  for s in 1337 1338 1339; do  # six blocks (the config's), and seven beside them
    timeout 200 python train.py config/20m_speed.py --seed=$s --target_loss=4.2462 --overwrite=True \
      --name=screen-speed-l6-split-s$s --results_file="$R" & pids+=($!)
  done
  timeout 200 python train.py config/20m_speed.py --n_layers=7 --seed=1337 --target_loss=4.2462 --overwrite=True \
    --name=screen-speed-l7-split-s1337 --results_file="$R" & pids+=($!)
  wait_each "${pids[@]}"; pids=()
  timeout 90 python train.py config/20m_gh200.py --epochs=2 --train_subset_tokens=655361 --val_subset_tokens=65536 \
    --overwrite=True --name=warm-reference-graphs-speed --results_file="$R"
  timeout 600 python compare.py config/20m_speed.py --mode=time-to-target --seeds=5 --target_loss=4.2462 \
    --target_baseline=config/20m_gh200.py --target_baseline_seeds=3 --name=20m-speed-l6-split --results_file="$R"
}
quality320() {  # "The quality candidate": the width 320 candidate and the recipe before it (before: its
  # regularisation then) over 3 and 4 passes and at seeds 1338 and 1339, then its seeds, each alone (the docs' rows
  # ran four at once)
  local before="--weight_decay=0.1 --cooldown_fraction=0.5 --ema=0.995" e s
  for e in 3 4; do
    timeout 600 python train.py config/20m_quality.py $SPLIT $NARROW $before --epochs=$e --overwrite=True \
      --name=screen-quality-q$e-ema-winners --results_file="$R"
  done
  for s in 1338 1339; do
    timeout 600 python train.py config/20m_quality.py $SPLIT $NARROW $before --seed=$s --overwrite=True \
      --name=screen-quality-q3-ema-winners-seed$s --results_file="$R"
  done
  for s in 1337 1338 1339 1340; do
    timeout 600 python train.py config/20m_quality.py $SPLIT $NARROW --seed=$s --overwrite=True \
      --name=20m-quality-seed$s --results_file="$R"
  done
}
quality4() {  # four passes of the width 320 at 32,768 tokens an update, each seed alone (the docs' rows ran six and
  # three at once but seed 1338); then the same at 1024 throughout: their 5-seed verdict beside the reference's two
  local s
  for s in 1337 1338 1339 1340 1341; do
    timeout 600 python train.py config/20m_quality.py $SPLIT $NARROW --epochs=4 --tokens_per_update=32768 \
      --micro_batch_size=32 --muon_lr=0.004 --seed=$s --overwrite=True --name=20m-quality-q4-32k-seed$s \
      --results_file="$R"
  done
  timeout 900 python compare.py config/20m_quality.py $NARROW --epochs=4 --tokens_per_update=32768 \
    --micro_batch_size=32 --muon_lr=0.004 --seq_len_schedule= --mode=time-to-target --seeds=5 --target_loss=3.80 \
    --target_baseline=config/20m_gh200.py --target_baseline_seeds=2 --name=20m-quality-q4-32k-ctx-none \
    --results_file="$R"
}
quality() {  # "The quality candidate": its verdict (width 384, 24,576 an update, three passes, Muon on the projections
  # apart) beside the reference's two seeds, after short runs that compile each recipe's graphs; then the candidate
  # before muon_split_projections, its seeds each alone after the reference (the docs' rows ran four at once)
  local s warm="--epochs=2 --train_subset_tokens=655361 --val_subset_tokens=65536 --overwrite=True"
  timeout 120 python train.py config/20m_quality.py $warm --name=warm-quality-graphs --results_file="$R"
  timeout 90 python train.py config/20m_gh200.py $warm --name=warm-reference-graphs --results_file="$R"
  timeout 900 python compare.py config/20m_quality.py --mode=time-to-target --seeds=5 --target_loss=3.80 \
    --eval_interval=0 --target_baseline=config/20m_gh200.py --target_baseline_seeds=2 --name=20m-quality-split \
    --results_file="$R"
  timeout 300 python train.py config/20m_gh200.py --seed=1337 --overwrite=True --name=20m-reference-seed1337-solo \
    --results_file="$R"
  for s in 1337 1338 1339 1340 1341; do
    timeout 300 python train.py config/20m_quality.py --muon_split_projections=False --eval_interval=0 --seed=$s \
      --overwrite=True --name=20m-quality-seed$s-solo --results_file="$R"
  done
}
speedrun() { screens; speed; contexts; speed6; quality320; quality4; quality; }

for part in "${parts[@]}"; do
  case $part in
    all) ceilings; current; accumulation; loss; matched; tune; levers; quack; push; cold; static; early; speedrun ;;
    *) echo "=== $part"; $part ;;
  esac
done
python scripts/summarize.py "$R" || failed=1
[ $failed = 0 ] || echo "=== a command above failed (its output says which); the others ran" >&2
exit $failed
