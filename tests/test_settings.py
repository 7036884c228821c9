"""The settings are declared once (settings.py): a new key needs one declaration, every rule is checked where the
settings are resolved, and every refusal comes before the model is built or a folder is made."""
import dataclasses
import math
import os
import re
from pathlib import Path

import pytest
import torch

import configurator
import env
import model as model_lib
import settings
import train
from configurator import ConfigError
from settings import RECIPE, TrainSettings, setting
from tests.test_train import small_config
import matched


@dataclasses.dataclass
class WithLabelSmoothing(TrainSettings):
    label_smoothing: float = setting(0.0, "share of each target's probability spread over the vocabulary", RECIPE,
                                     bounds="[0, 1)")


def test_a_new_recipe_key_is_declared_once_and_reaches_help_types_checks_and_the_recipe(capsys):
    with pytest.raises(SystemExit):
        configurator.load_config(WithLabelSmoothing, ["--help"])
    assert "--label_smoothing=0.0" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="label_smoothing"):
        configurator.load_config(WithLabelSmoothing, ["--label_smoothing=some"])  # the type check
    with pytest.raises(ConfigError, match=r"label_smoothing must lie in \[0, 1\)"):
        settings.resolve(WithLabelSmoothing, ["--label_smoothing=1.5"])
    mcfg = model_lib.get_preset("20m", vocab_size=256)
    at_default = settings.resolve(WithLabelSmoothing, [])
    off_default = settings.resolve(WithLabelSmoothing, ["--label_smoothing=0.1"])
    recipe = lambda cfg: settings.recipe(cfg, mcfg, "cache", cls=WithLabelSmoothing)
    # a later key at its default leaves every earlier run's identity as it was; off it, it is part of the math
    assert recipe(at_default) == settings.recipe(settings.Config(train.DEFAULTS), mcfg, "cache")
    assert recipe(off_default)["label_smoothing"] == 0.1
    assert "label_smoothing" not in settings.execution_keys()


def declared_rule_cases():
    """Every declared key's own rules: a value outside its bounds or choices, and NaN and infinity for a float."""
    cases = []
    for field in dataclasses.fields(TrainSettings):
        meta = field.metadata
        if meta["choices"]:
            cases.append(({field.name: "nonsense"}, f"{field.name} 'nonsense' is not one of"))
        if meta["bounds"]:
            bounds = meta["bounds"]
            low = float(bounds.split()[-1]) if bounds[0] in "<>" else float(bounds[1:-1].split(",")[0])
            outside = low if bounds.startswith(("> ", "(")) else low - 1
            if not bounds.startswith((">", "<")):
                high = float(bounds[1:-1].split(",")[1])
                cases.append(({field.name: field.type(high + 1)}, f"{field.name} must lie in"))
            cases.append(({field.name: field.type(outside)}, f"{field.name} must"))
        if field.type is float:
            cases += [({field.name: math.nan}, f"{field.name} must be a finite number, got nan"),
                      ({field.name: math.inf}, f"{field.name} must be a finite number, got inf")]
    return cases


COMBINATION_CASES = [
    (dict(min_lr=0.01), "min_lr 0.01 is above learning_rate"),
    (dict(tokens_per_update=100), "is not a multiple of seq_len"),
    (dict(micro_batch_size=3), "valid sizes: [1, 2, 4, 8]"),
    (dict(epochs=0), "epochs 0 trains nothing"),
    (dict(epochs=0, init_from="out/x", full_validation=False), "evaluates init_from's weights in the full validation"),
    (dict(muon_lr=0.05), "muon_lr set but optimizer is 'adamw'"),
    (dict(stop_at_target=True), "stop_at_target needs a target"),
    (dict(cooldown_fraction=0.5), "cooldown_fraction 0.5 is wsd's and lr_schedule is 'cosine'"),
    (dict(update_graph=True), "update_graph compiles the clip and the optimizer step"),
    (dict(lm_head_fp8=True, loss_impl="full"), "lm_head_fp8 runs inside the fused loss"),
    (dict(lm_head_fp8=True, loss_impl="fused", loss_chunk_tokens=1000), "loss_chunk_tokens to be a multiple of 16"),
    (dict(val_subset_tokens=1), "val_subset_tokens 1 holds no target"),
    (dict(name="a/b"), "cannot name a run's folder"),
    (dict(name="tuning"), "is a section of the results file"),
    (dict(attention_backend="cudnn"), "runs only on CUDA GPUs"),  # the machine's rules: check_device
    (dict(attention_backend="fa4"), "attention_backend"),
    (dict(loss_impl="quack_chunked"), "loss_impl 'quack_chunked' needs a CUDA GPU of compute capability 9.0"),
    (dict(mlp_impl="quack"), "mlp_impl 'quack' needs a CUDA GPU of compute capability 9.0"),
]


