"""The laptop laboratory, Absolute Zero: one small model proposes and solves deduction, abduction
and induction tasks on small Python functions, with the sandbox as the only judge.

    python tests/lab_absolute_zero.py model               # build (once, cached) the base model
    python tests/lab_absolute_zero.py run --seeds 0,1     # AZR, then the held-out eval, PNG, table
    python tests/lab_absolute_zero.py control             # the same, solver rewards permuted
    python tests/lab_absolute_zero.py frozen              # the same, --freeze-proposer
    python tests/lab_absolute_zero.py uncertainty         # the same, --proposer-reward uncertainty

The base model is a small Qwen3 (the lab's recipe, tests/lab.py) pretrained here, 2,000 steps in
~23 minutes on one core, on documents in absolute_zero.py's own formats: its solver prompts
followed by a short working and the answer (the output, an input, or the program) in the fenced
blocks its parsers read, or half of the time (--direct) the answer alone, as a base model often
answers without working (68% of documents: the evaluation's format), its wrapper and proposer
prompts followed by a program and an input, or inputs and a message (6%: ~700 tokens of fixed
text, for the formats), drills of the workings' one-step arithmetic (10%), and worked examples
outside the chats (16%); the workings compute step by step (`4 * 8 = 32, 32 - 1 = 31`), and
for induction read the constants off the shown pairs. The programs come from eight families of
one-line functions with small constants (`x * 3 + 2`, `a - b if a > b else b + 4`,
`[v * 3 for v in xs]`, `sum(xs) + 5`, ...), drawn family first; truth is what they return. A
fifth of each family's constant settings never occurs in pretraining: the held-out tasks use only
those programs (checked with common.Decontaminator). The experiment runs the real
absolute_zero.py with flags only and scores the base model and each run's final checkpoint on the
held-out tasks with absolute_zero.py's own solver prompts and grader (solver_prompt,
check_solutions, its sandboxed Executor): greedy accuracy per task type with 95% Wilson CIs, and
pass@k of base vs trained ("Towards Understanding Self-play for LLM Reasoning", Fig. 1), beside
the solve rate of newly proposed tasks per step from the run's metrics.jsonl (AZR Fig. 2).

`--quick` runs a reduced version (a smaller model, one step, --backend hf: no engine start-up)
that CI uses to check the pipeline end to end.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab import (CACHE, SEP, base_flags, base_folder, finished, leaks,  # noqa: E402 (the lab's)
                 pretrain, wilson, words)

TASKS = ("deduction", "abduction", "induction")
# (hidden, layers, intermediate, steps, batch, peak LR, vocab)
MODELS = {"full": (128, 4, 384, 2000, 4, 4e-3, 1024),
          "quick": (64, 2, 128, 20, 2, 4e-3, 512)}
SEQ = 1024  # tokens per packed row: a proposer prompt alone is ~600
CORPUS = "corpus.txt.gz"
N_INPUTS = 4  # --induction-inputs: 2 pairs shown, 2 held out
REFERENCES = 2  # --references: earlier puzzles in a proposer prompt
# document mix: solver and proposer chats per task type, arithmetic drills (ARITH), the rest
# worked examples (8-12 a document, the task types mixed). The chats' prompts are mostly fixed
# text (a proposer's ~700 tokens, a solver's ~150-550), so the solver chats, the evaluation's
# format, get most documents and the proposer chats (formats only) few: at 30% solver and 20%
# proposer chats the base model copied the input but never read the program's constants in a
# chat (1 of 48 dev tasks), though it read them in worked examples (and got 3 of 24 right)
MIX = {("solver", "deduction"): 0.28, ("solver", "abduction"): 0.28, ("solver", "induction"): 0.12,
       ("proposer", "deduction"): 0.02, ("proposer", "abduction"): 0.02,
       ("proposer", "induction"): 0.02}
ARITH = 0.1  # documents of the workings' one-step sums, products and quotients (a base model
# knows its tables: the workings alone left them mostly unlearnt)
# the share of solver chats with the answer alone (--direct): a base that always worked step by
# step left RL nothing to select (R-Zero's lab found the same); 900 steps read no program
DIRECT = 0.5


# ------------------------------------------------------------------------ the function domain
def _lin(op):
    def work_d(x, c, out):
        return f"{x} * {c[0]} = {x * c[0]}, {x * c[0]} {op} {c[1]} = {out}."

    def work_a(x, c, out):
        back = out - c[1] if op == "+" else out + c[1]
        return f"{out} {'-' if op == '+' else '+'} {c[1]} = {back}, {back} / {c[0]} = {x}."
    return work_d, work_a


def _each(op):
    def work_d(xs, c, out):
        return ", ".join(f"{v} {op} {c[0]} = {o}" for v, o in zip(xs, out)) + "."

    def work_a(xs, c, out):
        inv = "/" if op == "*" else "-"
        return ", ".join(f"{o} {inv} {c[0]} = {v}" for v, o in zip(xs, out)) + "."
    return work_d, work_a


def _sum_d(xs, c, out):
    return f"{' + '.join(map(str, xs))} = {sum(xs)}, {sum(xs)} + {c[0]} = {out}."


def _sum_a(xs, c, out):
    return f"{out} - {c[0]} = {sum(xs)}, numbers adding up to {sum(xs)}: {list(xs)}."


def _max_d(xs, c, out):
    return f"the largest is {max(xs)}, {max(xs)} * {c[0]} = {out}."


def _max_a(xs, c, out):
    return f"{out} / {c[0]} = {max(xs)}, a list whose largest is {max(xs)}: {list(xs)}."


def _cond_d(ab, c, out):
    a, b = ab
    return (f"{a} > {b}, so {a} - {b} = {out}." if a > b else
            f"{a} <= {b}, so {b} + {c[0]} = {out}.")


def _cond_a(ab, c, out):
    a, b = ab
    return (f"with a > b, a - b = {out}: a = {a}, b = {b}." if a > b else
            f"with a <= b, b = {out} - {c[0]} = {b}, a = {a}.")


def _scale2_d(ab, c, out):
    a, b = ab
    return f"{a} * {c[0]} = {a * c[0]}, {a * c[0]} + {b} = {out}."


def _scale2_a(ab, c, out):
    a, b = ab
    return f"b = {b}: {out} - {b} = {a * c[0]}, {a * c[0]} / {c[0]} = {a}."


# name: (signature, body with {0}, {1} constants, constant ranges, input kind, the deduction and
# abduction working, the message an induction proposer writes: what f does, never its constants)
FAMILIES = {
    "lin_add": ("x", "x * {0} + {1}", (range(2, 10), range(1, 10)), "int", *_lin("+"),
                "Multiply the number by a constant, then add a constant."),
    "lin_sub": ("x", "x * {0} - {1}", (range(2, 10), range(1, 10)), "int", *_lin("-"),
                "Multiply the number by a constant, then subtract a constant."),
    "scale2": ("a, b", "a * {0} + b", (range(2, 10),), "pair", _scale2_d, _scale2_a,
               "Scale the first number by a constant and add the second."),
    "cond": ("a, b", "a - b if a > b else b + {0}", (range(1, 10),), "pair", _cond_d, _cond_a,
             "If the first is larger, their difference; else the second plus a constant."),
    "each_mul": ("xs", "[v * {0} for v in xs]", (range(2, 10),), "list", *_each("*"),
                 "Multiply every element of the list by a constant."),
    "each_add": ("xs", "[v + {0} for v in xs]", (range(1, 10),), "list", *_each("+"),
                 "Add a constant to every element of the list."),
    "sum_add": ("xs", "sum(xs) + {0}", (range(1, 10),), "list", _sum_d, _sum_a,
                "The sum of the list plus a constant."),
    "max_mul": ("xs", "max(xs) * {0}", (range(2, 10),), "list", _max_d, _max_a,
                "The largest element times a constant."),
}


def program(family: str, consts) -> str:
    sig, body = FAMILIES[family][:2]
    return f"def f({sig}):\n    return {body.format(*consts)}"


def run_program(prog: str, args: tuple):
    """The truth of a program this file wrote (never a model's): it runs here."""
    scope: dict = {}
    exec(prog, scope)  # noqa: S102  (our own one-line programs)
    return scope["f"](*args)


def sample_args(rng: random.Random, kind: str) -> tuple:
    if kind == "int":
        return (rng.randint(0, 12),)
    if kind == "pair":
        return rng.randint(0, 9), rng.randint(0, 9)
    return ([rng.randint(0, 9) for _ in range(rng.randint(2, 3))],)


def args_text(args: tuple) -> str:
    return ", ".join(repr(a) for a in args)


def all_programs() -> list[tuple[str, tuple]]:
    out = []
    for fam, spec in FAMILIES.items():
        grids = [()]
        for r in spec[2]:
            grids = [g + (v,) for g in grids for v in r]
        out += [(fam, g) for g in grids]
    return out


def key(prog: str) -> tuple:
    """A program's words as common.Decontaminator reads them (operators dropped, so `x * 3 + 2`
    and `x * 3 - 2` are one key, and both are held out together)."""
    return words(prog)


def held_out_programs() -> set:
    """A fifth of each family's settings (at least two): their keys never occur in pretraining."""
    rng, keys = random.Random(2718), set()
    for fam in FAMILIES:
        ks = sorted({key(program(f, c)) for f, c in all_programs() if f == fam})
        keys |= set(rng.sample(ks, max(2, len(ks) // 5)))
    return keys


def task(rng: random.Random, fam: str, consts, kind: str) -> dict:
    """A task entry as absolute_zero.validate builds it (outputs as repr text)."""
    prog = program(fam, consts)
    spec = FAMILIES[fam]
    if kind == "induction":
        inputs = []
        while len(inputs) < N_INPUTS:  # distinct inputs, so the shown pairs say something
            a = args_text(sample_args(rng, spec[3]))
            if a not in inputs:
                inputs.append(a)
        outs = [repr(run_program(prog, ast.literal_eval(a + ","))) for a in inputs]
        return {"program": prog, "inputs": inputs, "outputs": outs, "message": spec[6],
                "step": 0, "family": fam}
    args = sample_args(rng, spec[3])
    return {"program": prog, "input": args_text(args), "output": repr(run_program(prog, args)),
            "step": 0, "family": fam, "args": args}


# -------------------------------------------------------------------- documents (absolute_zero.py)
def _cfg():
    import absolute_zero
    return absolute_zero.Config(induction_inputs=N_INPUTS, executor_timeout=2.0)


def _fence(kind: str, text: str) -> str:
    return f"```{kind}\n{text}\n```"


def solver_completion(t: str, e: dict) -> str:
    """After the wrapper's '<think>': a short working, then the answer block; with e["direct"],
    the answer block alone, as a base model often answers without working."""
    fam = FAMILIES[e["family"]]
    if t == "induction":
        shown = [ast.literal_eval(i + ",") for i in e["inputs"][:N_INPUTS // 2]]
        pairs = [(a, run_program(e["program"], a)) for a in shown]
        answer, work = _fence("python", e["program"]), _induce(e["family"], pairs)
    else:
        args, out = e["args"], run_program(e["program"], e["args"])
        a = args[0] if len(args) == 1 else args
        if t == "deduction":
            answer, work = _fence("output", e["output"]), fam[4](a, _consts(e), out)
        else:
            answer, work = _fence("input", e["input"]), fam[5](a, _consts(e), out)
    return f"{'' if e.get('direct') else ' ' + work} </think> <answer>{answer}</answer>"


def _induce(fam: str, pairs: list) -> str:
    """The constants read off the shown pairs by the family's inverse (the abduction working's
    steps): a working that only restated the pairs left induction unsolved. Short: the pairs are
    in the prompt, and the answer must fit the 96 new tokens the runs and the evaluation allow."""
    def first(ok):
        return next(((a, y) for a, y in pairs if ok(a)), None)
    if fam in ("lin_add", "lin_sub"):
        ((x1,), y1), ((x2,), y2) = sorted(pairs)
        d, e = y2 - y1, x2 - x1
        c0 = d // e
        last, c1 = ((f"{y1} - {x1 * c0}", y1 - x1 * c0) if fam == "lin_add"
                    else (f"{x1 * c0} - {y1}", x1 * c0 - y1))
        return f"{y2} - {y1} = {d}, {d} / {e} = {c0}, {last} = {c1}."
    if fam == "scale2":
        hit = first(lambda a: a[0] != 0)
        if hit:
            (a, b), y = hit
            return f"{y} - {b} = {y - b}, {y - b} / {a} = {(y - b) // a}."
    elif fam == "cond":
        hit = first(lambda a: a[0] <= a[1])
        if hit:
            (a, b), y = hit
            return f"{a} <= {b}, so {y} - {b} = {y - b}."
    elif fam in ("each_mul", "each_add"):
        hit = first(lambda a: any(a[0]) or fam == "each_add")
        if hit:
            (xs,), ys = hit
            v, o = next((v, o) for v, o in zip(xs, ys) if v or fam == "each_add")
            return f"{o} / {v} = {o // v}." if fam == "each_mul" else f"{o} - {v} = {o - v}."
    elif fam == "sum_add":
        (xs,), y = pairs[0]
        return f"{' + '.join(map(str, xs))} = {sum(xs)}, {y} - {sum(xs)} = {y - sum(xs)}."
    elif fam == "max_mul":
        hit = first(lambda a: max(a[0]) != 0)
        if hit:
            (xs,), y = hit
            return f"the largest is {max(xs)}, {y} / {max(xs)} = {y // max(xs)}."
    return "The pairs do not show the constant."


def arith(rng: random.Random) -> str:
    """A drill of the one-step facts the workings use: x * c and its inverse, sums and
    differences of a result and a constant (negative ones too: lin_sub's outputs), digit sums."""
    facts = []
    for _ in range(rng.randint(20, 30)):
        op = rng.choices("*/+-s", (3, 2, 2.5, 2.5, 1))[0]
        a, b, p = rng.randint(0, 12), rng.randint(2, 9), rng.randint(-9, 117)
        if op == "*":
            facts.append(f"{a} * {b} = {a * b}")
        elif op == "/":
            facts.append(f"{a * b} / {b} = {a}")
        elif op == "+":
            facts.append(f"{p} + {a % 10} = {p + a % 10}")
        elif op == "-":
            facts.append(f"{p} - {a} = {p - a}")
        else:
            xs = [rng.randint(0, 9) for _ in range(rng.randint(2, 3))]
            facts.append(f"{' + '.join(map(str, xs))} = {sum(xs)}")
    return "\n".join(facts)


def pick(rng: random.Random, pool: list) -> tuple:
    """A family uniformly, then one of its settings: drawn from the pool directly, x * a + b's 72
    settings per sign made the two lin families 75% of the documents (the test is 25%)."""
    fam = rng.choice(sorted({f for f, _ in pool}))
    return rng.choice([p for p in pool if p[0] == fam])


def _consts(e: dict) -> tuple:
    return e["consts"]


def proposer_completion(t: str, e: dict) -> str:
    if t == "induction":
        ins = "\n".join(_fence("input", i) for i in e["inputs"])
        return (f" Inputs that show what it does. </think> <answer>{ins}\n"
                f"{_fence('message', e['message'])}</answer>")
    return (f" A new puzzle. </think> <answer>{_fence('python', e['program'])}\n"
            f"{_fence('input', e['input'])}</answer>")


def worked(rng: random.Random, t: str, pool: list) -> str:
    """One worked example outside the chat format: the task's blocks, the working, the answer."""
    fam, consts = pick(rng, pool)
    e = {**task(rng, fam, consts, t), "consts": consts}
    work = solver_completion(t, e).split(" </think>")[0].strip()
    prog = _fence("python", e["program"])
    if t == "deduction":
        return f"{prog}\n{_fence('input', e['input'])}\n{work}\n{_fence('output', e['output'])}"
    if t == "abduction":
        return f"{prog}\n{_fence('output', e['output'])}\n{work}\n{_fence('input', e['input'])}"
    pairs = "\n".join(_fence(f"input_{k + 1}", i) + "\n" + _fence(f"output_{k + 1}", o)
                      for k, (i, o) in enumerate(zip(e["inputs"][:N_INPUTS // 2], e["outputs"])))
    return f"{pairs}\nMessage: {e['message']}\n{work}\n{prog}"


def document(rng: random.Random, role: str, t: str, pool: list, direct: float = 0.0) -> str:
    import absolute_zero
    cfg = _cfg()
    if role == "arith":
        return arith(rng)
    if role == "worked":
        return "\n\n".join(worked(rng, rng.choice(TASKS), pool)
                            for _ in range(rng.randint(8, 12)))
    fam, consts = pick(rng, pool)
    e = task(rng, fam, consts, t)
    e["consts"] = consts
    if role == "solver":
        e["direct"] = direct > 0 and rng.random() < direct
        return absolute_zero.solver_prompt(t, e, cfg) + solver_completion(t, e)
    if t == "induction":
        prompt = absolute_zero.proposer_prompt("induction", [], cfg, program=e["program"])
    else:
        refs = [task(rng, *pick(rng, pool), "deduction")
                for _ in range(rng.randint(0, REFERENCES))]
        prompt = absolute_zero.proposer_prompt(t, refs, cfg)
    return prompt + proposer_completion(t, e)


def test_tasks(kind: str) -> dict[str, list[dict]]:
    """The held-out tasks: per task type 60 ('quick': 8), the families in turn, programs only
    from the held-out settings, distinct per type."""
    rng, per, held = random.Random(4242), 60 if kind == "full" else 8, held_out_programs()
    progs = [(f, c) for f, c in all_programs() if key(program(f, c)) in held]
    out = {}
    for t in TASKS:
        rows, seen = [], set()
        while len(rows) < per:
            fam = list(FAMILIES)[len(rows) % len(FAMILIES)]
            fam, consts = rng.choice([p for p in progs if p[0] == fam])
            e = task(rng, fam, consts, t)
            sig = (e["program"], e.get("input"), tuple(e.get("inputs", ())))
            if sig not in seen:
                seen.add(sig)
                e.pop("args", None)
                rows.append(e)
        out[t] = rows
    return out


# ---------------------------------------------------------------------------------- the base model
def build_model(kind: str = "full", seed: int = 0, steps: int = 0, direct: float = DIRECT) -> Path:
    """Pretrain the base model (cached under the lab's CACHE by its settings) on MIX's documents,
    none with a held-out program. `steps`: pretraining steps (0 = MODELS'); `direct`: the share
    of solver chats with the answer alone, no working."""
    import absolute_zero
    shape = MODELS[kind][:3] + (steps or MODELS[kind][3],) + MODELS[kind][4:]
    hidden, layers, inter, steps, batch, lr, vocab = shape
    probe = [document(random.Random(1), r, t, all_programs()[:3])
             for r, t in (("proposer", "deduction"), ("solver", "induction"), ("arith", ""))]
    k = hashlib.sha256(repr((shape, SEQ, seed, MIX, ARITH, N_INPUTS, sorted(FAMILIES),
                             probe, absolute_zero.PROMPTS, 3)
                            + ((direct,) if direct else ())).encode())
    out = CACHE / f"lab-azr-{kind}-{k.hexdigest()[:10]}"
    if (out / ".complete").is_file():
        return out
    import torch
    torch.set_num_threads(1)
    rng, held = random.Random(seed), held_out_programs()
    pool = [(f, c) for f, c in all_programs() if key(program(f, c)) not in held]
    kinds = list(MIX) + [("arith", ""), ("worked", "")]
    weights = list(MIX.values()) + [ARITH, 1 - sum(MIX.values()) - ARITH]
    corpus = []

    def doc():
        corpus.append(document(rng, *rng.choices(kinds, weights)[0], pool, direct))
        return corpus[-1]

    return pretrain(doc, corpus, out, (hidden, layers, inter, steps, batch, lr), seed,
                    vocab=vocab, seq=SEQ, sep=SEP)


def decontamination(model: Path, tests: dict) -> str:
    """No held-out program occurs in the pretraining documents (lab.leaks: exactly, or whole)."""
    progs = sorted({e["program"] for rows in tests.values() for e in rows})
    found, n_docs = leaks(model, progs)
    if found:
        raise RuntimeError(f"held-out programs leak into the pretraining data: {found}")
    n_tasks = sum(len(v) for v in tests.values())
    return (f"decontamination: 0 of {len(progs)} held-out programs ({n_tasks} tasks) in the "
            f"{n_docs} pretraining documents (exact match and whole-program "
            "common.Decontaminator)")


# --------------------------------------------------------------- evaluation on the held-out tasks
def evaluate(model, tests_file: Path, out: Path, n: int, max_tokens: int, seed: int,
             backend: str = "vllm") -> None:
    """Greedy and n samples at T = 1 per held-out task, with absolute_zero.py's solver prompts,
    graded by its check_solutions in its sandboxed Executor; written to `out` as JSON."""
    import absolute_zero
    import common
    tests = json.loads(tests_file.read_text())
    cfg = absolute_zero.Config(model=str(model), seed=seed, induction_inputs=N_INPUTS,
                               max_model_len=1536, executor_timeout=2.0, sandbox_workers=2,
                               max_response_tokens=max_tokens, backend=backend)
    tok = common.load_tokenizer(str(model))
    sampler = common.make_sampler(str(model), tok, cfg)
    executor = absolute_zero.Executor(cfg)
    res = {}
    try:
        for t in TASKS:
            prompts = [absolute_zero.solver_prompt(t, e, cfg) for e in tests[t]]
            greedy = sampler.generate(prompts, n=1, temperature=0.0, max_tokens=max_tokens)
            sampled = sampler.generate(prompts, n=n, temperature=1.0, max_tokens=max_tokens,
                                       seed=seed)
            g = absolute_zero.check_solutions(executor, t, tests[t], [c[0].text for c in greedy])
            s = absolute_zero.check_solutions(executor, t, [e for e in tests[t] for _ in range(n)],
                                              [c.text for grp in sampled for c in grp])
            res[t] = {"greedy": [ok for _, ok in g], "formatted": [f for f, _ in g],
                      "correct_samples": [sum(ok for _, ok in s[i * n:(i + 1) * n])
                                          for i in range(len(prompts))], "n": n,
                      "example": greedy[0][0].text}
    finally:
        executor.close()
        sampler.close()
    res["model"] = str(model)
    out.write_text(json.dumps(res, indent=1) + "\n")


# ------------------------------------------------------------------------------------ the runs
# absolute_zero.py's flags per model kind (Config's names); --lr is the lab's own (see main).
# B = 4: the update (6B trajectories, proposer prompts ~700 tokens) is most of a step, ~25 s here.
# The update is the one LAB.md's figures were measured with: one AdamW step on the whole batch,
# averaged per sequence (absolute_zero.py now defaults to the official 3 steps, token-mean).
FLAGS = {"full": dict(steps=12, batch_size=4, references=REFERENCES, seed_factor=2,
                      seed_max_rounds=4, induction_inputs=N_INPUTS, learnability_samples=4,
                      max_prompt_tokens=1000, max_response_tokens=96, max_model_len=1200,
                      sandbox_workers=2, executor_timeout=2.0, mini_batch=24,
                      aggregation="seq-mean-token-mean"),
         "quick": dict(steps=1, batch_size=2, references=REFERENCES, seed_factor=1,
                       seed_max_rounds=1, induction_inputs=N_INPUTS, learnability_samples=2,
                       max_prompt_tokens=1000, max_response_tokens=48, max_model_len=1200,
                       sandbox_workers=2, executor_timeout=2.0, backend="hf", mini_batch=12,
                       aggregation="seq-mean-token-mean")}
# (samples per task for pass@k, new tokens, sampler): vLLM as the run samples; the quick one's
# HF sampler spares CI an engine start-up per model
EVAL = {"full": (8, 96, "vllm"), "quick": (2, 48, "hf")}


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "TOKENIZERS_PARALLELISM": "false"}


def _evaluate(model, work: Path, out: Path, kind: str, seed: int) -> None:
    """evaluate() in its own process (a vLLM engine per model)."""
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "_eval", str(model),
                    str(work / "test.json"), str(out), *map(str, EVAL[kind]), str(seed)],
                   check=True, cwd=ROOT, env=_env())


def absolute_zero_shuffled(argv) -> None:
    """The control: absolute_zero.py unchanged but for the solver's rewards, permuted across each
    task type's batch before TRR++ (the same reward rate and update sizes, no information in
    them): what the updates do to the held-out accuracy when the reward says nothing."""
    import absolute_zero
    build, rng = absolute_zero.build_trajectories, random.Random(0)

    def shuffled(props, solved):
        for recs in solved.values():
            rewards = [r["reward"] for r in recs]
            rng.shuffle(rewards)
            for r, x in zip(recs, rewards):
                r["reward"] = x
        return build(props, solved)
    absolute_zero.build_trajectories = shuffled
    absolute_zero.main(argv)


# The runs beside the standard one: their folder under the standard run's and their own flags.
# `frozen` and `uncertainty` are the analyses' RQ3 and RQ5 (tests/lab_analyses.py).
VARIANTS = {"control": ("shuffled_rewards", []),
            "frozen": ("frozen_proposer", ["--freeze-proposer"]),
            "uncertainty": ("uncertainty_reward", ["--proposer-reward", "uncertainty"])}


def lab_folder(args) -> Path:
    """The standard run's folder for these base flags (the variants' folders are inside it)."""
    work = Path(args.out) / ("absolute_zero_quick" if args.kind == "quick" else "absolute_zero")
    return base_folder(work, args, DIRECT)


def experiment(args) -> None:
    t0 = time.time()
    model = build_model(args.kind, steps=args.pretrain_steps, direct=args.direct)
    work = lab_folder(args)
    variant_flags = []
    if args.experiment in VARIANTS:
        subfolder, variant_flags = VARIANTS[args.experiment]
        work = work / subfolder
    work.mkdir(parents=True, exist_ok=True)
    tests = test_tasks(args.kind)
    (work / "test.json").write_text(json.dumps(tests, indent=1) + "\n")
    print(decontamination(model, tests), flush=True)
    flags = {**FLAGS[args.kind], **({"steps": args.steps} if args.steps else {})}
    walls = {}
    base_file = work / "eval_base.json"
    if base_file.exists() and json.loads(base_file.read_text()).get("model") != str(model):
        base_file.unlink()  # another base model's (the cache key changed): evaluate again
    parent_file = work.parent / "eval_base.json"  # a variant's base: the standard run's
    if args.experiment in VARIANTS and not base_file.exists() and parent_file.exists():
        if json.loads(parent_file.read_text()).get("model") == str(model):
            shutil.copyfile(parent_file, base_file)
    if not base_file.exists():
        t1 = time.time()
        _evaluate(model, work, work / "eval_base.json", args.kind, 0)
        walls["base eval"] = time.time() - t1
    results = {"base": json.loads((work / "eval_base.json").read_text())}
    metrics = {}
    for seed in map(int, args.seeds.split(",")):
        run = work / f"seed{seed}"
        entry = ([str(Path(__file__).resolve()), "_shuffled"] if args.experiment == "control"
                 else [str(ROOT / "absolute_zero.py")])
        cmd = [sys.executable, *entry, "--model", str(model),
               "--seed", str(seed), "--output-dir", str(run), "--lr", args.lr,
               "--eval-benchmarks", "", "--no-eval-code", "--save-every", "0",
               "--keep-checkpoints", "1"]
        cmd += [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))]
        cmd += variant_flags
        ev = work / f"eval_seed{seed}.json"
        if not finished(run, model):  # a finished run is kept; rerun by deleting it
            print("$", " ".join(["python"] + cmd[1:]), flush=True)
            shutil.rmtree(run, ignore_errors=True)
            ev.unlink(missing_ok=True)  # the old run's evaluation
            t1 = time.time()
            subprocess.run(cmd, check=True, cwd=ROOT, env=_env())
            walls[f"seed {seed} run"] = time.time() - t1
        if not ev.exists():
            t1 = time.time()
            ckpt = run / "checkpoints" / f"step_{flags['steps']}"
            _evaluate(ckpt, work, ev, args.kind, seed)
            walls[f"seed {seed} eval"] = time.time() - t1
        results[f"seed{seed}"] = json.loads(ev.read_text())
        metrics[seed] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()
                         if x.strip()]
    summary = report(results, metrics, work)
    summary["walls"] = walls
    (work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for k, v in walls.items():
        print(f"  wall time, {k}: {v:.0f} s")
    print(f"total wall time {time.time() - t0:.0f} s")


def _pass_curve(r: dict, ks) -> list[float]:
    import common
    n = r["n"]
    return [sum(common.pass_at_k(n, c, k) for c in r["correct_samples"]) / len(r["correct_samples"])
            for k in ks]


def report(results: dict, metrics: dict, work: Path) -> dict:
    """The table (greedy accuracy per task type, 95% Wilson CI, vs the base; pass@k; new-task
    solve rates per step) and the PNG, one panel each."""
    base = results["base"]
    n = base["deduction"]["n"]
    ks = [k for k in (1, 2, 4, 8) if k <= n]
    summary: dict = {"accuracy": {}, "pass@k": {}, "new_task_solve_rate": {}}
    print("\nAbsolute Zero on small Python functions: held-out greedy accuracy per task type "
          "(95% Wilson CI)")
    print(f"  {'model':8s} " + " ".join(f"{t:>26s}" for t in TASKS) + f" {'all':>26s}")
    for name, r in results.items():
        cells, row = [], {}
        tot_k = tot_n = 0
        for t in TASKS + ("all",):
            if t == "all":
                k, m = tot_k, tot_n
            else:
                k, m = sum(r[t]["greedy"]), len(r[t]["greedy"])
                tot_k, tot_n = tot_k + k, tot_n + m
            lo, hi = (max(0.0, x) for x in wilson(k, m))
            row[t] = (k, m, lo, hi)
            beats = ""
            if name != "base":
                bk, bm = (sum(sum(base[x]["greedy"]) for x in TASKS),
                          sum(len(base[x]["greedy"]) for x in TASKS)) if t == "all" else \
                    (sum(base[t]["greedy"]), len(base[t]["greedy"]))
                beats = "+" if lo > wilson(bk, bm)[1] else " "
            cells.append(f"{k / m:.3f} [{lo:.3f}, {hi:.3f}]{beats:1s}")
        summary["accuracy"][name] = row
        print(f"  {name:8s} " + " ".join(f"{c:>26s}" for c in cells))
    print("  (+: the lower bound is above the base model's upper bound)")
    print(f"\n  pass@k, T = 1, {n} samples per task (k = {', '.join(map(str, ks))})")
    for name, r in results.items():
        summary["pass@k"][name] = {t: _pass_curve(r[t], ks) for t in TASKS}
        print(f"  {name:8s} " + "  ".join(
            f"{t}: " + " ".join(f"{v:.2f}" for v in summary["pass@k"][name][t]) for t in TASKS))
    print("\n  solve rate of newly proposed valid tasks per step (metrics.jsonl "
          "<task>/new_task_solve_rate), valid rate in brackets")
    for seed, ms in metrics.items():
        rows = [m for m in ms if m.get("step", 0) >= 1 and "deduction/valid_rate" in m]
        summary["new_task_solve_rate"][seed] = {
            t: [(m["step"], m[f"{t}/new_task_solve_rate"], m[f"{t}/valid_rate"]) for m in rows]
            for t in TASKS}
        for t in TASKS:
            print(f"  seed {seed} {t:10s} " + " ".join(
                f"{s:.2f}[{v:.2f}]" for _, s, v in summary["new_task_solve_rate"][seed][t]))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(14, 4))
    names = list(results)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        row = summary["accuracy"][name]
        xs = [j + i * width for j in range(len(TASKS) + 1)]
        acc = [row[t][0] / row[t][1] for t in TASKS + ("all",)]
        err = [[a - row[t][2] for a, t in zip(acc, TASKS + ("all",))],
               [row[t][3] - a for a, t in zip(acc, TASKS + ("all",))]]
        a1.bar(xs, acc, width, yerr=err, capsize=3, label=name, color=f"C{i}")
    a1.set_xticks([j + 0.4 - width / 2 for j in range(len(TASKS) + 1)], list(TASKS) + ["all"])
    a1.set_ylabel("greedy held-out accuracy (95% Wilson CI)")
    a1.set_title("Solver per task type, base vs trained")
    a1.legend(fontsize=8)
    for i, (seed, per) in enumerate(summary["new_task_solve_rate"].items()):
        for j, t in enumerate(TASKS):
            pts = per[t]
            a2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{j}",
                    ls=["-", "--", ":"][i % 3], label=f"{t}, seed {seed}")
    a2.set_xlabel("step")
    a2.set_ylabel("solve rate of new valid tasks")
    a2.set_title("Newly proposed tasks (cf. AZR Fig. 2)")
    a2.legend(fontsize=7)
    for i, name in enumerate(names):
        for j, t in enumerate(TASKS):
            a3.plot(ks, summary["pass@k"][name][t], marker="o", color=f"C{j}",
                    ls="-" if name == "base" else ["--", ":", "-."][(i - 1) % 3],
                    label=f"{t}, {name}")
    a3.set_xscale("log", base=2)
    a3.set_xlabel("k")
    a3.set_ylabel("pass@k on held-out tasks")
    a3.set_title("pass@k, base vs trained (cf. [2] Fig. 1)")
    a3.legend(fontsize=6, ncol=2)
    fig.suptitle("Absolute Zero on small Python functions, held-out programs ([2]: Towards "
                 "Understanding Self-play for LLM Reasoning)", fontsize=10)
    fig.tight_layout()
    fig.savefig(work / "absolute_zero.png", dpi=70)
    plt.close(fig)
    print(f"wrote {work / 'absolute_zero.png'}")
    return summary


def skill(path: Path, n: int = 16) -> dict:
    """Greedy accuracy per task type on fresh dev tasks from the pretraining programs (never the
    held-out ones), absolute_zero.py's prompts and grader: what the base model can do."""
    import tempfile
    rng, held = random.Random(99), held_out_programs()
    pool = [(f, c) for f, c in all_programs() if key(program(f, c)) not in held]
    dev = {}
    for t in TASKS:
        dev[t] = []
        for _ in range(n):
            e = task(rng, *rng.choice(pool), t)
            e.pop("args", None)
            dev[t].append(e)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "test.json").write_text(json.dumps(dev))
        evaluate(str(path), Path(d) / "test.json", Path(d) / "out.json", 1, 96, 0)  # vLLM
        res = json.loads((Path(d) / "out.json").read_text())
    return {t: sum(res[t]["greedy"]) / n for t in TASKS}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_eval"]:  # model, tests, out, samples, new tokens, sampler, seed
        m, tests, out, n, tokens, backend, seed = argv[1:8]
        return evaluate(m, Path(tests), Path(out), int(n), int(tokens), int(seed), backend)
    if argv[:1] == ["_shuffled"]:
        return absolute_zero_shuffled(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", choices=["model", "run", *VARIANTS])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=0, help="0 = the kind's default")
    # Config's 1e-6 is a 7B model's; a 1M-parameter model moves ~nothing at it in a dozen steps
    ap.add_argument("--lr", default="1e-4")
    ap.add_argument("--out", default=str(ROOT / "runs" / "lab"))
    base_flags(ap, DIRECT, "solver chats")
    ap.add_argument("--quick", dest="kind", action="store_const", const="quick", default="full")
    args = ap.parse_args(argv)
    if args.experiment == "model":
        path = build_model(args.kind, steps=args.pretrain_steps, direct=args.direct)
        print(path)
        print("greedy accuracy per task type (dev):", skill(path))
    else:
        experiment(args)


if __name__ == "__main__":
    main()
