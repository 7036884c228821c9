"""configurator.py: the boolean words an override takes, in each form, and for the early reading of an override."""
import pytest

import configurator
import train


@pytest.mark.parametrize("word, expected", [("yes", True), ("on", True), ("YES", True), ("On", True),
                                            ("no", False), ("off", False)])
@pytest.mark.parametrize("form", ["--compile={}", "--compile {}"])
def test_every_boolean_word_reads_as_its_value_in_both_override_forms(word, expected, form):
    """The words the bare-flag check takes as a boolean's value (yes/no, on/off, any case) are the words the value
    is read as: `--compile yes` is True, never refused as "expected a boolean"."""
    config = configurator.load_config(train.DEFAULTS, form.format(word).split(" ", 1))
    assert config["compile"] is expected


@pytest.mark.parametrize("word, expected", [("yes", True), ("on", True), ("off", False)])
def test_the_early_reading_of_a_boolean_override_takes_the_same_words(word, expected):
    assert configurator.argv_value([f"--cold={word}"], "cold", bool, not expected) is expected


def test_a_written_config_keeps_the_named_keys_at_their_defaults_so_it_wins_when_layered(tmp_path):
    """tune.py writes a candidate's levers even at train.py's defaults (keep=): layered over a base config that sets a
    lever, the candidate's file must put the default back, not leave the base's value standing in for it."""
    base = tmp_path / "base.py"
    base.write_text("compile = True\nmicro_batch_size = 4\n")
    candidate = dict(train.DEFAULTS, epochs=3)  # compile and micro_batch_size at their defaults
    path = tmp_path / "candidate.py"
    configurator.write_config_file(path, candidate, train.DEFAULTS, keep=("compile",))
    layered = configurator.load_config(train.DEFAULTS, [str(base), str(path)])
    assert layered["compile"] is train.DEFAULTS["compile"] and layered["epochs"] == 3
    assert layered["micro_batch_size"] == 4  # a key neither kept nor changed is the base's


def test_a_config_file_may_set_the_recipe_keys_a_script_does_not_read_but_only_with_their_types(tmp_path):
    """A config file is a recipe: sample.py or bench.py given train.py's config takes the keys it declares and leaves
    the others out, type-checked; the same key as an override is refused, since it would do nothing."""
    import sample
    import settings
    path = tmp_path / "recipe.py"
    path.write_text("learning_rate = 1e-3\nwarmup_updates = 7\nseed = 5\n")
    cfg = settings.load(sample.SampleSettings, [str(path)])
    assert "learning_rate" not in cfg and "warmup_updates" not in cfg and cfg["seed"] == 5
    path.write_text("warmup_updates = 'seven'\n")
    with pytest.raises(configurator.ConfigError, match="warmup_updates must be int"):
        settings.load(sample.SampleSettings, [str(path)])
    with pytest.raises(configurator.ConfigError, match="--learning_rate is a key this script does not use"):
        settings.load(sample.SampleSettings, ["--learning_rate=1e-3"])
