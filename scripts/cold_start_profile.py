"""Where a first update's seconds go, phase by phase, cold (--cold=True: empty compiler caches) or warm.

    python scripts/cold_start_profile.py config/20m_gh200.py --cold=True --name=cold-start-20m
    python scripts/cold_start_profile.py config/20m_gh200.py --name=warm-start-20m

Times the imports (torch, the project), the run's checks (which import the attention backend's package), the
compiler's imports and its caches' source hashes (warm_compiler), the model and optimizer, the attention kernel's
and the loss kernel's first calls (flash-attn-4 and the fused loss compile on first use), then three updates of
synthetic tokens: the first compiles (its seconds split into torch.compile's phases: Dynamo's tracing, AOTAutograd,
Inductor's code generation, the wait for the Triton compiles, the backward's compile), the second records the CUDA
graphs, the third replays them. Records the phases, and what torch.compile's caches gave (hits and misses), under
--name in the results file.
"""
import sys
import time

start = time.perf_counter()
import torch  # noqa: E402

IMPORT_TORCH = time.perf_counter() - start
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
start = time.perf_counter()
import env  # noqa: E402
import plan as plan_lib  # noqa: E402
import settings  # noqa: E402
from data.loader import batch_stream, synthetic_batches  # noqa: E402
from model_kernels import cross_entropy, first_calls  # noqa: E402
from model_kernels.attention import causal_attention  # noqa: E402
from plan import USER_ERRORS  # noqa: E402
from results import record  # noqa: E402
from trainer import Trainer  # noqa: E402

IMPORT_PROJECT = time.perf_counter() - start


def timed(fn, device):
    """fn()'s seconds, the device synchronised on both sides."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    begin = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - begin


def cache_counters():
    """What torch.compile's on-disk caches gave the run: Inductor's and AOTAutograd's cache counters (hits, misses,
    bypasses, saves), so that of two warm starts the slower one shows which cache it missed."""
    counters = torch._dynamo.utils.counters
    return {group: {name: n for name, n in sorted(counters[group].items()) if "cache" in name}
            for group in ("inductor", "aot_autograd")}


def first_kernels(cfg, trainer, device):
    """The attention kernel's forward and backward and the fused loss's kernel at the run's shapes, called once:
    what compiles on first use outside torch.compile (flash-attn-4's CuTe kernels, the loss's Triton kernel)."""
    mcfg = trainer.raw_model.config
    shape = (cfg.micro_batch_size, cfg.seq_len, mcfg.n_heads, mcfg.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    backends = trainer.raw_model._sdpa_backends
    attention = timed(lambda: causal_attention(q, k, v, backends).sum().backward(), device)
    loss = 0.0
    if cfg.loss_impl == "fused" and device.type == "cuda":
        logits = torch.randn(4, mcfg.vocab_size, device=device, dtype=torch.bfloat16)
        targets = torch.zeros(4, dtype=torch.long, device=device)
        loss = timed(lambda: cross_entropy._cross_entropy_rows(device)(logits, targets), device)
    return attention, loss


def main(argv):
    cfg = settings.resolve(settings.BenchSettings, argv)
    folders, was_cold = env.compiler_cache_state(fresh=cfg.cold)  # before anything imports flash-attn-4
    begin = time.perf_counter()
    plan = plan_lib.resolve(settings.Config(cfg, data_mode="synthetic"), settings.BenchSettings, world=(0, 0, 1),
                            synthetic=True)  # synthetic tokens, as bench's; every check before any folder is made
    # the checks import the attention backend's package (flash-attn-4 and the CUTLASS DSL for fa4) and start CUDA
    phases = {"import_torch": IMPORT_TORCH, "import_project": IMPORT_PROJECT, "plan": time.perf_counter() - begin}
    begin = time.perf_counter()
    first_calls.import_compiler(cfg)  # as train.py's and bench.py's plan does (warm_compiler)
    phases["compiler_imports"] = time.perf_counter() - begin
    device, mcfg = torch.device(plan.device), plan.model
    _, make = synthetic_batches(cfg, mcfg.vocab_size, plan.sequences_per_update, 0, 1)
    batches = batch_stream(make, device, 4)
    begin = time.perf_counter()
    trainer = Trainer.from_plan(plan, total_updates=4)
    phases["model_and_optimizer"] = time.perf_counter() - begin
    phases["attention_first_call"], phases["loss_kernel_first_call"] = first_kernels(cfg, trainer, device)
    for name in ("first_update", "second_update", "third_update"):
        phases[name] = timed(lambda: trainer.update(*next(batches)), device)
        if trainer.compile_cache_due():  # --compile_cache: written after the update that compiled, off its clock
            trainer.save_compile_cache()
    phases.update(env.compiled_since()[1])  # this process's compiles: the first update's and the kernels'
    counters = cache_counters()
    record(cfg.results_file, [cfg.name], {"run_id": env.new_run_id(), "config": dict(cfg), "attention": plan.attention,
                                          "compiler_cache": folders, "cache_was_cold": was_cold, "seconds": phases,
                                          "cache_counters": counters, "environment": env.fingerprint(None)})
    print(f"{cfg.name}: {'cold' if was_cold else 'warm'} compiler caches, attention {plan.attention}")
    for phase, seconds in phases.items():
        print(f"  {phase:<26}{seconds:8.2f} s")
    for group, found in counters.items():
        print(f"  {group} caches: " + (", ".join(f"{name} {n}" for name, n in found.items()) or "none used"))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except USER_ERRORS as exc:
        sys.exit(f"error: {exc}")
