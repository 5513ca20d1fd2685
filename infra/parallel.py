"""torchrun helpers: ranks, object collectives, FSDP2 shards, the trainer's compute precision."""
from __future__ import annotations

import contextlib
import os
import sys

from infra.lazy import LazyModule

torch = LazyModule("torch", globals())


def dist_on() -> bool:
    """Whether a torch.distributed process group is running (never imports torch to ask)."""
    return "torch" in sys.modules and torch.distributed.is_available() and \
        torch.distributed.is_initialized()


def dist_info() -> tuple[int, int]:
    """(rank, world_size): from torch.distributed, else torchrun's environment, else (0, 1)."""
    if dist_on():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    return rank, world_size


def is_main_process() -> bool:
    rank, _ = dist_info()
    return rank == 0


def all_gather_objects(obj) -> list:
    """`obj` of every rank, in rank order ([obj] in one process)."""
    world_size = torch.distributed.get_world_size() if dist_on() else 1
    out = [obj] * world_size
    if world_size > 1:
        torch.distributed.all_gather_object(out, obj)
    return out


def broadcast_object(obj):  # rank 0's `obj` on every rank
    box = [obj]
    if dist_on():
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def shard(items: list, rank: int, world_size: int) -> list:
    """Rank `rank`'s contiguous share of `items` (sizes differ by at most one)."""
    n = len(items)
    start = rank * n // world_size
    end = (rank + 1) * n // world_size
    return list(items[start:end])


def init_distributed() -> tuple[int, int]:
    """(rank, world_size); under torchrun the process group started once (gloo, NCCL on GPUs)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not torch.distributed.is_initialized():
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = "cpu:gloo,cuda:nccl"  # CPU tensors (reduced figures) still go through gloo
        torch.distributed.init_process_group(backend=backend)
    return dist_info()


def is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def local_part(v, full=None, src=None):
    """This rank's FSDP2 shard of trainer tensor `v`, or of `full` (of its shape; rank `src`'s if
    given, else each rank's own, with no collective); a tensor not sharded is kept whole."""
    if not is_dtensor(v):
        return v if full is None else full
    if full is None:
        return v.to_local()
    from torch.distributed.tensor import distribute_tensor
    full = full.to(v.to_local().device, v.dtype)
    return distribute_tensor(full, v.device_mesh, v.placements, src_data_rank=src).to_local()


def full_from_part(part, v):
    """The full tensor from each rank's local_part of `v` (a gather: every rank calls it)."""
    if not is_dtensor(v):
        return part
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(part.to(v.to_local().device), v.device_mesh, v.placements,
                              run_check=False, shape=v.shape, stride=v.stride()).full_tensor()


def compute_context(model):
    """The trainer's forward context: bf16 autocast over fp32 weights if Policy.load set it."""
    dtype = getattr(model, "selfplay_autocast", None)
    if dtype is None:
        return contextlib.nullcontext()
    device_type = next(model.parameters()).device.type
    return torch.autocast(device_type=device_type, dtype=dtype)
