"""The laptop laboratory, R-Zero: a Challenger and a Solver co-evolve from one small base model on
multi-step integer arithmetic, where every question has an exact answer.

    python tests/lab_r_zero.py model                 # build (once, cached) the base model
    python tests/lab_r_zero.py run --seeds 0,1       # R-Zero, then the PNG and the table
    python tests/lab_r_zero.py control --seeds 0,1   # one iteration, exact labels for the Solver
    python tests/lab_r_zero.py control --shuffle-rewards  # the same, rewards permuted: pure noise

The base model is a small Qwen3 (the lab's recipe, tests/lab.py) pretrained here on chat documents
in r_zero.py's own formats: Solver documents (its system prompt, a question "What is 12 + 7 - 3?",
a step-by-step answer ending in \\boxed{}) and Challenger documents (its system and user prompts,
then a <question> block and a boxed answer). Half its Solver documents give the boxed answer with
no working (--direct), so, like a real base model, it often answers without the steps that make it
right. It sees mostly short problems with small numbers, so it starts with partial skill on long
ones. --direct 0 builds the first base, which always works step by step. The experiment runs the
real r_zero.py with flags only.
What it shows (R-Zero, Huang et al. 2025): the Solver's greedy held-out accuracy per iteration
against the base model's (95% Wilson CIs, Table 1's comparison), and the accuracy of the
majority-vote pseudo-labels of the kept Challenger questions against the exact oracle, per
iteration (the paper's label-accuracy table, §5: it falls as the questions get harder).
r_zero.py's best iteration is chosen on a dev set of fresh questions (dev.jsonl), never on the
held-out test.

`--quick` runs a reduced version (a smaller model, one iteration, one step a phase) that CI uses
to check the pipeline end to end.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab import (CACHE, SEP, finished, leaks, pretrain, score, wilson,  # noqa: E402 (the lab's)
                 words)

# (hidden, layers, intermediate, steps, batch, peak LR, vocab)
MODELS = {"full": (128, 4, 384, 1000, 8, 4e-3, 1024),
          "quick": (64, 2, 128, 30, 4, 4e-3, 512)}
SEQ = 512  # tokens per packed pretraining row (a Challenger document is ~150)
CORPUS = "corpus.txt.gz"
# pretraining difficulty: weights of 2..5 operands and of 1..2 digits per operand (mostly easy)
PRE_OPERANDS, PRE_DIGITS = (5, 3, 2, 1), (3, 2)
# the shares of Challenger-format and Solver-format documents; the rest are plain worked problems,
# 4-8 a document, as a base model's corpus holds math text beside chats (the chats' prompts are
# mostly fixed text, so the arithmetic would otherwise be a quarter of the tokens)
CHALLENGER_DOCS, SOLVER_DOCS = 0.2, 0.4
# the share of Solver documents that give the boxed answer alone, with no working (--direct): a
# real base model has seen both kinds of answer, so it sometimes skips the steps that make it right
DIRECT = 0.5


# -------------------------------------------------------------------------- the arithmetic domain
def sample_problem(rng: random.Random, op_weights, digit_weights) -> tuple[list[int], list[str]]:
    k = rng.choices(range(2, 2 + len(op_weights)), weights=op_weights)[0]
    nums = []
    for _ in range(k):
        d = rng.choices(range(1, 1 + len(digit_weights)), weights=digit_weights)[0]
        nums.append(rng.randint(1 if d == 1 else 10 ** (d - 1), 10 ** d - 1))
    return nums, [rng.choice("+-") for _ in range(k - 1)]


def question(nums, ops) -> str:
    return "What is " + " ".join([str(nums[0])] + [f"{o} {n}" for o, n in zip(ops, nums[1:])]) + "?"


QUESTION = re.compile(r"What is (-?\d{1,6}(?: [+-] \d{1,6}){1,9})\?")


def oracle(text: str) -> int | None:
    """The exact answer of a question in the domain's one form ('What is 12 + 7 - 3?', 2-10
    integers, + and -), parsed (never eval'd); None for anything else."""
    m = QUESTION.fullmatch(text.strip())
    if m is None:
        return None
    tokens = m.group(1).split(" ")
    total = int(tokens[0])
    for op, n in zip(tokens[1::2], tokens[2::2]):
        total = total + int(n) if op == "+" else total - int(n)
    return total


def solution(nums, ops) -> str:
    """Left to right, one operation a sentence, then the boxed answer (r_zero.py's Solver)."""
    acc, steps = nums[0], []
    for o, n in zip(ops, nums[1:]):
        new = acc + n if o == "+" else acc - n
        steps.append(f"{acc} {o} {n} = {new}.")
        acc = new
    return " ".join(steps) + f"\n\\boxed{{{acc}}}"


def chat(messages) -> str:
    return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in messages)


