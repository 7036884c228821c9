"""The fused loss's Triton kernel alone, on the GPU, at several launch shapes: microseconds per call on one
slice of logits, the bandwidth that is, and the error of the loss and gradient against float32 torch.
Picks model.ROWS_BLOCK and ROWS_NUM_WARPS; recorded under NAME in the results file. With --tree, the kernel
of another copy of the repository (e.g. the previous commit's) at its own launch, for a before/after.

    python scripts/ce_rows_sweep.py [--rows=8192] [--vocab=32000] [--tree=.carry/before] [--name=ce-rows-sweep]
"""
import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import env  # noqa: E402

LAUNCHES = [(32768, 32), (32768, 16), (16384, 16), (16384, 8), (8192, 16), (8192, 8), (8192, 4), (4096, 8),
            (4096, 4), (2048, 4)]


def load_model(tree):
    """model.py of the given tree (one per process: it registers its custom ops by name)."""
    spec = importlib.util.spec_from_file_location("model", Path(tree) / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    parser.add_argument("--rows", type=env.positive_int, default=8192)
    parser.add_argument("--vocab", type=env.positive_int, default=32000)
    parser.add_argument("--reps", type=env.positive_int, default=50)
    parser.add_argument("--tree", default=None,
                        help="the repository copy whose model.py is timed (default: this one)")
    parser.add_argument("--name", default="ce-rows-sweep")
    parser.add_argument("--results_file", default="results.json")
    args = parser.parse_args()
    env.check_gpu_script(parser, args.results_file, "the loss kernel")
    tree = Path(args.tree).resolve() if args.tree else ROOT
    if not (tree / "model.py").is_file():
        parser.error(f"--tree {args.tree} holds no model.py; give a copy of this repository")
    torch.manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, device="cuda") * 3).to(torch.bfloat16)
    targets = torch.randint(0, args.vocab, (args.rows,), device="cuda")
    targets[::97] = -100
    reference = logits.float().requires_grad_()
    F.cross_entropy(reference, targets, reduction="sum").backward()
    expected = F.cross_entropy(reference.detach(), targets, reduction="none")
    model = load_model(tree)
    if tree == ROOT:
        variants = {f"block{b}-warps{w}": (lambda x, t, b=b, w=w: model._cross_entropy_rows_triton(x, t, block=b,
                                                                                                   num_warps=w))
                    for b, w in LAUNCHES}
    else:  # another tree's kernel may take no launch arguments
        variants = {"its default": model._cross_entropy_rows_triton}
    bytes_moved = 2 * logits.numel() * logits.element_size()  # each row read once and its gradient written
    results = {}
    for name, kernel in variants.items():
        work = logits.clone()
        losses = kernel(work, targets)
        us = time_us(kernel, logits.clone(), targets, args.reps)
        results[name] = {"us_per_call": round(us, 1), "tb_per_s": round(bytes_moved / us / 1e6, 2),
                         "loss_max_error": (losses - expected).abs().max().item(),
                         "grad_max_error": (work.float() - reference.grad).abs().max().item()}
    env.record(args.results_file, [args.name], {
        "run_id": env.new_run_id(), "rows": args.rows, "vocab": args.vocab, "reps": args.reps,
        "tree": os.path.relpath(tree, ROOT), "results": results,  # relative: no machine's paths in the file
        "environment": env.fingerprint()})
    print(f"{'launch':<20}{'us/call':>9}{'TB/s':>7}{'loss err':>11}{'grad err':>11}")
    for name, r in results.items():
        print(f"{name:<20}{r['us_per_call']:>9.1f}{r['tb_per_s']:>7.2f}{r['loss_max_error']:>11.2e}"
              f"{r['grad_max_error']:>11.2e}")


if __name__ == "__main__":
    main()
