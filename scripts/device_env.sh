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
