"""SPICE: Self-Play In Corpus Environments (Liu et al., arXiv:2510.24684). One model, two roles:
the Challenger turns a document into a question with its gold answer (MCQ or free-form); the
Reasoner answers, seeing only the question.

One iteration (Alg. 1, §3.1), one function per step:
  1. sample_documents     B documents, each cut to <= 5,992 tokens, drawn uniformly from the corpus
  2. select_task_types    the Fig. 9 call (untrained): MCQ, or free-form and its answer type
  3. challenger_generate  attempts (q, a*) ~ pi(.|d, C) until one is valid or N were made; keep G
  4. reasoner_solve       K answers ~ pi(.|q, R) per valid task, without the document
  5. challenger_rewards   Eq. 1 on the K answers, r_C = exp(-(p(1-p) - 1/4)^2 / 2 tau); invalid: rho
  6. reasoner_group       one random valid task per document; its K answers, r_R = 1[a = a*]
  7. build_trajectories   A = r - mean(group) per role and document, no std (Eq. 3)
  8. drgrpo_update        Dr. GRPO (Eqs. 3-4): one optimizer step per 128 trajectories, then re-sync
Run: python spice.py --model Qwen/Qwen3-4B-Base (--resume RUN_DIR); smoke: --model tiny (CPU).
Evaluate a model only (Table 1's protocol, no training): --eval-only --model MODEL_OR_CHECKPOINT.

Choices where the paper is inconsistent or silent, and where we differ from it:
- One Reasoner task per document (§3.1), not one per iteration (Alg. 1); T_R reuses the K answers
  behind r_C (§2.5), not new ones (Alg. 1 l. 16). B = 128 documents (§3.1).
- Answer types Integer / Expression / String (the text), not Fig. 2's.
- r_C uses the population variance p(1 - p); torch.var's unbiased default moves the peak off 50%.
- Both roles generate <= 4,096 tokens (Dr. GRPO's L_max); truncated: r_R = 0, invalid task.
- An open stand-in corpus; documents and questions sharing a 13-gram with an eval set are dropped.
- Oat's defaults: clip 0.2, one epoch, grad clip 1, betas (0.9, 0.95), truncated IS at 2.
- Prompts in our words; zero-advantage groups stay in the batch (*/zero_adv_group_frac).
- The Fig. 9 type-selection call is greedy (ours), where both roles otherwise sample at T 1.0.
- Validity is stricter than §4's (a task failing it gets rho): an Integer answer is digits only
  ("42 apples" fails), a String <= 3 words, the MCQ key a letter ("D) 4" fails), options distinct.
- A String answer is compared on its letters and digits, lower-cased: "C++" matches "C".
- LaTeX in the Challenger's JSON is read as written. Math-Verify (Oat's 1 s timeout) also judges
  the evaluation, where the paper used GPT-4o; AIME samples at T 0.6 and top-p 0.95 (p unstated).
"""
from __future__ import annotations

import contextlib
import functools
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import common

TABLE1 = ("amc23,minerva,math500,gsm8k,olympiadbench,aime24@32,aime25@32,"
          "supergpqa,gpqa_diamond,mmlu_pro,bbeh")
# open stand-ins for Nemotron-CC-Math + NaturalReasoning (App. B): math web text, educational text
DEFAULT_CORPUS = "open-web-math/open-web-math,HuggingFaceFW/fineweb-edu:sample-10BT"


@dataclass
class Config(common.RunConfig):
    """SPICE: one model learns to reason as Challenger and Reasoner on the documents of a corpus."""
    # the flags of this Config for which 0 means "all" (RunConfig declares the shared ones)
    ZERO_MEANS_OFF: typing.ClassVar[tuple] = ("corpus_docs",)
    # the intervals of this Config's number flags (RunConfig declares the shared ones)
    RANGES: typing.ClassVar[dict] = {
        "reasoner_k": "[1, inf)", "tau": "(0, inf)", "challenger_gpu_memory_utilization": "(0, 1]",
        "temperature": "(0, inf)", "clip": "[0, 1)", "tis_cap": "[0, inf)"}
    model: str = "Qwen/Qwen3-4B-Base"  # the model of both roles (§3.1; also Qwen3-8B, OctoThinker)
    corpus: str = DEFAULT_CORPUS  # JSONL files or hub ids (id:config@split), equal shares (App. B)
    corpus_field: str = "text"  # the field of a corpus row that holds its document (the hub sets')
    corpus_docs: int = 20000  # documents read in all; 0 = all of a local file (§3.1)
    chunk_tokens: int = 5992  # tokens kept of each document, the rest cut off (App. B)
    split_documents: bool = False  # split long documents, each piece drawn alone (ours)
    steps: int = 640  # iterations T to run (§3.1, App. B)
    docs_per_step: int = 128  # B, documents per iteration (§3.1)
    group_size: int = 8  # G, Challenger trajectories kept per document (§3.1, Table 5)
    reasoner_k: int = 8  # K, Reasoner answers per valid task (= G, §3.1)
    max_attempts: int = 1024  # N, Challenger attempts per document before giving up (§3.1)
    invalid_penalty: float = -0.1  # rho, the Challenger reward of an invalid task (§3.1)
    tau: float = 0.01  # width of the Gaussian around the variance 0.25 (Eq. 1, App. D)
    challenger_reward: str = "variance"  # Challenger reward: variance (Eq. 1) or a Table 4 one
    task_types: str = "both"  # task kinds written: both (§3.1) | mcq | free (§4 ablation)
    type_selection: str = "prompt"  # kind chosen by prompt (Fig. 9, untrained) or random (a coin)
    no_document: bool = False  # the Challenger writes without a document (ablation, Fig. 4b)
    challenger_model: str = ""  # a frozen model writes every task (Table 1's Strong Challenger)
    challenger_gpu_memory_utilization: float = 0.2  # its own engine's GPU share, if any (ours)
    eval_benchmarks: str = TABLE1  # names or JSONL files; name@N scores mean@N (Table 1, App. A)
    eval_max_tokens: int = 4096  # tokens per evaluation answer (training's limit; App. A: none)
    eval_base: bool = False  # also evaluate the model before step 1 (Table 1's "Base Model" row)
    decontaminate: bool = True  # drop documents, questions sharing a 13-gram with eval sets (ours)
    temperature: float = 1.0  # sampling temperature of both roles (§3.1)
    max_tokens: int = 4096  # new tokens per reply and L_max (unstated; Oat recipes 3,000-4,096)
    verify_timeout: float = 1.0  # s per Math-Verify check, train and eval (oat/oracles/math.py)
    type_select_max_tokens: int = 512  # new tokens of the type-selection call (ours)
    prompt_format: str = "auto"  # the wrapper: auto | chat (Qwen3) | plain (OctoThinker) (Fig. 8)
    lr: float = 1e-6  # learning rate, constant (App. B)
    clip: float = 0.2  # PPO clip epsilon, active from the 2nd mini-batch on (oat/args.py)
    mini_batch: int = 128  # trajectories per optimizer step (App. B; oat/args.py train_batch_size)
    tis_cap: float = 2.0  # truncated IS cap on exp(l_old - l_vllm), 0 = off (oat/args.py tis_c)
    adam_beta2: float = 0.95  # AdamW beta_2 (oat/args.py adam_beta_2)
    max_model_len: int = 12288  # tokens per sequence: a 5,992-token document, prompt, 4,096 new


