"""Where the host's time goes in a config's update (eager is launch-bound: the CPU, not the GPU, sets its pace).

    python scripts/eager_cpu_profile.py config/20m_gh200.py --compile=False --micro_batch_size=8

Runs a few warmup updates on synthetic tokens, then times updates without and with torch.profiler, and prints
the wall time per update, the GPU kernel time per update and the ops with the most host (self CPU) time.
The profiler's own overhead inflates the host times; their order is what this is for.
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import plan as plan_lib  # noqa: E402
import settings  # noqa: E402
from data.loader import batch_stream, synthetic_batches  # noqa: E402
from plan import USER_ERRORS  # noqa: E402
from profiling import gpu_kernel_ms, quiet_profile  # noqa: E402
from trainer import Trainer  # noqa: E402


def main(argv, updates=10, top=25):
    cfg = settings.resolve(settings.BenchSettings, argv)
    plan = plan_lib.resolve(settings.Config(cfg, data_mode="synthetic"), settings.BenchSettings, world=(0, 0, 1),
                            synthetic=True)  # synthetic tokens, as bench's; every check before any folder is made
    device, mcfg, sequences_per_update = plan.device, plan.model, plan.sequences_per_update
    _, make = synthetic_batches(cfg, mcfg.vocab_size, sequences_per_update, 0, 1)
    batches = batch_stream(make, device, 10 + 2 * updates)
    trainer = Trainer(cfg, mcfg, device, total_updates=10 + 2 * updates)
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    for _ in range(10):
        trainer.update(*next(batches))
    sync()
    start = time.perf_counter()
    for _ in range(updates):
        trainer.update(*next(batches))
    sync()
    wall_ms = (time.perf_counter() - start) / updates * 1e3
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    with quiet_profile(activities) as prof:
        for _ in range(updates):
            trainer.update(*next(batches))
        sync()
    events = prof.key_averages()
    kernel_ms = sum(gpu_kernel_ms(e) for e in events) / updates
    print(f"{cfg.name}: {wall_ms:.2f} ms per update unprofiled, {kernel_ms:.2f} ms of GPU kernels per update")
    print(f"{'op':<60}{'calls/update':>13}{'self CPU ms/update':>20}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"{e.key[:59]:<60}{e.count / updates:>13.1f}{e.self_cpu_time_total / 1e3 / updates:>20.2f}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except USER_ERRORS as exc:
        sys.exit(f"error: {exc}")
