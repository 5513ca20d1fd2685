"""The laptop laboratory, SPICE: one small base model plays Challenger and Reasoner on a corpus of
short documents that state numeric facts, where every question written from one has an exact
answer, with and without the document (the paper's ablation).

    python tests/lab_spice.py model                 # build (once, cached) the base model
    python tests/lab_spice.py run --seeds 0,1       # SPICE with and without documents, PNG, table
    python tests/lab_spice.py model --pretrain-steps 1000 --direct 0  # the first base, its skills

The base model is a small Qwen3 (the lab's recipe, tests/lab.py) pretrained here on chat documents
in spice.py's own formats, with the compact templates of tests/data/spice_short_prompts.toml
(passed to spice.py with --prompts): Challenger documents (a corpus document in its
document block, or the no-document block, then a free-form JSON task that parse_task accepts) and
Reasoner documents (spice.py's Reasoner prompt, a question "Three wells give 37, 45 and 12 litres.
How many litres in all?", a step-by-step answer ending in \\boxed{}), beside plain fact documents
and worked problems. It sees mostly short problems, so it starts with partial skill on long ones,
and half of its Reasoner chats (--direct) give the boxed answer alone, as a base model often
answers without working. It pretrains for 2,000 steps (~21 minutes on one core): at 1,000 the
Challenger miscopied the document's numbers, so the Reasoner trained on wrong labels.
A corpus document ("Elmford has three wells. The north well gives 37 litres, ... In all the wells
give 94 litres.") holds its question's answer; without a document the Challenger must compute its
own gold answer, as the model it is. The experiment runs the real spice.py with flags only and
shows (SPICE, Liu et al. 2025, Fig. 4b's ablation): the Reasoner's greedy held-out accuracy over
steps in both arms against the base model's (95% Wilson CI), and how often the Challenger's gold
answers agree with the exact oracle in each arm.

`--quick` runs a reduced version (a smaller model, two steps an arm) that CI uses to check the
pipeline end to end.
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
from lab import (CACHE, CHATML, SEP, base_flags, base_folder, finished,  # noqa: E402,F401
                 leaks, pretrain, score, wilson, words)

# (hidden, layers, intermediate, steps, batch, peak LR, vocab)
MODELS = {"full": (128, 4, 384, 2000, 8, 4e-3, 1024),
          "quick": (64, 2, 128, 30, 4, 4e-3, 512)}
SEQ = 512  # tokens per packed pretraining row (a Challenger document is ~200)
CORPUS = "corpus.txt.gz"
SHORT_PROMPTS = ROOT / "tests" / "data" / "spice_short_prompts.toml"
# pretraining difficulty: weights of 2..5 quantities and of 1..2 digits per quantity (mostly easy)
PRE_COUNTS, PRE_DIGITS = (5, 3, 2, 1), (3, 2)
# shares of the pretraining documents: Challenger chats (with a document, without), Reasoner chats,
# plain fact documents (the corpus's kind); the rest are plain worked problems, 4-8 a document
CHALLENGER_DOCS, NO_DOCUMENT_DOCS, REASONER_DOCS, FACT_DOCS = 0.3, 0.1, 0.3, 0.1
# the share of Reasoner chats with the boxed answer alone (--direct): a base that always worked
# step by step was near-perfect at 2,000 steps, which left SPICE nothing to teach
DIRECT = 0.5

# ------------------------------------------------------------------------------ the ledger domain
THINGS = [("wells", "well", "litres"), ("orchards", "orchard", "apples"),
          ("mills", "mill", "sacks"), ("boats", "boat", "fish"), ("ovens", "oven", "loaves"),
          ("mines", "mine", "tonnes")]
PLACES = ("Elmford", "Ashby", "Brookton", "Dunmore", "Fairlee", "Greywick", "Holtby", "Kirkdale")
SIDES = ("north", "south", "east", "west", "old")
COUNTS = {2: "two", 3: "three", 4: "four", 5: "five"}


def sample_problem(rng: random.Random, count_weights, digit_weights) -> tuple[int, tuple]:
    """(index into THINGS, the quantities)."""
    k = rng.choices(range(2, 2 + len(count_weights)), weights=count_weights)[0]
    nums = []
    for _ in range(k):
        d = rng.choices(range(1, 1 + len(digit_weights)), weights=digit_weights)[0]
        nums.append(rng.randint(1 if d == 1 else 10 ** (d - 1), 10 ** d - 1))
    return rng.randrange(len(THINGS)), tuple(nums)


def question(p) -> str:
    """Numbers early and dense, so that every 13-word window (spice.py's decontamination n) holds
    most of them: a window of fixed words alone would flag unrelated questions as contaminated."""
    t, nums = p
    things, _, unit = THINGS[t]
    listed = ", ".join(map(str, nums[:-1])) + f" and {nums[-1]}"
    return (f"{COUNTS[len(nums)].capitalize()} {things} give {listed} {unit}. "
            f"How many {unit} in all?")


QUESTION = re.compile(r"(Two|Three|Four|Five) (\w+) give (\d{1,3}(?:, \d{1,3})*) and (\d{1,3}) "
                      r"(\w+)\. How many (\w+) in all\?")


def oracle(text: str) -> int | None:
    """The exact answer of a question in the domain's one form, parsed; None for anything else
    (a count word that disagrees with the quantities, a thing and unit that do not belong)."""
    m = QUESTION.fullmatch(text.strip())
    if m is None:
        return None
    nums = [int(x) for x in m[3].split(", ")] + [int(m[4])]
    if (COUNTS[len(nums)].capitalize() != m[1] or m[5] != m[6]
            or (m[2], m[5]) not in {(a, u) for a, _, u in THINGS}):
        return None
    return sum(nums)


def solution(p) -> str:
    """Left to right, one addition a sentence, then the boxed answer (spice.py's Reasoner)."""
    nums, steps = p[1], []
    acc = nums[0]
    for n in nums[1:]:
        steps.append(f"{acc} + {n} = {acc + n}.")
        acc += n
    return " ".join(steps) + f"\n\\boxed{{{acc}}}"


def fact_document(p, rng: random.Random) -> str:
    """A corpus document: the quantities listed, then each stated, then the total, so a question
    has its answer; the list reads as the question does, which a tiny model can copy."""
    t, nums = p
    things, thing, unit = THINGS[t]
    listed = ", ".join(map(str, nums[:-1])) + f" and {nums[-1]}"
    facts = [f"the {side} {thing} gives {n}" for side, n in zip(SIDES, nums)]
    facts = ", ".join(facts[:-1]) + f" and {facts[-1]}"
    return (f"{rng.choice(PLACES)} has {COUNTS[len(nums)]} {things}. They give {listed} {unit}: "
            f"{facts}. In all the {things} give {sum(nums)} {unit}.")


def signature(p) -> tuple:
    return p[0], tuple(sorted(p[1]))


def templates():
    import common
    import spice
    return common.load_prompts(str(SHORT_PROMPTS), spice.PROMPTS)


def chat(messages, reply: str) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
        f"<|im_start|>assistant\n{reply}<|im_end|>\n"


def reasoner_document(p, direct: bool = False) -> str:
    """A Reasoner chat: the working and the boxed answer, or (direct) the boxed answer alone."""
    import spice
    reply = f"\\boxed{{{sum(p[1])}}}" if direct else solution(p)
    return chat(spice.reasoner_prompt(question(p), "chat", templates()), reply)


def challenger_document(p, answer_type: str, document: str | None) -> str:
    """spice.py's free-form Challenger chat: with a document its answer is the document's total,
    copied; without one the model works the sum out first ("Think first"), as it must in the
    ablation, where nothing grounds its gold answer."""
    import spice
    # the answer type first: right after the prompt that names it, where a tiny model copies it
    task = json.dumps({"answer_type": answer_type, "question": question(p),
                       "answer": str(sum(p[1]))})
    reply = task if document else solution(p).split("\n")[0] + "\n" + task
    return chat(spice.challenger_prompt(document, "free", answer_type, "chat", templates()), reply)


def held_out(kind: str) -> list[tuple]:
    """The held-out problems: 2-5 quantities evenly (80 each, 'quick': 10), each 1 or 2 digits
    evenly, their facts (thing and quantities, in any order) distinct."""
    rng, per, out, seen = random.Random(4242), 80 if kind == "full" else 10, [], set()
    for k in range(2, 6):
        n = 0
        while n < per:
            p = sample_problem(rng, [int(j == k) for j in range(2, 6)], (1, 1))
            if signature(p) not in seen:
                seen.add(signature(p))
                out.append(p)
                n += 1
    return out


def test_rows(kind: str) -> list[dict]:
    return [{"question": question(p), "answer": str(sum(p[1])), "quantities": len(p[1])}
            for p in held_out(kind)]


def held_signatures() -> set:
    """The facts of every held-out question, of either kind's set."""
    return {signature(p) for kind in ("full", "quick") for p in held_out(kind)}


def spice_corpus(n: int, seed: int = 11) -> list[str]:
    """SPICE's corpus: fact documents of 2-5 quantities evenly, 1-2 digits evenly (the held-out
    set's difficulty), none stating a held-out question's facts."""
    rng, held, docs = random.Random(seed), held_signatures(), []
    while len(docs) < n:
        p = sample_problem(rng, (1, 1, 1, 1), (1, 1))
        if signature(p) not in held:
            docs.append(fact_document(p, rng))
    return docs


# ---------------------------------------------------------------------------------- the base model
def build_model(kind: str = "full", seed: int = 0, steps: int = 0, direct: float = DIRECT) -> Path:
    """Pretrain the base model (cached under the lab's CACHE by its settings): documents packed
    into rows of SEQ tokens, digits single tokens; no document states a held-out question's
    facts. `steps`: pretraining steps (0 = MODELS'); `direct`: the share of Reasoner documents
    without working."""
    import torch
    import spice

    shape = MODELS[kind][:3] + (steps or MODELS[kind][3],) + MODELS[kind][4:]
    hidden, layers, inter, steps, batch, lr, vocab = shape
    p0 = (0, (37, 45, 12))
    probe = (reasoner_document(p0) + challenger_document(p0, "Integer", "d")
             + challenger_document(p0, "String", None) + fact_document(p0, random.Random(0)))
    key = hashlib.sha256(repr((shape, SEQ, seed, PRE_COUNTS, PRE_DIGITS, CHALLENGER_DOCS,
                               NO_DOCUMENT_DOCS, REASONER_DOCS, FACT_DOCS, probe, 1)
                              + ((direct,) if direct else ())).encode())
    out = CACHE / f"lab-spice-{kind}-{key.hexdigest()[:10]}"
    if (out / ".complete").is_file():
        return out
    torch.set_num_threads(1)
    rng, held, corpus = random.Random(seed), held_signatures(), []

    def problem():
        while True:
            p = sample_problem(rng, PRE_COUNTS, PRE_DIGITS)
            if signature(p) not in held:
                return p

    def document():
        u = rng.random()
        if u < CHALLENGER_DOCS:
            p = problem()
            doc = challenger_document(p, rng.choice(spice.ANSWER_TYPES), fact_document(p, rng))
        elif (u := u - CHALLENGER_DOCS) < NO_DOCUMENT_DOCS:
            doc = challenger_document(problem(), rng.choice(spice.ANSWER_TYPES), None)
        elif (u := u - NO_DOCUMENT_DOCS) < REASONER_DOCS:
            doc = reasoner_document(problem(), direct=direct > 0 and rng.random() < direct)
        elif u - REASONER_DOCS < FACT_DOCS:
            doc = "\n\n".join(fact_document(problem(), rng) for _ in range(rng.randint(3, 6)))
        else:
            doc = "".join(f"{question(p)}\n{solution(p)}\n\n"
                          for p in (problem() for _ in range(rng.randint(4, 8))))
        corpus.append(doc)
        return doc

    return pretrain(document, corpus, out, (hidden, layers, inter, steps, batch, lr), seed,
                    vocab=vocab, seq=SEQ, sep=SEP)


def decontamination(model: Path, tests: list[dict], docs: list[str]) -> str:
    """No held-out question occurs in the pretraining documents or in SPICE's corpus: exactly and
    whole (lab.leaks), or by its facts (thing and quantities, in any order and phrasing)."""
    held = [r["question"] for r in tests]
    facts = {signature(p) for p in held_signatures()}
    found, n_pre = leaks(model, held, docs)
    stated = []  # a corpus document stating a held-out question's facts would hand its answer over
    for d in docs:
        t = next(i for i, (a, _, _) in enumerate(THINGS) if f" {a}." in d)
        nums = tuple(int(x) for x in re.findall(r"gives (\d+)", d))  # each stated once
        if (t, tuple(sorted(nums))) in facts:
            stated.append(d)
    if found or stated:
        raise RuntimeError(f"held-out questions leak into the training data: {found + stated}")
    return (f"decontamination: 0 of {len(held)} held-out questions in the {n_pre} pretraining "
            f"documents or the {len(docs)} corpus documents (exact match, facts, and "
            "whole-question common.Decontaminator)")


# --------------------------------------------------------------------------------------- SPICE
# spice.py's flags per model kind; token limits fit the domain (a 5-quantity answer is ~50
# tokens, a no-document Challenger reply ~110); one optimizer step a step (mini-batch 128); 20
# steps an arm, ~7 min on 2 shared cores (every arm was below the base CI by step 5, 2 seeds)
FLAGS = {"full": dict(steps=20, docs_per_step=16, group_size=4, reasoner_k=4, max_attempts=8,
                      max_tokens=160, eval_max_tokens=96, eval_every=5, max_model_len=1024,
                      corpus_docs=0),
         "quick": dict(steps=2, docs_per_step=2, group_size=2, reasoner_k=2, max_attempts=2,
                       max_tokens=64, eval_max_tokens=48, eval_every=1, max_model_len=1024,
                       corpus_docs=0)}


def curve(run: Path, flags: dict) -> list[tuple[int, int, int]]:
    """(step, correct, n) of each evaluation of a run: the base model, every eval_every, the end."""
    steps = [0] + list(range(flags["eval_every"], flags["steps"], flags["eval_every"]))
    files = ["eval_base.json"] + [f"eval_step{s}.json" for s in steps[1:]] + ["eval.json"]
    return [(s, *score(run / f)) for s, f in zip(steps + [flags["steps"]], files)]


def gold_accuracy(run: Path) -> dict:
    """The Challenger's valid tasks against the exact oracle, per step: how many are in the
    domain's form, how many of those have the right gold answer (all, and the Reasoner's)."""
    out = {}
    path = run / "samples.jsonl"  # every Challenger attempt (--log-samples below)
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if \
        path.is_file() else []
    for r in (r for r in rows if r.get("role") == "challenger" and r["question"] is not None):
        s = out.setdefault(r["step"], {"valid": 0, "in_domain": 0, "right": 0, "trained": 0,
                                       "trained_right": 0})
        truth = oracle(r["question"])
        s["valid"] += 1
        if truth is not None:
            ok = str(r["gold"]).strip().replace(",", "") == str(truth)
            s["in_domain"] += 1
            s["right"] += ok
            s["trained"] += bool(r["reasoner_task"])
            s["trained_right"] += bool(r["reasoner_task"]) and ok
    return out


def experiment(args) -> None:
    t0 = time.time()
    model = build_model(args.kind, steps=args.pretrain_steps, direct=args.direct)
    work = Path(args.out) / ("spice_quick" if args.kind == "quick" else "spice")
    work = base_folder(work, args, DIRECT)
    work.mkdir(parents=True, exist_ok=True)
    tests = test_rows(args.kind)
    test_file, corpus_file = work / "test.jsonl", work / "corpus.jsonl"
    test_file.write_text("".join(json.dumps(r) + "\n" for r in tests))
    docs = spice_corpus(2000 if args.kind == "full" else 50)
    corpus_file.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    print(decontamination(model, tests, docs), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "TOKENIZERS_PARALLELISM": "false"}
    flags = {**FLAGS[args.kind], **({"steps": args.steps} if args.steps else {})}
    results = {}
    for seed in map(int, args.seeds.split(",")):
        for arm in ("document", "no_document"):
            run = work / f"{arm}_seed{seed}"
            # free-form tasks, their answer type a coin: without a document spice.py has no
            # Fig. 9 call to make, so both arms draw their types the same way
            cmd = [sys.executable, str(ROOT / "spice.py"), "--model", str(model),
                   "--seed", str(seed), "--output-dir", str(run), "--corpus", str(corpus_file),
                   "--eval-benchmarks", str(test_file), "--eval-base", "--prompts",
                   str(SHORT_PROMPTS), "--task-types", "free", "--type-selection", "random",
                   "--lr", args.lr, "--save-every", "0", "--keep-checkpoints", "1",
                   "--log-samples", "1000000"]
            cmd += [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))]
            cmd += ["--no-document"] if arm == "no_document" else []
            wall = None
            if not finished(run, model):  # a finished run is kept; rerun by deleting it
                print("$", " ".join(["python"] + cmd[1:]), flush=True)
                shutil.rmtree(run, ignore_errors=True)
                t1 = time.time()
                subprocess.run(cmd, check=True, cwd=ROOT, env=env)
                wall = time.time() - t1
            results[f"{arm}_seed{seed}"] = {"arm": arm, "seed": seed, "wall": wall,
                                            "curve": curve(run, flags),
                                            "gold": gold_accuracy(run)}
    (work / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    report(results, work)
    print(f"total wall time {time.time() - t0:.0f} s")


def report(results: dict, work: Path) -> None:
    """The table and the PNG: the Reasoner's held-out accuracy over steps per arm and seed (the
    base model's 95% Wilson band), and the Challenger's gold answers against the oracle."""
    def frac(k, n):
        return k / n if n else float("nan")

    print("\nSPICE on numeric-fact documents: Reasoner greedy held-out accuracy (95% Wilson CI); "
          "the Challenger's gold answers vs the exact oracle")
    for name, r in results.items():
        pts = r["curve"]
        (_, k0, n0), (_, k1, n1) = pts[0], pts[-1]
        (lo0, hi0), (lo1, hi1) = wilson(k0, n0), wilson(k1, n1)
        g = r["gold"].values()
        right, dom = sum(x["right"] for x in g), sum(x["in_domain"] for x in g)
        valid, trained = sum(x["valid"] for x in g), sum(x["trained"] for x in g)
        print(f"  {name:20s} " + " ".join(f"{s}:{frac(k, n):.3f}" for s, k, n in pts)
              + f"  base [{lo0:.3f}, {hi0:.3f}] last [{lo1:.3f}, {hi1:.3f}]  beats base beyond "
              f"CI: {'yes' if lo1 > hi0 else 'no'}")
        print(f"  {'':20s} valid tasks {valid}, in the domain's form {dom}, gold right "
              f"{frac(right, dom):.3f}; the Reasoner's tasks: gold right "
              f"{frac(sum(x['trained_right'] for x in g), trained):.3f} of {trained}"
              + (f"; spice.py wall time {r['wall']:.0f} s" if r.get("wall") else ""))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    seeds = sorted({r["seed"] for r in results.values()})
    for name, r in results.items():
        c = "C0" if r["arm"] == "document" else "C3"
        ls = ["-", "--", ":"][seeds.index(r["seed"]) % 3]
        label = f"{'with' if r['arm'] == 'document' else 'without'} document, seed {r['seed']}"
        xs = [s for s, _, _ in r["curve"]]
        a1.plot(xs, [frac(k, n) for _, k, n in r["curve"]], marker="o", ls=ls, color=c,
                label=label)
        steps = sorted(r["gold"], key=int)
        a2.plot([int(s) for s in steps], [frac(r["gold"][s]["right"], r["gold"][s]["in_domain"])
                                          for s in steps], marker=".", ls=ls, color=c, label=label)
    _, k0, n0 = next(iter(results.values()))["curve"][0]
    a1.axhspan(*wilson(k0, n0), color="grey", alpha=0.2, label="base model, 95% CI")
    a1.set_xlabel("step")
    a1.set_ylabel(f"Reasoner greedy held-out accuracy ({n0} questions)")
    a1.set_title("Reasoner on held-out questions")
    a2.set_xlabel("step")
    a2.set_ylabel("Challenger gold answers right (vs exact oracle)")
    a2.set_title("Are the Challenger's answers grounded?")
    a2.set_ylim(0, 1.05)
    for a in (a1, a2):
        a.legend(fontsize=7)
    fig.suptitle("SPICE, documents stating numeric facts: with vs without the document "
                 "(cf. the paper's Fig. 4b)", fontsize=10)
    fig.tight_layout()
    fig.savefig(work / "spice.png", dpi=80)
    plt.close(fig)
    print(f"wrote {work / 'spice.png'}")


def skill(path: Path, n: int = 20, seed: int = 99) -> dict[int, float]:
    """Greedy accuracy per quantity count on fresh dev questions (not the test set), spice.py's
    Reasoner prompt: how much the base model can do before SPICE."""
    import torch
    import transformers
    import common
    import spice
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    rng, held, out = random.Random(seed), held_signatures(), {}
    for k in range(2, 6):
        ps = []
        while len(ps) < n:
            p = sample_problem(rng, [int(j == k) for j in range(2, 6)], (1, 1))
            if signature(p) not in held:
                ps.append(p)
        texts = [tok.apply_chat_template(spice.reasoner_prompt(question(p), "chat", templates()),
                                         tokenize=False, add_generation_prompt=True) for p in ps]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=80, do_sample=False)
        outs = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        out[k] = sum(common.extract_boxed(t) == str(sum(p[1])) for t, p in zip(outs, ps)) / n
    return out


