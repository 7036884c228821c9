"""Evaluation speed on the GPU: full validation passes (forward only, as train.py's final validation) of a
config's compiled model, with the batches fed in different ways, and the GPU kernel time of one pass, so that
a pass's wall time can be split into kernels and the rest. Recorded under NAME in the results file.

    python scripts/eval_speed.py config/20m_gh200.py [--name=eval-speed] [--results_file=...] [--key=value ...]

Variants: "unpinned" hands trainer.evaluate the loader's CPU batches, as train.py does (evaluate copies each
to the GPU itself); "prefetched" builds and pins them on a background thread first, as training's batches
are; "prefetched-2x" does so with twice the eval batch size. On the H200 all three run at the same speed, with
the GPU busy 95% of each pass: evaluation waits on its kernels, not on the host.
"""
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import env  # noqa: E402
import plan as plan_lib  # noqa: E402
import settings  # noqa: E402
from data.loader import Prefetcher, eval_batches  # noqa: E402
from configurator import ConfigError  # noqa: E402
from plan import USER_ERRORS  # noqa: E402
from profiling import gpu_kernel_ms, quiet_profile  # noqa: E402
from results import read_results, record  # noqa: E402
from trainer import Trainer  # noqa: E402



@dataclasses.dataclass
class EvalSpeedSettings(settings.TrainSettings):
    name: str = settings.setting("eval-speed", "the results entry", rule=settings.run_name_problem)
    passes: int = settings.setting(3, "timed passes (after one that compiles)", bounds=">= 1")


def timed_passes(trainer, make_batches, passes):
    """(median seconds of a pass, the last pass's result); the first, compiling pass is not timed."""
    trainer.evaluate(make_batches())
    seconds = []
    for _ in range(passes):
        start = time.perf_counter()
        result = trainer.evaluate(make_batches())  # ends in a host read of the totals: the pass has finished
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def kernel_ms(trainer, make_batches):
    from torch.profiler import ProfilerActivity
    with quiet_profile([ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.evaluate(make_batches())
    return sum(gpu_kernel_ms(evt) for evt in prof.key_averages())


def main(argv):
    cfg = settings.resolve(EvalSpeedSettings, argv)
    device = plan_lib.resolve_device(cfg)
    if device != "cuda":
        raise ConfigError(f"eval_speed.py times passes on the GPU; --device={cfg.device} gives the CPU"
                              if cfg.device == "cpu" else
                              "eval_speed.py times passes on the GPU, and PyTorch sees no CUDA GPU here")
    read_results(cfg.results_file)  # a broken results file fails now, not after the work
    plan = plan_lib.resolve(cfg, EvalSpeedSettings, world=(0, 0, 1))
    cache = plan.cache

    def loader(c):
        return eval_batches(cache.val, c.seq_len, c.eval_batch_size)

    def prefetched(c):
        return (batch for _, (batch,), _ in Prefetcher(lambda batch: ([batch], 0), loader(c), device))

    variants = {"unpinned": (cfg.eval_batch_size, loader), "prefetched": (cfg.eval_batch_size, prefetched),
                "prefetched-2x": (2 * cfg.eval_batch_size, prefetched)}
    trainer = Trainer.from_plan(plan, total_updates=1)  # init_from's weights too
    results = {}
    for name, (batch_size, make) in variants.items():
        c = settings.Config(cfg, eval_batch_size=batch_size)
        seconds, result = timed_passes(trainer, lambda: make(c), cfg.passes)
        kernels = kernel_ms(trainer, lambda: make(c))
        results[name] = {"eval_batch_size": batch_size, "seconds": seconds, "tokens": result["tokens"],
                         "loss": result["loss"], "tokens_per_second": result["tokens"] / seconds,
                         "kernel_ms": kernels, "gpu_busy": kernels / 1e3 / seconds}
        print(f"{name:<14} batch {batch_size:>3}  {result['tokens'] / seconds:>12,.0f} tok/s  {seconds * 1e3:7.1f} ms"
              f"  kernels {kernels:7.1f} ms ({kernels / 1e3 / seconds:.0%} busy)  loss {result['loss']:.5f}")
    record(cfg.results_file, [cfg.name], {"run_id": env.new_run_id(), "config": dict(cfg), "variants": results,
                                             "environment": env.fingerprint()})


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
