# Sourced by the scripts/h200_*.sh device calls: their shared settings. NVLink multicast stays off (the device
# notes say why); new entries go to a copy of results/h200.json under $OUT, so that a call that runs out of
# time still returns them (merge it back with scripts/merge_results.py).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out/h200}; mkdir -p "$OUT"
R=$(realpath -m "$OUT/h200.json"); cp results/h200.json "$R"
BEFORE=${BEFORE:-.carry/before}   # a copy of the previous commit's tree (git archive HEAD), for before/after
DATA=$(realpath -m --relative-to="$BEFORE" data/cache/gutenberg)   # the token cache as the before tree sees it
REF=config/20m_gh200.py
# bench CONFIG [--key=value ...] runs bench.py on this tree; before CONFIG ... on the previous commit's tree.
bench() { timeout "${BENCH_TIMEOUT:-150}" python3 bench.py "$@" --results_file="$R"; }
before() { (cd "$BEFORE" && timeout "${BENCH_TIMEOUT:-150}" python3 bench.py "$@" --results_file="$R" --data_dir="$DATA"); }
# pair NAME CONFIG [--key=value ...]: NAME-before on the previous tree, then NAME-after on this one (ROUND, when
# set, is appended to both names: NAME-before-ROUND); a before/after measured in one call, as METHOD asks.
pair() {
  local name=$1; shift
  before "$@" --name="$name-before${ROUND:+-$ROUND}"
  bench "$@" --name="$name-after${ROUND:+-$ROUND}"
}
# interleaved NAME CONFIG [--key=value ...]: two pairs in turn, NAME-before-1, NAME-after-1, -2, -2
interleaved() { local round; for round in 1 2; do ROUND=$round pair "$@"; done; }
