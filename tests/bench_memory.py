"""The trainer's memory, term by term, predicted (common.fit_memory's plan) beside measured.

    python tests/bench_memory.py                      # Qwen3-0.6B's shape, random weights, CPU fp32
    python tests/bench_memory.py --layers 4 --tokens 256,512 --quick

For each (tokens, checkpointing) it runs a real common.pg_step of two mini-batches of two
micro-batches (one sequence of `tokens` each; AdamW with fresh state) and prints the resident
peak it added (VmHWM, reset first) beside the plan's prediction, once per allocator: "trim", the
trainer's own (glibc's free heap handed back after each backward and optimizer step), "mmap",
the process-wide M_MMAP_THRESHOLD of 128 KiB that it replaces (every freed tensor back to the
kernel at once, every new one faulted in again), and "glibc", neither (what glibc keeps).
Then it prints the memory table of the README: every term per
model shape (weights, gradients, AdamW, activations per token with and without checkpointing),
with the activations measured on a 1- and 2-layer slice of each shape and scaled by its depth.
"""

import argparse
import contextlib
import ctypes
import gc
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import infra.memory  # noqa: E402

# hidden, intermediate, layers, heads, kv heads, tied embeddings (each model's config.json)
SHAPES = {
    "Qwen3-0.6B": (1024, 3072, 28, 16, 8, True),
    "Qwen3-1.7B": (2048, 6144, 28, 16, 8, True),
    "Qwen3-4B": (2560, 9728, 36, 32, 8, True),
    "Qwen3-8B": (4096, 12288, 36, 32, 8, False),
}
VOCAB = 151_936


def qwen3(shape, layers=None, vocab=None):
    h, inter, n, heads, kv, tied = SHAPES[shape]
    cfg = transformers.Qwen3Config(
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers or n,
        head_dim=128,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab or VOCAB,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg).train()


def rss_gib(key="VmRSS"):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def set_allocator(allocator: str) -> None:
    """"mmap": glibc's mmap threshold fixed at 128 KiB for the whole process, as Policy.load did
    for a CPU trainer until pg_step handed the heap back itself; "glibc": pg_step hands nothing
    back; "trim": as the trainer runs."""
    if allocator == "mmap":
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD (malloc.h)
    if allocator in ("mmap", "glibc"):
        common.release_freed_memory = lambda device: None


def measure(model, tokens, ckpt, whole_head):
    """Resident peak (GiB) added by a pg_step of two AdamW steps of two micro-batches of `tokens`
    each (one sequence each): the second step is the steady state, where the moments exist and
    the second micro-batch's activations meet the first one's gradients."""
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.selfplay_head_rows = tokens if whole_head else None  # as fit_memory plans it
    cfg = common.RunConfig(model="bench", lr=1e-6, micro_batch_tokens=tokens)
    engine = types.SimpleNamespace(model=model, sleep=lambda: None)  # pg_step's sync: nothing
    policy = common.Policy(cfg, model, None, engine, "bench")
    g = torch.Generator().manual_seed(tokens)
    trajs = []
    for advantage in (1.0, -1.0, 0.5, -0.5):
        ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=g).tolist()
        trajs.append(common.Trajectory(prompt_ids=ids[:16], completion_ids=ids[16:],
                                       advantage=advantage))
    gc.collect()
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    base = rss_gib()
    t0 = time.perf_counter()
    common.pg_step(policy, trajs, common.PGConfig(mini_batch=2))
    return rss_gib("VmHWM") - base, time.perf_counter() - t0


def predicted(model, cost, tokens, ckpt, whole_head):
    """fit_memory's plan for this micro-batch (without its 10% margin), in GiB."""
    plan = types.SimpleNamespace(model=model, optimizer=types.SimpleNamespace(state={}))
    return infra.memory.step_memory(plan, tokens, ckpt, cost, whole_head=whole_head) / 2**30


def table(autocast):
    """Activation bytes per token of every shape at full depth, from 1- and 2-layer slices (both
    terms are linear in depth; checkpointing adds one recomputed layer, 2 x off / 1.25 / n)."""
    rows = []
    for shape, (h, inter, n, heads, kv, tied) in SHAPES.items():
        c = []
        for layers in (1, 2):
            m = qwen3(shape, layers, vocab=1024)
            m.selfplay_autocast = torch.bfloat16 if autocast else None
            c.append(infra.memory.activation_costs(m))
            del m
            gc.collect()
        off = c[0]["off"] + (n - 1) * (c[1]["off"] - c[0]["off"])
        saved_on = [c[0]["on"] - 2 * c[0]["off"] / 1.25, c[1]["on"] - c[1]["off"] / 1.25]
        on = saved_on[0] + (n - 1) * (saved_on[1] - saved_on[0]) + 2 * off / 1.25 / n
        rows.append((shape, qwen3_params(shape), off, on))
    return rows


