"""Fitting the trainer in memory: activation costs measured before step 1, a plan of micro-batch
size and gradient checkpointing, and the resident-memory figures a step reports."""
from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

from infra.errors import InputError
from infra.lazy import LazyModule
from infra.parallel import all_gather_objects, compute_context, local_part

torch = LazyModule("torch", globals())


def set_gradient_checkpointing(model, on: bool) -> None:  # a checkpointed layer drops use_cache itself
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def activation_costs(model, tokens=(32, 96)) -> dict:
    """Activation bytes per token without ("off") and with ("on") checkpointing, and per forward
    ("fixed": autocast's bf16 weight copies): what autograd saves (no parameters) at two lengths."""
    was = model.is_gradient_checkpointing

    def saved_bytes(n):
        seen = {}

        def pack(t):  # parameters and their views (a linear layer saves weight.t()) are not
            base = t if t._base is None else t._base  # activations; FSDP2's unsharded ones neither
            if not (base.is_leaf and base.requires_grad):
                seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        ids = torch.randint(0, model.config.vocab_size, (1, n), device=model.device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), compute_context(model):
            model(input_ids=ids, use_cache=False)  # all ranks together under FSDP2
        return sum(seen.values())

    slope, fixed = {}, 0.0
    for ckpt in (False, True):
        set_gradient_checkpointing(model, ckpt)
        a, b = saved_bytes(tokens[0]), saved_bytes(tokens[1])
        slope[ckpt] = (b - a) / (tokens[1] - tokens[0])
        fixed = fixed if ckpt else max(0.0, a - slope[ckpt] * tokens[0])
    set_gradient_checkpointing(model, was)
    # Backward's own buffers (the activations' gradients) add ~25% without checkpointing (measured
    # at the 0.6B shape); with it, the layer being recomputed holds its activations and gradients.
    per_layer = slope[False] / model.config.num_hidden_layers
    return {"off": 1.25 * slope[False], "on": slope[True] + 2 * per_layer, "fixed": fixed}


def available_memory(device) -> int:
    """Bytes free: on CUDA the device's; on CPU MemAvailable, capped by a cgroup v2 memory limit."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    free = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        free = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) * 1024
    with contextlib.suppress(OSError, ValueError):  # a memory.max of "max": no limit
        limit, used = (int(Path(f"/sys/fs/cgroup/memory.{f}").read_text())
                       for f in ("max", "current"))
        free = min(free, limit - used)
    return free


def release_freed_memory() -> None:
    """Hand every freed tensor over 128 KiB back to the kernel. glibc keeps freed blocks of up to
    32 MiB in its heap (its mmap threshold rises with each one freed), so a CPU trainer's resident
    memory stayed up to 2 GiB above its live tensors at the 0.6B shape (tests/bench_memory.py)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; fixed: no rising


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def step_memory(policy, tokens: int, checkpointing: bool, cost: dict) -> float:
    """Peak bytes beyond those allocated for a step of `tokens`-token micro-batches: gradients and
    AdamW's moments (unless they exist), plus the larger of AdamW's temporaries (GPU: a weight set;
    CPU: two of the largest tensor) and the backward's: activations, LM-head chunks (~512 MiB), two
    full LM-head gradients (the chunks' sum and a chunk's own). Checked by tests/bench_memory.py."""
    local = [local_part(p) for p in policy.model.parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in local]
    temporaries = sum(sizes) if local[0].device.type == "cuda" else 2 * max(sizes)
    head = policy.model.get_output_embeddings().weight
    act = (cost["fixed"] + 512 * 2**20 + 2 * head.numel() * head.element_size()
           + tokens * cost["on" if checkpointing else "off"])
    return sum(sizes) * (1 if policy.optimizer.state else 3) + max(act, temporaries)


def fit_memory(policy, free: int | None = None) -> str:
    """Before step 1, fit the free memory (10% margin), same gradients: the largest micro-batch up
    to the configured one that holds a --max-model-len sequence. The line to print ('' if none)."""
    cfg = policy.cfg  # every rank must cut the same micro-batches (collectives): the least free
    free = min(all_gather_objects(available_memory(policy.device) if free is None else free))
    if cfg.vllm_sleep and policy.device.type == "cuda":  # the engine frees its share while training
        free += int(cfg.gpu_memory_utilization * torch.cuda.mem_get_info(policy.device)[1])
    cost = activation_costs(policy.model)
    tokens, seq, ckpt = cfg.micro_batch_tokens, cfg.max_model_len, cfg.gradient_checkpointing
    need = 1.1 * step_memory(policy, tokens, ckpt, cost)
    if need <= free:
        return ""

    def largest(ckpt):  # micro-batch tokens that fit, a multiple of 256
        room = free / 1.1 - step_memory(policy, 0, ckpt, cost)
        return int(room / cost["on" if ckpt else "off"]) // 256 * 256

    def plan(tokens, ckpt):
        return f"--micro-batch-tokens {tokens}" + (" with gradient checkpointing" if ckpt else "")

    new = ckpt or largest(False) < seq  # checkpointing only where needed: it is slower
    if largest(new) < seq:
        one = gib(1.1 * step_memory(policy, seq, True, cost))
        raise InputError(
            f"memory: one {seq}-token sequence needs ~{one} with gradient checkpointing, "
            f"{gib(free)} is free; lower --max-model-len, add --vllm-sleep or a lower "
            f"--gpu-memory-utilization, or shard over more GPUs with torchrun")
    cfg.gradient_checkpointing, cfg.micro_batch_tokens = new, min(tokens, largest(new))
    set_gradient_checkpointing(policy.model, new)
    return (f"memory: {plan(tokens, ckpt)} needs ~{gib(need)}, {gib(free)} is free: "
            f"training with {plan(cfg.micro_batch_tokens, new)} instead (the same gradients)")


def proc_status_kb(key: str) -> int | None:
    """A ``kB`` field of /proc/self/status (Linux), e.g. VmRSS or VmHWM (the resident peak)."""
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))
    return None


def peak_memory_gb(device: torch.device, base: float) -> float:
    """Peak GiB since the step began less ``base``: CUDA max allocated, or VmHWM (NaN: no /proc)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30 - base
    hwm = proc_status_kb("VmHWM")
    return float("nan") if hwm is None else max(0.0, hwm / 2**20 - base)
