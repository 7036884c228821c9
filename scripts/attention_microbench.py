"""Causal attention alone, forward and backward, on the GPU: each SDPA kernel, and flash-attn-4 as "fa4" when
it imports, on a preset's shape, in the layout the model gives it (q, k and v are views into one projection
output). Each one's output and gradients are compared with float32 math on the
same inputs, and its times are recorded under NAME in the results file (with the fingerprint).

    python scripts/attention_microbench.py [--preset=20m] [--batch=32] [--seq_len=1024] \
        [--backends=cudnn,flash,fa4,efficient] [--name=attention-microbench] [--results_file=results.json]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import env  # noqa: E402
import model  # noqa: E402


def attention(qkv, backends):
    return model.causal_attention(*qkv.unbind(2), backends)  # q, k, v views into one tensor, as in the model


def gradients(qkv, grad_out, backends):
    qkv = qkv.detach().requires_grad_()
    out = attention(qkv, backends)
    out.backward(grad_out)
    return out.float(), qkv.grad.float()


def time_ms(fn, reps):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def relative_error(value, reference):
    return ((value - reference).norm() / reference.norm()).item()


def measure(name, qkv, grad_out, reference, reps):
    backends = model.ATTENTION_BACKENDS[name]
    out, grad = gradients(qkv, grad_out, backends)
    leaf = qkv.detach().requires_grad_()

    def forward_backward():
        leaf.grad = None
        attention(leaf, backends).backward(grad_out)

    with torch.no_grad():
        forward_ms = time_ms(lambda: attention(qkv, backends), reps)
    return {"ms_forward": round(forward_ms, 4), "ms_forward_backward": round(time_ms(forward_backward, reps), 4),
            "out_relative_error": relative_error(out, reference[0]),
            "grad_relative_error": relative_error(grad, reference[1])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="20m", choices=list(model.PRESETS))
    parser.add_argument("--batch", type=env.positive_int, default=32)
    parser.add_argument("--seq_len", type=env.positive_int, default=1024)
    parser.add_argument("--backends", default="cudnn,flash,fa4,efficient")
    parser.add_argument("--reps", type=env.positive_int, default=50)
    parser.add_argument("--name", default="attention-microbench", help="the results file key")
    parser.add_argument("--results_file", default="results.json")
    args = parser.parse_args()
    names = args.backends.split(",")
    unknown = [n for n in names if n not in model.ATTENTION_BACKENDS]
    if unknown:
        parser.error(f"--backends: {', '.join(unknown)} not among {', '.join(model.ATTENTION_BACKENDS)}")
    if not torch.cuda.is_available():
        parser.error("this times attention on a GPU, and PyTorch sees no CUDA GPU here")
    try:
        env.read_results(args.results_file)  # a broken results file fails now, not after the work
    except env.ResultsFileError as exc:
        parser.error(str(exc))
    config = model.get_preset(args.preset)
    torch.manual_seed(0)
    shape = (args.batch, args.seq_len, 3, config.n_heads, config.head_dim)
    qkv = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn(args.batch, args.seq_len, config.n_heads, config.head_dim, device="cuda",
                           dtype=torch.bfloat16)
    reference = gradients(qkv.float(), grad_out.float(), model.ATTENTION_BACKENDS["math"])
    results = {}
    for name in names:
        try:
            results[name] = measure(name, qkv, grad_out, reference, args.reps)
        except Exception as exc:  # noqa: BLE001 - recorded, the others still run
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    env.record(args.results_file, [args.name], {
        "run_id": env.new_run_id(), "preset": args.preset, "shape_btHd": [args.batch, args.seq_len, config.n_heads,
                                                                           config.head_dim],
        "reps": args.reps, "results": results, "environment": env.fingerprint()})
    print(f"{'backend':<12}{'ms fwd':>10}{'ms fwd+bwd':>12}{'out err':>11}{'grad err':>11}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<12} error: {r['error']}")
        else:
            print(f"{name:<12}{r['ms_forward']:>10.3f}{r['ms_forward_backward']:>12.3f}"
                  f"{r['out_relative_error']:>11.2e}{r['grad_relative_error']:>11.2e}")


if __name__ == "__main__":
    main()
