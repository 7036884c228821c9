"""The LM head and its cross-entropy with no pass of their own over the logits: loss_impl "fused_epilogue".

Why this exists: the "fused" op (kernels/cross_entropy.py) runs, per slice of 8,192 tokens, a Triton row kernel
between cuBLAS's matmuls that reads the logits and writes the gradient over them: 1.05 GB of memory traffic a
slice, no arithmetic to hide it behind. Here the softmax's statistics come out of the forward matmul and its
gradient goes into the weight gradient's matmul:

  K1  logits = h @ W.T in Triton; its epilogue also writes, per row and column tile, the log-sum-exp of the
      logits as stored (rounded to their dtype first: the gradient is computed from the stored logits, so
      the same values must give the lse). A torch step combines the tiles into each row's lse. The
      alternative, TRITON_FORWARD = False: cuBLAS's matmul and a Triton kernel that reads each row once and
      writes only its lse (half the row kernel's traffic).
  K3  grad_W += P.T @ h in Triton, P = softmax - onehot (0 on ignored rows) computed in float32 from the
      stored logits as they are loaded and rounded to their dtype before the dot: the row kernel's gradient,
      stored over the logits in place.
  K2  grad_h = P @ W by cuBLAS, reading that stored P.

Each slice's logits are thus written once (K1), read and rewritten once inside K3, and read once by K2. Only
one slice of logits exists at a time, as in "fused".

What it measured on an H200 (docs/PERFORMANCE.md, "The LM head and loss alone"): at width 320, 32,768 tokens,
forward and backward, 6.33 ms with K1 and 5.93 ms with cuBLAS's forward, against 4.91 ms for "fused" and 3.43
ms for the three matmuls alone; -7.9% on the 20m update. Triton's matmuls at these widths lose more to cuBLAS
than the pass they remove, so "fused" stays the default and this op is an option (and tune.py's candidate).
"""
import os

import torch

from kernels import in_autocast_dtype, uses_triton

MAX_WIDTH = 1024
# K1 (True) or cuBLAS and the read-only lse kernel (False) for the forward matmul; the op takes either. The op
# alone is 0.4 to 0.8 ms faster with cuBLAS's at widths 320 to 768 (loss-microbench-*: "fused-epilogue-cublas-fwd");
# the update was measured with K1 (lever-fused-epilogue), so K1 stays until the other is measured there too.
TRITON_FORWARD = True

# GPU launch configs the autotuner picks from, keyed on (width, classes), each compiled for sm_90 with Triton
# 3.6 to check its registers and shared memory. Logits: (BLOCK_M tokens, BLOCK_N classes, warps, stages).
# Weight gradient: (BLOCK_V classes, BLOCK_T tokens, warps, stages). Its float32 accumulators hold BLOCK_V x
# width values (64 x 320: 80 registers a thread at 8 warps) and it reads all of h once per BLOCK_V classes
# (from L2: 2.6 GB a 8,192-token slice at 64, 1.3 GB at 128), hence the 128-class configs at
# 16 warps, which spill a little. _fitting drops those whose accumulators or pipeline cannot fit.
LOGITS_CONFIGS = ((128, 128, 8, 3), (128, 256, 8, 3), (128, 256, 8, 4), (128, 128, 4, 4), (64, 256, 4, 3))
WEIGHT_GRAD_CONFIGS = ((64, 64, 8, 3), (64, 32, 8, 3), (64, 32, 8, 4), (64, 128, 8, 2), (64, 32, 16, 3),
                       (128, 32, 16, 3), (128, 16, 16, 4), (64, 16, 16, 2))
