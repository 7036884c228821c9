"""Our model's loss and gradients against transformers' LlamaForCausalLM on the same weights and tokens.

    python scripts/parity.py --preset=20m --device=cuda            # a freshly initialized preset
    python scripts/parity.py --checkpoint=out/NAME/ckpt.pt          # a trained run, on its validation tokens

The figures go to the results file's trained-parity list (the reference's fields).
"""
import argparse
import contextlib
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import checkpoint  # noqa: E402
from data.loader import CacheError, TokenCache  # noqa: E402
from hf import hf_named_tensors, to_hf, unexported_levers  # noqa: E402
from model import Transformer, get_preset  # noqa: E402
from results import ResultsFileError, append, read_results  # noqa: E402
from scripts.common import positive_int  # noqa: E402


def parity(model, idx, targets, device="cpu", autocast=True):
    """Our loss and gradients against transformers' LlamaForCausalLM on the same weights and tokens.

    Returns the reference file's trained-parity fields; relative_gradient_error is the norm of the
    difference of all gradients over the norm of the reference's. With autocast (bf16 on CUDA), both
    models round differently, so expect about 1e-2, not float32's 1e-6.
    """
    hf = to_hf(model).to(device)
    model = model.to(device)
    idx, targets = idx.to(device), targets.to(device)
    context = (torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if autocast
               else contextlib.nullcontext())
    model.zero_grad(set_to_none=True)
    with context:
        loss = model(idx, targets)
    loss.backward()
    with context:
        logits = hf(input_ids=idx).logits
    reference = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
    reference.backward()
    ours = hf_named_tensors(model, of=lambda p: p.grad)
    theirs = dict(hf.named_parameters())
    diff = sum(float((ours[n].float() - theirs[n].grad.float()).pow(2).sum()) for n in ours)
    norm = sum(float(theirs[n].grad.float().pow(2).sum()) for n in ours)
    return {"tokens": int((targets != -100).sum()), "loss": loss.item(), "reference_loss": reference.item(),
            "relative_gradient_error": math.sqrt(diff / norm), "autocast": "bfloat16" if autocast else None,
            "device": str(device)}


def main(argv):
    parser = argparse.ArgumentParser(description="Loss and gradients against transformers' LlamaForCausalLM.")
    parser.add_argument("--preset", default="20m", help="a freshly initialized preset (ignored with --checkpoint)")
    parser.add_argument("--checkpoint", help="a train.py checkpoint (out/NAME/ckpt.pt): the trained weights")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=positive_int, default=2048)
    parser.add_argument("--seq_len", type=positive_int, default=1024)
    parser.add_argument("--results_file", default="results.json")
    args = parser.parse_args(argv)
    try:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device {args.device!r} is no device; give cuda, cuda:N or cpu") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device={args.device} but PyTorch sees no GPU; use --device=cpu")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"--device={args.device} but PyTorch sees {torch.cuda.device_count()} GPU(s); give "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"--device {args.device!r}: parity runs on cuda or cpu")
        if args.tokens < args.seq_len:
            raise ValueError(f"--tokens {args.tokens} is less than one sequence of --seq_len {args.seq_len}")
        read_results(args.results_file)  # a broken results file fails now, not after the work
        if args.checkpoint:
            model, ckpt = checkpoint.load_model(args.checkpoint)
            tokens = torch.from_numpy(TokenCache(checkpoint.run_data_dir(ckpt), verify=False).val[:args.tokens + 1]
                                      .astype("int64"))
            preset = ckpt["config"].get("preset")
            if len(tokens) < args.tokens + 1:
                raise ValueError(f"--tokens {args.tokens:,} is more than the validation split of "
                                 f"{checkpoint.run_data_dir(ckpt)} holds ({len(tokens) - 1:,} after its first); give "
                                 f"at most that")
        else:
            model, preset = Transformer(get_preset(args.preset)), args.preset
            tokens = torch.randint(0, model.config.vocab_size, (args.tokens + 1,),
                                   generator=torch.Generator().manual_seed(0))
        if args.seq_len > model.config.max_seq_len:
            raise ValueError(f"--seq_len {args.seq_len} is longer than the model's context of "
                             f"{model.config.max_seq_len} tokens; give at most {model.config.max_seq_len}")
        levers = unexported_levers(model.config)
        if levers:
            raise ValueError(f"checkpoint {args.checkpoint} has {', '.join(levers)}, which "
                             f"neither transformers' LlamaForCausalLM nor Qwen3ForCausalLM computes: there is no "
                             f"parity to check")
    except (ValueError, CacheError, ResultsFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = args.tokens // args.seq_len
    idx = tokens[:rows * args.seq_len].view(rows, args.seq_len)
    targets = tokens[1:rows * args.seq_len + 1].view(rows, args.seq_len)
    figures = dict(preset=preset, trained=bool(args.checkpoint), **parity(model, idx, targets, args.device))
    print(figures)
    append(args.results_file, ["trained-parity"], figures)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
