"""plan.resolve's checks of the model against the data (plan.py), at their edges."""
import dataclasses

import pytest

import plan
import settings
from configurator import ConfigError
from tests.test_train import small_config


@pytest.mark.parametrize("vocab_size, words", [
    (255, "the data's tokenizer has 256 tokens but the model's vocabulary holds 255; set vocab_size=0"),
    (257, "vocab_size 257 is larger than the 256 tokens of the cache")])
def test_a_model_vocabulary_one_off_the_caches_is_refused(text_cache, tmp_path, vocab_size, words):
    """One row short, a token id has no logit; one row over, the LM head holds a row no token uses."""
    with pytest.raises(ConfigError, match=words):
        plan.resolve(small_config(text_cache, tmp_path, vocab_size=vocab_size), world=(0, 0, 1))
    for fits in (0, 256):
        resolved = plan.resolve(small_config(text_cache, tmp_path, vocab_size=fits), world=(0, 0, 1))
        assert resolved.model.vocab_size == 256


def test_the_main_process_is_rank_zero_of_all_nodes_not_each_nodes_first(text_cache, tmp_path):
    """Under torchrun on two nodes, each node has a local rank 0; only the global rank 0 records and checkpoints."""
    p = plan.resolve(small_config(text_cache, tmp_path), world=(0, 0, 1))
    assert p.main_process
    assert not dataclasses.replace(p, rank=2, local_rank=0, world_size=4).main_process
    assert dataclasses.replace(p, rank=0, local_rank=0, world_size=4).main_process


def test_a_compile_cache_under_a_file_says_a_file_stands_where_its_folder_would_be(tmp_path):
    (tmp_path / "f").write_text("not a folder")
    cfg = settings.Config(settings.defaults(settings.TrainSettings), compile=True,
                          compile_cache=str(tmp_path / "f" / "sub" / "c.bin"))
    with pytest.raises(ConfigError, match=r"cannot be written there \(a file stands where its folder would be\)"):
        plan.check_compile_cache(cfg)
    assert (tmp_path / "f").read_text() == "not a folder"