def copy_skill(path: Path, n: int = 48, seed: int = 7) -> str:
    """The base Challenger, greedy, on n corpus documents (spice.py's free-form prompt, an answer
    type drawn per document): how many tasks parse, and how many parsed gold answers the exact
    oracle confirms. SPICE's Reasoner learns only from gold answers copied right."""
    import torch
    import transformers
    import spice
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    rng, docs = random.Random(seed), spice_corpus(2000)[:n]
    types = [rng.choice(spice.ANSWER_TYPES) for _ in docs]
    texts = [tok.apply_chat_template(spice.challenger_prompt(d, "free", t, "chat", templates()),
                                     tokenize=False, add_generation_prompt=True)
             for d, t in zip(docs, types)]
    outs = []
    for i in range(0, n, 16):
        enc = tok(texts[i:i + 16], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=160, do_sample=False)
        outs += tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    tasks = [spice.parse_task(o, "free", t)[0] for o, t in zip(outs, types)]
    tasks = [x for x in tasks if x is not None]
    checked = [x for x in tasks if oracle(x.question) is not None]
    right = sum(x.gold.strip().replace(",", "") == str(oracle(x.question)) for x in checked)
    return (f"{len(tasks)} of {n} tasks parse; {right} of the {len(checked)} the oracle can check "
            "have the right gold answer")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", choices=["model", "run"])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=0, help="0 = the kind's default")
    ap.add_argument("--lr", default="1e-4")
    ap.add_argument("--out", default=str(ROOT / "runs" / "lab"))
    base_flags(ap, DIRECT, "Reasoner documents")
    ap.add_argument("--quick", dest="kind", action="store_const", const="quick", default="full")
    args = ap.parse_args(argv)
    if args.experiment == "model":
        path = build_model(args.kind, steps=args.pretrain_steps, direct=args.direct)
        print(path)
        print("greedy accuracy per quantity count (dev):", skill(path))
        print("the base Challenger with the document:", copy_skill(path))
    else:
        experiment(args)


if __name__ == "__main__":
    main()
