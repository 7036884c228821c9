"""Gradient accumulation on the GPU: micro-batch 8, 16 and 32 of a recipe give the same losses, eager, compiled
and compiled with CUDA graphs (the CPU suite proves the same for eager; CUDA graphs exist only on the GPU).

    python scripts/accumulation_check.py config/20m_gh200.py [--updates=20] [--results_file=results.json]

Each variant trains the first `updates` updates of the recipe from the same seed on the same tokens and reports
the mean token loss of the last five, and the first update's gradient norm (before clipping: the same weights and
tokens in every variant, so a gradient accumulated at the wrong scale shows there, which the optimizer's steps
would hide from the loss). The noise floors are the two eager variants' differences (micro-batch 8 and 32: the same
math summed in another order in bf16); a variant passes when its loss lies within max(3 x that floor, 0.01) of
eager micro-batch 32 and its gradient norm within max(3 x that floor, 1%) of it. Exit status 1 if any variant fails
or errors.
"""
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import env  # noqa: E402
import plan as plan_lib  # noqa: E402
import settings  # noqa: E402
from plan import USER_ERRORS  # noqa: E402
from results import record  # noqa: E402
from trainer import Trainer  # noqa: E402

VARIANTS = [("eager", 32), ("eager", 8), ("default", 32), ("default", 16), ("default", 8),
            ("reduce-overhead", 32), ("reduce-overhead", 16), ("reduce-overhead", 8)]


@dataclasses.dataclass
class AccumulationSettings(settings.TrainSettings):
    updates: int = settings.setting(20, "updates compared between the variants", bounds=">= 1")


def losses_of(cfg, mode, micro, updates):
    """The token-mean loss of each of the first `updates` updates of cfg run as (mode, micro), and the first
    update's gradient norm."""
    run_cfg = settings.Config(cfg, compile=mode != "eager", compile_mode="default" if mode == "eager" else mode,
                              micro_batch_size=micro)
    plan = plan_lib.resolve(run_cfg, AccumulationSettings, world=(0, 0, 1))
    data = plan_lib.training_data(plan)
    trainer = Trainer.from_plan(plan, total_updates=max(updates, data.updates_per_epoch))
    losses, norms = [], []
    for u in range(updates):  # into the next epochs where updates is more than one (an epoch ended empty batches)
        batches, n_tokens = data.micro_batches(*divmod(u, data.updates_per_epoch), micro)
        batches = [(x.to(trainer.device), y.to(trainer.device)) for x, y in batches]
        loss_sum, grad_norm = trainer.update(batches, n_tokens)
        if trainer.compile_cache_due():  # --compile_cache: written after an update that compiled
            trainer.save_compile_cache()
        losses.append(loss_sum.item() / n_tokens)
        norms.append(float(grad_norm))
    del trainer
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return losses, norms[0]


def main(argv):
    try:
        cfg = settings.resolve(AccumulationSettings, argv)
        plan_lib.resolve(cfg, AccumulationSettings, world=(0, 0, 1))  # a missing cache or a bad setting: one line now
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = {}
    for mode, micro in VARIANTS:
        start = time.time()
        try:
            losses, norm = losses_of(cfg, mode, micro, cfg.updates)
            results[f"{mode}-mb{micro}"] = {"losses": losses, "last5": statistics.mean(losses[-5:]),
                                            "first_grad_norm": norm, "seconds": time.time() - start}
        except Exception as exc:  # a failure of one variant is the finding; the others still run
            results[f"{mode}-mb{micro}"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(f"{mode}-mb{micro}: {results[f'{mode}-mb{micro}'].get('last5', 'error')}", flush=True)
    reference, norm = results["eager-mb32"].get("last5"), results["eager-mb32"].get("first_grad_norm")
    floor = abs(results["eager-mb8"].get("last5", reference) - reference) if reference is not None else None
    tolerance = max(3 * floor, 0.01) if floor is not None else None
    norm_floor = (abs(results["eager-mb8"].get("first_grad_norm", norm) / norm - 1) if norm else None)
    norm_tolerance = max(3 * norm_floor, 0.01) if norm_floor is not None else None
    print(f"{'variant':<22}{'loss (updates -5..)':>20}{'vs eager mb32':>15}{'grad norm x':>13}  verdict  "
          f"(tolerances {tolerance}, {norm_tolerance})")
    ok = reference is not None
    for name, r in results.items():
        if "error" in r or reference is None:  # without the reference's loss no variant can be judged
            ok = False
            print(f"{name:<22} {'error: ' + r['error'] if 'error' in r else 'not judged: the reference failed'}")
            continue
        diff, ratio = r["last5"] - reference, r["first_grad_norm"] / norm if norm else float("nan")
        r["passed"] = abs(diff) <= tolerance and abs(ratio - 1) <= norm_tolerance
        ok = ok and r["passed"]
        print(f"{name:<22}{r['last5']:>20.5f}{diff:>+15.5f}{ratio:>13.4f}  {'ok' if r['passed'] else 'DIFFERS'}")
    record(cfg.results_file, ["accumulation-check"], {
        "run_id": env.new_run_id(), "updates": cfg.updates, "tolerance": tolerance, "noise_floor": floor,
        "grad_norm_tolerance": norm_tolerance, "grad_norm_noise_floor": norm_floor,
        "variants": results, "environment": env.fingerprint()})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
