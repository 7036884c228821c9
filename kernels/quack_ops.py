"""quack-kernels (Tri Dao's CuTe-DSL kernels for Hopper, requirements-gpu.txt) behind declared execution
choices, all off by default: loss_impl "quack" and "quack_chunked" (the LM head and its cross-entropy, quack's
two paths) and mlp_impl "quack" (the SwiGLU MLP). Why: both are mostly matmuls, and quack carries the work
between them in the matmuls' epilogues; whether that wins at our small widths is what these choices exist to measure. What they have to beat,
on the H200 at 32,768 tokens, forward and backward: the "fused" loss's 4.80 / 6.59 / 9.00 ms at widths 320 / 512 /
768 (its three matmuls alone take 3.21 / 5.21 / 7.74: `loss-microbench-quack-*`, docs/PERFORMANCE.md), and our MLP (the
w13 matmul, then SwiGLU with the down projection as one op: kernels/swiglu.py), timed beside quack's by
scripts/mlp_microbench.py (its quack rows not yet measured on the H200: docs/PERFORMANCE.md). Measured in training
on the H200, none is kept: the scaled-exp loss is
5.40 against 4.80 ms alone at width 320 (-3.0% on the 20m update) and 5.60 / 8.10 against 6.59 / 9.00 at 512 /
768, where its tiles fit; the chunked loss +1.3% at 20m with 5.74 GiB at its peak (over the 4 GB bar), +0.3% at
50m; the MLP -6.4% at 20m, -24% at 50m and +1.4% at 90m, each with more memory.

The loss: quack.linear_cross_entropy.chunked_linear_cross_entropy(x (M, d), weight (V, d), target (M,),
chunk_size, ignore_index, reduction "mean" or "sum", tuned, use_scaled_exp). use_scaled_exp None takes the
scaled-exp path wherever scaled_exp_lce_supported holds (compute capability exactly 9.0, bf16 operands or bf16
autocast, V % 128 == 0, d % 8 == 0, chunk_size % 128 == 0): per slice of tokens, the logits matmul's epilogue
stores E = bf16(exp(z) / 2^k), k a power of two per row and vocabulary tile, with the sums of exps and the target
logit; a Triton kernel turns those into the losses and per-row scales; dx and dw are matmuls over E that apply
the scales as they load it. Logits and their gradient never exist in float32, only E. Both gradients are made in
forward (as our fused op's are) and backward scales them; dw accumulates in float32 and is returned in the
weight's dtype from before autocast's cast, so our float32 weight gets a float32 gradient. The other path
(use_scaled_exp=False) keeps each slice's logits: torch.mm, quack's cross-entropy kernel writing the gradient
over them, torch.mm for dx and quack's autotuned matmul for dw.

Its tiles (quack 0.6.5, linear_cross_entropy.py; scaled_exp_tiles below mirrors them): the logits matmul's tile
over the vocabulary is _pick_tile_n1(V), the first of 192, 256, 128, 64 that divides V: 256 at our 32,000 (125
tiles, none wasted). The dx and dw matmuls tile the width with `tile_n2 = 192 if d % 192 == 0 else 256` (tile_M
128), set inline: at width 320, two 256-wide tiles compute 512 columns for 320 (37.5% of those two matmuls' work
wasted); at 512, two exact tiles of 256; at 768, four exact tiles of 192. No argument or config reaches tile_n2:
scaled_exp_linear_cross_entropy takes only tile_n1 (the vocabulary's tile, a multiple of 64 dividing V),
chunked_linear_cross_entropy not even that. A tile that fits 320 (160: SM90 takes tile_N % 16 == 0 up to 256 at
tile_M 128, two exact tiles) would need our own copy of scaled_exp_linear_cross_entropy_fwd. The chunked path
autotunes dw's tiles (160 among them) but keeps the logits; scripts/loss_microbench.py times both.

The MLP: quack.mlp.mlp_func(x, weight1 (2H, d), weight2 (d, H), activation, bias1, bias2, fuse_grad_accum, tuned,
recompute, concat_layout). By default it reads weight1's gate and up rows interleaved (gate at even rows);
concat_layout=True reads [gate; up] stacked, gate rows first: our w13 as it is (kernels/swiglu.py chunks it into
gate, up), so the parameters, the checkpoint and the transformers export stay unchanged. The concat is a view
the kernels take, not a copy. Forward: gemm_gated(x, w13.T, concat "B") stores preact (M, 2H) with gate and up
columns interleaved and, from its epilogue, postact = silu(gate) * up ("swiglu"); out = postact @ w2.T.
Backward: gemm_dgated(dout, w2, preact) gives dpreact (interleaved) and postact again (it is not kept);
dw2 = dout.T @ postact; dx = dpreact @ w13 (concat "B"); dw13 = dpreact.T @ x, written back stacked (concat
"out"). tests/test_quack_ops.py checks this mapping against quack's reference functions, ported to the CPU.
"""
import contextlib

import torch

