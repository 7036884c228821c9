"""The process group: one process per GPU under torchrun (NCCL on GPUs, gloo on CPUs), and its collectives."""
import os

import torch


def distributed():
    """(rank, local_rank, world_size); initializes the process group under torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 0, 1
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
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