CHOICES = {"challenger_reward": ("variance", "learnability", "uncertainty", "threshold"),
           "task_types": ("both", "mcq", "free"), "type_selection": ("prompt", "random"),
           "prompt_format": ("auto", "chat", "plain")}
ANSWER_TYPES = ("Integer", "Expression", "String")
# --model tiny: a one-minute smoke run on tests/data (flags override); ours fill 2,050 tiny tokens
TINY = dict(corpus=f"{common.TINY_DATA}/spice_corpus.jsonl",
            eval_benchmarks=f"{common.TINY_DATA}/spice_eval.jsonl", steps=2, docs_per_step=1,
            group_size=2, reasoner_k=2, max_attempts=2, max_tokens=24, max_model_len=2048,
            type_select_max_tokens=16, eval_max_tokens=8,
            prompts=f"{common.TINY_DATA}/spice_short_prompts.toml")


# Prompts: Figs. 8-10 in our words, str.format templates (braces doubled). train() loads them once,
# with those of --prompts FILE in their place, and passes them to every step that writes a prompt.
_JSON_RULES = ("\nFirst think your design through; this thinking is private. Then write one valid "
               "JSON object and nothing after it: no markdown, no code fences; start with {{ and "
               "end with }}. In its strings write every LaTeX backslash twice "
               "(\\\\frac{{1}}{{2}}), as JSON requires. Its fields, in order: ")
