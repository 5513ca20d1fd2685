"""pg_step beside a plain PyTorch GRPO step, interleaved in one process (figures, not a test).

    python tests/bench_step.py                     # all three parts, medians of 3
    python tests/bench_step.py --parts step --repeats 5

The batch: a random Qwen3 of 4 layers x 256 hidden and a 32k vocabulary, 16 trajectories of 64
prompt + 256 completion tokens, fp32 on the CPU (or the GPU, if there is one).
1. step: one on-policy common.pg_step (one mini-batch) beside the plain step (full logits,
   log_softmax and gather, token-mean PPO-clip loss, backward, clip, AdamW); then pg_step with
   two mini-batches beside a no-grad pass over the second half and two plain steps. Both train the
   same model with the same AdamW, one after the other, each repeat.
2. load: the plain step in a fresh process that loaded a Policy first, beside one that never did
   (a process-wide allocator setting would slow the first); the processes alternate.
3. memory: tests/bench_memory.py's predicted and measured peak of a step (one layer of Qwen3-0.6B's
   shape, --quick; run bench_memory.py itself for the full depth).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("SELFPLAY_CACHE", str(ROOT / "tests" / ".cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

LAYERS, HIDDEN, VOCAB = 4, 256, 32_000
TRAJECTORIES, PROMPT, COMPLETION = 16, 64, 256


def random_qwen3():
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=3 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg)


def save_model(folder: Path) -> str:
    """The random model and the tiny model's tokenizer (pg_step never reads it) in ``folder``."""
    import common
    random_qwen3().save_pretrained(folder)
    common.load_tokenizer(common.resolve_model_path("tiny")).save_pretrained(folder)
    return str(folder)


def make_batch(device):
    """Token ids [B, P + C], completions [B, C] and advantages [B] (mixed signs, none zero)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (TRAJECTORIES, PROMPT + COMPLETION), generator=g)
    advantages = torch.linspace(-1.5, 1.5, TRAJECTORIES)
    return types.SimpleNamespace(input_ids=ids.to(device), completions=ids[:, PROMPT:].to(device),
                                 advantages=advantages.to(device))


def trajectories(batch):
    import common
    out = []
    for ids, advantage in zip(batch.input_ids.tolist(), batch.advantages.tolist()):
        out.append(common.Trajectory(prompt_ids=ids[:PROMPT], completion_ids=ids[PROMPT:],
                                     advantage=advantage, role="solver"))
    return out


def plain_logprobs(model, batch):
    """log pi of the completion tokens [B, C]: the full logits, log_softmax, gather."""
    logits = model(input_ids=batch.input_ids, use_cache=False).logits.float()
    logp_all = torch.log_softmax(logits[:, PROMPT - 1:-1], dim=-1)
    return logp_all.gather(-1, batch.completions[..., None]).squeeze(-1)


def plain_step(model, optimizer, batch, old_logp=None, clip=1.0):
    """The plain GRPO step: PPO-clip at 0.2, token-mean, clip the gradient, AdamW."""
    logp = plain_logprobs(model, batch)
    if old_logp is None:  # on-policy: pi_old is this forward
        old_logp = logp.detach()
    ratio = torch.exp(logp - old_logp)
    advantages = batch.advantages[:, None]
    loss = -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def half(batch, which: int):
    n = TRAJECTORIES // 2
    rows = slice(which * n, (which + 1) * n)
    return types.SimpleNamespace(input_ids=batch.input_ids[rows],
                                 completions=batch.completions[rows],
                                 advantages=batch.advantages[rows])


def two_plain_steps(model, optimizer, batch):
    """pi_old of the second half before the first step moves the weights, then a step per half."""
    with torch.no_grad():
        second_old = plain_logprobs(model, half(batch, 1))
    plain_step(model, optimizer, half(batch, 0))
    plain_step(model, optimizer, half(batch, 1), old_logp=second_old)


def timed(fn, device) -> dict:
    """Wall and CPU seconds of ``fn()`` (CPU: every thread of this process, the kernel's page
    faults included; on a shared machine the steadier of the two)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}


def summary(runs: list[dict]) -> dict:
    """The median and the fastest of each kind of seconds (the fastest: the run least slowed by
    other work on a shared machine)."""
    out = {}
    for kind in ("wall", "cpu"):
        seconds = [run[kind] for run in runs]
        out[kind] = statistics.median(seconds)
        out[kind + " min"] = min(seconds)
    return out


