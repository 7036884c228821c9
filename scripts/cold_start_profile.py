"""Where a cold first update's seconds go: the compiler's own phase timings for a config, from empty caches.

    python scripts/cold_start_profile.py config/20m_gh200.py --compile_scope=blocks --compile_mode=reduce-overhead

First compiles the fused loss's Triton kernel alone (it is built on first use), then runs the first update and
prints its seconds with torch._dynamo's per-phase compile times.
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import env  # noqa: E402
import plan as plan_lib  # noqa: E402
from kernels import cross_entropy  # noqa: E402
import settings  # noqa: E402
from data.loader import batch_stream, synthetic_batches  # noqa: E402
from plan import USER_ERRORS  # noqa: E402
from trainer import Trainer  # noqa: E402


def main(argv):
    cfg = settings.resolve(settings.BenchSettings, argv)
    plan = plan_lib.resolve(settings.Config(cfg, data_mode="synthetic"), settings.BenchSettings, world=(0, 0, 1),
                            synthetic=True)  # synthetic tokens, as bench's; every check before any folder is made
    device, mcfg, sequences_per_update = plan.device, plan.model, plan.sequences_per_update
    folders, was_cold = env.compiler_cache_state(fresh=True)
    print(f"compiler caches {folders}, cold: {was_cold}")
    _, make = synthetic_batches(cfg, mcfg.vocab_size, sequences_per_update, 0, 1)
    batches = batch_stream(make, device, 3)
    start = time.perf_counter()
    trainer = Trainer(cfg, mcfg, device, total_updates=3)
    print(f"model and optimizer: {time.perf_counter() - start:.2f} s")
    if cfg.loss_impl == "fused" and trainer.device.type == "cuda":
        start = time.perf_counter()
        logits = torch.randn(4, mcfg.vocab_size, device=device, dtype=torch.bfloat16)
        cross_entropy._cross_entropy_rows(trainer.device)(logits, torch.zeros(4, dtype=torch.long, device=device))
        torch.cuda.synchronize()
        print(f"the loss kernel's Triton compile: {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    trainer.update(*next(batches))
    torch.cuda.synchronize() if trainer.device.type == "cuda" else None
    print(f"first update: {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    trainer.update(*next(batches))
    torch.cuda.synchronize() if trainer.device.type == "cuda" else None
    print(f"second update: {time.perf_counter() - start:.2f} s")
    print(torch._dynamo.utils.compile_times(repr="str"))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except USER_ERRORS as exc:
        sys.exit(f"error: {exc}")