PROMPTS = {
    # Fig. 8 wrappers: ChatML with a generic system message (Qwen3), or plain dialogue (OctoThinker)
    "system": "You are a helpful assistant.",
    "plain": ("This is a conversation between a User and an Assistant. The User asks a question "
              "and the Assistant solves it: it first thinks the reasoning through in its mind, "
              "then gives the User the answer.\n\nUser: {content}\n\nAssistant:"),
    "document_block": "=== DOCUMENT START ===\n{document}\n=== DOCUMENT END ===",
    "no_document_block": ("(No document is given. Draw on your own knowledge of mathematics and "
                          "science and invent the material yourself.)"),
    # Fig. 9: task type selection (not trained)
    "type_selection": """\
Which CHALLENGING exam question suits the document below best: multiple choice (MCQ) or free-form?
{document_block}
- MCQ needs intricate relationships, multi-step reasoning, several concepts to combine, and room \
for three wrong options that are plausible but false.
- Free-form needs one clear answer: a calculation (Integer), a formula to derive (Expression), or \
a concept in exact terminology (String).
Choose exactly ONE kind: one "suitable" is true; best_answer_type only for free-form, else null. \
Reply with one valid JSON object only: no markdown, no backticks.
{{"suitable_for_mcq": true or false, "suitable_for_free_form": true or false, "best_answer_type": \
"Integer" or "Expression" or "String" or null, "reason": "a few plain words: under 100 characters, \
no LaTeX, no special characters"}}""",
    # Fig. 10, left: the multiple-choice generator
    "mcq": """\
Turn the document below into one CHALLENGING multiple-choice exam question that can only be \
answered by connecting several of its parts over several reasoning steps.
{document_block}
Step 1. Find material that needs synthesis: relationships across parts, multi-step calculations \
or procedures, interacting principles, combined statements, comparisons, trade-offs, conditions, \
systems where one change moves several parameters; not stated facts, definitions, lone numbers.
Step 2. Plan the hardening ("hardening_process"): the easy version you avoid, the complexity \
you add, the concepts to connect, the shortcuts you block.
Step 3. Test relationships, not recall; you may compare scenarios or ask "what if". The solver \
never sees the document: never write "according to the text", "in the document", "as mentioned" \
or the like; give all context, define terms.
Step 4. Aim for HARD or EXTRA HARD: hard combines four or more concepts in multi-step problem \
solving; extra hard analyses a complex system, a counter-intuitive application or an edge case. \
No single look-up, sentence or keyword match may answer it.
Step 5. Write the reasoning path ("knowledge_and_reasoning_steps"): at least three distinct \
pieces of information from different parts, their links, and why a simple lookup fails.
Step 6. Write options A) to D). Balanced length: within about 20% of each other. Consistent units \
and formatting. Neutral tone: no "always" or "never" unless needed. Plausible distractors: slips \
in the multi-step work, stopping halfway, confusing related concepts, a key factor left out.
Step 7. Solve it as a student with the options in view ("self_test_solution"), by the quickest \
route. If two options can be ruled out without real understanding, or the options give the \
answer away or follow a pattern, redesign them. Count the reasoning steps: if fewer than 3, reject \
the question and write a harder one; if it takes less than 30 seconds, make it harder. Revise it \
if it fails Step 3, 4 or 6, or your solve took less than a minute.
""" + _JSON_RULES + """"identified_answer": the conclusion drawn by combining parts of the \
document; "answer_quote": quotes of the pieces it needs; "hardening_process"; "exam_question": \
the self-contained question; "correct_answer": the answer with its reasoning from the document; \
"multiple_choice_question": one string, the question then its options A) to D); \
"multiple_choice_correct": A, B, C or D; "self_test_solution"; "knowledge_and_reasoning_steps"; \
"question_difficulty": "Hard" or "Extra Hard", "Easy" only if the document offers nothing more. \
If the document is not rich enough, both questions, the answer and the letter are "".""",
    # Fig. 10, right: the free-form generator
    "free_form": """\
Turn the document below into one CHALLENGING free-form exam question whose answer is of type \
{answer_type} and that needs reasoning over several steps and understanding, not extraction.
{document_block}
Step 1. Find material for a {answer_type} answer that needs synthesis. Integer: calculations with \
variables from different parts, chained computations, counting, rates or percentages, \
optimisation, aggregate statistics. Expression: equations, patterns that generalise into a \
formula, systems of constraints, derivatives, recursions. String, at most three words: a term, \
name, method, unit or symbol ("Newton", "TCP/IP", "O(n log n)"), never a sentence. Avoid \
look-ups, single stated facts, simple arithmetic, yes/no.
Step 2. Plan the hardening ("hardening_process"): the too-easy version, the added layers, the \
parts to combine, the intermediate steps, the shortcuts you block.
Step 3. It connects at least three concepts from different parts and tests relationships, not \
memory. The solver never sees the document: never write "according to the text" or the like. Give \
all context and definitions; state the units, format and constraints of the answer.
Step 4. Make the answer precise. Integer: a whole number, the question says what it counts and in \
which unit; "answer": 42 or "42", never [42] or {{"value": 42}}. Expression: standard notation, \
every variable defined, canonical form ("2x^2 + 3x - 5"). String: the question says its exact \
form and whether case matters; no extra punctuation.
Step 5. Solve it step by step ("step_by_step_solution"), edge cases too; check the answer is of \
type {answer_type}, and estimate the time: a hard question takes more than a minute.
Step 6. Rate it ("difficulty_justification"). Medium: 2-3 steps, 1-2 minutes. Hard: 4-5 steps, \
2-3 minutes, four or more concepts. Extra hard: 6 or more steps, over 3 minutes, a complex system \
or a counter-intuitive result.
Step 7. Make sure exactly one answer is correct: no other reading, all constraints stated, an \
unambiguous format, every valid approach reaching it; else rewrite the question.
""" + _JSON_RULES + """"identified_information": three or more key facts from different parts; \
"relevant_quotes": word-for-word quotes showing them; "hardening_process"; "question": one clear, \
self-contained question in one single string, never a list or several questions; "answer": one \
plain value (never a list or object) that follows from the document alone; "answer_type": \
"{answer_type}", exactly; "step_by_step_solution"; "intermediate_results": an object, each step's \
result; "difficulty_level": "Hard" or "Extra Hard"; "difficulty_justification"; \
"solving_time_estimate": minutes for a student; "required_concepts": the document's concepts it \
needs; "potential_errors": typical mistakes and edge cases. "question" and "answer" are "" if the \
document is too thin.""",
    # Fig. 8: the Reasoner sees the question only
    "reasoner": ("{question}\n\nReason step by step, then put your final answer inside "
                 "\\boxed{{}}. If the question lists lettered options, put only the letter of the "
                 "correct one in the box."),
}


def resolve_prompt_format(cfg: Config, tokenizer) -> str:
    """--prompt-format auto: ChatML if the tokenizer has a chat template (Qwen3), else plain."""
    if cfg.prompt_format != "auto":
        return cfg.prompt_format
    return "chat" if getattr(tokenizer, "chat_template", None) else "plain"


def wrap(content: str, fmt: str, prompts: dict = PROMPTS):
    """Fig. 8: ChatML with a generic system message (Qwen3), or a User/Assistant preamble."""
    if fmt == "plain":
        return prompts["plain"].format(content=content)
    return [{"role": "system", "content": prompts["system"]},
            {"role": "user", "content": content}]


CHALLENGER_TEMPLATES = {"select": "type_selection", "mcq": "mcq", "free": "free_form"}


def challenger_prompt(document: str | None, kind: str, answer_type: str | None, fmt: str,
                      prompts: dict = PROMPTS):
    """The Challenger's prompt C: kind "select" (Fig. 9), "mcq" or "free" (Fig. 10)."""
    if document is None:
        block = prompts["no_document_block"]
    else:
        block = prompts["document_block"].format(document=document)
    template = prompts[CHALLENGER_TEMPLATES[kind]]
    return wrap(template.format(document_block=block, answer_type=answer_type), fmt, prompts)


def reasoner_prompt(question: str, fmt: str = "chat", prompts: dict = PROMPTS):
    """The Reasoner's prompt R (Fig. 8), from the question string only (information asymmetry)."""
    if not isinstance(question, str):
        raise TypeError("the Reasoner prompt is built from the question string only")
    return wrap(prompts["reasoner"].format(question=question.strip()), fmt, prompts)


# Validity and grading (§4). Model output is untrusted: nothing here raises on it.
_OPTION = re.compile(r"(?:^|(?<=\s)|(?=\())\(?([A-D])\s*[\)\.:]\s")  # from "(" if any
_BAD_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")  # control, lone surrogate


@dataclass
class Task:
    kind: str  # "mcq" | "free"
    question: str  # what the Reasoner sees
    gold: str  # the option letter (MCQ) or the answer (free-form)
    answer_type: str  # "MCQ" | Integer | Expression | String


def _scalar(x) -> str | None:
    """A JSON string or number as written (42, 2.5); None for a bool, list, object, nan or inf."""
    if isinstance(x, str):
        return x.strip()
    if isinstance(x, bool):  # a bool is an int to Python, not a number to JSON
        return None
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float) and np.isfinite(x):
        return str(int(x)) if x.is_integer() else repr(x)
    return None