def solver_document(nums, ops, direct: bool = False) -> str:
    """A Solver chat: the working and the boxed answer, or (direct) the boxed answer alone."""
    import r_zero
    reply = f"\\boxed{{{oracle(question(nums, ops))}}}" if direct else solution(nums, ops)
    return chat([("system", r_zero.PROMPTS["solver_system"].format()),
                 ("user", question(nums, ops)), ("assistant", reply)])


def challenger_document(nums, ops) -> str:
    import r_zero
    q = question(nums, ops)
    reply = f"<question>\n{q}\n</question>\n\n\\boxed{{{oracle(q)}}}"
    return chat([("system", r_zero.PROMPTS["challenger_system"].format()),
                 ("user", r_zero.PROMPTS["challenger_user"].format()), ("assistant", reply)])


def test_rows(kind: str) -> list[dict]:
    """The held-out set: 2-5 operands evenly (80 each, 'quick': 10), each operand 1 or 2 digits
    evenly, questions distinct."""
    rng, per, rows, seen = random.Random(4242), 80 if kind == "full" else 10, [], set()
    for k in range(2, 6):
        n = 0
        while n < per:
            nums, ops = sample_problem(rng, [int(j == k) for j in range(2, 6)], (1, 1))
            q = question(nums, ops)
            if words(q) not in seen:
                seen.add(words(q))
                rows.append({"question": q, "answer": str(oracle(q)), "operands": k})
                n += 1
    return rows


def dev_rows(kind: str) -> list[dict]:
    """The dev set that chooses r_zero.py's best iteration (--dev-benchmarks): 20 problems per
    operand count ('quick': 3), drawn as test_rows draws but with its own seed, no held-out
    question among them, so the reported test problems never take part in the choice."""
    rng, per, rows = random.Random(4343), 20 if kind == "full" else 3, []
    seen = {words(r["question"]) for r in test_rows("full")}
    for k in range(2, 6):
        n = 0
        while n < per:
            nums, ops = sample_problem(rng, [int(j == k) for j in range(2, 6)], (1, 1))
            q = question(nums, ops)
            if words(q) not in seen:
                seen.add(words(q))
                rows.append({"question": q, "answer": str(oracle(q)), "operands": k})
                n += 1
    return rows


