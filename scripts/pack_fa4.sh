#!/usr/bin/env bash
# Packs flash-attn-4 (requirements-gpu.txt) for a GPU machine with no package index, in two halves under 64 MiB
# each: .fa4a holds the CUTLASS DSL's CUDA 13 module (55 MB with zstd), .fa4b the other wheels, the rest of the
# CUDA 13 wheel, the token cache and a zstd binary. scripts/install_fa4_offline.sh installs them there. Run it in
# the repository root of a machine with an index, after data/prepare.py:
#     bash scripts/pack_fa4.sh && echo /.fa4a/ >> .git/info/exclude && echo /.fa4b/ >> .git/info/exclude
set -euo pipefail
wheels=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$wheels" \
  flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 \
  torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5
rm -rf .fa4a .fa4b && mkdir -p .fa4a .fa4b/bin "$wheels/cu13"
unzip -q "$wheels"/nvidia_cutlass_dsl_libs_cu13-*.whl -d "$wheels/cu13" && rm "$wheels"/nvidia_cutlass_dsl_libs_cu13-*.whl
module=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
zstd -19 -T0 --long=27 -q "$wheels/cu13/$module" -o .fa4a/cutlass_ir.so.zst
tar -c -C "$wheels/cu13" --exclude="$(basename $module)" . | zstd -19 -T0 -q > .fa4b/cu13_rest.tar.zst
cp "$wheels"/*.whl .fa4b/
tar -c data/cache/gutenberg | zstd -19 -T0 -q > .fa4b/gutenberg.tar.zst
cp "$(command -v zstd)" .fa4b/bin/
ldd "$(command -v zstd)" | awk '/=>/ {print $3}' | grep -Ev 'libc\.so|libpthread|ld-linux' | xargs -I{} cp {} .fa4b/bin/
rm -rf "$wheels"
du -sh .fa4a .fa4b
