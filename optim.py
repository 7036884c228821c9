"""The optimizers and learning-rate schedules that trainer.py uses.

    lr_at(step, ...)                      the learning rate of one update: cosine (the default) or wsd
    Muon                                  torch.optim.Muon's update, batched over matrices of one shape (and its
                                          lever, NorMuon)
    WeightAverage                         an exponential moving average of the weights (the ema key)
    build_optimizer(model, settings, dev) AdamW alone (the default), or Muon on the blocks' matrices + AdamW
    set_lr(optimizer, lr, learning_rate)  every group's learning rate for one update
"""
import contextlib
import math
from collections.abc import Mapping

import torch

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")
MUON_ADJUST = ("original", "match_rms_adamw")

# torch.optim.Muon's defaults (Keller Jordan's quintic Newton-Schulz coefficients and its epsilon)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
MAX_NS_STEPS = 100  # Newton-Schulz iterations below this, as torch.optim.Muon requires

# NorMuon (Li et al. 2025, "NorMuon: Making Muon more efficient and scalable", arXiv:2510.05491): its reference
# code's beta2 for the per-neuron second moment, and the epsilon beside its root and the norm it restores
NORMUON_BETA2 = 0.95
NORMUON_EPS = 1e-10


# ---------------------------------------------------------------- schedules

