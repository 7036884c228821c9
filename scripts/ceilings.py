"""The GPU's two ceilings, measured as METHOD-style floors need them: a large bf16 matrix product (TFLOP/s, on
random data: zeros run faster) and a large device-to-device copy (TB/s, bytes read plus bytes written). Also the
LM head's three matmul shapes at widths 320, 512 and 768, which the loss kernels are measured against.

    python scripts/ceilings.py [--name=ceilings] [--results_file=results.json]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
import env  # noqa: E402
from results import record  # noqa: E402


def milliseconds(fn, reps=20):
    """Median of `reps` timed calls after two warmups, with CUDA events."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=max(100, reps * 5), return_mode="median")


def matmul_tflops(m, n, k, transpose_a=False):
    a = torch.randn((k, m) if transpose_a else (m, k), device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    ms = milliseconds(lambda: (a.t() if transpose_a else a) @ b)
    return 2 * m * n * k / ms / 1e9, ms


def copy_tbps(gigabytes=4):
    src = torch.randn(int(gigabytes * 2**30 // 4), device="cuda")
    dst = torch.empty_like(src)
    ms = milliseconds(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e9, ms


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="ceilings", type=common.entry_name("ceilings"))
    parser.add_argument("--results_file", default="results.json")
    args = parser.parse_args()
    common.check_gpu_script(parser, args.results_file, "the matrix product and the copy")
    torch.manual_seed(0)
    rows = {"matmul 8192^3 bf16": matmul_tflops(8192, 8192, 8192), "copy 4 GiB": copy_tbps()}
    for width in (320, 512, 768):  # 8,192 tokens x 32,000 classes: the loss's slice
        rows[f"logits {width}"] = matmul_tflops(8192, 32000, width)
        rows[f"grad_h {width}"] = matmul_tflops(8192, width, 32000)
        rows[f"grad_w {width}"] = matmul_tflops(32000, width, 8192, transpose_a=True)
    results = {name: {"rate": rate, "ms": ms} for name, (rate, ms) in rows.items()}
    record(args.results_file, [args.name], {"run_id": env.new_run_id(), "results": results,
                                             "environment": env.fingerprint()})
    print(f"{'what':<22}{'ms':>9}{'rate':>10}")
    for name, r in results.items():
        unit = "TB/s" if name.startswith("copy") else "TFLOP/s"
        print(f"{name:<22}{r['ms']:>9.3f}{r['rate']:>10.1f} {unit}")


if __name__ == "__main__":
    main()
