"""The token data loader (data/loader.py): what a cache may name, the whole sequences an epoch takes, and the
prefetcher's thread."""
import json

import numpy as np
import pytest

from data import loader
from data.loader import CacheError, TokenCache, TrainData
from tests.conftest import write_cache


def test_a_shard_named_outside_the_cache_folder_is_refused(tmp_path):
    """meta.json names files in its own folder: a shard name with a path in it reads some other file."""
    train = np.arange(1000) % 256
    cache = write_cache(tmp_path / "cache", train, np.arange(100) % 256, 256)
    (tmp_path / "outside.bin").write_bytes((cache / "train.bin").read_bytes())
    meta = json.loads((cache / "meta.json").read_text())
    meta["train_shards"] = [{"file": "../outside.bin", "tokens": len(train), "sha256": meta["train_sha256"]}]
    (cache / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CacheError, match=r"has no \.\./outside\.bin \(meta\.json lists it in the train split\)"):
        TokenCache(cache)


@pytest.mark.parametrize("n_tokens, sequences", [(4 * 8, 3), (4 * 8 + 1, 4), (4 * 8 + 8, 4), (8, 0), (9, 1)])
def test_an_epoch_takes_only_whole_sequences_of_seq_len_targets(n_tokens, sequences):
    """A sequence needs T + 1 tokens (T inputs, T targets): 32 tokens make 3 sequences of 8, not 4 with a padded
    last target; every row of every update is whole."""
    assert loader.sequence_count(n_tokens, 8) == sequences
    if not sequences:
        with pytest.raises(CacheError, match="shorter than one sequence of 9 tokens"):
            TrainData(np.arange(n_tokens), 8, 1, seed=0)
        return
    data = TrainData(np.arange(n_tokens), 8, 1, seed=0)
    assert data.n_sequences == sequences and data.updates_per_epoch == sequences
    for update in range(data.updates_per_epoch):
        [(x, y)], n = data.micro_batches(0, update, 1)
        assert n == 8 and (y == x + 1).all()  # arange: every target is its input's next token, none padded


def test_every_rank_makes_the_same_micro_steps_in_an_epochs_short_last_update():
    """7 sequences in updates of 4: the last update's 3 split 2 and 1 over two ranks, and the second rank pads its
    share to the first's two micro-steps (a rank with fewer would leave the other waiting in a gradient sync)."""
    data = TrainData(np.arange(7 * 8 + 1), 8, 4, seed=0)
    assert data.updates_per_epoch == 2
    ranks = [data.micro_batches(0, 1, 1, rank, 2) for rank in range(2)]
    assert [len(batches) for batches, _ in ranks] == [2, 2]
    assert [n for _, n in ranks] == [3 * 8, 3 * 8]  # the update's targets over all ranks
    scored = [int((y != loader.IGNORE).sum()) for batches, _ in ranks for _, y in batches]
    assert scored == [8, 8, 8, 0]


def test_an_error_in_making_a_batch_reaches_the_training_loop_after_the_batches_before_it():
    """The thread's error is raised where the batches are taken, not swallowed as the end of the data (which
    would end the run early as if its updates were done)."""
    data = TrainData(np.arange(4 * 8 + 1), 8, 1, seed=0)

    def make_batches(u):
        if u == 2:
            raise CacheError("shard unreadable")
        return data.micro_batches(0, u, 1)
    taken = []
    prefetcher = loader.Prefetcher(make_batches, range(4), "cpu")
    with pytest.raises(CacheError, match="shard unreadable"):
        for key, batches, n_tokens in prefetcher:
            taken.append(key)
    assert taken == [0, 1] and not prefetcher.thread.is_alive()


def test_kept_windows_give_every_context_of_the_schedule_one_shape():
    """With context_windows the window starts are padded to as many as the smallest context makes, so a longer
    context later in the run is no new shape to compile."""
    data = TrainData(np.arange(8 * 16 + 1), 16, 2, seed=0, context_steps=((4, 0.5),), context_windows=True)
    early, _ = data.micro_batches(0, 0, 2)
    late, _ = data.micro_batches(0, data.updates_per_epoch - 1, 2)
    (x, y, positions_4, starts_4), (_, _, positions_16, starts_16) = early[0], late[0]
    assert x.shape == (2, 16) and positions_4.shape == positions_16.shape == (16,)
    assert starts_4.shape == starts_16.shape == (2 * 16 // 4 + 1,)
    assert starts_4.tolist() == list(range(0, 33, 4)) and starts_16.tolist() == [0, 16, 32] + [32] * 6