def write_sets(work: Path, kind: str) -> list[dict]:
    """test.jsonl (the held-out set) and dev.jsonl in `work`; the held-out rows."""
    tests = test_rows(kind)
    for name, rows in (("test", tests), ("dev", dev_rows(kind))):
        (work / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tests


def contaminates(text: str, held: set, lengths: set) -> bool:
    """Whether a text holds a held-out question's words (operators and punctuation dropped, as
    common.Decontaminator reads them) anywhere: in a question, or across a question and the
    working after it ('What is 1 - 82?' then '1 - 82 = -81' reads 'what is 1 82 1 82 81')."""
    w = words(text)
    return any(tuple(w[i:i + n]) in held for n in lengths for i in range(len(w) - n + 1))


# ---------------------------------------------------------------------------------- the base model
def build_model(kind: str = "full", seed: int = 0, direct: float = DIRECT) -> Path:
    """Pretrain the base model (cached under the lab's CACHE by its settings): documents packed
    into rows of SEQ tokens, digits single tokens; no held-out question is in any document.
    `direct`: the share of Solver documents without working."""
    import torch

    hidden, layers, inter, steps, batch, lr, vocab = MODELS[kind]
    probe = solver_document([12, 7, 3], ["+", "-"]) + challenger_document([5, 4], ["+"])
    settings = (MODELS[kind], SEQ, seed, PRE_OPERANDS, PRE_DIGITS, CHALLENGER_DOCS, SOLVER_DOCS,
                probe, 3) + ((direct,) if direct else ())  # direct 0: the first base's key
    out = CACHE / f"lab-rzero-{kind}-{hashlib.sha256(repr(settings).encode()).hexdigest()[:10]}"
    if (out / ".complete").is_file():
        return out
    torch.set_num_threads(1)
    rng = random.Random(seed)
    held = {words(r["question"]) for r in test_rows("full")}
    lengths = {len(w) for w in held}
    corpus = []

    def problem():
        while True:  # a problem whose question and working hold no held-out question
            nums, ops = sample_problem(rng, PRE_OPERANDS, PRE_DIGITS)
            if not contaminates(question(nums, ops) + " " + solution(nums, ops), held, lengths):
                return nums, ops

    def document():
        u = rng.random()
        if u < CHALLENGER_DOCS:
            doc = challenger_document(*problem())
        elif u < CHALLENGER_DOCS + SOLVER_DOCS:
            doc = solver_document(*problem(), direct=direct > 0 and rng.random() < direct)
        else:
            doc = ""
            for _ in range(rng.randint(4, 8)):  # nor across two problems
                p = problem()
                while contaminates(doc[-80:] + question(*p), held, lengths):
                    p = problem()
                doc += f"{question(*p)}\n{solution(*p)}\n\n"
        corpus.append(doc)
        return doc

    return pretrain(document, corpus, out, (hidden, layers, inter, steps, batch, lr), seed,
                    vocab=vocab, seq=SEQ, sep=SEP)


def decontamination(model: Path, tests: list[dict]) -> str:
    """No held-out question occurs in the pretraining documents (lab.leaks: exactly, or whole, its
    operators and punctuation dropped, so 'What is 5 - 3?' also meets 'What is 5 + 3 + 1?')."""
    held = [r["question"] for r in tests]
    found, n_docs = leaks(model, held)
    if found:
        raise RuntimeError(f"held-out questions leak into the pretraining data: {found}")
    return (f"decontamination: 0 of {len(held)} held-out questions in the {n_docs} pretraining "
            "documents (exact match and whole-question common.Decontaminator)")


# --------------------------------------------------------------------------------------- R-Zero
# r_zero.py's flags per model kind; token limits fit the domain (a 5-operand answer is ~50 tokens)
FLAGS = {"full": dict(iterations=3, challenger_steps=5, solver_steps=10, challenger_batch=16,
                      challenger_group=4, solver_batch=32, solver_group=5, votes=10,
                      question_pool=256, max_tokens=80, vote_max_tokens=80, eval_max_tokens=80,
                      max_prompt_tokens=256, max_model_len=512),
         "quick": dict(iterations=1, challenger_steps=1, solver_steps=1, challenger_batch=4,
                       challenger_group=2, solver_batch=4, solver_group=2, votes=4,
                       question_pool=16, max_tokens=48, vote_max_tokens=48, eval_max_tokens=48,
                       max_prompt_tokens=256, max_model_len=512)}
# Solver budgets over FLAGS["full"] (--budget): "lab" is FLAGS as they are; "paper" keeps the
# paper's proportions per step (r_zero.py's defaults: 512 questions x 5 answers, minibatches of 128,
# 15 steps, a pool of 8000) at half the batch, 256 questions (2 updates of 128 a step), with a pool
# of 1024 so the kept set (~60% of it here) holds several batches
BUDGETS = {"lab": {},
           "paper": dict(solver_batch=256, solver_minibatch=128, solver_steps=15,
                         question_pool=1024)}


def lab_flags(args, **over) -> tuple[dict, str]:
    """r_zero.py's flags of a run (the kind's FLAGS, the --budget's, --solver-steps, `over`) and
    the name of its budget ("" for the lab's default, whose folders stay as they were)."""
    flags = {**FLAGS[args.kind], **BUDGETS[args.budget], **over}
    name = "" if args.budget == "lab" else args.budget
    if args.solver_steps:
        flags["solver_steps"] = args.solver_steps
        name = f"{args.budget}_steps{args.solver_steps}"
    return flags, name


def label_accuracy(run: Path, k: int) -> dict:
    """The pseudo-labels of iteration k's voted questions against the exact oracle: on the kept
    ones (the Solver's training set) and on all voted ones; questions outside the domain's form
    (no oracle) are counted apart."""
    import common
    rows = [json.loads(x) for x in (run / f"dataset_iter{k}.jsonl").read_text().splitlines()
            if x.strip()]
    out = {"voted": len(rows)}
    for name, sel in (("kept", [r for r in rows if r["kept"]]), ("all", rows)):
        ok_rows = [r for r in sel if oracle(r["question"]) is not None]
        right = common.math_equal_many([(str(r["label"]), str(oracle(r["question"])))
                                        for r in ok_rows]) if ok_rows else []
        out[name] = len(sel)
        out[f"{name}_in_domain"] = len(ok_rows)
        out[f"{name}_correct"] = int(sum(right))
        out[f"{name}_operands"] = (sum(len(words(r["question"])) - 2 for r in ok_rows)
                                   / max(1, len(ok_rows)))
    return out


def by_operands(path: Path, tests: list[dict]) -> dict:
    """Greedy accuracy per operand count of an eval_*.json (its problems are the file's order)."""
    res = json.loads(path.read_text())
    (b,) = res["benchmarks"].values()
    out = {}
    for r, p in zip(tests, b["per_problem"]):
        assert p["answer"] == r["answer"]
        out.setdefault(r["operands"], []).append(bool(p["greedy_correct"]))
    return {k: sum(v) / len(v) for k, v in sorted(out.items())}


def workdir(args) -> Path:
    """The experiment's folder: one per model kind and --direct share (0: the first base's)."""
    name = "r_zero_quick" if args.kind == "quick" else "r_zero"
    return Path(args.out) / (name + (f"_direct{args.direct:g}" if args.direct else ""))


def answer_tokens(path: Path) -> float:
    """The mean length of the greedy held-out answers (an answer with no working is ~5 tokens)."""
    (b,) = json.loads(path.read_text())["benchmarks"].values()
    return b["greedy_mean_tokens"]


def experiment(args) -> None:
    t0 = time.time()
    model = build_model(args.kind, direct=args.direct)
    flags, budget = lab_flags(args, **({"iterations": args.iterations} if args.iterations else {}))
    work = workdir(args) / budget
    work.mkdir(parents=True, exist_ok=True)
    tests = write_sets(work, args.kind)
    test_file = work / "test.jsonl"
    print(decontamination(model, tests), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "TOKENIZERS_PARALLELISM": "false"}
    results = {}
    for seed in map(int, args.seeds.split(",")):
        run = work / f"seed{seed}"
        cmd = [sys.executable, str(ROOT / "r_zero.py"), "--model", str(model), "--seed", str(seed),
               "--output-dir", str(run), "--eval-benchmarks", str(test_file), "--lr", args.lr,
               "--dev-benchmarks", str(work / "dev.jsonl"), "--save-every", "0",
               "--keep-checkpoints", "1"]
        cmd += [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))]
        wall = None
        if not finished(run, model):  # a finished run is kept; rerun by deleting it
            print("$", " ".join(["python"] + cmd[1:]), flush=True)
            shutil.rmtree(run, ignore_errors=True)
            t1 = time.time()
            subprocess.run(cmd, check=True, cwd=ROOT, env=env)
            wall = time.time() - t1
        its = range(1, flags["iterations"] + 1)
        best = json.loads((run / "eval.json").read_text())["best"] or {}
        results[seed] = {"base": score(run / "eval_base.json"), "wall": wall,
                         "chosen": best.get("iteration"),
                         "solver": [score(run / f"eval_iter{k}.json") for k in its],
                         "labels": [label_accuracy(run, k) for k in its],
                         "by_operands": [by_operands(run / f"eval_{x}.json", tests) for x in
                                         ["base"] + [f"iter{k}" for k in its]],
                         "tokens": [answer_tokens(run / f"eval_{x}.json") for x in
                                    ["base"] + [f"iter{k}" for k in its]]}
    (work / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    report(results, work)
    print(f"total wall time {time.time() - t0:.0f} s")


def report(results: dict, work: Path) -> None:
    """The table and the PNG: Solver held-out accuracy per iteration (95% Wilson CI, the base
    model's band) and the kept pseudo-labels' accuracy against the oracle per iteration."""
    def frac(k, n):
        return k / n if n else float("nan")

    print("\nR-Zero on multi-step integer arithmetic: Solver greedy held-out accuracy (95% Wilson "
          "CI) and pseudo-label accuracy of the kept questions vs the exact oracle")
    print(f"  {'seed':4s} {'iter':>4s} {'solver acc':>10s} {'95% CI':>16s} {'kept':>5s} "
          f"{'label acc':>9s} {'all-voted label acc':>19s} {'operands':>8s} {'tokens':>6s} "
          f"{'beats base':>10s}")
    for seed, r in results.items():
        k0, n0 = r["base"]
        lo0, hi0 = wilson(k0, n0)
        toks = r.get("tokens") or [float("nan")] * (len(r["solver"]) + 1)
        print(f"  {seed:4d} {'base':>4s} {frac(k0, n0):10.3f} [{lo0:.3f}, {hi0:.3f}] "
              f"{'':5s} {'':9s} {'':19s} {'':8s} {toks[0]:6.1f}")
        for it, ((k, n), lab) in enumerate(zip(r["solver"], r["labels"]), start=1):
            lo, hi = wilson(k, n)
            print(f"  {seed:4d} {it:4d} {frac(k, n):10.3f} [{lo:.3f}, {hi:.3f}] {lab['kept']:5d} "
                  f"{frac(lab['kept_correct'], lab['kept_in_domain']):9.3f} "
                  f"{frac(lab['all_correct'], lab['all_in_domain']):19.3f} "
                  f"{lab['kept_operands']:8.2f} {toks[it]:6.1f} {'yes' if lo > hi0 else 'no':>10s}")
        print(f"  seed {seed}: accuracy by operand count, base -> last: "
              + ", ".join(f"{k}: {a:.2f} -> {b:.2f}" for (k, a), b in
                          zip(r["by_operands"][0].items(), r["by_operands"][-1].values())))
        if r.get("chosen"):
            print(f"  seed {seed}: the dev set chose iteration {r['chosen']}")
        if r.get("wall"):
            print(f"  seed {seed}: r_zero.py wall time {r['wall']:.0f} s")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (seed, r) in enumerate(results.items()):
        pts = [r["base"]] + r["solver"]
        xs = list(range(len(pts)))
        acc = [frac(k, n) for k, n in pts]
        ci = [wilson(k, n) for k, n in pts]
        c = f"C{i}"
        a1.errorbar([x + 0.03 * i for x in xs], acc, yerr=[[a - lo for a, (lo, _) in zip(acc, ci)],
                                                           [hi - a for a, (_, hi) in zip(acc, ci)]],
                    marker="o", capsize=3, color=c, label=f"Solver, seed {seed}")
        a1.axhspan(*ci[0], color=c, alpha=0.1)
        for x, y, t in zip(xs, acc, r.get("tokens") or []) if i == 0 else ():
            a1.annotate(f"{t:.0f} tokens", (x, y), textcoords="offset points", xytext=(6, -10),
                        fontsize=7, color=c)  # the greedy answers' length: working or not
        la = [frac(x["kept_correct"], x["kept_in_domain"]) for x in r["labels"]]
        lci = [wilson(x["kept_correct"], x["kept_in_domain"]) for x in r["labels"]]
        a2.errorbar([x + 0.03 * i for x in xs[1:]], la, capsize=3, marker="o", color=c,
                    yerr=[[a - lo for a, (lo, _) in zip(la, lci)],
                          [hi - a for a, (_, hi) in zip(la, lci)]],
                    label=f"kept questions, seed {seed}")
        ops = [x["kept_operands"] for x in r["labels"]]
        for x, y, o in zip(xs[1:], la, ops):
            a2.annotate(f"{o:.1f} ops", (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=7, color=c)
    a1.set_xlabel("iteration (0 = base model; band: its 95% CI)")
    a1.set_ylabel("greedy held-out accuracy (95% CI)")
    a1.set_title("Solver on held-out arithmetic")
    a2.set_xlabel("iteration")
    a2.set_ylabel("pseudo-label accuracy vs exact oracle (95% CI)")
    a2.set_title("Majority-vote labels of the Challenger's questions")
    for a in (a1, a2):
        a.legend(fontsize=8)
        a.set_xticks(range(len(next(iter(results.values()))["solver"]) + 1))
    fig.suptitle("R-Zero, multi-step integer arithmetic (cf. the paper's Table 1 and its "
                 "label-accuracy table)", fontsize=10)
    fig.tight_layout()
    fig.savefig(work / "r_zero.png", dpi=80)
    plt.close(fig)
    print(f"wrote {work / 'r_zero.png'}")


def skill(path: Path, n: int = 20, seed: int = 99) -> dict:
    """Greedy accuracy per operand count on fresh dev questions (not the test set), r_zero.py's
    Solver prompt, and the share of answers with working: what the base does before R-Zero."""
    import torch
    import transformers
    import common
    import r_zero
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    rng, out = random.Random(seed), {}
    held = {words(r["question"]) for r in test_rows("full")}
    for k in range(2, 6):
        qs = []
        while len(qs) < n:
            q = question(*sample_problem(rng, [int(j == k) for j in range(2, 6)], (1, 1)))
            if words(q) not in held:
                qs.append(q)
        texts = [tok.apply_chat_template(r_zero.solver_prompt(q, tok), tokenize=False,
                                         add_generation_prompt=True) for q in qs]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=80, do_sample=False)
        outs = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        out[k] = sum(common.extract_boxed(t) == str(oracle(q)) for t, q in zip(outs, qs)) / n
        out[f"{k} worked"] = sum(" = " in t for t in outs) / n  # the share with working
    return out


def r_zero_exact_labels(argv) -> None:
    """The control: r_zero.py unchanged but for the Solver's training labels, the exact oracle's
    answers in place of the majority votes (same kept questions; out-of-domain ones keep theirs),
    to tell the pseudo-labels' noise from the rest of the loop."""
    import r_zero
    vote_filter = r_zero.filter_dataset

    def exact(questions, stats, cfg):
        rows = vote_filter(questions, stats, cfg)
        for r in rows:
            truth = oracle(r["question"])
            r["label"] = r["label"] if truth is None else str(truth)
        return rows
    r_zero.filter_dataset = exact
    if "--shuffle-rewards" in argv:  # the noise floor: the same update, no information in it
        argv = [a for a in argv if a != "--shuffle-rewards"]
        update, rng = r_zero.grpo_update, random.Random(0)

        def shuffled(policy, trajs, *args, **kw):
            if trajs and trajs[0].role == r_zero.SOLVER:
                rewards = [t.reward for t in trajs]
                rng.shuffle(rewards)
                for t, r in zip(trajs, rewards):
                    t.reward = r
            return update(policy, trajs, *args, **kw)
        r_zero.grpo_update = shuffled
    r_zero.main(argv)


def control(args) -> None:
    """One iteration with exact labels (r_zero_exact_labels) per seed, beside the real runs;
    --shuffle-rewards permutes the Solver's rewards across each batch (the same reward rate and
    update sizes, no information): what its updates do to the held-out accuracy as pure noise."""
    model = build_model(args.kind, direct=args.direct)
    work = workdir(args)
    flags, budget = lab_flags(args, iterations=1)
    name = ("shuffled_rewards" if args.shuffle_rewards else "exact_labels") + (
        f"_{budget}" if budget else "")
    work.mkdir(parents=True, exist_ok=True)
    write_sets(work, args.kind)
    for seed in map(int, args.seeds.split(",")):
        run = work / f"{name}_seed{seed}"
        cmd = [sys.executable, str(Path(__file__).resolve()), "_exact", "--model", str(model),
               "--seed", str(seed), "--output-dir", str(run), "--eval-benchmarks",
               str(work / "test.jsonl"), "--dev-benchmarks", str(work / "dev.jsonl"), "--lr",
               args.lr, "--save-every", "0", "--keep-checkpoints", "1"]
        cmd += [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))]
        cmd += ["--shuffle-rewards"] if args.shuffle_rewards else []
        wall = ""
        if not finished(run, model):
            print("$", " ".join(["python"] + cmd[1:]), flush=True)
            shutil.rmtree(run, ignore_errors=True)
            t1 = time.time()
            subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
            wall = f"; wall time {time.time() - t1:.0f} s"
        (k0, n0), (k1, n1) = score(run / "eval_base.json"), score(run / "eval_iter1.json")
        lo, hi = wilson(k1, n1)
        lab = label_accuracy(run, 1)
        print(f"{name.replace('_', ' ')} control, seed {seed}: base {k0 / n0:.3f}, after "
              f"iteration 1 {k1 / n1:.3f} [{lo:.3f}, {hi:.3f}] ({lab['kept']} kept, their voted "
              f"labels {lab['kept_correct']}/{lab['kept_in_domain']} right){wall}; by operands "
              f"{by_operands(run / 'eval_iter1.json', test_rows(args.kind))}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", choices=["model", "run", "control"])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--iterations", type=int, default=0, help="0 = the kind's default")
    ap.add_argument("--lr", default="5e-5")  # 3e-4 collapsed the Solver (0.52 -> 0.17)
    ap.add_argument("--out", default=str(ROOT / "runs" / "lab"),
                    help="the lab's folder (default: runs/lab in the repository)")
    ap.add_argument("--shuffle-rewards", action="store_true",
                    help="control: permute the Solver's rewards across each batch")
    ap.add_argument("--budget", choices=sorted(BUDGETS), default="lab",
                    help="the Solver's budget: lab (FLAGS) or paper (BUDGETS); a non-default one "
                         "runs in its own folders")
    ap.add_argument("--solver-steps", type=int, default=0, help="0 = the budget's")
    ap.add_argument("--direct", type=float, default=DIRECT,
                    help="the share of pretraining Solver documents with no working (0: always "
                         "step by step, the first base)")
    ap.add_argument("--quick", dest="kind", action="store_const", const="quick", default="full")
    return ap


def main(argv=None) -> None:
    if (argv or sys.argv[1:])[:1] == ["_exact"]:
        return r_zero_exact_labels((argv or sys.argv[1:])[1:])
    args = parser().parse_args(argv)
    if args.experiment == "model":
        path = build_model(args.kind, direct=args.direct)
        print(path)
        print("greedy accuracy per operand count (dev):", skill(path))
    elif args.experiment == "control":
        control(args)
    else:
        experiment(args)


if __name__ == "__main__":
    main()