def lr_at(step, total_updates, learning_rate, min_lr, warmup_updates, schedule="cosine", cooldown_fraction=0.2):
    """The learning rate of update `step` (0-based) of `total_updates`.

    Both schedules warm up linearly: update s < warmup_updates gets learning_rate * (s + 1) / warmup_updates.
    cosine: then cosine decay from learning_rate to min_lr, reached at update total_updates. Its float operations
        are part of the recipe: changed, they would change every recorded run's rates (tests/test_optim.py pins them).
    wsd (warmup-stable-decay, the trapezoid of the modded-nanogpt speedrun records): then learning_rate flat,
        then a linear decay over the last round(cooldown_fraction * total_updates) updates (Python's round: half
        to even), each a step lower, so that the last update (total_updates - 1) gets exactly min_lr and the
        first of them is the first below learning_rate. The decay never overlaps the warmup: cooldown_fraction 1
        decays from the end of the warmup; cooldown_fraction 0 (or a cooldown that rounds to no update, or a
        warmup as long as the run) never decays, so min_lr is unused. Past the end the rate stays the last one.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if step < warmup_updates:
        return learning_rate * (step + 1) / warmup_updates
    if schedule == "cosine":
        progress = (step - warmup_updates) / max(1, total_updates - warmup_updates)
        progress = min(progress, 1.0)
        return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (learning_rate - min_lr)
    cooldown = max(min(round(cooldown_fraction * total_updates), total_updates - warmup_updates), 0)
    if cooldown == 0 or step < total_updates - cooldown:
        return learning_rate
    # counted from the end, so that the last update is min_lr exactly (min_lr + difference x 0)
    remaining = max(total_updates - 1 - step, 0) / cooldown
    return min_lr + (learning_rate - min_lr) * remaining


# ---------------------------------------------------------------- Muon

def orthogonalize(grads, buffers, momentum, nesterov, coefficients, ns_steps, eps, second_moments=None, pieces=1):
    """Momentum and Newton-Schulz for matrices of one shape: the float32 updates, stacked (n, rows, cols).

    torch.optim.Muon's math (_single_tensor_muon and _zeropower_via_newtonschulz) with each matrix product
    batched over the stack; second_moments (each parameter's (rows, 1) tensor) adds NorMuon's normalization.
    pieces: each parameter stacks that many matrices by rows (a fused projection), orthogonalized one by one.
    Updates the momentum buffers (and second moments) in place; uses no learning rate, so that compiled it is one
    graph per shape whatever the schedule does."""
    torch._foreach_lerp_(buffers, grads, 1 - momentum)
    updates = torch._foreach_lerp(grads, buffers, momentum) if nesterov else buffers
    stacked = torch.stack(updates)
    x = as_pieces(stacked, pieces).bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:  # the Gram matrix of the short side: fewer FLOPs
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm at most 1, per matrix
    a, b, c = coefficients
    for _ in range(ns_steps):  # x <- a x + b x^3 + c x^5
        gram = x @ x.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    if tall:
        x = x.mT
    # float32 and contiguous: the parameters' dtype and layout, so the foreach add below takes its fast path
    x = x.to(torch.float32, memory_format=torch.contiguous_format).view(stacked.shape)
    return x if second_moments is None else normalize_neurons(x, second_moments, pieces=pieces)


def as_pieces(stacked, pieces):
    """The stack (n, rows, cols) as its n x pieces matrices of rows / pieces rows each, in order: a view."""
    n, rows, cols = stacked.shape
    return stacked.view(n * pieces, rows // pieces, cols)


def normalize_neurons(updates, second_moments, beta2=NORMUON_BETA2, eps=NORMUON_EPS, pieces=1):
    """NorMuon's step on the stacked float32 orthogonalized updates (n, rows, cols), as its reference code takes
    it: each row's mean square (a row is an output neuron of the (out, in) weight) enters that row's second
    moment, an average over updates (second_moments, each (rows, 1), lerped in place by 1 - beta2); each row is
    divided by the moment's root; each matrix (each of a fused parameter's pieces) is then scaled back to the
    Frobenius norm it had, so that muon_lr and muon_adjust_lr keep their meaning and only the rows' shares
    change."""
    norm = as_pieces(updates, pieces).norm(dim=(-2, -1), keepdim=True)
    means = updates.square().mean(dim=-1, keepdim=True).to(second_moments[0].dtype)  # the moments are p's dtype
    torch._foreach_lerp_(second_moments, means.unbind(0), 1 - beta2)
    normalized = as_pieces(updates / (torch.stack(second_moments).float().sqrt() + eps), pieces)
    return (normalized * (norm / (normalized.norm(dim=(-2, -1), keepdim=True) + eps))).view(updates.shape)


_compiled_orthogonalize = None


def compiled_orthogonalize():
    """orthogonalize under torch.compile, made on first use (importing this module compiles nothing)."""
    global _compiled_orthogonalize
    if _compiled_orthogonalize is None:
        _compiled_orthogonalize = torch.compile(orthogonalize, fullgraph=True, dynamic=False)
    return _compiled_orthogonalize


def adjusted_ratio(adjust_lr_fn, shape):
    """torch.optim.Muon's _adjust_lr factor: the learning rate of a (rows, cols) matrix is lr x this."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def apply_updates(params, updates, lr, weight_decay, ratio):
    """Decoupled weight decay, then params -= lr x ratio x updates, with foreach ops over the shape group.

    lr may be a float or a 0-dim tensor: both take the same ops (the update scaled, then added), so they give
    the same bits when the tensor holds the float (a float64 tensor does exactly), and a tensor is never read
    on the host."""
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    updates.mul_(-(lr * ratio))
    torch._foreach_add_(params, updates.unbind(0))