def parse_task(text: str, kind: str, answer_type: str | None = None) -> tuple[Task | None, str]:
    """Validity (§4): (task, "ok") or (None, why); hostile output must never crash a run."""
    try:
        obj = common.last_json_object(text)
        if obj is None:
            return None, "no_json"
        mcq = kind == "mcq"
        # an empty question (MCQ: exam_question) is how the prompt says "the document is too thin"
        if mcq:
            question = obj.get("multiple_choice_question")
            exam_question = obj.get("exam_question", "-")
            too_thin = not isinstance(exam_question, str) or not exam_question.strip()
        else:
            question = obj.get("question")
            too_thin = isinstance(question, str) and not question.strip()
        if too_thin:
            return None, "too_thin"
        if not isinstance(question, str) or not question.strip():
            return None, "missing_question"
        if len(question) > 6_000:  # before the tokenizer sees it
            return None, "question_too_long"
        question = question.strip()
        answer = None if mcq else _scalar(obj.get("answer"))
        # "\u0008", a lone "\ud800": no repair recovers them
        if _BAD_CHARS.search(question + (answer or "")):
            return None, "bad_characters"
        if mcq:
            return _parse_mcq(obj, question)
        return _parse_free_form(obj, question, answer, answer_type)
    except Exception as e:
        return None, f"parse_error:{type(e).__name__}"


def _parse_mcq(obj: dict, question: str) -> tuple[Task | None, str]:
    """A stem, then options A) to D), distinct and non-empty, and the correct letter."""
    marks = []  # the first "A)", then the first "B)" after it, and so on to "D)"
    for mark in _OPTION.finditer(question):
        if len(marks) < 4 and mark[1] == "ABCD"[len(marks)]:
            marks.append(mark)
    if len(marks) < 4:
        return None, "options_not_A_to_D"
    if not question[:marks[0].start()].strip():
        return None, "empty_stem"
    ends = [mark.start() for mark in marks[1:]] + [None]
    options = [question[mark.end():end].strip() for mark, end in zip(marks, ends)]
    normalized = {re.sub(r"[\s.,;:]+", " ", option.lower()).strip() for option in options}
    if not all(options) or len(normalized) < 4:
        return None, "options_not_distinct"
    # str(): no other JSON value (number, list, null) turns into a letter
    letter = str(obj.get("multiple_choice_correct")).strip().strip("()")
    letter = letter.rstrip(").:").strip().upper()
    if letter not in ("A", "B", "C", "D"):
        return None, "bad_correct_letter"
    return Task("mcq", question, letter, "MCQ"), "ok"


def _parse_free_form(obj: dict, question: str, answer: str | None,
                     answer_type: str) -> tuple[Task | None, str]:
    """A free-form task: an answer of the type asked for (a declared type must agree)."""
    if not answer:
        return None, "missing_answer"
    declared = obj.get("answer_type")
    if isinstance(declared, str) and declared.strip().lower() != answer_type.lower():
        return None, "wrong_answer_type"
    if not _has_answer_form(answer.strip("$").strip(), answer_type):
        return None, "answer_not_" + answer_type.lower()
    if answer_type != "String":
        answer = answer.strip("$ ").strip()
    return Task("free", question, answer, answer_type), "ok"


def _has_answer_form(bare: str, answer_type: str) -> bool:
    """An Integer's digits (1,000 allowed), an Expression of <= 300 characters, a String of <= 3
    words and 100 characters."""
    if answer_type == "Integer":
        return re.fullmatch(r"[+-]?\d+(?:,\d{3})*", bare) is not None
    if answer_type == "Expression":
        return 0 < len(bare) <= 300
    if answer_type != "String" or not 0 < len(bare) <= 100 or len(bare.split()) > 3:
        return False
    # a String is graded normalized: one of symbols only ("?!") could never match
    return bool(common.normalize_string(bare))


def parse_type_selection(text: str) -> tuple[str, str | None] | None:
    """Fig. 9's reply -> ("mcq", None) | ("free", answer type or None); None if unusable."""
    obj = common.last_json_object(text) or {}
    mcq = obj.get("suitable_for_mcq") is True
    free = obj.get("suitable_for_free_form") is True
    if mcq == free:  # neither or both: no choice
        return None
    if mcq:
        return "mcq", None
    answer_type = str(obj.get("best_answer_type")).strip().capitalize()  # None, a list: no type
    return "free", answer_type if answer_type in ANSWER_TYPES else None


def grade_answers(task: Task, completions: list, timeout: float = 1.0) -> list[float]:
    """r_R = 1[a = a*] on the last \\boxed{} (none, or a truncated answer: 0): an MCQ by the letter
    it starts with, a String normalized, else Math-Verify (over `timeout` s: 0)."""
    preds = []
    for c in completions:
        preds.append(None if c.finish_reason == "length" else common.extract_boxed(c.text))
    if task.kind == "mcq" or task.answer_type == "String":
        normalize = common.choice_letter if task.kind == "mcq" else common.normalize_string
        gold = normalize(task.gold)
        return [float(pred is not None and normalize(pred) == gold) for pred in preds]
    pairs = [(pred, task.gold) for pred in preds]
    equal = common.math_equal_many(pairs, timeout=timeout,
                                   expression=task.answer_type == "Expression")
    return [float(e) for e in equal]