@pytest.mark.parametrize("change, message", declared_rule_cases() + COMBINATION_CASES,
                         ids=lambda v: ",".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else "")
def test_every_rule_refuses_before_the_model_is_built(text_cache, tmp_path, monkeypatch, change, message):
    cfg = small_config(text_cache, tmp_path, **change)

    def built(*args, **kwargs):
        raise AssertionError("the model was built before the refusal")
    monkeypatch.setattr(model_lib.Transformer, "__init__", built)
    with pytest.raises(ConfigError) as refused:
        train.train(cfg)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not Path(cfg.out_dir).exists() and not Path(cfg.results_file).exists()


def test_every_declared_key_has_a_role_help_and_a_type_the_command_line_can_give():
    for field in dataclasses.fields(TrainSettings):
        assert field.metadata["role"] in (settings.RECIPE, settings.MODEL, settings.WEIGHTS, settings.EXECUTION, settings.RUN)
        assert field.metadata["help"] and field.type in (bool, int, float, str), field.name
        assert type(field.default) is field.type, field.name
        assert settings.check_value(field.name, field.default, field) is None, field.name  # defaults pass


def test_non_finite_numbers_from_the_command_line_and_config_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="learning_rate must be a finite number, got inf"):
        settings.resolve(TrainSettings, ["--learning_rate=1e999"])
    path = tmp_path / "nan.py"
    path.write_text("grad_clip = float('nan')\n")
    with pytest.raises(ConfigError, match="grad_clip must be a finite number, got nan"):
        settings.resolve(TrainSettings, [str(path)])


def test_warnings_for_legal_values_that_are_probably_not_meant():
    cfg = settings.Config(train.DEFAULTS, warmup_updates=500, cpu_threads=10_000)
    lines = settings.doubtful_values(cfg, total_updates=300)
    assert any("warmup_updates 500 is longer than the run's 300 updates" in line for line in lines)
    assert any("cpu_threads 10000 is more than the" in line for line in lines)
    assert settings.doubtful_values(settings.Config(train.DEFAULTS), total_updates=3000) == []
    # as long as the run: its last update reaches the peak, which the warning said it never does
    assert settings.doubtful_values(settings.Config(train.DEFAULTS, warmup_updates=300), total_updates=300) == []


def test_compare_and_tune_vary_only_execution_keys():
    execution = settings.execution_keys()
    assert set(matched.BASELINE_EXECUTION) <= execution
    assert {"micro_batch_size", "compile", "attention_backend"} <= execution
    assert not {"learning_rate", "optimizer", "lr_schedule", "seed", "eval_interval", "target_loss"} & execution
    # how a run validates, stops and writes is its own, neither the recipe nor an execution tune.py may vary
    assert {"eval_interval", "target_loss", "name", "results_file"} <= settings.keys_of_role(settings.RUN)
    assert env.hash_json(settings.recipe(settings.Config(train.DEFAULTS, compile=True, micro_batch_size=4),
                                         model_lib.get_preset("20m", vocab_size=256), "c")) == \
        env.hash_json(settings.recipe(settings.Config(train.DEFAULTS), model_lib.get_preset("20m", vocab_size=256), "c"))