def closure_loss(closure):
    """torch.optim's step(closure) convention: the closure re-evaluates the loss, with gradients on (None without)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update, with the matrices of one shape orthogonalized together.

    Why batched: torch.optim.Muon runs Newton-Schulz one matrix at a time from Python, and on a GPU the update
    waits on those launches. Here a group's parameters are grouped by shape (4 shapes in a Llama block), and each
    shape takes one stack, one batched Newton-Schulz (bmm and baddbmm in bf16) and a few torch._foreach_* ops
    that apply the decay and the update: the launches of one matrix, for all the matrices of a shape. What it
    saves: docs/TIME_TO_QUALITY.md, "Muon's cost".

    compile=True runs the per-shape math under torch.compile (fullgraph, static shapes: one graph per shape,
    compiled at the first step) where the parameters are on CUDA; on the CPU it runs eagerly. Compiled, a step
    takes less GPU time and more host time (the same section), which pays only where the host has time to spare,
    so it is off by default and build_optimizer turns it on with the model's compile; its fused bf16 math also
    rounds differently from torch's. Nothing in step() syncs with the host: lr may be a float or a 0-dim tensor,
    which is never read back.

    The math is torch.optim.Muon's: momentum buf.lerp_(grad, 1 - momentum), Nesterov grad.lerp(buf, momentum),
    Newton-Schulz on the bf16 update (transposed when tall, divided by its Frobenius norm clamped at eps),
    param *= 1 - lr x weight_decay, param -= lr x adjust(shape) x update. A batched bf16 matmul may round a
    product differently from torch's single one, so the two agree closely, not always bit for bit
    (tests/test_optim.py holds eager and compiled to their tolerances). The state is per parameter
    (state[p]["momentum_buffer"], and NorMuon's state[p]["second_moment"]), so state_dict() and load_state_dict()
    are torch's, and a resumed run continues bit for bit.

    The levers, group options off by default (off, the math above): normuon=True (normalize_neurons says what it
    computes); pieces=k, for parameters that stack k matrices by rows (model.py's fused wqkv and w13): each
    piece is orthogonalized, and its learning rate adjusted, as a matrix of its own, as torch.optim.Muon does
    the unfused projections of transformers' Llama (the momentum and NorMuon's rows are the same either way).
    """
    LEVERS = dict(normuon=False, pieces=1)  # off

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=NS_COEFFICIENTS, eps=NS_EPS, ns_steps=5, adjust_lr_fn=None, compile=False,
                 normuon=False, pieces=1):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Muon: a tensor lr must have one element")
        if not (lr >= 0 and momentum >= 0 and weight_decay >= 0):
            raise ValueError(f"Muon: lr, momentum and weight_decay must be >= 0, got {lr}, {momentum}, "
                             f"{weight_decay}")
        if adjust_lr_fn is not None and adjust_lr_fn not in MUON_ADJUST:
            raise ValueError(f"Muon: unknown adjust_lr_fn {adjust_lr_fn!r}; valid: {', '.join(MUON_ADJUST)}")
        if not 1 <= ns_steps < MAX_NS_STEPS or len(ns_coefficients) != 3:
            raise ValueError(f"Muon: ns_steps must be in [1, {MAX_NS_STEPS}) and ns_coefficients three numbers, got "
                             f"{ns_steps} and {ns_coefficients!r}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, normuon=bool(normuon), pieces=pieces)
        super().__init__(params, defaults)
        self.compile = compile  # not a group option: how the math runs, not what it is
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes only 2-D parameters; got one of shape {tuple(p.shape)}")
                pieces = group["pieces"]
                if not (isinstance(pieces, int) and pieces >= 1 and p.shape[0] % pieces == 0):
                    raise ValueError(f"Muon: pieces must be a whole number >= 1 that divides each parameter's rows; "
                                     f"got {pieces!r} for one of shape {tuple(p.shape)}")

    def shape_groups(self, group):
        """The group's parameters that have gradients, as lists of one shape, dtype and device, in order."""
        by_shape = {}
        for p in group["params"]:
            if p.grad is not None:
                if p.grad.is_sparse or torch.is_complex(p):
                    raise RuntimeError("Muon supports neither sparse gradients nor complex parameters")
                by_shape.setdefault((p.shape, p.dtype, p.device), []).append(p)
        return list(by_shape.values())

    def __setstate__(self, state):
        """A group saved before a lever existed holds no option for it: it ran with it off."""
        super().__setstate__(state)
        self.__dict__.setdefault("compile", False)  # a copy or a pickle (torch keeps the groups and state only)
        for group in self.param_groups:
            for key, off in self.LEVERS.items():
                group.setdefault(key, off)

    def state_of(self, params, key):
        """state[p][key] of each parameter, made as zeros where it has none yet: the momentum buffer (p's shape)
        or NorMuon's second moment (one per row)."""
        tensors = []
        for p in params:
            state = self.state[p]
            if key not in state:
                state[key] = (torch.zeros_like(p, memory_format=torch.preserve_format) if key == "momentum_buffer"
                              else p.new_zeros(p.shape[0], 1))
            tensors.append(state[key])
        return tensors

    def init_state(self):
        """Every momentum buffer (and second moment), zeros, now rather than at the first step (which makes the
        same zeros), so that a compiled step finds its state in place and is traced once."""
        for group in self.param_groups:
            self.state_of(group["params"], "momentum_buffer")
            if group["normuon"]:
                self.state_of(group["params"], "second_moment")

    def orthogonalize_fn(self, device):
        return compiled_orthogonalize() if self.compile and device.type == "cuda" else orthogonalize

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            for params in self.shape_groups(group):
                moments = self.state_of(params, "second_moment") if group["normuon"] else None
                updates = self.orthogonalize_fn(params[0].device)(
                    [p.grad for p in params], self.state_of(params, "momentum_buffer"), group["momentum"],
                    group["nesterov"], group["ns_coefficients"], group["ns_steps"], group["eps"], moments,
                    group["pieces"])
                rows, cols = params[0].shape
                apply_updates(params, updates, group["lr"], group["weight_decay"],
                              adjusted_ratio(group["adjust_lr_fn"], (rows // group["pieces"], cols)))
        return loss


# ---------------------------------------------------------------- Muon and AdamW as one optimizer

class MuonWithAdamW:
    """Muon on the blocks' matrices and AdamW on the other parameters, as one optimizer for the trainer.

    param_groups lists AdamW's groups, then Muon's (the live dicts: setting group["lr"] sets it); every group
    holds its peak rate as group["base_lr"]. state_dict() is {"adamw": ..., "muon": ...}."""

    def __init__(self, muon, adamw):
        self.muon, self.adamw = muon, adamw
        self.optimizers = (adamw, muon)

    @property
    def param_groups(self):
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self):
        return {**self.adamw.state, **self.muon.state}

    def step(self, closure=None):
        loss = closure_loss(closure)
        # one call each, not a loop: torch.optim's step breaks the graph on purpose (an inference graph for the
        # optimizer), and under update_graph's compile a break inside a loop would leave this frame to eager
        self.adamw.step()
        self.muon.step()
        return loss

    def zero_grad(self, set_to_none=True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state_dict):
        if set(state_dict) != {"adamw", "muon"}:
            raise ValueError(f"this optimizer state is not Muon with AdamW (it has {', '.join(map(str, state_dict))}"
                             f"); was it saved with optimizer=adamw?")
        self.adamw.load_state_dict(state_dict["adamw"])
        self.muon.load_state_dict(state_dict["muon"])

    def __repr__(self):
        return f"MuonWithAdamW(\n{self.muon!r},\n{self.adamw!r})"


def setting(settings, key, *default):
    """settings[key] from a mapping, or the attribute (a settings dataclass such as train.py's cfg); the default,
    if one is given, where the key is absent."""
    if isinstance(settings, Mapping):
        return settings.get(key, *default) if default else settings[key]
    return getattr(settings, key, *default)


def split_by_decay(params, weight_decay, **options):
    """trainer.py's two AdamW groups: matrices (and the embedding) with weight decay, the rest (norms) without."""
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay, **options},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, **options}]


