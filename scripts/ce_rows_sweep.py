"""The fused loss's Triton kernel alone, on the GPU, at several launch shapes: microseconds per call on one
slice of logits, the bandwidth that is, and the error of the loss and gradient against float32 torch.
Picks model_kernels.cross_entropy.ROWS_BLOCK and ROWS_NUM_WARPS; recorded under NAME in the results file.

    python scripts/ce_rows_sweep.py [--rows=8192] [--vocab=32000] [--name=ce-rows-sweep]
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import env  # noqa: E402
from results import record  # noqa: E402
import common  # noqa: E402
from model_kernels import cross_entropy  # noqa: E402

LAUNCHES = [(32768, 32), (32768, 16), (16384, 16), (16384, 8), (8192, 16), (8192, 8), (8192, 4), (4096, 8),
            (4096, 4), (2048, 4)]


def time_us(kernel, logits, targets, reps):
    kernel(logits, targets)  # compiles; the logits now hold gradients, which time the same
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        kernel(logits, targets)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=common.positive_int, default=8192)
    parser.add_argument("--vocab", type=common.positive_int, default=32000)
    common.add_run_arguments(parser, "ce-rows-sweep", reps=50)
    args = parser.parse_args()
    common.check_gpu_script(parser, args.results_file, "the loss kernel")
    torch.manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, device="cuda") * 3).to(torch.bfloat16)
    targets = torch.randint(0, args.vocab, (args.rows,), device="cuda")
    targets[::97] = -100
    reference = logits.float().requires_grad_()
    F.cross_entropy(reference, targets, reduction="sum").backward()
    expected = F.cross_entropy(reference.detach(), targets, reduction="none")
    variants = {f"block{b}-warps{w}": (lambda x, t, b=b, w=w: cross_entropy._cross_entropy_rows_triton(
        x, t, block=b, num_warps=w)) for b, w in LAUNCHES}
    bytes_moved = 2 * logits.numel() * logits.element_size()  # each row read once and its gradient written
    results = {}
    for name, kernel in variants.items():
        work = logits.clone()
        losses = kernel(work, targets)
        us = time_us(kernel, logits.clone(), targets, args.reps)
        results[name] = {"us_per_call": round(us, 1), "tb_per_s": round(bytes_moved / us / 1e6, 2),
                         "loss_max_error": (losses - expected).abs().max().item(),
                         "grad_max_error": (work.float() - reference.grad).abs().max().item()}
    record(args.results_file, [args.name], {
        "run_id": env.new_run_id(), "rows": args.rows, "vocab": args.vocab, "reps": args.reps,
        "results": results,
        "environment": env.fingerprint()})
    print(f"{'launch':<20}{'us/call':>9}{'TB/s':>7}{'loss err':>11}{'grad err':>11}")
    for name, r in results.items():
        print(f"{name:<20}{r['us_per_call']:>9.1f}{r['tb_per_s']:>7.2f}{r['loss_max_error']:>11.2e}"
              f"{r['grad_max_error']:>11.2e}")


if __name__ == "__main__":
    main()