@pytest.mark.parametrize("config_file", sorted(p.name for p in (Path(__file__).parent.parent / "config").glob("*.py")))
def test_every_shipped_config_passes_every_check_of_a_setting(config_file):
    """A shipped recipe that names a removed lever, a value out of bounds or a refused combination would fail its
    first user; the checks are train.py's own (settings.resolve), before any data or model."""
    cfg = settings.resolve(TrainSettings, [str(Path(__file__).parent.parent / "config" / config_file)])
    assert cfg.name and cfg.preset in model_lib.PRESETS


def test_the_quality_candidate_is_the_speed_candidate_wider_over_three_passes_regularised(tmp_path, monkeypatch):
    """config/20m_quality.py reads config/20m_speed.py beside it (a config file sees its own __file__): its recipe
    is the speed candidate's but for the keys it names, wherever the script runs from (here a relative path from
    another folder, so that a path read from the working directory would not find the speed config)."""
    root = Path(__file__).resolve().parent.parent
    speed = settings.resolve(TrainSettings, [str(root / "config" / "20m_speed.py")])
    monkeypatch.chdir(tmp_path)
    quality = settings.resolve(TrainSettings, [os.path.relpath(root / "config" / "20m_quality.py")])
    assert {k: quality[k] for k in quality if quality[k] != speed[k]} == \
        {"name": "20m-quality", "dim": 384, "n_heads": 6, "hidden_dim": 1024, "train_subset_tokens": 0, "epochs": 3,
         "n_layers": 0, "seq_len_schedule": "", "tokens_per_update": 24576, "micro_batch_size": 24,
         "muon_lr": 0.0035, "weight_decay": 0.3, "cooldown_fraction": 0.7, "ema": 0.998}


def test_the_narrow_keys_of_the_docs_and_the_reproduce_script_restore_the_width_320_candidate():
    """docs/TIME_TO_QUALITY.md's NARROW and scripts/reproduce_h200.sh's $NARROW, on config/20m_quality.py, must give
    the candidate that ran before the width grew (the speed candidate as it was then, eight blocks with Muon on
    whole projections: the reproduce script's $EIGHT, over three passes, regularised), or the rows they claim to
    reproduce would run another recipe."""
    root = Path(__file__).resolve().parent.parent
    script_text = (root / "scripts" / "reproduce_h200.sh").read_text()
    docs = re.search(r"`NARROW` = `([^`]+)`", (root / "docs" / "TIME_TO_QUALITY.md").read_text())
    script = re.search(r'^NARROW="([^"]+)"', script_text, re.M)
    eight = re.search(r'^EIGHT="([^"]+)"', script_text, re.M)
    assert docs and script and eight, "NARROW's or EIGHT's definition is gone from the docs or the reproduce script"
    keys = docs.group(1).split()
    assert keys == script.group(1).split()
    speed = settings.resolve(TrainSettings, [str(root / "config" / "20m_speed.py"), *eight.group(1).split()])
    narrow = settings.resolve(TrainSettings, [str(root / "config" / "20m_quality.py"), *keys])
    preset = model_lib.PRESETS[speed["preset"]]  # the speed candidate's 0s keep the preset's shape, NARROW names it
    shape = {"dim": preset.dim, "n_heads": preset.n_heads, "hidden_dim": preset.hidden_dim}
    assert {k: speed[k] for k in shape} == {k: 0 for k in shape}
    assert {k: narrow[k] for k in narrow if narrow[k] != speed[k]} == \
        {"name": "20m-quality", **shape, "train_subset_tokens": 0, "epochs": 3, "weight_decay": 0.3,
         "cooldown_fraction": 0.7, "ema": 0.998}


def test_thousands_of_cpu_threads_are_refused_before_pytorch_crashes_on_them():
    """cpu_threads=5000 passed the check (>= 0), and the run died in a segmentation fault."""
    cfg = settings.Config(settings.defaults(TrainSettings), cpu_threads=5000)
    with pytest.raises(ConfigError, match="cpu_threads"):
        settings.check(TrainSettings, cfg)
    settings.check(TrainSettings, settings.Config(cfg, cpu_threads=1024))