def build_optimizer(model, settings, device, captured=False):
    """The optimizer of settings["optimizer"] for model (the raw Transformer, not a compiled or DDP wrapper);
    captured: its step runs inside a CUDA graph of the whole update (trainer.CapturedUpdate), so its learning rates
    are device tensors and AdamW is capturable (adamw_kernels).

    adamw: torch.optim.AdamW over split_by_decay's two groups, in that order and with no options of ours (no
        base_lr: set_lr needs none): the layout of an adamw checkpoint's optimizer state, which must keep loading.
    muon: MuonWithAdamW: Muon (lr muon_lr, Nesterov) on the 2-D weights of model.layers, AdamW (lr learning_rate,
        the same betas, eps and fused rule) on the rest: the tied embedding and LM head with weight decay, the
        norms without. Muon's per-shape math is compiled when settings' compile is (on CUDA), except where the
        update is captured. Its levers normuon and muon_split_projections (muon_groups) are Muon's alone.
    """
    get = lambda key: setting(settings, key)
    name = get("optimizer")
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")
    graph = bool(setting(settings, "update_graph", False))
    tensor_lr = graph or captured
    adamw_options = dict(lr=group_lr(get("learning_rate"), tensor_lr, device), betas=(get("beta1"), get("beta2")),
                         eps=get("adam_eps"), **adamw_kernels(graph, device, captured))
    params = list(model.parameters())  # the tied embedding and head once
    if name == "adamw":
        return torch.optim.AdamW(split_by_decay(params, get("weight_decay")), **adamw_options)
    matrices = [p for p in model.layers.parameters() if p.dim() == 2]
    in_muon = {id(p) for p in matrices}  # by identity: `in` on tensors would compare values
    rest = [p for p in params if id(p) not in in_muon]
    adamw = torch.optim.AdamW(split_by_decay(rest, get("weight_decay"), base_lr=get("learning_rate")),
                              **adamw_options)
    pieces = model.fused_projections() if setting(settings, "muon_split_projections", False) else []
    muon = Muon(muon_groups(matrices, pieces, get("muon_lr")), lr=group_lr(get("muon_lr"), tensor_lr, device),
                weight_decay=get("weight_decay"), momentum=get("muon_momentum"), nesterov=True,
                ns_steps=get("muon_ns_steps"), adjust_lr_fn=get("muon_adjust_lr"),
                normuon=setting(settings, "normuon", False),
                # compiled with the model: under CUDA graphs the host has time; inside the update's graph, the
                # trainer's compile traces it whole; inside the update's own CUDA graph (captured) the eager
                # math's launches cost no host time, and a cold start saves a compile per shape
                compile=bool(get("compile")) and not graph and not captured)
    return MuonWithAdamW(muon, adamw)


