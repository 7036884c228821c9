"""quack-kernels (Tri Dao's CuTe-DSL kernels for Hopper, requirements-gpu.txt) behind two execution choices, off by
default: loss_impl "quack_chunked" (the LM head and its cross-entropy) and mlp_impl "quack" (the SwiGLU MLP). Both
are mostly matmuls, and quack carries the work between them in the matmuls' epilogues or autotunes them; what each
measured against the default is in docs/PERFORMANCE.md, "quack-kernels' loss and MLP".

The loss: quack.linear_cross_entropy.chunked_linear_cross_entropy with use_scaled_exp=False, the fused op's
structure (model_kernels/cross_entropy.py): per slice of tokens torch.mm for the logits, quack's cross-entropy kernel
writing the gradient over them, torch.mm for dx and quack's autotuned matmul for dw. Both gradients are made in
forward and backward scales them; dw accumulates in float32 and comes back in the weight's dtype from before
autocast's cast, so our float32 weight gets a float32 gradient.

The MLP: quack.mlp.mlp_func(x, w13, w2, concat_layout=True), which reads weight1 as [gate; up] stacked, our w13 as
it is (its default interleaves gate and up rows), so the parameters, the checkpoint and the transformers export
stay unchanged. Forward: gemm_gated stores preact (gate and up columns interleaved) and, from its epilogue,
postact = silu(gate) * up; out = postact @ w2.T. Backward: gemm_dgated gives dpreact and postact again; dw2 =
dout.T @ postact; dx = dpreact @ w13; dw13 = dpreact.T @ x, written back stacked. tests/test_quack_ops.py checks
this mapping against quack's reference functions, ported to the CPU.
"""
import contextlib

import torch

CAPABILITY = (9, 0)  # quack's kernels are SM90's, and the H200 is where these choices were measured
ROW_ALIGN = 8  # the loss's slices: rows of whole 16-byte groups for its TMA matmuls
WIDTH_MULTIPLE = 8  # rows of 16 bytes in bf16, as quack's TMA loads take them
TUNED = True  # quack's default: each matmul autotuned on the first call of a shape (cached on disk, ~/.quack)
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


def load():
    """The quack-kernels modules the choices call, when a model takes one (model.py): a ValueError, in one
    sentence, where they do not import, rather than a ModuleNotFoundError in the first forward."""
    try:
        import quack.linear_cross_entropy  # noqa: F401
        import quack.mlp  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - as quack_problem's
        raise ValueError(f"quack-kernels did not import ({type(exc).__name__}: {exc}){install_hint(exc)}; pip "
                         f"install -r requirements-gpu.txt on a Hopper GPU") from None


def install_hint(exc):
    """What to do about an import failure that comes from where quack was installed, else "". quack 0.6.5 keys
    its compiled kernels by fingerprints of the functions they use, and takes every function outside a
    site-packages folder for its own, to fingerprint whole: the CUTLASS DSL's, installed elsewhere (pip install
    --target DIR), reach a context variable it cannot fingerprint."""
    if "semantic key" in str(exc):
        return ("; install requirements-gpu.txt into a site-packages folder (a virtual environment's), not with "
                "pip install --target into another")
    return ""


def device_problem(device):
    """Why a quack choice cannot run on `device`, as the words after its name in a refusal, or None."""
    why = quack_problem(device)
    return why and (f"needs a CUDA GPU of compute capability {CAPABILITY[0]}.{CAPABILITY[1]} and the quack-kernels "
                    f"package (pip install -r requirements-gpu.txt), but {why}")


def loss_shape_problem(model_config, cfg):
    """Why the loss cannot take the settings' slices or, given a ModelConfig, the model's width, or None."""
    if cfg["loss_chunk_tokens"] % ROW_ALIGN:
        return (f"needs loss_chunk_tokens to be a multiple of {ROW_ALIGN} (rows its matmuls load whole), got "
                f"{cfg['loss_chunk_tokens']}")
    tokens = cfg["micro_batch_size"] * cfg["seq_len"]  # a micro-step's rows, which quack's loss asserts too
    if tokens % ROW_ALIGN:
        return f"needs micro_batch_size x seq_len to be a multiple of {ROW_ALIGN} tokens, got {tokens}"
    if model_config is not None and model_config.dim % WIDTH_MULTIPLE:
        return (f"needs the model's width to be a multiple of {WIDTH_MULTIPLE} (rows of 16 bytes for quack's loads), "
                f"got {model_config.dim}")
    return None


def mlp_shape_problem(model_config, cfg):
    """Why the MLP cannot take the model's widths (a ModelConfig; None: nothing to check yet), or None."""
    if model_config is None or not (model_config.dim % WIDTH_MULTIPLE or model_config.hidden_dim % WIDTH_MULTIPLE):
        return None
    return (f"needs the model's width and hidden width to be multiples of {WIDTH_MULTIPLE} (rows of 16 bytes for "
            f"quack's loads), got {model_config.dim} and {model_config.hidden_dim}")


def _bf16(device):
    """quack's functions cast their operands to the CUDA autocast dtype, and its kernels take bf16: calls run under
    bf16 autocast, as training already does. The cast is inside their autograd functions, so each weight's
    gradient comes back to the float32 parameter."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def linear_cross_entropy(h, weight, targets, chunk_tokens):
    """Sum of the cross-entropy of (h @ weight.T) against targets (-100 ignored), as model_kernels/cross_entropy.py's
    losses return it, through quack's chunked linear cross-entropy over slices of chunk_tokens tokens. h: (N, C),
    weight: (V, C), targets: (N,)."""
    # imported here, on first use (quack loads CUDA and CuTe as it imports), by an import statement, which
    # torch.compile traces (importlib.import_module would break the graph)
    from quack.linear_cross_entropy import chunked_linear_cross_entropy
    with _bf16(h.device):
        return chunked_linear_cross_entropy(h, weight, targets, chunk_size=chunk_tokens, ignore_index=-100,
                                            reduction="sum", tuned=TUNED, use_scaled_exp=False)


def swiglu_mlp(x, w13, w2, tuned=None):
    """FeedForward's math, F.linear(silu(gate) * up, w2) with [gate; up] = F.linear(x, w13), through quack's gated
    matmuls: SwiGLU in the first matmul's epilogue, its gradient in the epilogue of backward's. tuned: None for
    TUNED, else whether quack autotunes its matmuls (False: its default tiles)."""
    from quack.mlp import mlp_func  # on first use, as linear_cross_entropy's
    with _bf16(x.device):
        return mlp_func(x, w13, w2, tuned=TUNED if tuned is None else tuned, **MLP_ARGUMENTS)
