"""The SwiGLU MLP alone, forward and backward, on the GPU, mlp_impl "torch" against "quack", at each preset's shape.

"torch" (the w13 matmul, then SwiGLU and the down projection as one op, model_kernels/swiglu.py) eager and compiled (its
Triton kernels run only compiled, as in training); "quack" (quack-kernels' gated matmuls, model_kernels/quack_ops.py)
eager, compiled, and untuned (quack's default tiles instead of its autotuned ones), where quack can run. x is
(batch, seq_len, width) in float32 with float32 weights under bf16 autocast, as in training.
For each: the milliseconds of a forward and backward (CUDA events, as scripts/loss_microbench.py times), its GPU
kernel milliseconds (the profiler: quack prepares each launch in Python, which CUDA graphs hide in training), the
memory it adds at its peak, and the relative error of the gradients of x, w13 and w2 against the same MLP in
float32. Each preset goes to NAME.PRESET in the results file as soon as it is measured.

    python scripts/mlp_microbench.py [--presets=20m,50m,90m] [--batch=32] [--seq_len=1024] [--reps=20] \
        [--name=mlp-microbench] [--results_file=results.json]
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
from model_kernels import quack_ops  # noqa: E402
from model_kernels.swiglu import swiglu_down  # noqa: E402
from model import PRESETS, get_preset  # noqa: E402


def torch_mlp(x, w13, w2):
    """mlp_impl "torch": FeedForward's forward as model.py runs it (in float32 without autocast, the reference)."""
    return swiglu_down(F.linear(x, w13), w2)


def candidates():
    found = {"torch-eager": torch_mlp, "torch-compiled": torch.compile(torch_mlp, dynamic=False)}
    problem = quack_ops.quack_problem(torch.device("cuda"))
    if problem:
        print(f"quack-kernels not measured: {problem}")
        return found
    found.update({"quack": quack_ops.swiglu_mlp, "quack-compiled": torch.compile(quack_ops.swiglu_mlp, dynamic=False),
                  "quack-untuned": lambda x, w13, w2: quack_ops.swiglu_mlp(x, w13, w2, tuned=False)})
    return found


def forward_backward(fn, inputs, probe, autocast=True):
    """A step of fn on `inputs` (leaves, their gradients cleared first): forward, then backward with `probe` as
    the output's gradient."""
    for t in inputs:
        t.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = fn(*inputs)
    (out.float() * probe).sum().backward()


def measure(fn, inputs, probe, reference, reps):
    step = lambda: forward_backward(fn, inputs, probe)
    _, ms, peak_extra_bytes = common.timed(step, reps)
    errors = {f"grad_{name}_relative_error": common.relative_error(t.grad.float(), ref)
              for name, t, ref in zip(("x", "w13", "w2"), inputs, reference)}
    return {"ms_forward_backward": round(ms, 4), "kernel_ms_forward_backward": round(common.kernel_ms(step, reps), 4),
            "peak_extra_gib": round(peak_extra_bytes / 2**30, 3), **errors}


def measure_preset(preset, found, args):
    """Every candidate at the preset's shape, the same inputs for all: {name: its figures, or its error}."""
    config = get_preset(preset)
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.seq_len, config.dim, device="cuda")
    w13 = torch.randn(2 * config.hidden_dim, config.dim, device="cuda") * config.dim ** -0.5
    w2 = torch.randn(config.dim, config.hidden_dim, device="cuda") * config.hidden_dim ** -0.5
    probe = torch.randn(args.batch, args.seq_len, config.dim, device="cuda")
    inputs = [t.requires_grad_() for t in (x, w13, w2)]
    forward_backward(torch_mlp, inputs, probe, autocast=False)
    reference = [t.grad.clone() for t in inputs]
    results = {}
    for name, fn in found.items():
        try:
            results[name] = measure(fn, inputs, probe, reference, args.reps)
        except Exception as exc:  # noqa: BLE001 - recorded, the others still run
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--batch", type=common.positive_int, default=32)
    parser.add_argument("--seq_len", type=common.positive_int, default=1024)
    common.add_run_arguments(parser, "mlp-microbench", reps=20)
    args = parser.parse_args()
    presets = common.names_in(parser, "--presets", args.presets, PRESETS)
    common.check_gpu_script(parser, args.results_file, "the MLP")
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in float32, not TF32
    found, fingerprint = candidates(), env.fingerprint()
    for preset in presets:
        config = get_preset(preset)
        results = measure_preset(preset, found, args)
        record(args.results_file, [args.name, preset], {
            "run_id": env.new_run_id(), "shape_btdh": [args.batch, args.seq_len, config.dim, config.hidden_dim],
            "reps": args.reps, "quack_tuned": quack_ops.TUNED, "results": results, "environment": fingerprint})
        print(f"{preset}: width {config.dim}, hidden {config.hidden_dim}, {args.batch} x {args.seq_len} tokens")
        common.print_variants("variant", results, [
            ("ms fwd+bwd", "ms_forward_backward", ".3f"), ("kernel ms", "kernel_ms_forward_backward", ".3f"),
            ("extra GiB", "peak_extra_gib", ".3f"), ("grad_x err", "grad_x_relative_error", ".2e"),
            ("grad_w13 err", "grad_w13_relative_error", ".2e"), ("grad_w2 err", "grad_w2_relative_error", ".2e")])


if __name__ == "__main__":
    main()