def muon_groups(matrices, pieces, base_lr):
    """Muon's parameter groups: the matrices whole, then (muon_split_projections) each fused projection's kind in
    its own group, with the matrices it stacks as the group's pieces; a group only where it has parameters."""
    split = {id(w): k for w, k in pieces}
    groups = [{"params": [p for p in matrices if id(p) not in split], "base_lr": base_lr}]
    for k in dict.fromkeys(split.values()):  # 3 (wqkv), then 2 (w13)
        groups.append({"params": [p for p in matrices if split.get(id(p)) == k], "base_lr": base_lr, "pieces": k})
    return [group for group in groups if group["params"]]


def adamw_kernels(graph, device, captured=False):
    """AdamW's implementation options: fused on CUDA (the default run's); with update_graph, the foreach form that
    torch.compile traces, capturable so that its step counts stay on the device and CUDA graphs can hold it;
    captured (the update one CUDA graph), the default's fused kernel, capturable on CUDA (torch refuses a step
    captured without it)."""
    if graph:
        return dict(fused=False, foreach=True, capturable=True)
    cuda = torch.device(device).type == "cuda"
    return dict(fused=cuda, capturable=True) if captured and cuda else dict(fused=cuda)


def group_lr(value, tensor, device):
    """A group's learning rate: the float, or (tensor: update_graph, or the update one CUDA graph) a float32 device
    tensor that set_lr fills in place, so that the compiled step or the graph reads it each update instead of
    holding the first value."""
    return torch.tensor(value, dtype=torch.float32, device=device) if tensor else value