# The corpus: local JSONL or streamed hub sets, each document cut to <= chunk_tokens tokens.
def read_documents(src: str, field_name: str = "text", limit: int = 0) -> list[str]:
    """The documents of a JSONL file or a hub set "owner/name[:config][@split]", streamed (limit 0:
    all of a file, 20,000 of a hub set); bad input stops naming the source and the fix."""
    looks_local = src.endswith((".jsonl", ".json")) or src.startswith((".", "/", "~"))
    local = looks_local or Path(src).exists()
    spec, _, split = src.partition("@")
    name, _, config = spec.partition(":")
    where = f"corpus file {src!r}" if local else f"hub dataset {name!r}"
    fix = f'--corpus takes a JSONL file with one {{"{field_name}": "..."}} per line'
    docs = []
    try:
        if local:  # errors="replace": web text may hold stray bytes; the document is still one
            rows = common.iter_jsonl(src, shape=fix, error=common.InputError, errors="replace")
        else:
            import datasets
            limit = limit or 20000
            hub_set = datasets.load_dataset(name, config or None, split=split or "train",
                                            streaming=True)
            rows = enumerate(hub_set)
        for n, row in rows:
            text = row.get(field_name)
            if not isinstance(text, str):
                place = f"{src}:{n}" if local else where
                keys = ", ".join(list(row)[:8])
                raise common.InputError(f"{place}: no string field {field_name!r} (keys: {keys}); "
                                        "pass --corpus-field NAME")
            if text.strip():
                docs.append(text)
            if limit and len(docs) >= limit:
                break
    except common.InputError:
        raise
    except Exception as e:  # no network, a gated set, an unknown id
        raise common.InputError(f"could not stream {where} ({type(e).__name__}: {str(e)[:200]});"
                                f" if the hub is unreachable or gated: {fix}") from None
    if not docs:
        raise common.InputError(f"{where} holds no documents (no non-empty {field_name!r})")
    return docs


def document_tokens(cfg: Config, tokenizer, prompts: dict) -> int:
    """cfg.chunk_tokens, or less: a document leaves room for the longest Challenger prompt around
    it and the Challenger's reply."""
    fmt = resolve_prompt_format(cfg, tokenizer)
    kinds = [("select", None), ("mcq", None)] + [("free", t) for t in ANSWER_TYPES]
    overhead = 0  # the longest Challenger prompt without its document
    for kind, answer_type in kinds:
        prompt = challenger_prompt("", kind, answer_type, fmt, prompts)
        overhead = max(overhead, len(common.encode_prompt(tokenizer, prompt)))
    room = cfg.max_model_len - cfg.max_tokens - overhead - 16
    if room < 32:
        raise common.InputError(f"--max-model-len {cfg.max_model_len} < --max-tokens "
                                f"{cfg.max_tokens} + a {overhead}-token prompt + a document")
    return min(cfg.chunk_tokens, room)


def load_corpus(cfg: Config, tokenizer, chunk_tokens: int, decon=None) -> list[str]:
    """Each source's documents (equal shares of cfg.corpus_docs), each cut to its first
    chunk_tokens tokens (App. B) or, with --split-documents, into segments of at most that many,
    less those that share a 13-gram with an eval set (`decon`)."""
    sources = [s.strip() for s in cfg.corpus.split(",") if s.strip()]
    if not sources:
        raise common.InputError("--corpus is empty; pass a JSONL file or a hub dataset id")
    docs_per_source = cfg.corpus_docs // len(sources)
    texts = []
    for src in sources:
        for document in read_documents(src, cfg.corpus_field, docs_per_source):
            ids = tokenizer(document, add_special_tokens=False)["input_ids"]
            if len(ids) <= chunk_tokens:
                texts.append(document)
                continue
            # truncated as in the paper; split, a long document has one draw per segment
            starts = [0]
            if cfg.split_documents:
                starts = range(0, len(ids), chunk_tokens)
            for start in starts:
                texts.append(tokenizer.decode(ids[start:start + chunk_tokens]))
    # "<|im_end|>" in web text would end the prompt as a real control token
    cleaned = [common.strip_special_tokens(s, tokenizer) for s in texts]
    texts = [s for s in cleaned if s.strip()]
    if decon is None:
        return texts
    contaminated = decon.flags(texts)
    kept = [s for s, bad in zip(texts, contaminated) if not bad]
    print(f"[spice] corpus: {len(kept)} documents ({len(texts) - len(kept)} dropped as "
          "contaminated)", file=sys.stderr)
    if not kept:
        raise common.InputError("every corpus document overlaps an eval set; use another corpus")
    return kept


# The loop: one function per step of Alg. 1 / §3.1, in paper order. Steps 3-6 return per
# document what they produce: rollouts[d].attempts[i], answers[d][i] and rewards[d][i] belong to
# attempt i of document d; reasoner_picks[d] is the i whose task trains the Reasoner.
@dataclass
class Attempt:
    completion: object  # the Challenger's common.Completion
    task: Task | None  # None if invalid
    reason: str  # "ok" or why it is invalid


@dataclass
class DocRollout:
    """One document in one iteration; the counts are over every attempt, not the kept group."""
    document: str | None
    kind: str
    answer_type: str | None
    attempts: list[Attempt]  # the Challenger group T_C (<= G)
    n_generated: int = 0
    n_valid: int = 0


class Answers(typing.NamedTuple):
    """The Reasoner's K answers to one task (none to an invalid one) and their r_R."""
    completions: list  # common.Completion each
    correct: list[float]  # r_R = 1[a = a*] of each


def _mean(xs) -> float:
    return float(np.mean(xs)) if len(xs) else 0.0


def sample_documents(corpus: list[str], n: int, rng, no_document: bool = False) -> list:
    """Step 1: B documents drawn uniformly, without replacement within an iteration if possible."""
    if no_document:
        return [None] * n
    picks = rng.choice(len(corpus), size=n, replace=len(corpus) < n)
    return [corpus[i] for i in picks]


def select_task_types(policy, docs: list, cfg: Config, fmt: str, prompts: dict,
                      rng) -> list[tuple]:
    """Step 2: MCQ or free-form (and its answer type) per document by the Fig. 9 call, untrained
    and greedy; without a document, for MCQ only, or on an unusable reply: a coin."""
    allowed = ("mcq", "free") if cfg.task_types == "both" else (cfg.task_types,)
    choices = [None] * len(docs)  # (kind, answer type) per document, from the Fig. 9 call
    if cfg.type_selection == "prompt" and docs[0] is not None and "free" in allowed:
        batch = [challenger_prompt(d, "select", None, fmt, prompts) for d in docs]
        outs = policy.generate(batch, n=1, temperature=0.0, max_tokens=cfg.type_select_max_tokens)
        choices = [parse_type_selection(out[0].text) for out in outs]
    # each document draws its kind, then its answer type, in order: a resumed run replays them
    types = []
    for choice in choices:
        kind, answer_type = choice if choice is not None else (None, None)
        if kind not in allowed:
            kind, answer_type = allowed[rng.integers(len(allowed))], None
        if kind == "free" and answer_type is None:
            answer_type = ANSWER_TYPES[rng.integers(3)]
        types.append((kind, answer_type))
    return types


