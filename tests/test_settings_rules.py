"""settings.py's own rules and the recipe it makes, checked on settings alone (no model, no data): what
test_settings.py's end-to-end cases leave open."""
import pytest

import model as model_lib
import settings
from configurator import ConfigError

DEFAULTS = settings.defaults(settings.TrainSettings)


def check(**change):
    settings.check(settings.TrainSettings, settings.Config(DEFAULTS, **change))


def test_the_defaults_pass_every_check():
    check()


@pytest.mark.parametrize("name", [".", "..", "", "runs/a"])
def test_a_name_that_is_no_folder_of_its_own_is_refused(name):
    """out/.. is the out folder itself, and a results entry named ".." is no run."""
    with pytest.raises(ConfigError, match="cannot name a run's folder and results entry"):
        check(name=name)


@pytest.mark.parametrize("schedule, words", [("8:0.2,8:0.5", "must be positive and grow, got 8 after 8"),
                                             ("0:0.5", "must be positive and grow, got 0")])
def test_a_schedule_step_that_does_not_grow_its_context_is_refused(schedule, words):
    """A repeated context is the same run as one step under another recipe identity; a context of 0 divides
    nothing."""
    with pytest.raises(ValueError, match=words):
        settings.schedule_steps(schedule)
    with pytest.raises(ConfigError, match=words):
        check(seq_len_schedule=schedule)


@pytest.mark.parametrize("key, value", [("muon_lr", 0.05), ("muon_momentum", 0.9), ("muon_ns_steps", 3),
                                        ("muon_adjust_lr", "match_rms_adamw")])
def test_every_muon_key_off_its_default_is_refused_without_muon(key, value):
    with pytest.raises(ConfigError, match=f"{key} set but optimizer is 'adamw'"):
        check(**{key: value})
    check(**{key: value}, optimizer="muon")


def test_the_recipe_holds_the_identity_keys_at_any_value_and_the_others_only_off_their_defaults():
    """Recorded runs' identities hash these fields: the identity keys are there at their defaults too, and a key
    declared later is there only when a run sets it."""
    mcfg = model_lib.get_preset("20m", vocab_size=256)
    at_defaults = settings.recipe(settings.Config(DEFAULTS), mcfg, "cache")
    assert set(at_defaults) == settings.IDENTITY_KEYS | {"model", "cache_identity"}
    assert at_defaults["seed"] == 1337 and at_defaults["learning_rate"] == 2e-3
    with_ema = settings.recipe(settings.Config(DEFAULTS, ema=0.9), mcfg, "cache")
    assert with_ema["ema"] == 0.9 and settings.recipe_differences(at_defaults, with_ema) == ["ema"]
    assert settings.recipe_differences(with_ema, at_defaults) == ["ema"]


def test_the_micro_batch_sizes_offered_divide_the_update_on_every_process():
    """32 sequences on 2 processes: 16 each, so a micro-batch of 32 leaves nothing for the second, and is not
    offered."""
    cfg = settings.Config(DEFAULTS, micro_batch_size=32)
    assert settings.sequences_per_update(cfg) == 32
    with pytest.raises(ConfigError, match=r"on 2 process\(es\) does not divide .* valid sizes: \[1, 2, 4, 8, 16\]$"):
        settings.sequences_per_update(cfg, world_size=2)
    assert settings.micro_steps(settings.Config(cfg, micro_batch_size=4), world_size=2) == 4


def test_a_run_of_no_updates_is_not_warned_about_its_warmup():
    """epochs 0 (init_from's weights evaluated) makes no update: there is no peak the warmup fails to reach."""
    cfg = settings.Config(DEFAULTS, epochs=0, init_from="out/x")
    assert settings.doubtful_values(cfg, total_updates=0) == []
    assert "longer than the run's 50 updates" in settings.doubtful_values(cfg, total_updates=50)[0]


class WithOwnRule(settings.TrainSettings):
    @staticmethod
    def rules(cfg):
        if cfg.epochs > 3:
            raise ConfigError("this script trains at most 3 epochs")


def test_a_settings_class_with_rules_of_its_own_has_them_checked():
    with pytest.raises(ConfigError, match="at most 3 epochs"):
        settings.check(WithOwnRule, settings.Config(DEFAULTS))
    settings.check(WithOwnRule, settings.Config(DEFAULTS, epochs=3))
