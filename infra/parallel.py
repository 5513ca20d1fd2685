"""torchrun helpers: ranks, object collectives, FSDP2 shards, and the trainer's compute precision."""
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
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def is_main_process() -> bool:
    return dist_info()[0] == 0


def all_gather_objects(obj) -> list:
    """`obj` of every rank, in rank order ([obj] in one process)."""
    out = [obj] * (torch.distributed.get_world_size() if dist_on() else 1)
    if len(out) > 1:
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
    return list(items[rank * n // world_size:(rank + 1) * n // world_size])


def init_distributed() -> tuple[int, int]:
    """(rank, world_size); under torchrun the process group started once (gloo, NCCL on GPUs)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(
            backend="cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
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
    return contextlib.nullcontext() if dtype is None else torch.autocast(
        device_type=next(model.parameters()).device.type, dtype=dtype)