def validity_checker(cfg: Config, tokenizer, fmt: str, prompts: dict, decon=None):
    """check(completion, kind, answer_type) -> (task, "ok") | (None, why); invalid: rho (§4)."""
    def check(completion, kind: str, answer_type: str | None) -> tuple[Task | None, str]:
        if completion.finish_reason == "length":
            return None, "truncated"
        # special-token strings in a question would forge chat turns in the Reasoner's prompt
        text = common.strip_special_tokens(completion.text, tokenizer)
        task, why = parse_task(text, kind, answer_type)
        if task is None:
            return None, why
        if decon is not None and decon.contaminated(task.question):
            return None, "contaminated"
        reasoner_ids = common.encode_prompt(tokenizer, reasoner_prompt(task.question, fmt, prompts))
        if len(reasoner_ids) + cfg.max_tokens > cfg.max_model_len:
            return None, "question_too_long"
        return task, why
    return check


def subsample_group(attempts: list[Attempt], G: int, rng) -> list[Attempt]:
    """G attempts with the valid:invalid ratio of the pool (§3.1), at least one valid if any."""
    if len(attempts) <= G:
        return attempts
    valid = [a for a in attempts if a.task is not None]
    invalid = [a for a in attempts if a.task is None]
    valid_share = round(G * len(valid) / len(attempts))
    n_valid = min(len(valid), max(1, valid_share)) if valid else 0
    n_invalid = min(len(invalid), G - n_valid)
    n_valid = G - n_invalid  # too few invalid attempts: more valid ones fill the group
    group = []
    for pool, k in ((valid, n_valid), (invalid, n_invalid)):
        if k:
            picks = rng.choice(len(pool), size=k, replace=False)
            group.extend(pool[i] for i in sorted(picks))
    return group


def challenger_generate(policy, docs: list, types: list, cfg: Config, fmt: str, prompts: dict,
                        check, rng) -> list[DocRollout]:
    """Step 3: attempts (q, a*) ~ pi(.|d, C), G at a time, until one is valid or N were made."""
    pools = [[] for _ in docs]  # every attempt made, per document
    active = list(range(len(docs)))  # the documents without a valid task and with attempts left
    while active:
        # every active document has made the same number of attempts so far
        n = min(cfg.group_size, cfg.max_attempts - len(pools[active[0]]))
        batch = []
        for i in active:
            kind, answer_type = types[i]
            batch.append(challenger_prompt(docs[i], kind, answer_type, fmt, prompts))
        outs = policy.generate(batch, n=n, temperature=cfg.temperature, max_tokens=cfg.max_tokens)
        for i, completions in zip(active, outs):
            kind, answer_type = types[i]
            for c in completions:
                task, reason = check(c, kind, answer_type)
                pools[i].append(Attempt(c, task, reason))
        active = [i for i in active if len(pools[i]) < cfg.max_attempts
                  and all(a.task is None for a in pools[i])]
    rollouts = []
    for doc, (kind, answer_type), pool in zip(docs, types, pools):
        group = subsample_group(pool, cfg.group_size, rng)
        n_valid = sum(a.task is not None for a in pool)
        rollouts.append(DocRollout(doc, kind, answer_type, group, len(pool), n_valid))
    return rollouts


def reasoner_solve(policy, rollouts: list[DocRollout], cfg: Config, fmt: str,
                   prompts: dict) -> list[list[Answers]]:
    """Step 4: K answers to every valid task, from the question alone, in one batched call;
    answers[d][i] to attempt i of document d."""
    answers = [[Answers([], []) for _ in r.attempts] for r in rollouts]
    valid = []  # (d, i) of every valid task
    for d, rollout in enumerate(rollouts):
        valid += [(d, i) for i, a in enumerate(rollout.attempts) if a.task is not None]
    if not valid:
        return answers
    tasks = [rollouts[d].attempts[i].task for d, i in valid]
    batch = [reasoner_prompt(task.question, fmt, prompts) for task in tasks]
    outs = policy.generate(batch, n=cfg.reasoner_k, temperature=cfg.temperature,
                           max_tokens=cfg.max_tokens)
    for (d, i), task, completions in zip(valid, tasks, outs):
        correct = grade_answers(task, completions, cfg.verify_timeout)
        answers[d][i] = Answers(completions, correct)
    return answers


def challenger_rewards(rollouts: list[DocRollout], answers: list[list[Answers]],
                       cfg: Config) -> list[list[float]]:
    """Step 5: r_C (Eq. 1; App. D, Eq. 5; or Table 4) on p, the pass rate of the K; invalid: rho.
    rewards[d][i] of attempt i of document d."""
    rewards = []
    for rollout, doc_answers in zip(rollouts, answers):
        doc_rewards = []
        for attempt, task_answers in zip(rollout.attempts, doc_answers):
            if attempt.task is None:
                doc_rewards.append(cfg.invalid_penalty)
                continue
            pass_rate = np.mean(task_answers.correct)
            reward = common.proposer_reward(pass_rate, cfg.challenger_reward, tau=cfg.tau)
            doc_rewards.append(float(reward))
        rewards.append(doc_rewards)
    return rewards


def reasoner_group(rollouts: list[DocRollout], rng) -> list[int | None]:
    """Step 6: one random valid task per document (§3.1), whose K answers behind r_C are T_R;
    reasoner_picks[d] is its attempt's index in rollouts[d].attempts (None: no valid task)."""
    reasoner_picks = []
    for rollout in rollouts:
        valid = [i for i, a in enumerate(rollout.attempts) if a.task is not None]
        reasoner_picks.append(valid[rng.integers(len(valid))] if valid else None)
    return reasoner_picks


class Group(typing.NamedTuple):
    """The trajectories of one role on one document, whose mean reward is their baseline."""
    role: str  # "challenger" | "reasoner"
    completions: list
    rewards: list[float]


