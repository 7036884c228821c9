# Installs flash-attn-4 (requirements-gpu.txt) on a GPU machine without a package index, from what
# scripts/pack_fa4.sh packed, under /tmp/site; source it (it exports PYTHONPATH). The CUTLASS DSL's CUDA 13 module
# (.fa4a) is expected at /tmp/fa4stash/cutlass_ir.so.zst, copied there first when a transfer limit splits the two
# halves; .fa4b holds the rest, the token cache and a zstd binary for machines without one.
zstd() { LD_LIBRARY_PATH=$PWD/.fa4b/bin "$PWD/.fa4b/bin/zstd" "$@"; }
mkdir -p data/cache && zstd -dcq .fa4b/gutenberg.tar.zst | tar -x || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .fa4b/*.whl || exit 1
zstd -dcq .fa4b/cu13_rest.tar.zst | tar -x -C /tmp/site || exit 1
zstd -dcq /tmp/fa4stash/cutlass_ir.so.zst \
  > /tmp/site/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so || exit 1
# --target skips the DSL's .pth file, which puts dsl_packages on the path; compiled kernels are kept on disk
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
python3 -c "import torch, flash_attn.cute, importlib.metadata as m; print('torch', torch.__version__, 'flash-attn-4', m.version('flash-attn-4'), 'cutlass-dsl', m.version('nvidia-cutlass-dsl'))"