def load_state(optimizer, state_dict):
    """Load a checkpoint's optimizer state, kept in the form of this run: the one conversion a saved state needs.

    A saved state's groups hold the execution options of the run that saved it: float learning rates and AdamW
    fused on CUDA (the form without update_graph, so every checkpoint written before update_graph existed), or
    float32 device-tensor rates and AdamW's capturable foreach form (with it). Execution keys may differ between
    the run that saved and the run that resumes, and torch's load_state_dict takes the saved options; so this
    run's own (fused, foreach, capturable) and its learning rates' kind (float or tensor) are put back."""
    kept = [{k: group[k] for k in ("fused", "foreach", "capturable", "lr") if k in group}
            for group in optimizer.param_groups]
    optimizer.load_state_dict(state_dict)
    for group, options in zip(optimizer.param_groups, kept):
        group.update(options)


def set_lr(optimizer, lr, learning_rate):
    """Set every group's learning rate for an update whose schedule gives `lr` (peak: learning_rate).

    AdamW groups get lr itself, so the default run's math is unchanged; Muon groups get base_lr x (lr /
    learning_rate), the same schedule scaled to their own peak (the ratio first, so the peak is base_lr exactly).
    """
    for each in getattr(optimizer, "optimizers", (optimizer,)):
        for group in each.param_groups:
            value = group["base_lr"] * (lr / learning_rate) if isinstance(each, Muon) else lr
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(value)  # update_graph: the tensor the compiled step reads
            else:
                group["lr"] = value


# ---------------------------------------------------------------- the weights' average

class WeightAverage:
    """An exponential moving average of a model's weights (the ema key: its decay), for evaluation and export.

    After update t the accumulator holds a_t = decay x a_(t-1) + (1 - decay) x w_t from a_0 = 0, one
    torch._foreach_lerp_ on the weights' device after each optimizer step (nothing read on the host; under
    update_graph inside the compiled step), and the average is a_t / (1 - decay^t): the weights after each update
    weighted decay^(t - i) and normalized, as Adam corrects its moments' bias. So the initial weights carry no
    weight, and a run shorter than 1 / (1 - decay) updates is not pulled back toward its start. Under DDP every
    rank holds the same average, as it holds the same weights. state_dict() keys the accumulator by parameter
    name (the tied embedding once), which checkpoint.load_model reads through averaged_weights."""

    def __init__(self, model, decay):
        if not 0 < decay < 1:
            raise ValueError(f"WeightAverage: decay must lie in (0, 1), got {decay}")
        named = list(model.named_parameters())
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.decay = decay
        self.accumulator = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def update(self):
        torch._foreach_lerp_(self.accumulator, self.params, 1 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self, updates):
        """Inside, the model's weights are the average after `updates` updates (with none yet, the weights as
        they are); after, the live weights again, bit for bit."""
        if updates == 0:
            yield
            return
        with torch.no_grad():
            live = [p.detach().clone() for p in self.params]
            torch._foreach_copy_(self.params, debiased(self.accumulator, self.decay, updates))
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, live)

    def state_dict(self):
        return {"decay": self.decay, "accumulator": dict(zip(self.names, self.accumulator))}

    def load_state_dict(self, state):
        if state["decay"] != self.decay or list(state["accumulator"]) != self.names:
            raise ValueError(f"this weight average (decay {state['decay']}, {len(state['accumulator'])} weights) is "
                             f"not this run's (decay {self.decay}, {len(self.names)} weights)")
        with torch.no_grad():  # in place: a compiled step holds these tensors
            torch._foreach_copy_(self.accumulator, list(state["accumulator"].values()))


def debiased(accumulator, decay, updates):
    """The average of the weights from WeightAverage's accumulator after `updates` (>= 1) updates: new tensors."""
    return torch._foreach_div(accumulator, 1 - decay ** updates)


def averaged_weights(state, updates):
    """{name: weight} of the average a WeightAverage.state_dict() holds after `updates` updates (a checkpoint's
    "ema" and "step"): the bits the run evaluated with; {} before any update (the weights are their own)."""
    if updates == 0:
        return {}
    names = list(state["accumulator"])
    return dict(zip(names, debiased(list(state["accumulator"].values()), state["decay"], updates)))