CAPABILITY = (9, 0)  # the scaled-exp loss's mainloop is SM90's, and the H200 is what these are measured on
ROW_TILE = 128  # the scaled-exp loss's tile over tokens: each slice of loss_chunk_tokens is whole tiles of it
ROW_ALIGN = 8  # the chunked loss's slices: rows of whole 16-byte groups for its TMA matmuls
VOCAB_MULTIPLE = 128  # the scaled-exp loss's dw tile over the vocabulary (else quack falls back to its other path)
WIDTH_MULTIPLE = 8  # rows of 16 bytes in bf16, as quack's TMA loads take them
TUNED = True  # quack's default: each matmul autotuned on the first call of a shape (cached on disk, ~/.quack)
# loss_impl's quack choices: the path each takes (chunked_linear_cross_entropy's use_scaled_exp; None: quack's
# own choice, its scaled-exp path wherever it runs)
LOSS_PATHS = {"quack": None, "quack_chunked": False}
CHUNK_MULTIPLE = {"quack": ROW_TILE, "quack_chunked": ROW_ALIGN}  # what loss_chunk_tokens must be a multiple of
MLP_ARGUMENTS = dict(activation="swiglu", concat_layout=True)  # silu(gate) * up, on w13 = [gate; up] (above)


def quack_problem(device):
    """Why quack's kernels cannot run on `device` (a torch.device), or None when they can: a CUDA GPU of compute
    capability 9.0 with the quack-kernels package."""
    if device.type != "cuda":
        return f"this run's device is the {device.type}"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA GPU here"
    capability = torch.cuda.get_device_capability(device)
    if capability != CAPABILITY:
        return f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}"
    try:
        import quack.linear_cross_entropy  # noqa: F401
        import quack.mlp  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - quack loads CUDA and CuTe as it imports: any failure means it cannot run
        return f"quack did not import ({type(exc).__name__}: {exc}){install_hint(exc)}"
    return None


def install_hint(exc):
    """What to do about an import failure that comes from where quack was installed, else "". quack 0.6.5 keys
    its compiled kernels by fingerprints of the functions they use, and takes every function outside a
    site-packages folder for its own, to fingerprint whole: the CUTLASS DSL's, installed elsewhere (pip install
    --target DIR), reach a context variable it cannot fingerprint."""
    if "semantic key" in str(exc):
        return ("; install requirements-gpu.txt into a site-packages folder (a virtual environment's), not with "
                "pip install --target into another")
    return ""


def check_shape(config, loss_impl, mlp_impl):
    """The model's shape (a ModelConfig) as the chosen quack kernels take it: a ValueError naming what they do not."""
    if loss_impl in LOSS_PATHS and config.dim % WIDTH_MULTIPLE:
        raise ValueError(f"loss_impl {loss_impl} needs the model's width to be a multiple of {WIDTH_MULTIPLE} (rows "
                         f"of 16 bytes for quack's loads), got {config.dim}")
    if loss_impl == "quack" and config.vocab_size % VOCAB_MULTIPLE:
        raise ValueError(f"loss_impl quack needs the vocabulary size to be a multiple of {VOCAB_MULTIPLE} (its "
                         f"scaled-exp path's tile), got {config.vocab_size}")
    if mlp_impl == "quack" and (config.dim % WIDTH_MULTIPLE or config.hidden_dim % WIDTH_MULTIPLE):
        raise ValueError(f"mlp_impl quack needs the model's width and hidden width to be multiples of "
                         f"{WIDTH_MULTIPLE} (rows of 16 bytes for quack's loads), got {config.dim} and "
                         f"{config.hidden_dim}")


def scaled_exp_tiles(vocab_size, width):
    """The tiles quack 0.6.5's scaled-exp loss picks (linear_cross_entropy.py), recorded beside its times: the
    logits matmul's over the vocabulary (None: a vocabulary that is not a multiple of VOCAB_MULTIPLE, where quack
    takes its other path), the dx and dw matmuls' over the width, and the columns of the width those two compute."""
    vocab_tile = None
    if vocab_size % VOCAB_MULTIPLE == 0:
        vocab_tile = next(tile for tile in (192, 256, 128, 64) if vocab_size % tile == 0)
    width_tile = 192 if width % 192 == 0 else 256
    return {"vocab_tile": vocab_tile, "width_tile": width_tile, "width_computed": -(-width // width_tile) * width_tile}


def _bf16(device):
    """quack's functions cast their operands to the CUDA autocast dtype, and its kernels take bf16: calls run under
    bf16 autocast, as training already does. The cast is inside their autograd functions, so each weight's
    gradient comes back to the float32 parameter."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def linear_cross_entropy(h, weight, targets, chunk_tokens, scaled_exp=None):
    """Sum of the cross-entropy of (h @ weight.T) against targets (-100 ignored), as kernels/cross_entropy.py's
    losses return it, through quack's linear cross-entropy over slices of chunk_tokens tokens. h: (N, C),
    weight: (V, C), targets: (N,). scaled_exp: None (quack's choice: its scaled-exp path wherever it runs) or
    False (its chunked path)."""
    # imported here, on first use (quack loads CUDA and CuTe as it imports), by an import statement, which
    # torch.compile traces (importlib.import_module would break the graph)
    from quack.linear_cross_entropy import chunked_linear_cross_entropy
    with _bf16(h.device):
        return chunked_linear_cross_entropy(h, weight, targets, chunk_size=chunk_tokens, ignore_index=-100,
                                            reduction="sum", tuned=TUNED, use_scaled_exp=scaled_exp)


def swiglu_mlp(x, w13, w2, tuned=None):
    """FeedForward's math, F.linear(silu(gate) * up, w2) with [gate; up] = F.linear(x, w13), through quack's gated
    matmuls: SwiGLU in the first matmul's epilogue, its gradient in the epilogue of backward's. tuned: None for
    TUNED, else whether quack autotunes its matmuls (False: its default tiles)."""
    from quack.mlp import mlp_func  # on first use, as linear_cross_entropy's
    with _bf16(x.device):
        return mlp_func(x, w13, w2, tuned=TUNED if tuned is None else tuned, **MLP_ARGUMENTS)