def build_trajectories(rollouts: list[DocRollout], answers: list[list[Answers]],
                       rewards: list[list[float]], reasoner_picks: list[int | None],
                       cfg: Config) -> tuple[list, dict]:
    """Step 7 (Eq. 3): A = r - mean(group), no std, per role and document; no T_C if frozen."""
    groups = []
    for rollout, doc_answers, doc_rewards, pick in zip(rollouts, answers, rewards,
                                                       reasoner_picks):
        if not cfg.challenger_model:
            completions = [a.completion for a in rollout.attempts]
            groups.append(Group("challenger", completions, doc_rewards))
        if pick is not None:
            chosen = doc_answers[pick]
            groups.append(Group("reasoner", chosen.completions, chosen.correct))
    trajs = []
    zero_adv = {}  # role -> per group: equal rewards, so zero advantages and no signal
    for group in groups:
        group_ids = [0] * len(group.rewards)
        advantages = common.group_advantages(group.rewards, group_ids, scale="none").tolist()
        for completion, reward, advantage in zip(group.completions, group.rewards, advantages):
            trajs.append(common.Trajectory.from_completion(
                completion, reward=reward, role=group.role, advantage=advantage))
        # a zero-advantage group stays in the batch
        zero_adv.setdefault(group.role, []).append(len(set(group.rewards)) == 1)
    stats = {f"{role}/zero_adv_group_frac": _mean(flags) for role, flags in zero_adv.items()}
    return trajs, stats


def drgrpo_update(policy, trajs: list, cfg: Config) -> dict:
    """Step 8 (Eqs. 3-4): clipped surrogate with truncated IS, summed per sequence / L_max, no KL;
    T_C and T_R permuted together (oat/algorithms/ppo.py), one step per mini-batch; re-sync."""
    if not trajs:
        return {}
    pg = common.PGConfig(clip_low=cfg.clip, clip_high=cfg.clip, aggregation="drgrpo",
                         max_len=cfg.max_tokens, temperature=cfg.temperature, tis_cap=cfg.tis_cap,
                         mini_batch=cfg.mini_batch, shuffle=True)
    stats = common.pg_step(policy, trajs, pg)
    # named as in every method: entropy is Eq. 1 of "Towards Understanding Self-play for LLM
    # Reasoning" (pg_step's nll_entropy), entropy_exact the exact entropy (pg_step's entropy)
    stats["entropy_exact"] = stats["entropy"]
    stats["entropy"] = stats.pop("nll_entropy")
    return stats


def step_metrics(rollouts: list[DocRollout], answers: list[list[Answers]],
                 rewards: list[list[float]]) -> dict:
    """Validity over every attempt made (not the G kept), r_C, pass rate, question diversity."""
    questions, pass_rates = [], []  # of the valid tasks
    for rollout, doc_answers in zip(rollouts, answers):
        for attempt, task_answers in zip(rollout.attempts, doc_answers):
            if attempt.task is not None:
                questions.append(attempt.task.question)
                pass_rates.append(_mean(task_answers.correct))
    n_generated = sum(r.n_generated for r in rollouts)
    n_valid = sum(r.n_valid for r in rollouts)
    metrics = {"challenger/valid_rate": n_valid / max(1, n_generated),
               "challenger/docs_without_valid": sum(r.n_valid == 0 for r in rollouts),
               "challenger/reward": _mean([x for doc_rewards in rewards for x in doc_rewards]),
               "reasoner/accuracy": _mean(pass_rates)}
    if questions:
        for name, value in common.diversity_metrics(questions).items():
            metrics[f"challenger/{name}"] = value
    return metrics


def untrained_note(learned: dict, steps: int) -> str | None:
    """The summary's line on a run that trained nothing, from the counts of steps with a valid
    question (learned["valid"]) and with a non-zero gradient (learned["trained"]); else None."""
    steps_text = f"{steps} steps" if steps != 1 else "1 step"
    if learned["valid"] == 0:  # every Challenger reward rho: zero advantages, no Reasoner task
        return f"no valid question in {steps_text}: nothing was trained"
    if learned["trained"] == 0:  # every group's rewards were equal
        return f"every advantage was 0 in {steps_text} (zero gradients): nothing was trained"
    return None


def sample_records(rollouts: list[DocRollout], answers: list[list[Answers]],
                   rewards: list[list[float]], reasoner_picks: list[int | None]) -> list[dict]:
    """samples.jsonl: every Challenger attempt with its task, r_C and the K answers behind it."""
    records = []
    for rollout, doc_answers, doc_rewards, pick in zip(rollouts, answers, rewards,
                                                       reasoner_picks):
        for i, attempt in enumerate(rollout.attempts):
            task = attempt.task
            records.append({
                "document": rollout.document, "type": rollout.answer_type or rollout.kind,
                "challenger_output": attempt.completion.text,
                "invalid_reason": None if task else attempt.reason,
                "question": task.question if task else None,
                "gold": task.gold if task else None,
                "challenger_reward": doc_rewards[i],
                "pass_rate": _mean(doc_answers[i].correct) if task else None,
                "reasoner_task": i == pick,
                "answers": [c.text for c in doc_answers[i].completions]})
    return records


def run_eval(policy, run, cfg: Config, fmt: str, prompts: dict, step: int,
             name: str = "eval.json") -> dict:
    """Zero-shot with the training Reasoner prompt (App. A): run_dir/`name`; returns eval/*."""
    if not cfg.eval_benchmarks.strip():
        return {}

    def prompt_fn(problem: dict, tokenizer=None):
        question = problem["question"]
        for j, choice in enumerate(problem.get("choices") or []):  # lettered, as MCQ tasks are
            question += f"\n{chr(65 + j)}) {choice}"
        return reasoner_prompt(question, fmt, prompts)
    results = common.evaluate_config(policy, cfg, prompt_fn=prompt_fn, timeout=cfg.verify_timeout)
    run.write_eval({"step": step, **results}, name=name)
    return common.eval_metrics(results)


