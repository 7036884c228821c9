"""The process group: one process per GPU under torchrun (NCCL on GPUs, gloo on CPUs), and its collectives."""
import os

import torch


def distributed(device=None):
    """(rank, local_rank, world_size); initializes the process group under torchrun: NCCL where the run's device
    (None: any) is a CUDA GPU, gloo on the CPU (torchrun of a CPU config on a GPU machine, too)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 0, 1
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        from configurator import ConfigError
        raise ConfigError(f"WORLD_SIZE={world_size} is set but {', '.join(missing)} not: launch with torchrun "
                          f"--nproc_per_node={world_size}, or unset WORLD_SIZE for one process")
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo" if device == "cpu" or not torch.cuda.is_available() else "nccl")
    return dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")), world_size


def end_distributed():
    """Free the DDP wrapper (it sits in reference cycles) and the process group now, if there is one: left to
    interpreter exit, gloo's threads can abort the process (SIGABRT), and torchrun then fails the job and kills
    rank 0, maybe before it records the run."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        import gc
        gc.collect()
        torch.distributed.destroy_process_group()


def all_reduce_sum(tensor, world_size):
    if world_size > 1:
        import torch.distributed as dist
        dist.all_reduce(tensor)
    return tensor