SHARED_MEMORY_BYTES = 220 * 1024  # of the H200's 227 KiB a program may have, some left to the epilogue
# Launches under TRITON_INTERPRET=1, where the autotuner's timing has no meaning.
INTERPRETER_LOGITS_BLOCKS = dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=2)
INTERPRETER_WEIGHT_GRAD_BLOCKS = dict(BLOCK_V=32, BLOCK_T=16)
# The weight gradient is tuned on a copy of this many tokens of the first slice's logits (see _tune_weight_grad).
TUNE_TOKENS = 2048
ROW_LSE_BLOCK, ROW_LSE_NUM_WARPS = 8192, 8  # the row kernel's launch (kernels/cross_entropy.py), read only


def width_pieces(width):
    """The widths of the three accumulators (powers of two, 0 for an absent one) that hold `width` columns of
    the weight gradient between them: exact where three suffice (320 = 256 + 64, 768 = 3 x 256), else the
    last one is masked at its end (1008 = 512 + 256 + 240 of 256)."""
    if width % 16 or not 16 <= width <= MAX_WIDTH:
        raise ValueError(f"the fused_epilogue loss takes widths that are multiples of 16 up to {MAX_WIDTH}, "
                         f"got {width}")
    cap = 256 if width <= 768 else 512
    pieces, left = [], width
    while left > 0:
        piece = 1 << (left - 1).bit_length() if len(pieces) == 2 else min(cap, 1 << (left.bit_length() - 1))
        pieces.append(piece)
        left -= piece
    return tuple(pieces + [0] * (3 - len(pieces)))


# ---------------------------------------------------------------- the Triton kernels, built on first use

_built = {}


