"""The LM head + cross-entropy alone, forward and backward, on the GPU: our fused op against what it
replaces (full logits, eager and compiled) and against the two libraries made for this, when importable:
Liger-Kernel's fused linear cross-entropy and Apple's Cut Cross-Entropy (CCE, which never writes the logits
to memory; "cce" with its gradient filter off, the same math, and "cce-filtered" with its default filter,
which skips softmax entries below bf16's resolution and so changes the gradient slightly). Also the declared FP8
head ("fused-fp8", model_kernels/linear_cross_entropy_fp8.py, a change of math whose gradient errors say by how much);
the floor: "matmuls-alone", the fused op's three matmuls of the same shapes and slices with no loss between them
(its loss is 0 and its gradient errors mean nothing); and, on a Hopper GPU with quack-kernels, loss_impl
"quack_chunked" (model_kernels/quack_ops.py) as "quack-chunked". Same inputs for all; each one's loss and the relative
error of both gradients against the eager full loss are recorded beside its time, under NAME in the results file
(with the fingerprint).

    python scripts/loss_microbench.py [--tokens=32768] [--dim=320] [--vocab=32000] [--reps=20] \
        [--name=loss-microbench] [--results_file=results.json]
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
from model_kernels.cross_entropy import in_autocast_dtype  # noqa: E402
from model_kernels import quack_ops  # noqa: E402
from model_kernels.cross_entropy import linear_cross_entropy  # noqa: E402
from model_kernels.linear_cross_entropy_fp8 import linear_cross_entropy_fp8  # noqa: E402


def full_loss(h, weight, targets):
    return F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=-100, reduction="sum")


class MatmulsAlone(torch.autograd.Function):
    """The fused op's three matmuls (logits, then both gradients from them as if they were the softmax's
    gradient) in its slices and dtypes, with nothing between them: the time no fused loss can beat."""

    @staticmethod
    def forward(ctx, h, weight, chunk_tokens):
        with torch.autocast("cuda", enabled=False):
            w = weight.to(h.dtype)
            grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
            for start in range(0, h.shape[0], chunk_tokens):
                h_slice = h[start:start + chunk_tokens]
                logits = h_slice @ w.t()
                torch.mm(logits, w, out_dtype=torch.float32, out=grad_h[start:start + chunk_tokens])
                torch.addmm(grad_w, logits.t(), h_slice, out_dtype=torch.float32, out=grad_w)
                del logits
        ctx.dtypes = h.dtype, weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return grad_h.new_zeros(())

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * grad_total).to(ctx.dtypes[0]), (grad_w * grad_total).to(ctx.dtypes[1]), None


def candidates():
    found = {"full-eager": full_loss,
             "full-compiled": torch.compile(full_loss, dynamic=False),
             "fused-8192": lambda h, w, t: linear_cross_entropy(h, w, t, 8192),
             "fused-32768": lambda h, w, t: linear_cross_entropy(h, w, t, 32768),
             "matmuls-alone": lambda h, w, t: MatmulsAlone.apply(in_autocast_dtype(h), w, 8192),
             "fused-fp8": lambda h, w, t: linear_cross_entropy_fp8(h, w, t, 8192)}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:  # noqa: BLE001 - any import failure only means "not measured"
        print(f"liger-kernel not measured: {exc}")
    else:
        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum", accum_dtype=torch.float32)
        found["liger"] = lambda h, w, t: liger(w, h, t)
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
    except Exception as exc:  # noqa: BLE001
        print(f"cut-cross-entropy not measured: {exc}")
    else:
        bf16 = torch.bfloat16  # CCE takes both inputs in the compute dtype; autocast does not cast for it
        found["cce"] = lambda h, w, t: cce(h.to(bf16), w.to(bf16), t, reduction="sum", filter_eps=None)
        found["cce-filtered"] = lambda h, w, t: cce(h.to(bf16), w.to(bf16), t, reduction="sum")
    problem = quack_ops.quack_problem(torch.device("cuda"))
    if problem:
        print(f"quack-kernels not measured: {problem}")
    else:
        found["quack-chunked"] = lambda h, w, t: quack_ops.linear_cross_entropy(h, w, t, 8192)
    return found


def run(fn, h32, weight, targets, reps):
    h = h32.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    scale = 1.0 / targets.numel()

    def step():
        h.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(h, w, targets)
        (loss * scale).backward()
        return loss

    loss, ms, peak_extra_bytes = common.timed(step, reps)
    return {"ms": ms, "loss": loss.item(), "grad_h": h.grad.float(), "grad_w": w.grad.float(),
            "peak_extra_bytes": peak_extra_bytes}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=common.positive_int, default=32768)
    parser.add_argument("--dim", type=common.positive_int, default=320)
    parser.add_argument("--vocab", type=common.positive_int, default=32000)
    common.add_run_arguments(parser, "loss-microbench", reps=20)
    args = parser.parse_args()
    common.check_gpu_script(parser, args.results_file, "the loss")
    torch.manual_seed(0)
    h = torch.randn(args.tokens, args.dim, device="cuda")
    weight = torch.randn(args.vocab, args.dim, device="cuda") * 0.02
    targets = torch.randint(0, args.vocab, (args.tokens,), device="cuda")
    targets[::97] = -100
    results, reference, variants = {}, None, candidates()
    for name, fn in variants.items():
        try:
            r = run(fn, h, weight, targets, args.reps)
        except Exception as exc:  # noqa: BLE001 - recorded, the others still run
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        if name == next(iter(variants)):  # the eager full loss; where it failed, no variant has an error against it
            reference = r
        error = lambda key: common.relative_error(r[key], reference[key]) if reference else None
        results[name] = {
            "ms_forward_backward": round(r["ms"], 3), "loss": r["loss"],
            "peak_extra_gib": round(r["peak_extra_bytes"] / 2**30, 3),
            "grad_h_relative_error": error("grad_h"), "grad_w_relative_error": error("grad_w")}
    record(args.results_file, [args.name], {
        "run_id": env.new_run_id(), "tokens": args.tokens, "dim": args.dim, "vocab": args.vocab, "reps": args.reps,
        "results": results, "environment": env.fingerprint()})
    common.print_variants("variant", results, [("ms fwd+bwd", "ms_forward_backward", ".3f"),
                                            ("extra GiB", "peak_extra_gib", ".3f"), ("loss", "loss", ".2f"),
                                            ("grad_h err", "grad_h_relative_error", ".2e"),
                                            ("grad_w err", "grad_w_relative_error", ".2e")])


if __name__ == "__main__":
    main()
