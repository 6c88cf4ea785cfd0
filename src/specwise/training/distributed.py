"""Training under torch DDP (``torchrun --nproc-per-node N``): joining the gloo process group, and the
few decisions one rank makes for all."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist


def join_process_group() -> tuple[int, int]:
    """``(rank, world size)``; under torchrun (``WORLD_SIZE`` > 1) joins the gloo group first."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main_process() -> bool:
    """True outside DDP, and on rank 0 inside it."""
    return not dist.is_initialized() or dist.get_rank() == 0


def rank0_decides(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank under DDP (the ranks must train alike); ``flag`` otherwise."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([int(flag)])
    dist.broadcast(value, src=0)
    return bool(value)


@contextlib.contextmanager
def main_process_first():
    """Run the block's work on rank 0 only (``yield`` tells whether this process does it); the
    other ranks wait at a barrier until it is done. Joins the process group under ``torchrun``."""
    rank, _ = join_process_group()
    yield rank == 0
    if dist.is_initialized():
        dist.barrier()
