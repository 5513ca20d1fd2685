"""Fitting the trainer in memory: activation costs measured before step 1, a plan of micro-batch
size and gradient checkpointing, and the resident-memory figures a step reports."""
from __future__ import annotations

import contextlib
import ctypes
import math
import time
from pathlib import Path

from infra.errors import InputError
from infra.lazy import LazyModule
from infra.parallel import all_gather_objects, compute_context, local_part

torch = LazyModule("torch", globals())


def set_gradient_checkpointing(model, on: bool) -> None:
    """Gradient checkpointing on or off (a checkpointed layer drops use_cache itself)."""
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def _saved_activation_bytes(model, n_tokens: int) -> int:
    """Bytes that autograd saves for the backward of one ``n_tokens`` forward, weights excluded."""
    storages = {}  # each saved storage once: data pointer -> bytes

    def pack(t):
        # parameters and their views (a linear layer saves weight.t()) are not activations, nor are
        # FSDP2's unsharded parameters
        base = t if t._base is None else t._base
        if not (base.is_leaf and base.requires_grad):
            storage = t.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    ids = torch.randint(0, model.config.vocab_size, (1, n_tokens), device=model.device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), compute_context(model):
        model(input_ids=ids, use_cache=False)  # all ranks together under FSDP2
    return sum(storages.values())


def activation_costs(model, tokens=(32, 96)) -> dict:
    """Activation bytes per token without ("off") and with ("on") checkpointing, and per forward
    ("fixed": autocast's bf16 weight copies): what autograd saves (no parameters) at two lengths."""
    was = model.is_gradient_checkpointing
    n_short, n_long = tokens
    slope = {}
    for checkpointing in (False, True):
        set_gradient_checkpointing(model, checkpointing)
        short_bytes = _saved_activation_bytes(model, n_short)
        long_bytes = _saved_activation_bytes(model, n_long)
        slope[checkpointing] = (long_bytes - short_bytes) / (n_long - n_short)
        if not checkpointing:  # what a forward saves whatever its length
            fixed = max(0.0, short_bytes - slope[False] * n_short)
    set_gradient_checkpointing(model, was)
    # Backward's own buffers (the activations' gradients) add ~25% without checkpointing (measured
    # at the 0.6B shape); with it, the layer being recomputed holds its activations and gradients.
    per_layer = slope[False] / model.config.num_hidden_layers
    return {
        "off": 1.25 * slope[False],
        "on": slope[True] + 2 * per_layer,
        "fixed": fixed,
    }


def available_memory(device) -> int:
    """Bytes free: on CUDA the device's; on CPU MemAvailable, capped by a cgroup v2 memory limit."""
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes)
    free = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        meminfo = Path("/proc/meminfo").read_text()
        available_kb = meminfo.split("MemAvailable:")[1].split()[0]
        free = int(available_kb) * 1024
    with contextlib.suppress(OSError, ValueError):  # a memory.max of "max": no limit
        limit = int(Path("/sys/fs/cgroup/memory.max").read_text())
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        free = min(free, limit - used)
    return free


def release_freed_memory(device) -> None:
    """On the CPU, hand the free pages of glibc's heap back to the kernel now (malloc_trim(0)), as
    pg_step and sft_step do after each backward and optimizer step; fit_memory plans on it. glibc
    keeps freed blocks of up to 32 MiB (its mmap threshold rises with each one freed), which held a
    CPU trainer up to 1.8 GiB above its live tensors at the 0.6B shape (tests/bench_memory.py). A
    process-wide threshold of 128 KiB (mallopt) did it before, at the price of faulting the pages
    of every new tensor in: everything in the process ran 1.3x slower (tests/bench_step.py)."""
    if device.type != "cpu":
        return  # the trainer's tensors are not in this heap
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def step_memory(policy, tokens: int, checkpointing: bool, cost: dict,
                whole_head: bool = False) -> float:
    """Peak bytes beyond those allocated for a step of `tokens`-token micro-batches: gradients and
    AdamW's moments (unless they exist), plus the larger of AdamW's temporaries (GPU: a weight set;
    CPU: two of the largest tensor) and the backward's: activations, four fp32 logits of the LM
    head's chunk (128 MiB each) or, ``whole_head``, of all `tokens` rows at once, and two full
    LM-head gradients (the chunks' sum and a chunk's own). Checked by tests/bench_memory.py."""
    trainable = [local_part(p) for p in policy.model.parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in trainable]
    weights = sum(sizes)
    if trainable[0].device.type == "cuda":
        optimizer_temporaries = weights  # a weight set
    else:
        optimizer_temporaries = 2 * max(sizes)  # two of the largest tensor
    grads_and_moments = weights
    if not policy.optimizer.state:  # AdamW makes its two moments at its first step
        grads_and_moments += 2 * weights
    head = policy.model.get_output_embeddings().weight
    head_bytes = head.numel() * head.element_size()
    head_logits = 2**27  # a chunk's fp32 logits (common._head_rows)
    if whole_head:
        head_logits = tokens * head.shape[0] * 4
    per_token = cost["on"] if checkpointing else cost["off"]
    backward = cost["fixed"] + 4 * head_logits + 2 * head_bytes + tokens * per_token
    return grads_and_moments + max(backward, optimizer_temporaries)