def show(name: str, runs: list[dict]) -> str:
    s = summary(runs)
    return (f"{name:>34}: wall {s['wall']:6.2f} s (fastest {s['wall min']:5.2f}), "
            f"cpu {s['cpu']:6.2f} s (fastest {s['cpu min']:5.2f})")


def show_ratio(label: str, runs: list[dict], baseline: list[dict]) -> str:
    s, base = summary(runs), summary(baseline)
    ratios = ", ".join(f"{kind} {s[kind] / base[kind]:.2f}" for kind in s)
    return f"{label}: {ratios}"


def load_policy(model_dir: str):
    import common
    cfg = common.RunConfig(model=model_dir, backend="hf", lr=1e-6, output_dir="")
    return common.Policy.load(cfg)


def bench_step(model_dir: str, repeats: int) -> None:
    import common
    policy = load_policy(model_dir)
    model, optimizer, device = policy.model, policy.optimizer, policy.device
    batch = make_batch(device)
    trajs = trajectories(batch)
    one = common.PGConfig(aggregation="token-mean")
    two = common.PGConfig(aggregation="token-mean", mini_batch=TRAJECTORIES // 2)
    cases = {
        "pg_step, one mini-batch": lambda: common.pg_step(policy, trajs, one),
        "plain step": lambda: plain_step(model, optimizer, batch),
        "pg_step, two mini-batches": lambda: common.pg_step(policy, trajs, two),
        "no-grad pass + two plain steps": lambda: two_plain_steps(model, optimizer, batch),
    }
    for fn in cases.values():  # warm-up: AdamW's moments, the allocator's pools
        fn()
    runs = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            runs[name].append(timed(fn, device))
    print(f"# {LAYERS} layers x {HIDDEN} hidden, vocabulary {VOCAB}, {TRAJECTORIES} x ({PROMPT} + "
          f"{COMPLETION}) tokens, {device}, {torch.get_num_threads()} threads; "
          f"medians of {repeats}")
    for name in cases:
        print(show(name, runs[name]))
    print(show_ratio("pg_step / plain step, one mini-batch", runs["pg_step, one mini-batch"],
                     runs["plain step"]))
    print(show_ratio("pg_step / plain steps, two mini-batches", runs["pg_step, two mini-batches"],
                     runs["no-grad pass + two plain steps"]))


def _plain_step_times(model_dir: str, load: bool, repeats: int) -> list[dict]:
    """In this (fresh) process: the plain step's times, after loading a Policy if ``load``."""
    if load:
        load_policy(model_dir)
    model = random_qwen3().train()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch = make_batch(device)
    plain_step(model, optimizer, batch)  # warm-up
    return [timed(lambda: plain_step(model, optimizer, batch), device) for _ in range(repeats)]


def bench_load(model_dir: str, repeats: int) -> None:
    runs = {"never loaded a Policy": [], "loaded a Policy first": []}
    for _ in range(repeats):  # the two kinds of process alternate
        for load, name in enumerate(runs):
            cmd = [sys.executable, __file__, "--child", model_dir, "--load", str(load),
                   "--repeats", str(repeats), "--threads", str(torch.get_num_threads())]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[name] += json.loads(out.splitlines()[-1])
    print(f"# the plain step in fresh processes, {repeats} of each kind, {repeats} steps each")
    for name, times in runs.items():
        print(show(f"plain step, {name}", times))
    print(show_ratio("loaded / never", runs["loaded a Policy first"],
                     runs["never loaded a Policy"]))


def bench_memory() -> None:
    cmd = [sys.executable, str(ROOT / "tests" / "bench_memory.py"), "--layers", "1", "--tokens",
           "256", "--quick"]
    print(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout, end="")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="step,load,memory", help="comma-separated: step,load,memory")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per case (the median)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)  # MODEL_DIR: one load process
    ap.add_argument("--load", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(_plain_step_times(args.child, bool(args.load), args.repeats)))
        return
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(Path(tmp))
        if "step" in parts:
            bench_step(model_dir, args.repeats)
        if "load" in parts:
            bench_load(model_dir, args.repeats)
    if "memory" in parts:
        bench_memory()


if __name__ == "__main__":
    main()