def qwen3_params(shape):
    h, inter, n, heads, kv, tied = SHAPES[shape]
    attn = h * heads * 128 * 2 + h * kv * 128 * 2 + 4 * 128
    layer = attn + 3 * h * inter + 2 * h
    return n * layer + VOCAB * h * (1 if tied else 2) + h


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="Qwen3-0.6B", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the shape's (quicker)")
    ap.add_argument("--tokens", default="512,1024", help="micro-batch sizes to measure")
    ap.add_argument("--vocab", type=int, default=0, help="a smaller vocabulary (quicker)")
    ap.add_argument("--quick", action="store_true", help="skip the per-shape table")
    ap.add_argument("--allocators", default="trim,mmap",
                    help="trim (the trainer's), mmap (the old process-wide setting), glibc (none)")
    ap.add_argument("--whole-head", action="store_true",
                    help="the LM head in one piece, as fit_memory plans it where it fits")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # TOKENS,CKPT,ALLOCATOR here
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if args.one:
        tokens, ckpt, allocator = args.one.split(",")
        set_allocator(allocator)  # before the model: its weights are allocations too
        model = qwen3(args.shape, args.layers or None, args.vocab or None)
        print(*measure(model, int(tokens), bool(int(ckpt)), args.whole_head))
        return
    model = qwen3(args.shape, args.layers or None, args.vocab or None)
    n_params = sum(p.numel() for p in model.parameters())
    cost = infra.memory.activation_costs(model)
    depth = f" ({args.layers} layers)" if args.layers else ""
    head = "in one piece" if args.whole_head else "in 128 MiB chunks"
    print(f"{args.shape} shape{depth}: {n_params / 1e6:.0f}M parameters, fp32 on CPU; measured "
          f"activations {cost['off'] / 2**20:.2f} MiB/token, {cost['on'] / 2**20:.2f} with "
          f"gradient checkpointing; the LM head {head}")
    print(f"{'tokens':>7} {'ckpt':>5} {'allocator':>9} {'predicted':>10} {'measured':>9} "
          f"{'ratio':>6} {'s':>6}   (GiB, seconds)")
    cases = [(int(t), ckpt) for t in args.tokens.split(",") for ckpt in (False, True)]
    plan = {case: predicted(model, cost, *case, args.whole_head) for case in cases}
    # Each measurement runs in a fresh process, alone: freed heap pages stay resident and would
    # hide the next peak, and two models side by side would not fit a small machine.
    del model
    gc.collect()
    for (tokens, ckpt), want in plan.items():
        for allocator in args.allocators.split(","):  # interleaved, in one run
            cmd = [sys.executable, __file__, "--shape", args.shape, "--layers", str(args.layers),
                   "--vocab", str(args.vocab), "--one", f"{tokens},{int(ckpt)},{allocator}"]
            if args.whole_head:
                cmd.append("--whole-head")
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            got, secs = map(float, out.split()[-2:])
            print(f"{tokens:>7} {str(ckpt):>5} {allocator:>9} {want:>10.2f} {got:>9.2f} "
                  f"{got / want:>6.2f} {secs:>6.0f}", flush=True)
    if args.quick:
        return
    print(
        "\nper GPU at the defaults (--micro-batch-tokens 16384), bf16 autocast, fp32 master"
        " weights;"
        " training state = weights + gradients + AdamW = 16 B/param, divided by the FSDP ranks"
    )
    print(
        f"{'model':>11} {'params':>7} {'state GiB':>10} {'act MiB/tok':>12} {'ckpt MiB/tok':>13} "
        f"{'act@16384 GiB':>14} {'ckpt@16384 GiB':>15}"
    )
    for shape, params, off, on in table(autocast=True):
        print(
            f"{shape:>11} {params / 1e9:>6.2f}B {16 * params / 2**30:>10.1f} {off / 2**20:>12.2f} "
            f"{on / 2**20:>13.3f} {16384 * off / 2**30:>14.1f} {16384 * on / 2**30:>15.1f}"
        )


if __name__ == "__main__":
    main()