def _largest_micro_batch(policy, free: int, checkpointing: bool, cost: dict) -> int:
    """The micro-batch tokens whose step fits in ``free`` bytes (10% margin), a multiple of 256."""
    room = free / 1.1 - step_memory(policy, 0, checkpointing, cost)
    per_token = cost["on"] if checkpointing else cost["off"]
    tokens = int(room / per_token)
    return tokens // 256 * 256


def _plan_text(tokens: int, checkpointing: bool) -> str:
    text = f"--micro-batch-tokens {tokens}"
    if checkpointing:
        text += " with gradient checkpointing"
    return text


def fit_memory(policy, free: int | None = None) -> str:
    """Before step 1, fit the free memory (10% margin), same gradients: the LM head in one piece
    if it fits, else the largest micro-batch up to the configured one that holds a
    --max-model-len sequence. The line to print ('' if none)."""
    cfg = policy.cfg
    if free is None:
        free = available_memory(policy.device)
    free = min(all_gather_objects(free))  # every rank must cut the same micro-batches: the least
    if cfg.vllm_sleep and policy.device.type == "cuda":  # the engine frees its share while training
        _, total = torch.cuda.mem_get_info(policy.device)
        free += int(cfg.gpu_memory_utilization * total)
    cost = activation_costs(policy.model)
    tokens, checkpointing = cfg.micro_batch_tokens, cfg.gradient_checkpointing
    # The LM head in one piece where its logits fit beside the rest: no chunk is recomputed in
    # the backward (common._head_logprobs). Else chunks, as without a plan.
    policy.model.selfplay_head_rows = None
    if 1.1 * step_memory(policy, tokens, checkpointing, cost, whole_head=True) <= free:
        policy.model.selfplay_head_rows = tokens
        return ""
    need = 1.1 * step_memory(policy, tokens, checkpointing, cost)
    if need <= free:
        return ""
    seq = cfg.max_model_len
    # checkpointing only where needed: it is slower
    new_checkpointing = checkpointing or _largest_micro_batch(policy, free, False, cost) < seq
    largest = _largest_micro_batch(policy, free, new_checkpointing, cost)
    if largest < seq:
        one = gib(1.1 * step_memory(policy, seq, True, cost))
        raise InputError(
            f"memory: one {seq}-token sequence needs ~{one} with gradient checkpointing, "
            f"{gib(free)} is free; lower --max-model-len, add --vllm-sleep or a lower "
            f"--gpu-memory-utilization, or shard over more GPUs with torchrun")
    cfg.gradient_checkpointing = new_checkpointing
    cfg.micro_batch_tokens = min(tokens, largest)
    set_gradient_checkpointing(policy.model, new_checkpointing)
    return (f"memory: {_plan_text(tokens, checkpointing)} needs ~{gib(need)}, {gib(free)} is "
            f"free: training with {_plan_text(cfg.micro_batch_tokens, new_checkpointing)} instead "
            f"(the same gradients)")


def proc_status_kb(key: str) -> int | None:
    """A ``kB`` field of /proc/self/status (Linux), e.g. VmRSS or VmHWM (the resident peak)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


def peak_memory_gb(device: torch.device, base: float) -> float:
    """Peak GiB since the step began less ``base``: CUDA max allocated, or VmHWM (NaN: no /proc)."""
    if device.type == "cuda":
        peak_gb = torch.cuda.max_memory_allocated(device) / 2**30
        return peak_gb - base
    peak_kb = proc_status_kb("VmHWM")
    if peak_kb is None:
        return float("nan")
    return max(0.0, peak_kb / 2**20 - base)


class StepMeter:
    """Seconds and peak memory of one pg_step or sft_step on this rank, from its creation."""

    def __init__(self, device):
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.base_gb = torch.cuda.memory_allocated(device) / 2**30
        else:
            with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the resident peak VmHWM (Linux >= 4.0)
            rss_kb = proc_status_kb("VmRSS") or math.nan
            self.base_gb = rss_kb / 2**20
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def peak_memory_gb(self) -> float:
        return peak_memory_gb(self.device, self.base_gb)
