"""The model, its optimizer and schedule, and the one update step that train.py runs and bench.py times; and the
evaluation pass."""
import contextlib
import inspect
import math
import os
import resource
from pathlib import Path

import torch
import torch._functorch.config  # activation_memory_budget

import compile_cache
import env
import model as model_lib
import optim
from distributed import all_reduce_sum
from model_kernels import first_calls, swiglu
from model_kernels.attention import resolve_backend
import settings
from data.loader import sequence_lengths


def peak_memory_bytes(device):
    """The allocator's peak on a GPU; on the CPU the process's peak RSS (since reset_peak_memory, where it works)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_memory(device):
    """Start peak_memory_bytes anew, for a process that measures several models (bench.py's presets): the allocator's
    peak, or on the CPU the process's RSS high-water mark (Linux's clear_refs; elsewhere it stays the process's)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def autocast(device, dtype, enabled=True):
    """Autocast to dtype on device's type; none (the model's float32) when dtype is None."""
    return torch.autocast(torch.device(device).type, dtype=dtype or torch.bfloat16,
                          enabled=enabled and dtype is not None)


# ---------------------------------------------------------------- the update step

def uses_cudagraphs(cfg):
    """Whether the compiled model runs as CUDA graphs (the compile modes that capture them)."""
    return cfg.compile and cfg.compile_mode in ("reduce-overhead", "max-autotune")


def compile_mode(cfg, captured=False):
    """torch.compile's mode argument for cfg.compile_mode ("default" is torch's None); captured (the update one CUDA
    graph of the trainer's own), the same mode without torch's CUDA graphs, which cannot nest in it."""
    if cfg.compile_mode == "default" or (captured and cfg.compile_mode == "reduce-overhead"):
        return None
    return "max-autotune-no-cudagraphs" if captured and cfg.compile_mode == "max-autotune" else cfg.compile_mode


def captures_update(cfg, device, world_size):
    """Whether the trainer captures each update whole as one CUDA graph (CapturedUpdate): compile_scope blocks with
    a compile mode that makes CUDA graphs, one process on a GPU. Under DDP each region keeps torch's CUDA graphs."""
    return (uses_cudagraphs(cfg) and cfg.compile_scope == "blocks" and torch.device(device).type == "cuda"
            and world_size == 1)


def cuda_graph_capture(step):
    """step() captured as a CUDA graph, not run: (replay, step's outputs), tensors that each replay() writes. Errors
    for this thread's unsafe calls only, as torch's own CUDA graphs (cudagraph_trees) capture: the data loader's
    thread pins the next batches meanwhile."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = step()
    return graph.replay, outputs


class CapturedUpdate:
    """The whole update (every micro-step's forward and backward, the clip, the optimizer step, the gradients let
    go) as one CUDA graph: compile_scope blocks compiles one block's code for all blocks, and torch's CUDA
    graphs would then replay each region's graphs apart, with the autograd engine and guards between them in
    Python; one graph of the trainer's own runs the update in one launch.

    An update's first shape of micro-batches (a context schedule's each shape) runs uncaptured: it compiles the
    regions and makes each kernel's first call (compiles, autotuning), which a capture must not do. Its second is
    captured and replayed, and every later one replayed: the batch copied into the graph's input tensors, the scale
    world_size / n_tokens into its own, the learning rates device tensors that set_lr fills (build_optimizer's
    captured form). The gradients are made inside the graph, in its memory, as PyTorch's whole-network capture
    makes them: each update's first backward gives every parameter its gradient as it comes, later micro-steps add
    into it, and the step sets them to None again (gradients kept outside the graph cost an add each and their
    zeroing, every update). One graph is held, the last shape's, dropped when another shape comes: a schedule's
    shapes come one after another."""

    def __init__(self, step, device, capture):
        # step(micro_batches, scale): the update; capture(fn): (replay, outputs), cuda_graph_capture's
        self.step, self.device, self.capture = step, device, capture
        self.seen, self.shape, self.graph = set(), None, None

    def __call__(self, micro_batches, scale):
        shape = tuple(tuple(t.shape) for batch in micro_batches for t in batch)
        if shape != self.shape:
            self.graph, self.shape = None, None  # the last shape's graph and its memory go before this shape runs
            if shape not in self.seen:
                self.seen.add(shape)
                return self.step(micro_batches, scale)
            inputs = [tuple(t.clone() for t in batch) for batch in micro_batches]
            scale_tensor = torch.zeros((), device=self.device)  # float32, as the losses it multiplies
            replay, outputs = self.capture(lambda: self.step(inputs, scale_tensor))
            self.graph, self.shape = (replay, inputs, scale_tensor, outputs), shape
        replay, inputs, scale_tensor, outputs = self.graph
        for batch, static in zip(micro_batches, inputs):
            for t, s in zip(batch, static):
                s.copy_(t, non_blocking=True)
        scale_tensor.fill_(scale)
        replay()
        return tuple(t.clone() for t in outputs)  # the next replay overwrites the graph's own


class Trainer:
    """Model, optimizer and schedule, with the one update step that train.py runs and bench.py times."""

    def __init__(self, cfg, mcfg, device, total_updates, world_size=1, local_rank=0, initial_state=None,
                 attention=None):
        """cfg has passed settings.check and settings.check_device, which returned `attention` (the backend
        that runs here, and why); without it, the setting's backend is resolved here."""
        self.cfg, self.device, self.world_size = cfg, torch.device(device), world_size
        self.total_updates = total_updates
        if cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        self.attention, self.attention_reason = attention or resolve_backend(cfg.attention_backend, self.device)
        self.compile_cache = self.load_compile_cache(cfg.get("compile_cache") if cfg.compile else None)
        # cold, the kernels that compile at their first call are compiled by a child while this process builds and
        # compiles the model (model_kernels/first_calls.py)
        first_calls.start(first_calls.spec(cfg, mcfg, self.device, self.attention, sequence_lengths(
            cfg.seq_len, settings.schedule_steps(cfg.get("seq_len_schedule", ""))), env.compiler_cache_state()[1]))
        torch.manual_seed(cfg.seed)
        # the backend resolved here, once: "auto" inside compiled code would trace the package lookup
        self.raw_model = model_lib.Transformer(mcfg, attention_backend=self.attention, loss_impl=cfg.loss_impl,
                                               loss_chunk_tokens=cfg.loss_chunk_tokens,
                                               residual_dtype=cfg.residual_dtype,
                                               lm_head_fp8=cfg.lm_head_fp8, mlp_impl=cfg.mlp_impl).to(self.device)
        if initial_state is not None:  # init_from: the weights a run starts from, in place of the seed's
            self.raw_model.load_state_dict(initial_state)
        captured = captures_update(cfg, self.device, world_size)
        self.mode = compile_mode(cfg, captured)
        self.cudagraphs = uses_cudagraphs(cfg) and not captured  # torch's, around each compiled graph
        # gradients outside torch's CUDA graphs' memory, added into in place (allocate_gradients), where several
        # micro-steps replay them apart; CapturedUpdate's one graph makes its own
        self.stable_grads = self.cudagraphs and settings.micro_steps(cfg, world_size) > 1
        if self.stable_grads:
            self.allocate_gradients()
        self.model = self.compiled(self.raw_model) if cfg.compile else self.raw_model
        self.eval_model = self.model  # evaluation needs no gradient sync, so never the DDP wrapper
        if world_size > 1:
            self.model = self.data_parallel(self.model, local_rank)
        self.optimizer = optim.build_optimizer(self.raw_model, cfg, self.device, captured)
        # ema: the weights' average, updated after each optimizer step; validation and the final evaluation use it
        self.ema = optim.WeightAverage(self.raw_model, cfg.ema) if cfg.get("ema") else None
        # plain values for the step, which torch.compile traces under update_graph (it cannot read cfg's keys)
        self.params, self.max_norm = list(self.raw_model.parameters()), cfg.grad_clip or math.inf
        self.optimizer_step = self.compile_step if cfg.update_graph else self.clip_and_step
        self.captured = CapturedUpdate(self.update_step, self.device, cuda_graph_capture) if captured else None
        self.step = 0
        # bf16 autocast on the GPU; None (float32) on the CPU. A test turns it on there too.
        self.autocast_dtype = torch.bfloat16 if self.device.type == "cuda" else None

    @classmethod
    def from_plan(cls, plan, total_updates):
        """The trainer of a resolved run (plan.py): its model, its optimizer over total_updates, on its device."""
        return cls(plan.cfg, plan.model, plan.device, total_updates, plan.world_size, plan.local_rank,
                   initial_state=plan.initial.state if plan.initial else None,
                   attention=(plan.attention, plan.attention_reason))

    def load_compile_cache(self, path):
        """compile_cache's file put into the compiler's caches when it matches; returns the path this process saves
        it to (None: no file, or another process of the run saves it). The file is written after the first update
        and again after any update that compiled graphs since (a schedule's new shape), never when nothing new was
        compiled (a warm start)."""
        self.compile_cache_loaded = False
        if not path:
            return None
        loaded, line = compile_cache.load(path, self.device)
        self.compile_cache_loaded = loaded
        main = int(os.environ.get("RANK", "0")) == 0
        if main:
            print(line, flush=True)
        self.graphs_in_compile_cache = env.inductor_graph_counts()["compiled"] if loaded else -1
        return path if main else None

    def compile_cache_due(self):
        """After an update: whether this process saves the compile cache and has compiled graphs it does not hold
        (the first update's, a schedule's new shape). The caller saves it out of its clock (save_compile_cache)."""
        return bool(self.compile_cache) and env.inductor_graph_counts()["compiled"] > self.graphs_in_compile_cache

    def save_compile_cache(self):
        """Save it; a write that fails (a full disk) costs the run nothing but the file: one line, and no more tries."""
        compiled = env.inductor_graph_counts()["compiled"]
        try:
            line = compile_cache.save(self.compile_cache, self.device)
        except (OSError, RuntimeError, ValueError) as exc:  # a full disk; torch's own failure; a file put there since
            why = getattr(exc, "strerror", None) or exc
            line, self.compile_cache = f"compile cache {self.compile_cache} not saved ({why}); the run goes on", None
        if line:
            print(line, flush=True)
        self.graphs_in_compile_cache = compiled

    def allocate_gradients(self):
        """Give every parameter a zeroed .grad that the optimizer step keeps (zero_grad without set_to_none).

        With CUDA graphs, a .grad first created by a graph's backward lives in the graph's memory pool, and the
        next micro-step's replay overwrites it ("accessing tensor output of CUDAGraphs that has been overwritten
        by a subsequent run"). Gradients allocated here, outside any pool, are added into in place instead:
        PyTorch's own advice for gradient accumulation under CUDA graphs. The sum is the same."""
        for p in self.raw_model.parameters():
            p.grad = torch.zeros_like(p)

    def compiled(self, model):
        """The model under torch.compile: one graph (compile_scope model), or (blocks) each block and the loss head
        apart, the blocks' code compiled once for all of them."""
        cfg = self.cfg
        # Read by the partitioner when the first call compiles; process-wide, as torch.compile's settings are.
        torch._functorch.config.activation_memory_budget = cfg.activation_memory_budget
        if cfg.static_launch_user_kernels:
            swiglu.launch_from_saved_binary()
        mode = self.mode
        if cfg.compile_scope == "model":
            return torch.compile(model, dynamic=False, mode=mode)
        # Compiled in place, so the module (and its state_dict names) stay as they are.
        for layer in model.layers:
            layer.compile(dynamic=False, mode=mode)
        model.loss = torch.compile(model.loss, dynamic=False, mode=mode)
        return model

    def clip_and_step(self):
        """The gradient clip, then the optimizer step (and the weights' average, with ema); returns the gradient
        norm before clipping (a tensor)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.optimizer.step()
        if self.ema is not None:
            self.ema.update()
        return grad_norm

    def compile_step(self):
        """update_graph's first step: clip_and_step compiled in the model's mode, then run. Eager, the clip and the
        optimizer step are a few hundred small kernels launched from Python after the model's graphs; compiled
        with reduce-overhead they replay as CUDA graphs (torch.optim's step breaks the graph on purpose: AdamW's
        step is two graphs, Muon's three). Compiled here, not when the trainer is built, so that what it marks is
        what the updates use: a resumed run's loaded optimizer state, and gradients that exist (under DDP, its
        bucket views, which replace allocate_gradients' tensors at the first backward)."""
        if isinstance(self.optimizer, optim.MuonWithAdamW):
            self.optimizer.muon.init_state()  # kept where a checkpoint brought it; AdamW's torch makes and marks
        # Tensors that live across updates and that the step reads or writes in place: marked, the graph uses
        # them where they are instead of copying them in at each replay. Without accumulation or DDP the
        # gradients are the backward graph's outputs, which CUDA graphs already hold in place.
        held = self.stable_grads or self.world_size > 1
        static = [p.grad for p in self.params if p.grad is not None] if held else []
        static += [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        static += [g["lr"] for g in self.optimizer.param_groups if torch.is_tensor(g["lr"])]
        static += self.ema.accumulator if self.ema is not None else []
        for tensor in static:
            torch._dynamo.mark_static_address(tensor)
        self.optimizer_step = torch.compile(self.clip_and_step, dynamic=False, mode=self.mode)
        return self.optimizer_step()

    def data_parallel(self, model, local_rank):
        from torch.nn.parallel import DistributedDataParallel
        # No buffer broadcast: the rotary tables are identical on every rank, and a broadcast per forward
        # would make evaluation (ranks see different batch counts) a collective.
        no_buffer_sync = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                          else {"broadcast_buffers": False})  # the name in PyTorch 2.11 and before
        return DistributedDataParallel(model, **no_buffer_sync, gradient_as_bucket_view=True,
                                       bucket_cap_mb=self.cfg.ddp_bucket_mb,
                                       device_ids=[local_rank] if self.device.type == "cuda" else None)

    def autocast(self, enabled=True):
        return autocast(self.device, self.autocast_dtype, enabled)

    def lr_at(self, step):
        """The schedule's learning rate (the AdamW groups' peak is learning_rate) of update `step`."""
        cfg = self.cfg
        return optim.lr_at(step, self.total_updates, cfg.learning_rate, cfg.min_lr, cfg.warmup_updates,
                           cfg.lr_schedule, cfg.cooldown_fraction)

    def update(self, micro_batches, n_tokens):
        """One optimizer update over this rank's micro-batches; n_tokens counts the update's targets on all
        ranks. Returns (sum of this rank's token losses, gradient norm before clipping) as device tensors:
        no host sync here, the caller reads them when it logs."""
        optim.set_lr(self.optimizer, self.lr_at(self.step), self.cfg.learning_rate)
        # Each micro-step adds sum(token losses) / n_tokens, so the update's gradient is the mean over its
        # tokens whatever the micro-batch size; DDP averages over ranks, hence the world_size factor.
        scale = self.world_size / n_tokens
        step = self.captured or self.update_step
        loss_sum, grad_norm = step(micro_batches, scale)
        self.step += 1
        return loss_sum, grad_norm

    def update_step(self, micro_batches, scale):
        """update's work on the device: the micro-steps' forwards and backwards, each loss times scale (a float, or
        in CapturedUpdate's graph a device tensor), the clip, the optimizer step, the gradients zeroed (stable_grads)
        or let go."""
        loss_sum = torch.zeros((), device=self.device)
        last = len(micro_batches) - 1
        # One autocast region for all micro-steps: autocast keeps its bf16 copy of each weight until the
        # region ends, so eager casts the weights once per update instead of once per micro-step (the
        # weights change only in the optimizer step, so the copies are the same). Backward runs outside it.
        with self.autocast():
            for i, (x, y, *windows) in enumerate(micro_batches):  # windows: context_windows' (data/loader.py)
                sync = contextlib.nullcontext()
                if self.world_size > 1 and i < last:
                    sync = self.model.no_sync()  # all-reduce gradients once, on the last micro-step
                if self.cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with sync:
                    loss = self.model(x, y, reduction="sum", windows=tuple(windows) or None)
                    with self.autocast(enabled=False):
                        (loss * scale).backward()
                loss_sum += loss.detach()
        grad_norm = self.optimizer_step()
        if self.cfg.update_graph:
            grad_norm = grad_norm.clone()  # a CUDA graph's output is overwritten by its next replay
        self.optimizer.zero_grad(set_to_none=not self.stable_grads)
        return loss_sum, grad_norm

    def evaluate(self, batches, stopped=None):
        """Mean token loss over batches, with the per-token standard deviation and the token count; None when
        stopped() turns true between batches (a signal: the pass is abandoned, not cut short and reported). With
        ema, of the weights' average (swapped into the model for the pass, the live weights back after it)."""
        self.eval_model.eval()
        averaged = self.ema.swapped_in(self.step) if self.ema is not None else contextlib.nullcontext()
        try:
            with averaged:
                return mean_token_loss(self.eval_model, batches, self.device, self.autocast_dtype, stopped,
                                       self.cudagraphs, self.world_size)
        finally:
            self.eval_model.train()

    def checkpoint_state(self):
        """What a checkpoint holds of the trainer beyond the model, the optimizer and the update count: the
        weights' average, with ema (checkpoint.load_model samples and exports it)."""
        return {"ema": self.ema.state_dict()} if self.ema is not None else {}

    def load_checkpoint_state(self, ckpt):
        if self.ema is not None:
            self.ema.load_state_dict(ckpt["ema"])


@torch.no_grad()
def mean_token_loss(model, batches, device, autocast_dtype=None, stopped=None, cudagraphs=False, world_size=1):
    """Trainer.evaluate's pass of a model in eval mode on device (evaluate.py calls it with its own model):
    autocast to autocast_dtype (None: the model's float32), the sums over this process's batches added over
    world_size processes. {"loss", "loss_std", "tokens"}, or None when stopped() turns true between batches."""
    device = torch.device(device)
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in batches:
        if stopped and stopped():
            return None
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast(device, autocast_dtype):
            losses = model(x, y, reduction="none").double()
        totals += torch.stack([losses.sum(), (losses * losses).sum(), (y != -100).sum().double()])
    totals = all_reduce_sum(totals, world_size)
    loss_sum, square_sum, count = totals.tolist()
    mean = loss_sum / max(count, 1)
    std = math.sqrt(max(square_sum / max(count, 1) - mean * mean, 0.0))
    return {"loss": mean, "loss_std": std, "tokens": int(count)}
