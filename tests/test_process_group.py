"""distributed.py without a process group: what it reads of torchrun's environment and what it asks of
torch.distributed (stood in for), so the CPU checks the ranks, the backend and the collectives' use."""
import pytest
import torch
import torch.distributed as dist

import distributed
from configurator import ConfigError


@pytest.fixture
def torchrun(monkeypatch):
    """torchrun's environment for rank 3 of 4 (local rank 1 of its node's 2), and torch.distributed stood in for;
    returns the backends init_process_group was called with."""
    inits = []
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(inits))
    monkeypatch.setattr(dist, "init_process_group", lambda backend: inits.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    for variable, value in (("WORLD_SIZE", "4"), ("RANK", "3"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "localhost"),
                            ("MASTER_PORT", "29500")):
        monkeypatch.setenv(variable, value)
    return inits


def test_the_local_rank_is_torchruns_not_the_global_rank(torchrun):
    """The local rank picks the GPU on a node: rank 3 of two nodes of two runs on its node's GPU 1."""
    assert distributed.distributed("cpu") == (3, 1, 4)


def test_the_process_group_is_started_once(torchrun, monkeypatch):
    distributed.distributed("cpu")
    distributed.distributed("cpu")
    assert torchrun == ["gloo"]


def test_no_device_on_a_machine_without_a_gpu_takes_gloo(torchrun, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    distributed.distributed()
    assert torchrun == ["gloo"]


@pytest.mark.parametrize("unset", ["RANK", "MASTER_ADDR", "MASTER_PORT"])
def test_each_missing_torchrun_variable_is_a_one_line_error_naming_it(torchrun, monkeypatch, unset):
    monkeypatch.delenv(unset)
    with pytest.raises(ConfigError, match=f"WORLD_SIZE=4 is set but {unset} not: launch with torchrun"):
        distributed.distributed("cpu")
    assert torchrun == []


def test_one_process_is_rank_0_of_1_with_no_process_group(torchrun, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.distributed("cpu") == (0, 0, 1) and torchrun == []


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_sum_is_all_reduced_whenever_there_are_several_processes(monkeypatch, world_size):
    reduced = []
    monkeypatch.setattr(dist, "all_reduce", lambda t: reduced.append(t) or t.mul_(world_size))
    t = torch.ones(2)
    assert distributed.all_reduce_sum(t, world_size) is t
    assert reduced == ([t] if world_size > 1 else []) and t.tolist() == [world_size] * 2


@pytest.mark.parametrize("initialized", [True, False])
def test_the_end_of_a_run_frees_the_process_group_it_started(monkeypatch, initialized):
    """Left to interpreter exit, gloo's threads can abort the process (torchrun then fails the job)."""
    destroyed = []
    monkeypatch.setattr(dist, "is_initialized", lambda: initialized)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: destroyed.append(True))
    distributed.end_distributed()
    assert destroyed == ([True] if initialized else [])