def _kernel(name):
    """The named Triton kernel (logits, weight_grad or row_lse), built on first use so that importing this
    file never needs Triton (the CPU build has none); on the GPU the matmuls are wrapped in the autotuner."""
    if name not in _built:
        _built[name] = {"logits": _build_logits, "weight_grad": _build_weight_grad, "row_lse": _build_row_lse}[name]()
    return _built[name]


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _time_launch(kernel_call, quantiles):
    """The autotuner's timing without triton.testing.do_bench's 256 MB cache-flush buffer, which would sit on
    the training update's memory peak; the tensors timed are larger than the L2 cache anyway."""
    kernel_call()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
    for start, end in events:
        start.record()
        kernel_call()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return [times[len(times) // 2], times[0], times[-1]]


def _launcher(kernel, blocks):
    """The kernel to launch: given blocks (and num_warps, num_stages) go to the kernel itself, past the
    autotuner where there is one; without them the autotuner chooses."""
    return kernel.fn if blocks and not interpreting() else kernel


def _fitting(configs, named_args, **meta):
    """The autotuner's pruning: the configs whose pipeline stages fit in shared memory and, for the weight
    gradient, whose accumulators fit in registers (past those limits a config spills heavily or cannot launch);
    the smallest one if none does."""
    width, size = meta["width"], named_args["h_ptr"].element_size()

    def shared_and_accumulators(config):
        c, stages, threads = config.kwargs, config.num_stages, 32 * config.num_warps
        if "BLOCK_V" in c:
            padded = sum(width_pieces(width))
            return stages * c["BLOCK_T"] * (padded + c["BLOCK_V"]) * size, c["BLOCK_V"] * padded // threads
        return stages * (c["BLOCK_M"] + c["BLOCK_N"]) * meta["BLOCK_K"] * size, 0

    def fits(config):
        shared, accumulators = shared_and_accumulators(config)
        return shared <= SHARED_MEMORY_BYTES and accumulators <= (128 if config.num_warps <= 8 else 96)

    return [c for c in configs if fits(c)] or [min(configs, key=shared_and_accumulators)]


def _autotuned(kernel, configs, key):
    import triton
    if interpreting():
        return kernel
    return triton.autotune([triton.Config(c, num_warps=w, num_stages=s) for c, w, s in configs], key=key,
                           prune_configs_by={"early_config_prune": _fitting}, do_bench=_time_launch)(kernel)


def _build_logits():
    import triton
    import triton.language as tl

    @triton.jit
    def logits_kernel(h_ptr, w_ptr, logits_ptr, tile_lse_ptr, n_rows, n_cols, h_stride, w_stride, logits_stride,
                      tiles_stride, width: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """logits = h @ w.T, and per row and BLOCK_N-column tile the log-sum-exp of the logits as stored.
        BLOCK_K divides width (the host picks it), so only rows and classes need masks."""
        pid = tl.program_id(0)
        # GROUP_M row blocks in turn take each column block of w, which stays in L2 between them
        n_row_blocks, n_col_blocks = tl.cdiv(n_rows, BLOCK_M), tl.cdiv(n_cols, BLOCK_N)
        in_group = GROUP_M * n_col_blocks
        first = (pid // in_group) * GROUP_M
        group_rows = tl.minimum(n_row_blocks - first, GROUP_M)
        pid_m = first + (pid % in_group) % group_rows
        pid_n = (pid % in_group) // group_rows
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_in, col_in = rows < n_rows, cols < n_cols
        ks = tl.arange(0, BLOCK_K)
        a_at = h_ptr + rows[:, None] * h_stride + ks[None, :]
        b_at = w_ptr + cols.to(tl.int64)[None, :] * w_stride + ks[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, width, BLOCK_K):
            a = tl.load(a_at, mask=row_in[:, None], other=0.0)
            b = tl.load(b_at, mask=col_in[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_at += BLOCK_K
            b_at += BLOCK_K
        logits = acc.to(logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + rows[:, None] * logits_stride + cols[None, :], logits,
                 mask=row_in[:, None] & col_in[None, :])
        x = tl.where(col_in[None, :], logits.to(tl.float32), float("-inf"))
        tile_max = tl.max(x, axis=1)
        tile_lse = tile_max + tl.log(tl.sum(tl.exp(x - tile_max[:, None]), axis=1))
        tl.store(tile_lse_ptr + pid_n * tiles_stride + rows, tile_lse, mask=row_in)  # (tiles, rows): coalesced

    configs = [(dict(BLOCK_M=m, BLOCK_N=n, GROUP_M=8), w, s) for m, n, w, s in LOGITS_CONFIGS]
    return _autotuned(logits_kernel, configs, ["width", "n_cols"])


def _build_weight_grad():
    import triton
    import triton.language as tl

    @triton.jit
    def weight_grad_kernel(logits_ptr, lse_ptr, targets_ptr, h_ptr, grad_w_ptr, n_rows, n_cols, logits_stride,
                           h_stride, grad_w_stride, width: tl.constexpr, BLOCK_V: tl.constexpr,
                           BLOCK_T: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
        """grad_w[v] += sum over tokens t of P[t, v] h[t] with P = softmax - onehot of the stored logits, which
        P replaces. A program owns BLOCK_V classes and all `width` columns (three accumulators of C0, C1, C2
        columns sharing each P tile), so each logit becomes P exactly once and no other program reads it.
        Only the third piece can reach past `width` (width_pieces), so only its columns are masked."""
        vs = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
        v_in = vs < n_cols
        cs0 = tl.arange(0, C0)
        acc0 = tl.zeros((BLOCK_V, C0), dtype=tl.float32)
        if C1 > 0:
            cs1 = C0 + tl.arange(0, C1)
            acc1 = tl.zeros((BLOCK_V, C1), dtype=tl.float32)
        if C2 > 0:
            cs2 = C0 + C1 + tl.arange(0, C2)
            acc2 = tl.zeros((BLOCK_V, C2), dtype=tl.float32)
        for start in range(0, n_rows, BLOCK_T):
            ts = start + tl.arange(0, BLOCK_T)
            t_in = ts < n_rows
            target = tl.load(targets_ptr + ts, mask=t_in, other=-100)
            lse = tl.load(lse_ptr + ts, mask=t_in, other=0.0)
            # (classes, tokens): P.T is the dot's left operand, held in registers as flash attention's P is
            at = logits_ptr + ts.to(tl.int64)[None, :] * logits_stride + vs[:, None]
            mask = v_in[:, None] & t_in[None, :]
            x = tl.load(at, mask=mask, other=float("-inf")).to(tl.float32)  # masked: P = 0
            p = tl.exp(x - lse[None, :]) - tl.where(vs[:, None] == target[None, :], 1.0, 0.0)
            p = tl.where((target != -100)[None, :], p, 0.0).to(logits_ptr.dtype.element_ty)
            tl.store(at, p, mask=mask)
            h_at = h_ptr + ts.to(tl.int64)[:, None] * h_stride
            acc0 = tl.dot(p, tl.load(h_at + cs0[None, :], mask=t_in[:, None], other=0.0), acc0,
                          input_precision=DOT_PRECISION)
            if C1 > 0:
                acc1 = tl.dot(p, tl.load(h_at + cs1[None, :], mask=t_in[:, None], other=0.0), acc1,
                              input_precision=DOT_PRECISION)
            if C2 > 0:
                acc2 = tl.dot(p, tl.load(h_at + cs2[None, :], mask=t_in[:, None] & (cs2 < width)[None, :],
                                         other=0.0), acc2, input_precision=DOT_PRECISION)
        out_at = grad_w_ptr + vs.to(tl.int64)[:, None] * grad_w_stride
        tl.store(out_at + cs0[None, :], tl.load(out_at + cs0[None, :], mask=v_in[:, None]) + acc0,
                 mask=v_in[:, None])
        if C1 > 0:
            tl.store(out_at + cs1[None, :], tl.load(out_at + cs1[None, :], mask=v_in[:, None]) + acc1,
                     mask=v_in[:, None])
        if C2 > 0:
            mask2 = v_in[:, None] & (cs2 < width)[None, :]
            tl.store(out_at + cs2[None, :], tl.load(out_at + cs2[None, :], mask=mask2) + acc2, mask=mask2)

    configs = [(dict(BLOCK_V=v, BLOCK_T=t), w, s) for v, t, w, s in WEIGHT_GRAD_CONFIGS]
    return _autotuned(weight_grad_kernel, configs, ["width", "n_cols"])


def _build_row_lse():
    import triton
    import triton.language as tl

    @triton.jit
    def row_lse_kernel(logits_ptr, logits_stride, lse_ptr, n_cols, BLOCK: tl.constexpr):
        """Each row's log-sum-exp, the row read once in BLOCK-column pieces (online) and left as it is."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * logits_stride
        running_max = float("-inf")
        running_sum = 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
        tl.store(lse_ptr + row, running_max + tl.log(running_sum))

    return row_lse_kernel


# ---------------------------------------------------------------- launches

def _dot_precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"  # true float32 products, as torch's matmuls; else unused


def _block_k(width):
    return 64 if width % 64 == 0 else 32 if width % 32 == 0 else 16


def _logits_triton(h, w, lse, blocks=None):
    """K1: the slice's logits (in h's dtype), and each row's log-sum-exp of them into lse. blocks: a launch of
    one's own (BLOCK_M, BLOCK_N, GROUP_M, and num_warps, num_stages on the GPU), else the autotuner's."""
    import triton
    kernel = _kernel("logits")
    blocks = blocks or (INTERPRETER_LOGITS_BLOCKS if interpreting() else {})
    (n, width), n_cols = h.shape, w.shape[0]
    logits = h.new_empty((n, n_cols))
    # a row of tile_lse per tile of the narrowest config; the config chosen fills the first ones
    narrowest = blocks.get("BLOCK_N") or min(c[1] for c in LOGITS_CONFIGS)
    tile_lse = torch.empty((triton.cdiv(n_cols, narrowest), n), dtype=torch.float32, device=h.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_M"]) * triton.cdiv(n_cols, meta["BLOCK_N"]),)
    _launcher(kernel, blocks)[grid](h, w, logits, tile_lse, n, n_cols, h.stride(0), w.stride(0), logits.stride(0),
                                    tile_lse.stride(0), width=width, BLOCK_K=_block_k(width),
                                    DOT_PRECISION=_dot_precision(h.dtype), **blocks)
    block_n = blocks["BLOCK_N"] if blocks else kernel.best_config.kwargs["BLOCK_N"]
    torch.logsumexp(tile_lse[:triton.cdiv(n_cols, block_n)], dim=0, out=lse)
    return logits


def _logits_cublas_row_lse(h, w, lse, block=None):
    """The alternative to K1: cuBLAS's logits, then each row's log-sum-exp by a kernel that only reads them."""
    import triton
    logits = h @ w.t()
    n_rows, n_cols = logits.shape
    block = min(triton.next_power_of_2(n_cols), block or ROW_LSE_BLOCK)
    _kernel("row_lse")[(n_rows,)](logits, logits.stride(0), lse, n_cols, BLOCK=block,
                                  num_warps=min(ROW_LSE_NUM_WARPS, max(4, block // 1024)))
    return logits


_weight_grad_tuned = set()


def _tune_weight_grad(kernel, args, meta, grid):
    """The autotuner runs each config several times on the tensors it is given, and this kernel turns its
    logits into P and adds into grad_w: each run would change the next one's input. So it is tuned once per
    (width, classes, dtype) on copies of the first TUNE_TOKENS tokens (0.13 GB at 32,000 classes in bf16;
    a copy of the whole slice would add 0.5 GB to the update's peak), and the real call finds it tuned."""
    logits, lse, targets, h, grad_w, n, *rest = args
    key = (meta["width"], logits.shape[1], logits.dtype)
    if key in _weight_grad_tuned:
        return
    rows = min(n, TUNE_TOKENS)
    kernel[grid](logits[:rows].clone(), lse[:rows], targets[:rows], h[:rows], torch.zeros_like(grad_w), rows, *rest,
                 **meta)
    _weight_grad_tuned.add(key)


def _weight_grad_triton(logits, lse, targets, h, grad_w, blocks=None):
    """K3: grad_w += P.T @ h (float32), P = d(loss)/d(logits) written over the logits. blocks: a launch of
    one's own (BLOCK_V, BLOCK_T, and num_warps, num_stages on the GPU), else the autotuner's."""
    import triton
    kernel = _kernel("weight_grad")
    blocks = blocks or (INTERPRETER_WEIGHT_GRAD_BLOCKS if interpreting() else {})
    (n, n_cols), width = logits.shape, h.shape[1]
    c0, c1, c2 = width_pieces(width)
    args = (logits, lse, targets, h, grad_w, n, n_cols, logits.stride(0), h.stride(0), grad_w.stride(0))
    meta = dict(width=width, C0=c0, C1=c1, C2=c2, DOT_PRECISION=_dot_precision(h.dtype), **blocks)
    grid = lambda launch: (triton.cdiv(n_cols, launch["BLOCK_V"]),)
    if not blocks:
        _tune_weight_grad(kernel, args, meta, grid)
    _launcher(kernel, blocks)[grid](*args, **meta)


def _input_grad(p, w, out):
    """K2: out = p @ w in float32 (bf16 products, float32 sums on CUDA; float32 products elsewhere, as "fused")."""
    if p.device.type == "cuda" and p.dtype != torch.float32:
        torch.mm(p, w, out_dtype=torch.float32, out=out)
    else:
        torch.mm(p.float(), w.float(), out=out)


# ---------------------------------------------------------------- the same stages in torch

def _logits_torch(h, w, lse):
    logits = h @ w.t()
    torch.logsumexp(logits.float(), dim=1, out=lse)
    return logits


def _weight_grad_torch(logits, lse, targets, h, grad_w):
    """K3's math in torch (the row kernel's reference gradient, kernels/cross_entropy.py), then the matmul."""
    counted = targets != -100
    p = torch.exp(logits.float() - lse[:, None])
    p[torch.arange(len(targets), device=p.device), targets.clamp(min=0)] -= 1.0
    logits.copy_(p * counted[:, None])
    if logits.device.type == "cuda" and logits.dtype != torch.float32:
        torch.addmm(grad_w, logits.t(), h, out_dtype=torch.float32, out=grad_w)
    else:
        grad_w += logits.t().float() @ h.float()


def _stages(device, triton_forward):
    """(forward: h, w, lse -> logits; weight gradient) for the device: the kernels where Triton runs."""
    if not uses_triton(device):
        return _logits_torch, _weight_grad_torch
    return (_logits_triton if triton_forward else _logits_cublas_row_lse), _weight_grad_triton


# ---------------------------------------------------------------- the op

def _linear_cross_entropy_epilogue_impl(h, weight, targets, chunk_tokens, triton_forward):
    """(sum of token losses, d sum / d h, d sum / d weight) in float32, one slice of tokens at a time."""
    h, targets = h.contiguous(), targets.contiguous()
    w = weight.to(h.dtype).contiguous()
    forward, weight_grad = _stages(h.device, triton_forward)
    n = h.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=h.device)
    target_logits = h.new_empty((n, 1))
    safe_targets = targets.clamp(min=0)[:, None]
    grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for start in range(0, n, chunk_tokens):
        part = slice(start, start + chunk_tokens)
        logits = forward(h[part], w, lse[part])
        torch.gather(logits, 1, safe_targets[part], out=target_logits[part])  # before P replaces them
        weight_grad(logits, lse[part], targets[part], h[part], grad_w)
        _input_grad(logits, w, grad_h[part])
        del logits  # else the next slice's logits would be allocated while these are held
    losses = torch.where(targets != -100, lse - target_logits.squeeze(1).float(), 0.0)
    return losses.sum(), grad_h, grad_w


@torch.library.custom_op("tiny_llm::linear_cross_entropy_epilogue", mutates_args=())
def _linear_cross_entropy_epilogue_op(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                                      triton_forward: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _linear_cross_entropy_epilogue_impl(h, weight, targets, chunk_tokens, triton_forward)


@_linear_cross_entropy_epilogue_op.register_fake
def _(h, weight, targets, chunk_tokens, triton_forward):
    # contiguous, as the real op allocates them
    return (h.new_empty((), dtype=torch.float32), h.new_empty(h.shape, dtype=torch.float32),
            weight.new_empty(weight.shape, dtype=torch.float32))


def _setup(ctx, inputs, output):
    h, weight = inputs[:2]
    ctx.dtypes = h.dtype, weight.dtype
    ctx.save_for_backward(*output[1:])


def _backward(ctx, grad_total, _grad_h, _grad_w):
    grad_h, grad_w = ctx.saved_tensors
    h_dtype, weight_dtype = ctx.dtypes
    return (grad_h * grad_total).to(h_dtype), (grad_w * grad_total).to(weight_dtype), None, None, None


_linear_cross_entropy_epilogue_op.register_autograd(_backward, setup_context=_setup)


def linear_cross_entropy_epilogue(h, weight, targets, chunk_tokens, triton_forward=None):
    """Sum of cross-entropy of (h @ weight.T) against targets (-100 ignored), its gradients computed in forward:
    "fused"'s contract (kernels/cross_entropy.linear_cross_entropy), with the loss inside the matmuls' kernels.

    triton_forward: K1 for the forward matmul, or cuBLAS and the lse kernel; TRITON_FORWARD when None.
    A width the kernels cannot hold (not a multiple of 16, or above MAX_WIDTH) is refused on every device."""
    width_pieces(weight.shape[1])
    triton_forward = TRITON_FORWARD if triton_forward is None else bool(triton_forward)
    return _linear_cross_entropy_epilogue_op(in_autocast_dtype(h), weight, targets, int(chunk_tokens),
                                             triton_forward)[0]
