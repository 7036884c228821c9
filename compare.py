"""Matched runs: prove that a faster execution of a recipe kept its math. Or (--mode=time-to-target) time a recipe
to a target loss, as a speed record is timed.

    python compare.py config/20m_gh200.py                  # train a plain baseline, its noise run and the config
    python compare.py config/20m_gh200.py --tuned=True      # the optimized side takes tune.py's selected config
    python compare.py config/tiny_cpu.py --full_validation=True --optimized_overrides="--loss_impl=fused"  # a lever
    python compare.py --baseline=NAME --optimized=NAME      # compare two finished runs of the results file
    python compare.py config/20m_gh200.py --optimizer=muon --name=20m-muon --mode=time-to-target --target_loss=L \\
        --eval_interval=50 --target_baseline=config/20m_gh200.py    # 5 seeds to L, and the speed-up to it

The matched mode (matched.py): the baseline runs the same config plainly (eager, micro-batch
`baseline_micro_batch_size`, SDPA's attention, full loss), the optimized run is the config as given; a speed-up
kept the math when both have the same recipe identity and their final validation losses agree within the larger of
the validation noise and the training noise, and it is a speed-up when the two sides run different executions and
the speed ratio's noise band lies above 1 (docs/MATCHED_RUNS.md has the rules and how far to trust them). The
time-to-target mode (time_to_target.py, docs/TIME_TO_QUALITY.md): the config at several seeds, each to its
end, against target_loss, beside a baseline recipe stopping at the target. Runs are train.py subprocesses (runs.py),
one after the other; a finished run of the same config and code on this machine is reused, an unfinished one
(stopped, killed or failed) resumed from its checkpoint, and SIGINT or SIGTERM stops the running one with its
checkpoint.
Exit status: 0 when the comparison holds (or is an allowed recipe change) or the target is reached, 1 when a matched
run's losses disagree, the target is missed or a training run failed, 2 on a user mistake, 3 when stopped by a
signal or by a run's stop_after_updates (130: Ctrl-C while no run trains).
"""
import dataclasses
import sys

import settings
import time_to_target
from configurator import ConfigError
from matched import Matched, matched_mode
from plan import USER_ERRORS
from results import check_writable
from runs import EXIT_INTERRUPTED, CompareError, RunFailed, Stopped
from settings import TRAIN_GROUPS, setting
from time_to_target import Target

MODES = ("matched", "time-to-target")


@dataclasses.dataclass
class Comparison:
    """the comparison"""
    mode: str = setting("matched", "matched: a baseline and an optimized run of one recipe, the same math (the matched "
                                   "mode's keys); time-to-target: the config at several seeds against target_loss, "
                                   "beside a baseline recipe (the time-to-target mode's keys; docs/TIME_TO_QUALITY.md)",
                        choices=MODES)
    plot: str = setting("", '"" means out/<name>-comparison.png (out/<name>-time-to-target.png in that mode)')
    rerun: bool = setting(False, "train again even when a complete run of the same config exists")


def check_mode(cfg):
    """Each mode refuses the other's keys (off their defaults), so that no key is silently ignored; and the keys
    compare.py sets itself."""
    managed = [f"--{k}" for k in ("resume", "overwrite") if cfg[k]]
    if managed:
        raise ConfigError(f"{' and '.join(managed)}: compare.py decides them for each run (a run stopped or killed "
                          f"resumes when the command runs again; --rerun=True trains every run afresh); drop them")
    more = cfg.seeds - 1 if cfg.mode == "time-to-target" else cfg.noise_seed_runs  # seeds above --seed it trains
    if cfg.seed + more >= 2 ** 64:
        raise ConfigError(f"--seed {cfg.seed} and the {more} seeds above it that {cfg.mode} trains pass torch's "
                          f"largest seed, {2 ** 64 - 1}; give a --seed at most {2 ** 64 - 1 - more}")
    if cfg.mode == "matched" and cfg.lm_head_fp8:
        raise ConfigError("lm_head_fp8 runs inside the fused loss and the matched baseline runs the plain loss "
                          "(loss_impl=full); compare the two finished runs with --allow_recipe_change=True")
    if cfg.mode == "matched":
        off = off_defaults(cfg, Target)
        if off:
            raise ConfigError(f"{', '.join(off)} belong to --mode=time-to-target; add it, or drop them")
        return
    if not cfg.target_loss:
        raise ConfigError("--mode=time-to-target needs --target_loss=L > 0: the validation-subset loss the "
                          "config's seeds must end below")
    off = off_defaults(cfg, Matched)
    if off:
        raise ConfigError(f"{', '.join(off)} belong to --mode=matched; drop them with --mode=time-to-target")
    if cfg.stop_at_target:
        raise ConfigError("stop_at_target is refused with --mode=time-to-target: a seed's time is its whole "
                          "recipe's training time, as a record's is (the baseline alone stops at the target)")
    if cfg.target_baseline_seeds != 1 and not cfg.target_baseline:
        raise ConfigError(f"--target_baseline_seeds={cfg.target_baseline_seeds} needs --target_baseline (the "
                          f"baseline recipe's config) to train; give it, or drop --target_baseline_seeds")


def off_defaults(cfg, group):
    return [f"--{f.name}" for f in dataclasses.fields(group) if cfg[f.name] != f.default]


CompareSettings = settings.compose("CompareSettings", Comparison, Matched, Target, *TRAIN_GROUPS)
CompareSettings.rules = staticmethod(check_mode)
DEFAULTS = settings.defaults(CompareSettings)


def compare(cfg):
    check_writable(cfg.results_file, sections=["time-to-target" if cfg.mode == "time-to-target" else
                                               "matched-comparison"])
    return time_to_target.time_to_target_mode(cfg) if cfg.mode == "time-to-target" else matched_mode(cfg)


def main(argv):
    try:
        cfg = settings.resolve(CompareSettings, argv)
        comparison = compare(cfg)
    except (*USER_ERRORS, CompareError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Stopped as exc:
        print(exc, file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        return 130
    if "reaches_target" in comparison:  # time-to-target: a miss, whatever its mean, is a failed verdict
        failed = time_to_target.failed_runs(comparison)
        if failed:  # a failed baseline run leaves the verdict standing, but not the command's success
            print(f"error: {', '.join(failed)} failed (the output above says why)", file=sys.stderr)
        return 0 if comparison["reaches_target"] and not failed else 1
    return 0 if comparison["label"] == "recipe change" or comparison["losses_agree"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