def evaluate_only(cfg: Config, tokenizer, fmt: str, prompts: dict, sampler=None) -> Path:
    """--eval-only: the model as given, evaluated as a run evaluates its Reasoner (run_eval), into
    eval.json. Only the engine loads (no trainer, no optimizer, no corpus), and nothing trains."""
    run = common.Run(cfg, "spice")
    sampler = sampler or common.make_sampler(cfg.model, tokenizer, cfg)
    run.log(0, run_eval(sampler, run, cfg, fmt, prompts, 0))
    run.note("--eval-only: the model as given was evaluated; nothing was trained")
    run.close()
    return run.dir


def validate_config(cfg: Config) -> None:
    for name, allowed in CHOICES.items():
        value = getattr(cfg, name)
        if value not in allowed:
            options = f"{', '.join(allowed[:-1])} or {allowed[-1]}"
            raise ValueError(f"--{name.replace('_', '-')} must be {options}, not {value!r}")
    if cfg.reasoner_k < 1:  # the other sizes: parse_config
        raise ValueError("--reasoner-k must be >= 1")
    if cfg.max_attempts < cfg.group_size:
        raise ValueError("--max-attempts must be at least --group-size")
    common.check_benchmark_names(cfg.eval_benchmarks)
    if cfg.eval_only and not cfg.eval_benchmarks.strip():
        raise ValueError("--eval-only needs benchmarks: pass --eval-benchmarks NAMES_OR_FILES")
    if cfg.eval_only and cfg.resume:  # it would write over the run's own eval.json
        raise ValueError("--eval-only evaluates --model into a new folder, not a --resume run; "
                         "pass --model RUN_DIR/checkpoints/step_N")
    common.load_prompts(cfg.prompts, PROMPTS)  # a bad --prompts file: a usage error, nothing loaded


def train(cfg: Config, policy=None) -> Path:
    """The whole run; `policy` may be passed in (tests share one engine), else loaded from cfg."""
    validate_config(cfg)
    common.seed_everything(cfg.seed)
    prompts = common.load_prompts(cfg.prompts, PROMPTS)
    # inputs first (corpus, eval sets): bad input fails in seconds, before the model loads
    tokenizer = policy.tokenizer if policy else common.load_tokenizer(cfg.model)
    fmt = resolve_prompt_format(cfg, tokenizer)
    if cfg.eval_only:
        return evaluate_only(cfg, tokenizer, fmt, prompts, policy)
    # the corpus documents and every generated question are screened against the eval sets
    decon = common.eval_decontaminator(cfg.eval_benchmarks, cfg.decontaminate)
    # the Challenger reads the documents: its tokenizer sizes them
    doc_tokenizer = tokenizer
    if cfg.challenger_model:
        doc_tokenizer = common.load_tokenizer(cfg.challenger_model)
    corpus = []
    if not cfg.no_document:
        chunk_tokens = document_tokens(cfg, doc_tokenizer, prompts)
        corpus = load_corpus(cfg, doc_tokenizer, chunk_tokens, decon)
    run = common.Run(cfg, "spice")
    policy = policy or common.Policy.load(cfg)
    check = validity_checker(cfg, tokenizer, fmt, prompts, decon)
    # the Challenger: the policy, or the frozen --challenger-model with its own tokenizer
    writer = contextlib.nullcontext
    if cfg.challenger_model:
        writer = common.FrozenModel(cfg.challenger_model, policy, cfg,
                                    cfg.challenger_gpu_memory_utilization).sampling
    start, state = 0, {}
    if cfg.resume:
        start, state = run.load_checkpoint(policy)
    # steps with a valid question and with a non-zero gradient (a checkpoint without: all of them)
    learned = state.get("learned", {"valid": start, "trained": start})
    eval_at = functools.partial(run_eval, policy, run, cfg, fmt, prompts)
    if cfg.eval_base and start == 0:
        base = eval_at(0, "eval_base.json")
        if base:
            run.log(0, base)  # step 0: the curve's starting point, same prompt and grader
    pbar = run.progress(cfg.steps, initial=start)
    for step in range(start + 1, cfg.steps + 1):
        rng = np.random.default_rng([cfg.seed, step])  # per step: a resumed run replays the draws
        with run.timer("rollout"):
            docs = sample_documents(corpus, cfg.docs_per_step, rng, cfg.no_document)
            with writer(policy) as challenger:
                challenger_fmt = resolve_prompt_format(cfg, challenger.tokenizer)
                types = select_task_types(challenger, docs, cfg, challenger_fmt, prompts, rng)
                rollouts = challenger_generate(challenger, docs, types, cfg, challenger_fmt,
                                               prompts, check, rng)
            answers = reasoner_solve(policy, rollouts, cfg, fmt, prompts)
            rewards = challenger_rewards(rollouts, answers, cfg)
            reasoner_picks = reasoner_group(rollouts, rng)
        trajs, traj_stats = build_trajectories(rollouts, answers, rewards, reasoner_picks, cfg)
        with run.timer("update"):
            update_stats = drgrpo_update(policy, trajs, cfg)
        metrics = step_metrics(rollouts, answers, rewards)
        metrics.update(traj_stats)
        metrics.update({f"train/{k}": v for k, v in update_stats.items()})
        learned["valid"] += metrics["challenger/valid_rate"] > 0
        learned["trained"] += metrics.get("train/grad_norm", 0.0) > 0
        records = sample_records(rollouts, answers, rewards, reasoner_picks)
        run.log_samples(step, "challenger", records)
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            metrics.update(eval_at(step, f"eval_step{step}.json"))
        run.log(step, metrics)
        pbar.update(1)
        if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
            run.save_checkpoint(step, policy, {"step": step, "learned": learned})
    pbar.close()
    note = untrained_note(learned, cfg.steps)
    if note:
        run.note(note)
    final = eval_at(cfg.steps, "eval.json")
    if final:
        run.log(cfg.steps, final)
    run.close()
    return run.dir


def main(argv=None):
    common.run_cli(Config, train, argv, check=validate_config, tiny=TINY)


if __name__ == "__main__":
    main()
