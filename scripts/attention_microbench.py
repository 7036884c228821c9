"""Causal attention alone, forward and backward, on the GPU: the SDPA kernels, and the fa4 backend (cuDNN's
forward with flash-attn-4's backward) when flash-attn-4 imports, on a preset's shape, in the layout the model gives it (q, k and v are views into one projection
output). Each one's output and gradients are compared with float32 math on the
same inputs, and its GPU kernel times are recorded under NAME in the results file (with the fingerprint).

    python scripts/attention_microbench.py [--preset=20m] [--batch=32] [--seq_len=1024] \
        [--backends=cudnn,fa4] [--name=attention-microbench] [--results_file=results.json]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import env  # noqa: E402
from results import record  # noqa: E402
import common  # noqa: E402
from model_kernels.attention import causal_attention  # noqa: E402
from model_kernels.registry import ATTENTION  # noqa: E402
from model import PRESETS, get_preset  # noqa: E402


def attention(qkv, backends):
    return causal_attention(*qkv.unbind(2), backends)  # q, k, v views into one tensor, as in the model


def gradients(qkv, grad_out, backends):
    qkv = qkv.detach().requires_grad_()
    out = attention(qkv, backends)
    out.backward(grad_out)
    return out.float(), qkv.grad.float()


def measure(name, qkv, grad_out, reference, reps):
    backends = ATTENTION[name].backends
    out, grad = gradients(qkv, grad_out, backends)
    leaf = qkv.detach().requires_grad_()

    def forward_backward():
        leaf.grad = None
        attention(leaf, backends).backward(grad_out)

    # forward with gradients wanted: for fa4 it also saves the log-sum-exp, which evaluation's forward does not
    return {"kernel_ms_forward": round(common.kernel_ms(lambda: attention(leaf, backends), reps), 4),
            "kernel_ms_forward_backward": round(common.kernel_ms(forward_backward, reps), 4),
            "out_relative_error": common.relative_error(out, reference[0]),
            "grad_relative_error": common.relative_error(grad, reference[1])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="20m", choices=list(PRESETS))
    parser.add_argument("--batch", type=common.positive_int, default=32)
    parser.add_argument("--seq_len", type=common.positive_int, default=1024)
    parser.add_argument("--backends", default="cudnn,fa4")
    common.add_run_arguments(parser, "attention-microbench", reps=50)
    args = parser.parse_args()
    names = common.names_in(parser, "--backends", args.backends, ATTENTION)
    common.check_gpu_script(parser, args.results_file, "attention")
    config = get_preset(args.preset)
    torch.manual_seed(0)
    shape = (args.batch, args.seq_len, 3, config.n_heads, config.head_dim)
    qkv = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn(args.batch, args.seq_len, config.n_heads, config.head_dim, device="cuda",
                           dtype=torch.bfloat16)
    reference = gradients(qkv.float(), grad_out.float(), ATTENTION["math"].backends)
    results = {}
    for name in names:
        try:
            results[name] = measure(name, qkv, grad_out, reference, args.reps)
        except Exception as exc:  # noqa: BLE001 - recorded, the others still run
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    record(args.results_file, [args.name], {
        "run_id": env.new_run_id(), "preset": args.preset, "shape_btHd": [args.batch, args.seq_len, config.n_heads,
                                                                           config.head_dim],
        "reps": args.reps, "results": results, "environment": env.fingerprint()})
    common.print_variants("backend", results, [("kernel ms fwd", "kernel_ms_forward", ".3f"),
                                            ("fwd+bwd", "kernel_ms_forward_backward", ".3f"),
                                            ("out err", "out_relative_error", ".2e"),
                                            ("grad err", "grad_relative_error", ".2e")])


if __name__ == "__main__":
    main()
