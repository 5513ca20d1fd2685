"""Absolute Zero Reasoner (AZR): Zhao, Wu, Yue, Wu, Xu, Lin, Zhao, Liu, Huang, arXiv:2505.03335v2.

One model plays two roles on the same weights, with a Python executor as the only source of truth:
  * the proposer writes code-reasoning tasks built on (program p, input i, output o) triplets;
  * the solver solves them, in three modes:
      deduction  predict o from (p, i)
      abduction  find an input i' with p(i') == o (p need not be one-to-one)
      induction  write p from half of N I/O pairs plus a message; graded on the hidden half.
No data is used: the buffers start from one "zero triplet" (the identity function on "Hello World").

The loop (paper Alg. 1, §3.3); the building blocks come first, the steps last, in this order:
  0. seed_buffers          the base model proposes from the zero triplet until D_seed holds S*B triplets, then
                           induction tasks on D_seed's programs until D_ind holds S*B (§3.3.1)
  1. propose               B prompts per task type: a program from D_ded u D_abd -> N inputs + a message
                           (induction, §3.3.2); K references from D_alpha -> (p, i) (deduction, abduction)
  2. validate              executor checks (§3.3.3): parses and defines f (one def only, as the
                           official parser), no banned modules (checked on the AST), the input
                           evaluated in the sandbox only, runs without error, deterministic over j =
                           2 *independent* processes with different hash seeds (their parsed values
                           equal, so set print order may differ), output is a finite literal without
                           memory addresses, size cap. Valid tasks join their buffer; invalid
                           proposals get the format penalty (-1). Under torchrun, rank 0 runs every
                           program and broadcasts the outcomes, so all ranks keep the same buffers
  3. estimate_learnability n = 8 solver rollouts at T = 1 per valid proposal (never trained on) -> r_bar
  4. solve                 per task type: this step's valid tasks, back-filled from the buffer up to B; one answer
                           each, graded by the executor and compared in trusted code (Eq. 5)
  5. rewards               proposer_reward: Eq. 4 learnability (or Eq. 3 of "Towards Understanding Self-play");
                           solver_reward: 1[correct]; Eq. 6 format penalties (-0.5 wrong but formatted, -1 format)
  6. trr_update            TRR++ (Eq. 8): one baseline and std per (task, role), 6 keys; PPO-clip
                           (Eq. 9, seq-mean-token-mean, entropy bonus 0.001, no KL) on the joint
                           6*B batch in task order, one AdamW step per --mini-batch 128
                           trajectories, i.e. one per task type, pi_old the rollout policy; sync.
                           Official: scripts/selfplay/coder7b.sh sets train_batch_size=64 (= B),
                           ppo_mini_batch_size=128 (x rollout.n = 1) on 4 GPUs in one Ulysses group;
                           trainer/ppo/azr_ray_trainer.py concatenates the six task-role batches in
                           task order, and veRL's dp_actor takes one step per 128 of them
  7. evaluate              math through common.evaluate, HumanEval+/MBPP+ through
                           common.evaluate_code (greedy, 16,000 new tokens), at the end and every
                           --eval-every steps. Not the paper's full Table 1: LiveCodeBench is not
                           supported, so eval/code/mean_greedy_acc is the HumanEval+/MBPP+ mean (not
                           its CAvg) and eval/avg is not its AVG; the in-distribution CruxEval /
                           LCB-Execution tracking during training is not implemented either
Ablations of "Towards Understanding Self-play for LLM Reasoning" (§3.3, §3.5), which analyses this loop:
--freeze-proposer (proposer trajectories get no gradient) and --proposer-reward uncertainty (its Eq. 3).

Where the official code (LeapLabTHU/Absolute-Zero-Reasoner) and the paper differ, this file follows the paper
(paper Alg. 1, §3.3):
  * the solver trains on THIS step's proposals (the code's dataloaders hold step t-1 tasks);
  * a valid task with r_bar in {0, 1} earns 0 (Eq. 4); the code's -0.5 is `--zero-learnability-reward -0.5`;
  * Monte-Carlo learnability samples are always drawn at T = 1 (master used greedy validation settings);
  * determinism = two separate processes (the code calls f twice inside one exec, so id()/hash-seed/address
    dependent programs passed); outputs are never truncated (the code cut them to 400 chars);
  * the banned-module check is done on the AST (catches __import__, importlib, `from os import path`, aliases,
    dotted names) and also bans os/sys/shutil, which §3.3.3 names; solver programs get the same static checks;
  * the buffer cap evicts the OLDEST entries (the code kept the oldest and silently dropped new programs);
  * the induction proposer draws programs from the de-duplicated union D_ded u D_abd (seed programs sit in
    both, so the code drew them twice as often);
  * TRR++ normalises per sequence (Eq. 8); the code whitened token-level returns;
  * training length 500 steps (paper §4.1; the code's default is 960).
Kept from the code: N = 10 induction inputs, the first 5 shown to the solver and the last 5 held out.

Parsing and grading follow the official code (rewards/reward_managers.py, rewards/code_reward.py,
utils/code_utils/templates.py):
  * a solver answer is formatted when it has the <think>/<answer> tags (get_format_reward);
    deduction and abduction read the last ```output / ```input block, else the whole <answer> text;
    induction the last ```python block, else any fenced block, and no fence at all is a format error
    (parse_code_function);
  * a proposal with more than one def, nested helpers and methods included, is invalid
    (parse_code_input_output, reject_multiple_functions); --no-reject-multiple-defs accepts them.
    Induction solver programs may have helpers, as there;
  * an input is the text of an argument list pasted into f(...), so expressions (`list(range(5))`)
    and keyword arguments work. It is evaluated in the sandbox only; the trainer checks its AST (one
    call, nothing banned, no call of the program's own functions, which would let an abduction
    answer search with f itself). Deduction answers stay literals: the official eval of the answer
    with the program loaded lets `f(3)` answer itself;
  * not implemented: the official extractors' further fallbacks ("# Output:", `output(...)`,
    <output> tags, "the output is ...") before the whole answer text.
Evaluation follows evaluation/math_eval (eval_math_nodes.sh --template azr): greedy, 16,000 new
tokens, the question as the User turn with the Assistant turn unopened, the answer from
extract_azr_answer (eval_answer). The context is --max-model-len (16,384), so a long prompt shortens
the budget (the official one is 32,768). Code: Table 1's numbers come from EvalPlus's own prompts at
768 new tokens (evaluation/code_eval/scripts/run_evalplus.sh); ours use the eval_code template and
--eval-max-tokens.

Prompts (PROMPTS; --prompts FILE replaces any of them) carry every instruction of the official
prompts (data_construction/prompts.py, the paper's prompt figures) in our words. Where they differ:
  * difficulty criterion: each task's own unknown (the official two prompts have theirs swapped);
  * `f` is the only def under --reject-multiple-defs (the official prompt allows nested defs);
  * banned modules: not imported or used (official: not even named in comments; it checks imports);
  * one example call shows the input format, instead of separate example blocks;
  * induction proposer: "called as f(<your input>)" in words, not an appended placeholder call;
  * references: "Earlier puzzle k" with fenced blocks, not <snippet_k> tags;
  * the induction solver reads the message as plain text ("Message: ..."), not in a ```message block.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import json
import os
import random
import re
import sys
from collections import Counter
from dataclasses import dataclass

import common

TASKS = ("deduction", "abduction", "induction")


# --------------------------------------------------------------------------------------------------------------
# Config: the paper's defaults (sources in the comments). Every field is a --flag (common.parse_config).
# --------------------------------------------------------------------------------------------------------------
@dataclass
class Config(common.RunConfig):
    model: str = "Qwen/Qwen2.5-Coder-7B"  # §4.1 / Table 1 (also Qwen2.5-7B, Coder-3B/14B, Llama-3.1-8B)
    steps: int = 500  # training iterations (§4.1; the code's default is 960, spec §1)
    batch_size: int = 64  # B, prompts per task-role; 6*B trajectories per iteration (Table 3)
    references: int = 6  # K, past triplets shown to the deduction/abduction proposer (Table 3, code io_n=6)
    seed_factor: int = 4  # S, the seed buffers hold S*B tasks before training starts (§3.3.1, Table 3)
    seed_max_rounds: int = 64  # not in the paper: give up a seeding phase (D_seed, then D_ind) after this many proposal rounds (weak models)
    buffer_cap: int = 16384  # maximum entries per buffer, oldest evicted (Table 3; the code keeps the oldest)
    induction_inputs: int = 10  # N, inputs per induction task: first half shown, second half held out (code)
    learnability_samples: int = 8  # n, solver rollouts per valid proposal for r_bar (Eq. 4, Table 3)
    temperature: float = 1.0  # rollout temperature (Table 3); the learnability samples always use T = 1 (spec §1)
    top_p: float = 1.0  # rollout top-p (Table 3)
    max_prompt_tokens: int = 6144  # references are dropped until a proposer prompt fits (Table 3)
    max_response_tokens: int = 8096  # generation limit for every role (Table 3)
    max_model_len: int = 16384  # vLLM context: prompt + response (Table 3: 6,144 + 8,096)
    lr: float = 1e-6  # AdamW, constant (Table 3)
    weight_decay: float = 0.01  # paper branch of the code (azr_ppo_trainer.yaml); master uses 0
    grad_clip: float = 1.0  # Table 3
    clip_ratio: float = 0.2  # PPO epsilon (Eq. 9); active from the second mini-batch on
    mini_batch: int = 128  # trajectories per AdamW step (selfplay/coder7b.sh ppo_mini_batch_size)
    entropy_coef: float = 0.001  # entropy bonus (Table 3; master code: 0)
    aggregation: str = "seq-mean-token-mean"  # loss aggregation (Eq. 9); token-mean = master code
    proposer_reward: str = "learnability"  # learnability = Eq. 4, 1 - r_bar | uncertainty = Eq. 3 of "Towards Understanding Self-play", 1 - 2|r_bar - 0.5|
    zero_learnability_reward: float = 0.0  # reward of a VALID proposal with r_bar in {0,1}: 0 (paper Eq. 4) or -0.5 (official code)
    token_weighted_advantages: bool = False  # official code: whiten token-level returns per (task, role); paper Eq. 8 is per sequence
    freeze_proposer: bool = False  # "Towards Understanding Self-play" §3.3: proposer trajectories get no gradient
    executor_timeout: float = 10.0  # seconds per program run (Table 3)
    determinism_runs: int = 2  # j, independent executions that must agree (§3.3.3)
    sandbox_workers: int = 4  # parallel sandbox processes
    sandbox_memory_mb: int = 1024  # address-space limit of one program run
    max_program_chars: int = 8000  # not in the paper: longer programs are invalid (size cap, never truncated)
    max_output_chars: int = 4000  # not in the paper: longer output literals are invalid (never truncated)
    reject_multiple_defs: bool = True  # one def per proposal, as the official code_reward.py parser
    eval_benchmarks: str = "aime24,aime25,amc23,math500,minerva,olympiadbench"  # Table 1's six math benchmarks
    eval_max_tokens: int = 16000  # official math eval (evaluation/math_eval/eval_math_nodes.sh)
    eval_code: bool = True  # Table 1 reports HumanEval+/MBPP+ too (--no-eval-code skips them)
    eval_code_benchmarks: str = "humaneval+,mbpp+"  # HumanEval+/MBPP+ (EvalPlus, from the hub: needs `datasets`) or local JSONL files (common.load_code_benchmark)


# --model tiny: a one-minute smoke run (flags still override)
TINY = {"steps": 2, "batch_size": 2, "references": 2, "induction_inputs": 2,
        "learnability_samples": 2, "seed_max_rounds": 1, "max_prompt_tokens": 1500,
        "max_response_tokens": 48, "max_model_len": 2048, "sandbox_workers": 2,
        "executor_timeout": 2.0, "eval_benchmarks": f"{common.TINY_DATA}/azr_eval.jsonl",
        "eval_code_benchmarks": f"{common.TINY_DATA}/code_tiny.jsonl", "eval_max_tokens": 16}


# --------------------------------------------------------------------------------------------------------------
# The zero triplet (Fig. 5) and the banned modules (Fig. 8 list plus os/sys/shutil, which §3.3.3 names).
# --------------------------------------------------------------------------------------------------------------
ZERO_TRIPLET = {"program": "def f(x):\n    return x", "input": "'Hello World'", "output": "'Hello World'"}

BANNED_MODULES = frozenset({
    # Fig. 8 of the paper (non-determinism, time, I/O, processes)
    "logging", "random", "multiprocessing", "pebble", "subprocess", "threading", "datetime", "time",
    "hashlib", "hmac", "bcrypt", "calendar",
    # named in §3.3.3, missed by the official import blacklist (azr_ppo_trainer.yaml banned_words)
    "os", "sys", "shutil",
    # the other ways out: dynamic import, the interpreter's internals, files, network, processes
    "importlib", "builtins", "__builtin__", "imp", "ctypes", "gc", "inspect", "socket", "signal", "resource",
    "pathlib", "tempfile", "io", "glob", "pickle", "marshal", "uuid", "secrets", "asyncio", "concurrent",
    "_thread", "select", "mmap", "code", "codeop", "pty", "fcntl", "platform", "sysconfig", "site",
    "urllib", "http", "requests", "ftplib", "smtplib", "webbrowser", "faulthandler", "tracemalloc", "atexit",
})
# builtins that import, run code, do I/O or reach the interpreter; checked as Names the program does not bind
# itself, so `parse_input(` and a parameter called `input` are fine
BANNED_NAMES = frozenset({
    "__import__", "eval", "exec", "compile", "open", "input", "breakpoint", "exit", "quit", "help",
    "globals", "locals", "vars", "__builtins__", "__loader__", "__spec__",
})
BANNED_ATTRS = frozenset({"__subclasses__", "__globals__", "__builtins__", "__code__", "__import__",
                          "__loader__", "__bases__", "__mro__", "f_globals", "f_back", "gi_frame"})

REJECT_REASONS = ("format", "syntax", "banned", "multiple_defs", "error", "timeout",
                  "nondeterministic", "non_literal", "too_large")


# --------------------------------------------------------------------------------------------------------------
# Prompts: R1-style plain text, no chat template; everything parsed sits in fenced blocks. Our own
# words, carrying every instruction of the official prompts (data_construction/prompts.py and the
# paper's prompt figures); the differences are listed in the module docstring. All templates live in
# PROMPTS, so `--prompts FILE` can replace any of them (common.load_prompts: same names, exactly the
# same placeholders).
# --------------------------------------------------------------------------------------------------------------
_PREAMBLE = (
    "A conversation between User and Assistant. The Assistant first reasons about the User's task "
    "step by step inside <think> </think> tags, then writes its final result inside <answer> "
    "</answer> tags, i.e. <think> reasoning </think> <answer> result </answer>.\n\n")
_CALL_FORMAT = ("the arguments of one call to `f`, separated by commas, with strings in quotes: "
                "for `def f(a, b)`, the input `[3, 1], 'xy'` means the call `f([3, 1], 'xy')`")
_HARD = ("The program should make the solver track state across several data transformations, "
         "so that solving the puzzle takes long, multi-step reasoning: for example build and "
         "operate on data structures (trees, heaps, stacks, queues, graphs, your own classes) or "
         "use involved control flow (dynamic programming, recursion, divide and conquer, greedy "
         "choices, backtracking).")


def _propose(aim: str, hard_part: str) -> str:
    return (
        "Design a new Python puzzle for an I.Q. test: one program and one input for it. " + aim
        + "\n\n{code_rules}- " + _HARD + "\n\n"
        "The input: exactly one, written as " + _CALL_FORMAT + ".\n\n"
        "What makes a good puzzle:\n"
        "- it runs without error on your input;\n"
        "- " + hard_part + "\n"
        "- it is clearly different from the earlier puzzles below.\n\n"
        "Plan first: in your reasoning, decide what will make your program hard, how it differs "
        "from the earlier puzzles and what is new about it; only then write the program and its "
        "input.\n\n"
        "Earlier puzzles:\n{references}\n\n"
        "Answer format: inside <answer> </answer>, one ```python block with the program, then one "
        "```input block with the input.")


PROMPTS: dict[str, str] = {
    "wrapper": _PREAMBLE + "User: {task}\n\nAssistant: <think>",
    # shared by the proposers and the induction solver; {definitions} is one of the two rules below
    "code_rules": (
        "Rules for the program:\n"
        "- The entry function is named `f`; it takes at least one argument and returns a value.\n"
        "{definitions}"
        "- It is deterministic: no randomness, dates or clocks, file or network I/O, printing or "
        "logging, and no outside state.\n"
        "- Imports and classes come first, at the top; the program ends with the return of `f`: "
        "nothing follows.\n"
        "- It finishes well within {timeout} seconds on a modern CPU.\n"
        "- These modules may not be imported or used: {banned}.\n"),
    "definitions_single": (  # --reject-multiple-defs (the official parser's rule)
        "- `f` is the only function: no helper functions, no functions nested in `f`, no methods "
        "(a program with more than one `def` is rejected). Classes without methods are fine.\n"),
    "definitions_helpers": "- Helper functions and classes are allowed, also nested inside `f`.\n",
    "propose_deduction": _propose(
        "A test subject will see your program and your input and must deduce the output.",
        "its output is hard to predict from the program and the input;"),
    "propose_abduction": _propose(
        "A test subject will see your program and the output of your input, and must find an input "
        "that produces that output (any such input counts).",
        "your input is hard to recover from the program and its output;"),
    "propose_induction": (
        "Here is a Python program; it will be called as `f(<your input>)`.\n"
        "```python\n{program}\n```\n"
        "Write {n} inputs for it and a message for an I.Q. test: a test subject will see some of "
        "your inputs with the outputs they produce, plus your message, and must rebuild the "
        "program.\n"
        "- Each input is " + _CALL_FORMAT + "; put each input in its own ```input block.\n"
        "- Every input must run without error.\n"
        "- Coverage: together, the inputs and their outputs should pin down what `f` does over its "
        "whole input space.\n"
        "- Variety: the inputs differ clearly from each other and give diverse outputs.\n"
        "- Difficulty: inputs and message together make the task challenging, but not impossible.\n"
        "- The message helps the test subject: a coding question, a hint or a plain description of "
        "what the program does, but never the code itself. Put it in one ```message block.\n\n"
        "Plan first: understand the program, then decide how your inputs cover it and why they are "
        "challenging and varied; only then write the inputs and the message.\n\n"
        "Answer format: inside <answer> </answer>, {n} ```input blocks (one input each), then one "
        "```message block."),
    "solve_deduction": (
        "Deduce what this program returns for the given input; work through it step by step.\n"
        "```python\n{program}\n```\n```input\n{input}\n```\n"
        "Answer format: inside <answer> </answer>, one ```output block with the return value as a "
        "Python literal: strings in quotes, a tuple if it returns several values."),
    "solve_abduction": (
        "Find an input for which this program returns the given output; any such input counts. "
        "Work through it step by step.\n```python\n{program}\n```\n```output\n{output}\n```\n"
        "The input is " + _CALL_FORMAT + ".\n"
        "Answer format: inside <answer> </answer>, one ```input block."),
    "solve_induction": (
        "Deduce the Python function `f` that maps each input below to its output. It will be run "
        "on hidden inputs and must reproduce the outputs of the program that made these pairs.\n"
        "Message: {message}\n\n{pairs}\n"
        "Check your function against each pair in turn, and revise it until it fits all of them.\n"
        "{code_rules}"
        "\nAnswer format: inside <answer> </answer>, one ```python block defining `f`."),
    # evaluation (official evaluation/math_eval/eval/utils.py, template "azr": the question is the
    # User turn, the Assistant turn is left unopened)
    "eval_math": _PREAMBLE + "User: {question}\n\nAssistant:",
    "eval_code": _PREAMBLE + "User: {task} Put the code inside your <answer> tags.\n\nAssistant:",
}

_BANNED_LIST = ", ".join(sorted(m for m in BANNED_MODULES if not m.startswith("_")))


@functools.lru_cache(maxsize=8)
def _prompt_file(path: str) -> dict[str, str]:
    return common.load_prompts(path, PROMPTS)


def prompts(cfg: Config) -> dict[str, str]:
    """Our templates, or those of --prompts FILE in their place (check_config loads the file first,
    so a bad one is a usage error before anything loads)."""
    return _prompt_file(cfg.prompts) if cfg.prompts else PROMPTS


def wrap(task: str, cfg: Config) -> str:
    return prompts(cfg)["wrapper"].format(task=task)


def _code_rules(cfg: Config, single_def: bool) -> str:
    t = prompts(cfg)
    rule = t["definitions_single" if single_def else "definitions_helpers"]
    return t["code_rules"].format(timeout=f"{cfg.executor_timeout:g}", banned=_BANNED_LIST,
                                  definitions=rule)


def _fence(kind: str, text: str) -> str:
    return f"```{kind}\n{text}\n```"


def proposer_prompt(task: str, refs: list[dict], cfg: Config, program: str = "") -> str:
    t = prompts(cfg)
    if task == "induction":
        return wrap(t["propose_induction"].format(program=program, n=cfg.induction_inputs), cfg)
    shown = "\n\n".join(f"Earlier puzzle {k + 1}:\n{_fence('python', r['program'])}\n"
                        f"{_fence('input', r['input'])}\n{_fence('output', r['output'])}"
                        for k, r in enumerate(refs))
    rules = _code_rules(cfg, cfg.reject_multiple_defs)
    filled = t[f"propose_{task}"].format(references=shown or "(none yet)", code_rules=rules)
    return wrap(filled, cfg)


def solver_prompt(task: str, entry: dict, cfg: Config) -> str:
    t = prompts(cfg)
    if task == "deduction":
        filled = t["solve_deduction"].format(program=entry["program"], input=entry["input"])
    elif task == "abduction":
        filled = t["solve_abduction"].format(program=entry["program"], output=entry["output"])
    else:
        half = len(entry["inputs"]) // 2
        shown = zip(entry["inputs"][:half], entry["outputs"][:half])
        pairs = "\n".join(_fence(f"input_{k + 1}", i) + "\n" + _fence(f"output_{k + 1}", o)
                          for k, (i, o) in enumerate(shown))
        # solver programs may have helpers: the official parser counts the defs of proposals only
        rules = _code_rules(cfg, single_def=False)
        filled = t["solve_induction"].format(message=entry["message"], pairs=pairs,
                                             code_rules=rules)
    return wrap(filled, cfg)


def _fits(tokenizer, prompt: str, cfg: Config) -> bool:
    return len(common.encode_prompt(tokenizer, prompt)) <= cfg.max_prompt_tokens


# --------------------------------------------------------------------------------------------------------------
# Parsing model output. Model output is untrusted: nothing here may raise.
# --------------------------------------------------------------------------------------------------------------
_FORMAT_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>", re.S)
# a fence with an optional tag; the body may start on the fence's own line (the official patterns
# allow that too)
_BLOCK_RE = re.compile(r"```[ \t]*([A-Za-z_]\w*)?[ \t]*\n?(.*?)```", re.S)
_PYTHON_TAGS = ("python", "py", "python3")
_MAX_INPUT_CHARS = 100_000  # not in the paper: a longer input is invalid
_ANSWER_BLOCK = {"deduction": "output", "abduction": "input", "induction": "python"}


def extract_answer(completion: str) -> str | None:
    """The last <answer> block, if the response has R1 format (the prompt already opened <think>)."""
    text = "<think>" + completion
    if not _FORMAT_RE.match(text):
        return None
    start = text.rfind("<answer>")
    end = text.find("</answer>", start)
    return text[start + len("<answer>"):end] if end >= 0 else None


def blocks(answer: str, kind: str | None) -> list[str]:
    """The bodies of the fenced blocks tagged `kind` (any tag, or none, for kind None)."""
    return [body.strip() for k, body in _BLOCK_RE.findall(answer)
            if kind is None or k.lower() == kind]


def solver_answer(completion: str, task: str) -> str | None:
    """What a solver answer is graded on, None for a format error (Eq. 6: -1). Format means the
    <think>/<answer> tags only, as in the official reward manager (rewards/reward_managers.py,
    get_format_reward):
      deduction, abduction: the last ```output / ```input block, else the whole <answer> text (the
        official extract_input_output falls back to it as well);
      induction: the last ```python block, else the last fenced block of any tag (the official
        parse_code_function accepts any fence); no fenced block at all is a format error there, and
        here."""
    answer = extract_answer(completion)
    if answer is None:
        return None
    if task == "induction":
        code = [b for k, b in _BLOCK_RE.findall(answer) if (k or "").lower() in _PYTHON_TAGS]
        code = code or blocks(answer, None)
        return code[-1].strip() if code else None
    found = blocks(answer, _ANSWER_BLOCK[task])
    return found[-1] if found else answer.strip()


@functools.lru_cache(maxsize=512)
def _program_functions(program: str) -> frozenset:
    """`f` and the names of the program's top-level functions, which an input may not call."""
    try:
        body = ast.parse(program).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        body = []
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    return frozenset({"f"} | {n.name for n in body if isinstance(n, defs)})


def check_input(text: str, program: str = "") -> str | None:
    """None if `text` is the argument list of one call, to be pasted into f(...) and evaluated in
    the sandbox as the official code does (templates.py: `f({inputs})`), so expressions
    (`list(range(5))`, `'a' * 3`) and keyword arguments work; else the reject reason. Nothing is
    evaluated here: the AST must be a single call (no text that closes the call and starts another
    expression), with nothing banned in it (the proposal checks), and it may not call the program's
    own functions (an abduction answer could otherwise search for the input with f itself). Huge
    values, endless loops and errors are the sandbox's business."""
    if not isinstance(text, str) or not text.strip():
        return "syntax"
    if len(text) > _MAX_INPUT_CHARS:
        return "too_large"
    try:
        node = ast.parse(f"_(\n{text.strip()}\n)", mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "syntax"
    one_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
        node.func.id == "_"
    if not one_call or not (node.args or node.keywords):
        return "syntax"
    if any(_banned(n) for n in ast.walk(node)) or _uses_banned_name(node):
        return "banned"
    own = _program_functions(program)
    if any(isinstance(n, ast.Name) and n.id in own for n in ast.walk(node)):
        return "banned"
    return None


def call_expression(text: str) -> str:
    """The expression the sandbox evaluates for an input that passed check_input (the newlines keep
    a trailing comment from swallowing the closing parenthesis)."""
    return f"f(\n{text.strip()}\n)"


def _module_banned(name: str) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:k]) in BANNED_MODULES for k in range(1, len(parts) + 1))


def _banned(node: ast.AST) -> bool:
    """Imports of banned modules and banned attributes (names are scope-dependent: _uses_banned_name)."""
    if isinstance(node, ast.Import):
        return any(_module_banned(a.name) for a in node.names)
    if isinstance(node, ast.ImportFrom):  # relative imports could reach anything next to the program
        return bool(node.level) or _module_banned(node.module or "") or \
            any(_module_banned(f"{node.module}.{a.name}") for a in node.names)
    return isinstance(node, ast.Attribute) and node.attr in BANNED_ATTRS


_FUNCTION_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_NESTED_SCOPES = _FUNCTION_SCOPES + _COMPREHENSIONS + (ast.ClassDef,)


def _function_locals(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> set[str]:
    """Names that are local to a function: parameters and every name its body binds (assignment, for, with,
    except, match and walrus targets, del, def/class names, import aliases), minus `global`/`nonlocal` ones.
    A local name never falls back to the builtin, even when read before it is bound (UnboundLocalError)."""
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x is not None}
    declared: set[str] = set()
    stack = list(fn.body) if isinstance(fn.body, list) else [fn.body]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)  # its own body is another scope
            continue
        if isinstance(node, (ast.Lambda,) + _COMPREHENSIONS):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((x.asname or x.name).split(".")[0] for x in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            declared.update(node.names)
        stack.extend(ast.iter_child_nodes(node))
    return names - declared


def _uses_banned_name(tree: ast.AST) -> bool:
    """A BANNED_NAMES name that is not local to an enclosing function or comprehension, i.e. one that may resolve
    to the builtin. Module and class bodies do not count as binding: there a read before the assignment (or after
    a `del`) still finds the builtin. Decorators, defaults, annotations and a comprehension's first iterable run
    in the enclosing scope and are checked there. Iterative, so a deeply nested expression cannot overflow."""
    stack: list[tuple[ast.AST, frozenset]] = [(tree, frozenset())]
    while stack:
        node, bound = stack.pop()
        if isinstance(node, ast.Name) and node.id in BANNED_NAMES and node.id not in bound:
            return True
        if isinstance(node, _FUNCTION_SCOPES):
            a = node.args
            outside = a.defaults + [d for d in a.kw_defaults if d is not None]
            if not isinstance(node, ast.Lambda):
                outside += node.decorator_list + ([node.returns] if node.returns else [])
                outside += [x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]
                            if x is not None and x.annotation is not None]
            inner = bound | _function_locals(node)
            stack.extend((n, bound) for n in outside)
            stack.extend((n, inner) for n in (node.body if isinstance(node.body, list) else [node.body]))
        elif isinstance(node, _COMPREHENSIONS):
            gens = node.generators
            targets = {n.id for g in gens for n in ast.walk(g.target)
                       if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            inner = bound | targets
            stack.append((gens[0].iter, bound))
            # targets too: a subscript target such as `a[open]` reads a name
            rest = [g.target for g in gens] + [x for g in gens for x in g.ifs] + [g.iter for g in gens[1:]]
            rest += [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            stack.extend((n, inner) for n in rest)
        else:
            stack.extend((n, bound) for n in ast.iter_child_nodes(node))
    return False


def static_check(program: str, max_chars: int = 8000,
                 single_def: bool = False) -> tuple[str | None, str]:
    """(reason or None, program with entry function `f`): the AST must parse, hold nothing banned
    (§3.3.3) and define a top-level entry function. With `single_def` (proposals under
    --reject-multiple-defs) a program with more than one def anywhere, nested helpers and methods
    included, is invalid: the official parser counts every `def` line (rewards/code_reward.py
    parse_code_input_output, reject_multiple_functions)."""
    if not program or len(program) > max_chars:
        return ("too_large" if program else "syntax"), program
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "syntax", program
    if any(_banned(node) for node in ast.walk(tree)) or _uses_banned_name(tree):
        return "banned", program
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    if single_def and sum(isinstance(n, defs) for n in ast.walk(tree)) > 1:
        return "multiple_defs", program
    # otherwise only top-level definitions count, so nested helpers and classes are allowed
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if any(n.name == "f" for n in defs):
        ok = not any(n.name == "f" and isinstance(n, ast.AsyncFunctionDef) for n in defs)
        return (None if ok else "syntax"), program
    if len(defs) != 1 or isinstance(defs[0], ast.AsyncFunctionDef):
        return "syntax", program
    return None, f"{program.rstrip()}\n\nf = {defs[0].name}"  # the single entry function becomes f


def strip_program(program: str) -> str:
    """Seed programs lose comments, docstrings and top-level statements other than imports and definitions
    (§3.3.1), so that the references the model starts from are plain code."""
    body = [n for n in ast.parse(program).body
            if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))
            or (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                and n.targets[0].id == "f")]
    module = ast.Module(body=body, type_ignores=[])
    for node in ast.walk(module):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and node.body and \
                isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            node.body = node.body[1:] or [ast.Pass()]
    return ast.unparse(module)


def parse_triplet_proposal(completion: str) -> dict:
    """{'program','input'} or {'reason'}: the first ```python block and the first ```input block."""
    answer = extract_answer(completion) or ""
    programs, inputs = blocks(answer, "python"), blocks(answer, "input")
    if not programs or not inputs:
        return {"reason": "format"}
    reason = check_input(inputs[0], programs[0])
    if reason:
        return {"reason": reason, "program": programs[0], "input": inputs[0]}
    return {"program": programs[0], "input": inputs[0].strip()}


def parse_induction_proposal(completion: str, n: int, program: str = "") -> dict:
    """{'inputs','message'} or {'reason'}: all ```input blocks (>= n, the last n kept) and the
    ```message."""
    answer = extract_answer(completion) or ""
    inputs, messages = blocks(answer, "input"), blocks(answer, "message")
    if len(inputs) < n or not messages or not messages[-1]:
        return {"reason": "format"}
    reason = next((r for r in (check_input(i, program) for i in inputs[-n:]) if r), None)
    if reason:
        return {"reason": reason}
    return {"inputs": [i.strip() for i in inputs[-n:]], "message": messages[-1][:2000]}


# --------------------------------------------------------------------------------------------------------------
# The executor (§3.3.3) and the buffers. Programs run in common.PythonSandbox; gold values never enter it; results
# come back as repr text and are compared in this (trusted) process with ==, after common.parse_literal.
# --------------------------------------------------------------------------------------------------------------
# only the repr form of an object's address ('<Node object at 0x7f3a...>'): a bare hex number such as
# hex(12345678) == '0xbc614e' is a legitimate output; any other address dependence shows up in the j runs
_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+>")
_STATUS_REASON = {"ok": None, "error": "error", "crash": "error", "memory": "error", "sandbox_error": "error",
                  "forbidden": "banned", "timeout": "timeout", "output_limit": "too_large"}


def _same_value(a, b) -> bool:
    """Determinism compares values, not printed text: two hash seeds may print the same set in different orders
    (the trainer compares parsed values with ==, sets are order-free); the type must match too."""
    try:
        return type(a) is type(b) and bool(a == b)
    except (RecursionError, MemoryError, ValueError, TypeError):
        return False


class Executor:
    """Runs f(<input>) for (program, input text) jobs and classifies the outcome. There are
    `determinism_runs` sandboxes, each with its own zygote processes (so its own address-space
    layout) and its own PYTHONHASHSEED (= j): run j of a job always goes to sandbox j, so two runs
    never share a process, a memory layout or a hash secret. Under torchrun only rank 0 runs
    programs and broadcasts the outcomes: wall-clock limits could otherwise make ranks disagree
    about which tasks are valid or which answers are right, and their buffers would diverge."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.sandboxes = [common.PythonSandbox(workers=cfg.sandbox_workers, timeout_s=cfg.executor_timeout,
                                               memory_mb=cfg.sandbox_memory_mb, max_output_chars=cfg.max_output_chars,
                                               hash_seed=j) for j in range(max(1, cfg.determinism_runs))]

    def call(self, jobs: list[tuple[str, str]], run: int = 0) -> list[tuple[str, str]]:
        """-> [(status, output repr)], status: ok | syntax | banned | error | timeout | too_large |
        nondeterministic | non_literal. The input text is checked again (check_input: jobs may come
        from an edited checkpoint) and evaluated in the sandbox only; the output must parse as a
        finite literal that survives a repr round trip."""
        return [(status, text) for status, text, _ in self._call(jobs, run)]

    def _call(self, jobs: list[tuple[str, str]], run: int = 0) -> list[tuple[str, str, object]]:
        """call() with the parsed output value as a third item (None unless ok); rank 0 runs, all ranks get it."""
        rank, world = common.dist_info()
        if world == 1:
            return self._run(jobs, run)
        return common.broadcast_object(self._run(jobs, run) if rank == 0 else None)

    def _run(self, jobs: list[tuple[str, str]], run: int) -> list[tuple[str, str, object]]:
        refused = [check_input(text, program) for program, text in jobs]
        todo = [(p, call_expression(t)) for (p, t), r in zip(jobs, refused) if r is None]
        results = iter(self.sandboxes[run].run_many(todo) if todo else [])
        out = []
        for r in refused:
            if r is not None:
                out.append((r, "", None))
                continue
            res = next(results)
            reason = _STATUS_REASON.get(res.status, "error")
            if reason is not None:
                out.append((reason, res.error or "", None))
                continue
            if _ADDRESS_RE.search(res.value):  # e.g. '<object at 0x7f..>' inside a string
                out.append(("nondeterministic", res.value, None))
                continue
            try:
                value = common.parse_literal(res.value, max_chars=self.cfg.max_output_chars)
                out.append(("ok", res.value, value))
            except ValueError:
                out.append(("non_literal", res.value, None))
        return out

    def run_checked(self, jobs: list[tuple[str, str]]) -> list[tuple[str | None, str]]:
        """Proposal validation: the j runs must all succeed and give the same VALUE (== and the same type; the
        printed text may differ, e.g. set order under another hash seed). Run 0's text becomes the gold output.
        -> [(reject reason or None, gold output repr)]."""
        out = []
        for per_job in zip(*[self._call(jobs, run=j) for j in range(len(self.sandboxes))]):
            bad = next((s for s, _, _ in per_job if s != "ok"), None)
            if bad is None and not all(_same_value(per_job[0][2], v) for _, _, v in per_job[1:]):
                bad = "nondeterministic"
            out.append((bad, "") if bad else (None, per_job[0][1]))
        return out

    def close(self):
        for sb in self.sandboxes:
            sb.close()


class Buffer:
    """D_ded, D_abd or D_ind: JSON-able entries, stored in checkpoints. The cap evicts the oldest entries."""

    def __init__(self, cap: int, entries: list[dict] | None = None):
        self.cap, self.entries = cap, list(entries or [])[-cap:]

    def add(self, entry: dict) -> None:
        self.entries.append(entry)
        del self.entries[:-self.cap]  # keep the newest `cap`

    def sample(self, k: int, rng: random.Random, replace: bool = False) -> list[dict]:
        if not self.entries or k <= 0:
            return []
        if replace:
            return [rng.choice(self.entries) for _ in range(k)]
        return rng.sample(self.entries, min(k, len(self.entries)))

    def __len__(self):
        return len(self.entries)


def buffers_state(buffers: dict[str, Buffer]) -> dict:
    return {t: b.entries for t, b in buffers.items()}


def buffers_from_state(state: dict, cap: int) -> dict[str, Buffer]:
    return {t: Buffer(cap, state.get(t, [])) for t in TASKS}


# --------------------------------------------------------------------------------------------------------------
# Step 2: validate proposals (§3.3.3). Each proposal dict gets 'reason' (None = valid) and, if valid, its entry.
# --------------------------------------------------------------------------------------------------------------
def validate(executor: Executor, task: str, proposals: list[dict], cfg: Config, step: int = 0,
             tokenizer=None) -> list[dict]:
    """Deduction/abduction: static checks, then the runs give the gold output. Induction (a buffer program + N
    inputs + message): every input must run validly. A task whose solver prompt would not fit the prompt budget
    is useless (back-filling would run dry): too_large."""
    jobs, owner = [], []
    for k, p in enumerate(proposals):
        if p.get("reason"):
            continue
        if task != "induction":  # induction programs come from the buffers, already checked
            p["reason"], p["program"] = static_check(p["program"], cfg.max_program_chars,
                                                     single_def=cfg.reject_multiple_defs)
            if p["reason"]:
                continue
        for text in (p["inputs"] if task == "induction" else [p["input"]]):
            jobs.append((p["program"], text))
            owner.append(k)
    runs: dict[int, list] = {}
    for k, res in zip(owner, executor.run_checked(jobs)):
        runs.setdefault(k, []).append(res)
    for k, res in runs.items():
        p = proposals[k]
        p["reason"] = next((r for r, _ in res if r), None)
        if p["reason"] is None:
            outputs = [o for _, o in res]
            if task == "induction":
                p["entry"] = {"program": p["program"], "inputs": p["inputs"], "outputs": outputs,
                              "message": p["message"]}
            else:
                p["entry"] = {"program": p["program"], "input": p["input"], "output": outputs[0]}
            p["entry"]["step"] = step
            if tokenizer is not None and not _fits(tokenizer, solver_prompt(task, p["entry"], cfg), cfg):
                p["reason"], p["entry"] = "too_large", None
    for p in proposals:
        p.setdefault("reason", None)
    return proposals


# --------------------------------------------------------------------------------------------------------------
# Steps 3-5: grade solver answers (Eq. 5; gold values stay in this process, == on parsed literals) and reward.
# --------------------------------------------------------------------------------------------------------------
def _equal(pred_text: str, gold_text: str) -> bool:
    """Value equality in trusted code (Eq. 5): sets are order-free, 1 == 1.0, a tuple is not a list."""
    try:
        return bool(common.parse_literal(pred_text, require_roundtrip=False) == common.parse_literal(gold_text))
    except (ValueError, RecursionError, MemoryError):
        return False


def check_solutions(executor: Executor, task: str, entries: list[dict], completions: list[str],
                    cfg: Config) -> list[tuple[bool, bool]]:
    """(formatted, correct) per answer, on solver_answer's text. deduction: the predicted output, a
    literal, equals the gold one (never evaluated: an expression would let the executor do the
    solving); abduction: f(predicted input) == gold output, the input evaluated in the sandbox like
    a proposal's (f need not be one-to-one); induction: the program passes the proposals' static
    checks (without the one-def rule, which the official code applies to proposals only) and EVERY
    held-out pair."""
    out = [(False, False)] * len(completions)
    jobs, owner = [], []
    for k, (entry, text) in enumerate(zip(entries, completions)):
        pred = solver_answer(text, task)
        if pred is None:
            continue
        out[k] = (True, task == "deduction" and _equal(pred, entry["output"]))
        tests = []  # (program, input text, gold output) to run in the sandbox
        if task == "abduction":
            tests = [(entry["program"], pred, entry["output"])]
        elif task == "induction":
            reason, program = static_check(pred, cfg.max_program_chars)
            half = len(entry["inputs"]) // 2
            held_out = zip(entry["inputs"][half:], entry["outputs"][half:])
            tests = [] if reason else [(program, i, o) for i, o in held_out]
        for program, inp, gold in tests:
            jobs.append((program, inp))
            owner.append((k, gold))
    passed: dict[int, bool] = {}
    for (k, gold), (status, value) in zip(owner, executor.call(jobs)):
        passed[k] = passed.get(k, True) and status == "ok" and _equal(value, gold)
    for k, ok in passed.items():
        out[k] = (True, ok)
    return out


# Step 5, rewards: Eq. 4 (or Eq. 3) for valid proposals, Eq. 5 for the solver, Eq. 6 format penalties for both.
def proposer_reward(valid: bool, solve_rate: float | None, cfg: Config) -> float:
    if not valid:
        return common.FORMAT_ERROR  # any invalid proposal counts as a format error (Eq. 6, spec §2)
    if solve_rate in (0.0, 1.0):
        return float(cfg.zero_learnability_reward)  # 0 in the paper, -0.5 in the official code
    return float(common.proposer_reward(solve_rate, cfg.proposer_reward))


def solver_reward(formatted: bool, correct: bool) -> float:
    return common.azr_composite_reward(1.0, formatted=formatted, passable=correct)


def trr_advantages(rewards: list[float], roles: list[str], eps: float = 1e-6, lengths=None,
                   token_weighted: bool = False) -> list[float]:
    """TRR++ (Eq. 8): A = (r - mu_{task,role}) / sigma_{task,role}; roles are '<role>/<task>', so 6 keys."""
    return common.keyed_advantages(rewards, roles, eps, lengths=lengths, token_weighted=token_weighted).tolist()


# --------------------------------------------------------------------------------------------------------------
# The loop: one function per step of Alg. 1, in order.
# --------------------------------------------------------------------------------------------------------------
def _generate(policy, prompts: list[str], n: int, cfg: Config, temperature: float | None = None,
              top_p: float | None = None):
    if not prompts:
        return []
    return policy.generate(prompts, n=n, temperature=cfg.temperature if temperature is None else temperature,
                           top_p=cfg.top_p if top_p is None else top_p, max_tokens=cfg.max_response_tokens)


def seed_buffers(policy, executor: Executor, cfg: Config, rng: random.Random) -> dict[str, Buffer]:
    """Step 0 (§3.3.1, spec §1), no updates, in two phases:
      1. D_seed: rounds of B deduction, then B abduction proposer prompts (taking turns, as the official code's
         _init_seed_dataset alternates the problem type), each with up to K references from D_seed, until it holds
         S*B triplets (the zero triplet included). Seed programs lose comments and globals (strip_program) and are
         validated again, since stripping may break them. D_ded = D_abd = D_seed.
      2. D_ind: induction proposals on programs drawn from the FINISHED D_seed, until it holds S*B tasks; built
         together with phase 1, every early induction seed would be on the identity program of the zero triplet.
    Each phase gives up after --seed-max-rounds rounds (weak models) and training starts with what it has."""
    target = cfg.seed_factor * cfg.batch_size
    seed = Buffer(cfg.buffer_cap, [dict(ZERO_TRIPLET, step=0)])
    ind = Buffer(cfg.buffer_cap)
    views = {"deduction": seed, "abduction": seed, "induction": ind}
    for r in range(cfg.seed_max_rounds):
        if len(seed) >= target:
            break
        task = ("deduction", "abduction")[r % 2]
        stripped = []
        for p in propose(policy, executor, views, cfg, rng, 0, tasks=(task,))[task]:
            if p["reason"] is None:
                with contextlib.suppress(SyntaxError, ValueError, RecursionError):
                    stripped.append({"program": strip_program(p["program"]), "input": p["input"]})
        for q in validate(executor, task, stripped, cfg, 0, policy.tokenizer):
            if q["reason"] is None and len(seed) < target:
                seed.add(q["entry"])
    for _ in range(cfg.seed_max_rounds):
        if len(ind) >= target:
            break
        for p in propose(policy, executor, views, cfg, rng, 0, tasks=("induction",))["induction"]:
            if p["reason"] is None and len(ind) < target:
                ind.add(p["entry"])
    if len(seed) < target or len(ind) < target:
        print(f"[absolute_zero] seeding stopped after {cfg.seed_max_rounds} rounds per phase with {len(seed)} "
              f"triplets and {len(ind)} induction tasks (target {target}); training starts with these",
              file=sys.stderr)
    return {"deduction": Buffer(cfg.buffer_cap, list(seed.entries)),
            "abduction": Buffer(cfg.buffer_cap, list(seed.entries)), "induction": ind}


def make_triplet_prompt(policy, task: str, buffer: Buffer, cfg: Config, rng: random.Random) -> str:
    """K references drawn uniformly without replacement, dropped until the prompt fits (at most K retries,
    unlike the code's unbounded resampling loop)."""
    refs = buffer.sample(cfg.references, rng)
    prompt = proposer_prompt(task, refs, cfg)
    while refs and not _fits(policy.tokenizer, prompt, cfg):
        refs.pop()
        prompt = proposer_prompt(task, refs, cfg)
    return prompt


def make_induction_prompt(policy, programs: list[str], cfg: Config, rng: random.Random) -> tuple[str, str] | None:
    for _ in range(4):  # a few draws for a program whose prompt fits; then give up on this prompt
        program = rng.choice(programs)
        prompt = proposer_prompt("induction", [], cfg, program=program)
        if _fits(policy.tokenizer, prompt, cfg):
            return program, prompt
    return None


def propose(policy, executor: Executor, buffers: dict[str, Buffer], cfg: Config, rng: random.Random, step: int,
            tasks=TASKS) -> dict[str, list[dict]]:
    """Steps 1-2 for the given task types (the caller adds the valid tasks to the buffers)."""
    props: dict[str, list[dict]] = {t: [] for t in tasks}
    # D_ded u D_abd de-duplicated, so seed programs (in both buffers) are not drawn twice as often
    programs = list(dict.fromkeys(e["program"] for t in ("deduction", "abduction") for e in buffers[t].entries))
    for t in tasks:
        for _ in range(cfg.batch_size):
            if t != "induction":
                props[t].append({"task": t, "prompt": make_triplet_prompt(policy, t, buffers[t], cfg, rng)})
            elif programs and (made := make_induction_prompt(policy, programs, cfg, rng)):
                props[t].append({"task": t, "program": made[0], "prompt": made[1]})
    flat = [p for t in tasks for p in props[t]]
    for p, group in zip(flat, _generate(policy, [p["prompt"] for p in flat], 1, cfg)):
        p["completion"] = group[0]
        p.update(parse_induction_proposal(group[0].text, cfg.induction_inputs, p["program"])
                 if p["task"] == "induction" else parse_triplet_proposal(group[0].text))
    for t in tasks:
        validate(executor, t, props[t], cfg, step, policy.tokenizer)
    return props


def estimate_learnability(policy, executor: Executor, props: dict[str, list[dict]], cfg: Config) -> None:
    """Step 3 (Eq. 4): r_bar of every valid proposal, stored as p['solve_rate']. The n samples are always drawn
    at T = 1, top-p 1 (spec §1: master drew them with the greedy validation settings, n identical answers)."""
    n = cfg.learnability_samples
    valid = [p for t in props for p in props[t] if p["reason"] is None]
    groups = _generate(policy, [solver_prompt(p["task"], p["entry"], cfg) for p in valid], n, cfg,
                       temperature=1.0, top_p=1.0)
    for t in TASKS:
        idx = [k for k, p in enumerate(valid) if p["task"] == t]
        graded = check_solutions(executor, t, [valid[k]["entry"] for k in idx for _ in range(n)],
                                 [c.text for k in idx for c in groups[k]], cfg)
        for j, k in enumerate(idx):
            rows = graded[j * n:(j + 1) * n]
            valid[k]["solve_rate"] = sum(c for _, c in rows) / len(rows)


def solve(policy, executor: Executor, props: dict[str, list[dict]], buffers: dict[str, Buffer], cfg: Config,
          rng: random.Random, step: int) -> dict[str, list[dict]]:
    """Step 4: the back-filling draws uniformly from the buffer's older tasks (with replacement if too few)."""
    work: dict[str, list[dict]] = {}
    for t in TASKS:
        new = [p["entry"] for p in props[t] if p["reason"] is None][: cfg.batch_size]
        old = [e for e in buffers[t].entries if e.get("step") != step] or buffers[t].entries
        need = cfg.batch_size - len(new)
        fill = rng.sample(old, need) if need <= len(old) else [rng.choice(old) for _ in range(need)] if old else []
        work[t] = [{"task": t, "entry": e, "new": k < len(new)} for k, e in enumerate(new + fill)]
    flat = [s for t in TASKS for s in work[t]]
    for s, group in zip(flat, _generate(policy, [solver_prompt(s["task"], s["entry"], cfg) for s in flat], 1, cfg)):
        s["completion"] = group[0]
    for t in TASKS:
        graded = check_solutions(executor, t, [s["entry"] for s in work[t]], [s["completion"].text for s in work[t]],
                                 cfg)
        for s, (formatted, correct) in zip(work[t], graded):
            s.update(formatted=formatted, correct=correct, reward=solver_reward(formatted, correct))
    return work


def build_trajectories(props: dict[str, list[dict]], solved: dict[str, list[dict]], cfg: Config):
    """The joint 6*B batch with TRR++ advantages (Eq. 8); role '<role>/<task>' gives the 6 keys. With
    --freeze-proposer the proposer trajectories are dropped BEFORE the advantages and the loss, so they count in
    no normaliser. Each record gets its 'advantage' (None if it is not trained on)."""
    records, trajs = [], []
    for t in TASKS:
        for role, recs in (("proposer", props[t]), ("solver", solved[t])):
            for r in recs:
                r["advantage"] = None
                if (role == "proposer" and cfg.freeze_proposer) or not r["completion"].token_ids:
                    continue
                records.append(r)
                trajs.append(common.Trajectory.from_completion(r["completion"], reward=r["reward"],
                                                               role=f"{role}/{t}"))
    if trajs:
        adv = trr_advantages([tr.reward for tr in trajs], [tr.role for tr in trajs],
                             lengths=[len(tr.completion_ids) for tr in trajs],
                             token_weighted=cfg.token_weighted_advantages)
        for tr, r, a in zip(trajs, records, adv):
            tr.advantage = r["advantage"] = a
    return trajs


def trr_update(policy, props: dict[str, list[dict]], solved: dict[str, list[dict]], cfg: Config) -> dict:
    """Step 6: one AdamW step per cfg.mini_batch trajectories of the task-ordered batch (by default
    one per task type), then common.pg_step syncs the new weights into the sampler."""
    trajs = build_trajectories(props, solved, cfg)
    if not trajs:
        return {}
    pg = common.PGConfig(clip_low=cfg.clip_ratio, clip_high=cfg.clip_ratio, entropy_coef=cfg.entropy_coef,
                         aggregation=cfg.aggregation, max_len=cfg.max_response_tokens,
                         temperature=cfg.temperature, mini_batch=cfg.mini_batch)
    return common.pg_step(policy, trajs, pg)


def self_play_step(policy, executor: Executor, buffers: dict[str, Buffer], cfg: Config, rng: random.Random,
                   step: int, run=None) -> tuple[dict, dict, dict]:
    """One iteration of Alg. 1."""
    timer = run.timer if run is not None else (lambda name: contextlib.nullcontext())
    with timer("propose"):
        props = propose(policy, executor, buffers, cfg, rng, step)
        for t in TASKS:
            for p in props[t]:
                if p["reason"] is None:
                    buffers[t].add(p["entry"])
    with timer("learnability"):
        estimate_learnability(policy, executor, props, cfg)
    for t in TASKS:
        for p in props[t]:
            p["reward"] = proposer_reward(p["reason"] is None, p.get("solve_rate"), cfg)
    with timer("solve"):
        solved = solve(policy, executor, props, buffers, cfg, rng, step)
    with timer("update"):
        stats = trr_update(policy, props, solved, cfg)
    return props, solved, stats


# --------------------------------------------------------------------------------------------------------------
# Metrics (per task type and role; what the AZR paper and "Towards Understanding Self-play" plot)
# --------------------------------------------------------------------------------------------------------------
def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else 0.0


def _nll_entropy(completions) -> float | None:
    """Eq. 1 of "Towards Understanding Self-play": mean over sequences of the per-token NLL of the sampled tokens
    (rollouts at T = 1), from the sampler's log-probs, so it is measured for a frozen proposer too."""
    seqs = [c.logprobs for c in completions if c.logprobs]
    return _mean(-sum(lp) / len(lp) for lp in seqs) if seqs else None


def _ast_key(program: str) -> str:
    """Programs that differ only in comments or formatting count once (analysis §7.2)."""
    try:
        return ast.dump(ast.parse(program))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return program


def _proposal_text(task: str, entry: dict) -> str:
    """What the proposer wrote in a valid proposal: the program (deduction, abduction) or the inputs and message
    (induction, whose program comes from the buffers)."""
    return "\n".join(entry["inputs"] + [entry["message"]]) if task == "induction" else entry["program"]


def step_metrics(props: dict[str, list[dict]], solved: dict[str, list[dict]], buffers: dict[str, Buffer]) -> dict:
    m: dict = {}
    for t in TASKS:
        ps, ss = props[t], solved[t]
        valid = [p for p in ps if p["reason"] is None]
        reasons = Counter(p["reason"] for p in ps if p["reason"])
        m[f"{t}/valid_rate"] = len(valid) / len(ps) if ps else 0.0
        for r in REJECT_REASONS:
            m[f"{t}/reject/{r}"] = reasons.get(r, 0)
        m[f"{t}/buffer_size"] = len(buffers[t])
        m[f"{t}/solver_acc"] = _mean(s["correct"] for s in ss)
        m[f"{t}/solver_reward"] = _mean(s["reward"] for s in ss)
        m[f"{t}/proposer_reward"] = _mean(p["reward"] for p in ps)
        m[f"{t}/new_task_solve_rate"] = _mean(p["solve_rate"] for p in valid)  # difficulty over time (Fig. 2)
        m[f"{t}/new_tasks_in_solver_batch"] = sum(s["new"] for s in ss)
        m[f"len/proposer/{t}"] = _mean(len(p["completion"].token_ids) for p in ps)
        m[f"len/solver/{t}"] = _mean(len(s["completion"].token_ids) for s in ss)
        if valid:
            # induction proposals write inputs and a message for a program drawn from D_ded u D_abd, so for
            # induction these describe the drawn programs, not anything the proposer wrote
            prog = "source_program" if t == "induction" else "program"
            m[f"{t}/{prog}_chars"] = _mean(len(p["entry"]["program"]) for p in valid)
            m[f"{t}/distinct_{prog}s"] = len({_ast_key(p["entry"]["program"]) for p in valid}) / len(valid)
            # analysis.md §7.2: diversity of what the proposer wrote this step (B texts, one BLEU matrix: cheap)
            for k, v in common.diversity_metrics(_proposal_text(t, p["entry"]) for p in valid).items():
                m[f"{t}/diversity/{k}"] = v
    records = {"proposer": [p for t in TASKS for p in props[t]], "solver": [s for t in TASKS for s in solved[t]]}
    for role, recs in records.items():
        m[f"len/{role}"] = _mean(len(r["completion"].token_ids) for r in recs)
        a = [abs(r["advantage"]) for r in recs if r.get("advantage") is not None]
        if a:
            m[f"adv_abs_mean/{role}"] = _mean(a)
    for role, recs in (*records.items(), ("policy", records["proposer"] + records["solver"])):
        h = _nll_entropy(r["completion"] for r in recs)
        if h is not None:
            m[f"entropy/{role}"] = h
    m["valid_rate"] = _mean(m[f"{t}/valid_rate"] for t in TASKS)
    m["solver_acc"] = _mean(m[f"{t}/solver_acc"] for t in TASKS)
    return m


def log_step_samples(run, step: int, props, solved) -> None:
    for t in TASKS:
        run.log_samples(step, f"proposer/{t}", [
            {"task": t, "prompt": p["prompt"], "completion": p["completion"].text, "valid": p["reason"] is None,
             "reason": p["reason"], "task_entry": p.get("entry"), "solve_rate": p.get("solve_rate"),
             "reward": p["reward"]} for p in props[t]])
        run.log_samples(step, f"solver/{t}", [
            {"task": t, "prompt": solver_prompt(t, s["entry"], run.cfg), "completion": s["completion"].text,
             "task_entry": s["entry"], "new_task": s["new"], "formatted": s["formatted"], "correct": s["correct"],
             "reward": s["reward"]} for s in solved[t]])


def append_tasks(run, step: int, props) -> None:
    """tasks.jsonl: every valid proposed task with its step and solve rate (for the difficulty-over-time study,
    analysis.md §2: sample equal numbers per step bucket and re-score with two checkpoints)."""
    if run.is_main:
        with open(run.dir / "tasks.jsonl", "a", encoding="utf-8") as f:
            for p in (p for t in TASKS for p in props[t] if p["reason"] is None):
                row = {"step": step, "task": p["task"], "solve_rate": p["solve_rate"], **p["entry"]}
                f.write(json.dumps(row) + "\n")


# --------------------------------------------------------------------------------------------------------------
# Step 7: evaluation, as the official scripts run it (evaluation/math_eval/eval_math_nodes.sh,
# --template azr): greedy, 16,000 new tokens, the question as the User turn of the training
# preamble, the answer read from the last <answer> block. A base model is evaluated there with a
# boxed-answer chat template instead (qwen-boxed, official issue #27): give one as eval_math with
# --prompts.
# --------------------------------------------------------------------------------------------------------------
_DISPLAY_MATH_RE = re.compile(r"\\\[(.*?)\\\]")


def eval_answer(text: str) -> str | None:
    """The official extraction (evaluation/math_eval/eval/parser.py, extract_azr_answer): the text
    of the last <answer> block, or the last \\boxed{} inside it when it has one; without <answer>,
    the last \\boxed{} of the whole text, else the first \\[ ... \\]; None when nothing is found."""
    if "<answer>" in text:
        answer = text.split("<answer>")[-1].split("</answer>")[0].strip()
        if "boxed" in answer:
            return common.extract_boxed(answer)
        return answer or None
    if "boxed" in text:
        return common.extract_boxed(text)
    m = _DISPLAY_MATH_RE.search(text)
    return m.group(1).strip() or None if m else None


def eval_prompt(problem: dict, tokenizer=None, cfg: Config | None = None) -> str:
    """The eval_math template (--prompts can replace it) on the problem's question."""
    return prompts(cfg or Config())["eval_math"].format(question=problem["question"].strip())


def code_eval_prompt(problem: dict, tokenizer=None, cfg: Config | None = None) -> str:
    """Code benchmarks in the eval_code template; the solution is the last ```python block of the
    answer."""
    return prompts(cfg or Config())["eval_code"].format(task=common.code_task_prompt(problem))


def _named(fn, cfg: Config):
    """fn with cfg bound, named after the template source (eval.json's settings say which was
    used)."""
    def bound(problem, tokenizer=None):
        return fn(problem, tokenizer, cfg)
    bound.__name__ = f"absolute_zero.{fn.__name__}" + (f" ({cfg.prompts})" if cfg.prompts else "")
    return bound


def evaluate(policy, cfg: Config) -> dict:
    results = common.evaluate_config(policy, cfg, prompt_fn=_named(eval_prompt, cfg),
                                     extract_fn=eval_answer) if cfg.eval_benchmarks.strip() else {}
    if cfg.eval_code:
        try:
            results["code"] = common.evaluate_code(
                policy, cfg.eval_code_benchmarks, n=cfg.eval_n, k=cfg.eval_k,
                max_tokens=cfg.eval_max_tokens, limit=cfg.eval_limit,
                prompt_fn=_named(code_eval_prompt, cfg), seed=cfg.seed)
        except common.BenchmarkUnavailable as e:  # a finished training run keeps its math results
            print(f"[absolute_zero] --eval-code skipped: {e}", file=sys.stderr)
            results["code"] = {"skipped": str(e)}
    return results


def eval_metrics(results: dict) -> dict:
    """eval/<bench>/... (math) and eval/code/<bench>/... (code). eval/mean_greedy_acc is the paper's MAvg over the
    six default math sets; eval/code/mean_greedy_acc is the mean over the code sets run here (HumanEval+ and
    MBPP+ by default), NOT the paper's CAvg, which also averages LiveCodeBench (not supported here); so eval/avg,
    their mean, is not the paper's AVG either."""
    m = common.eval_metrics(results)
    if "benchmarks" in results.get("code", {}):
        m.update(common.eval_metrics(results["code"], prefix="eval/code"))
    if "eval/mean_greedy_acc" in m and "eval/code/mean_greedy_acc" in m:
        m["eval/avg"] = (m["eval/mean_greedy_acc"] + m["eval/code/mean_greedy_acc"]) / 2
    return m


# --------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------
def check_config(cfg: Config) -> None:
    """A bad value is a ValueError naming the flag (a usage error, exit 2, from the command line)."""
    if cfg.proposer_reward not in ("learnability", "uncertainty"):
        raise ValueError(f"--proposer-reward {cfg.proposer_reward!r}: choose learnability (Eq. 4) or uncertainty "
                         "(Eq. 3)")
    if cfg.zero_learnability_reward not in (0.0, -0.5):
        raise ValueError(f"--zero-learnability-reward {cfg.zero_learnability_reward}: choose 0 (paper) or -0.5 (code)")
    if cfg.induction_inputs < 2 or cfg.induction_inputs % 2:
        raise ValueError(f"--induction-inputs {cfg.induction_inputs}: needs an even number >= 2 (half shown, half "
                         "held out)")
    if not cfg.temperature > 0:  # the policy gradient needs sampled rollouts (PGConfig would fail only after seeding)
        raise ValueError(f"--temperature {cfg.temperature} must be > 0")
    for name in ("batch_size", "learnability_samples", "seed_factor", "buffer_cap", "determinism_runs", "steps"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.mini_batch < 0:
        raise ValueError(f"--mini-batch {cfg.mini_batch}: trajectories per AdamW step, >= 0")
    if cfg.max_prompt_tokens + 1 > cfg.max_model_len:
        raise ValueError(f"--max-prompt-tokens {cfg.max_prompt_tokens} must be below --max-model-len "
                         f"{cfg.max_model_len}")
    common.check_benchmark_names(cfg.eval_benchmarks)
    prompts(cfg)  # --prompts FILE: unknown names, wrong placeholders or a bad file fail here
    code = [b.strip() for b in cfg.eval_code_benchmarks.split(",") if b.strip()] if cfg.eval_code else []
    for b in code:
        if b.lower() not in common.CODE_BENCHMARKS and not (b.endswith((".jsonl", ".json")) and os.path.isfile(b)):
            raise ValueError(f"--eval-code-benchmarks: {b!r} is neither one of {sorted(common.CODE_BENCHMARKS)} nor "
                             "an existing .jsonl file")
    if any(b.lower() in common.CODE_BENCHMARKS for b in code) and importlib.util.find_spec("datasets") is None:
        raise ValueError("--eval-code: HumanEval+/MBPP+ come from the Hugging Face hub through the `datasets` "
                         "package, which is not installed: pip install datasets, give local JSONL "
                         "files with --eval-code-benchmarks, or skip them with --no-eval-code")


def train(cfg: Config) -> dict:
    check_config(cfg)
    common.seed_everything(cfg.seed)
    run = common.Run(cfg, "absolute_zero")
    policy = common.Policy.load(cfg)
    executor = Executor(cfg)
    try:
        start, state = run.load_checkpoint(policy) or (0, {})
        if state.get("buffers"):
            buffers = buffers_from_state(state["buffers"], cfg.buffer_cap)
            if run.is_main:  # like metrics.jsonl: the steps after the checkpoint are logged again
                common.truncate_jsonl(run.dir / "tasks.jsonl", start)
        else:  # step 0: seed the buffers from the zero triplet, no updates (§3.3.1)
            with run.timer("seed"):
                buffers = seed_buffers(policy, executor, cfg, random.Random(cfg.seed))
            run.log(0, {f"{t}/buffer_size": len(buffers[t]) for t in TASKS})
        bar = run.progress(cfg.steps, initial=start)
        for step in range(start + 1, cfg.steps + 1):
            rng = random.Random(cfg.seed * 1_000_003 + step)  # resumable without storing RNG state
            props, solved, stats = self_play_step(policy, executor, buffers, cfg, rng, step, run)
            metrics = step_metrics(props, solved, buffers)
            metrics.update({f"train/{k}": v for k, v in stats.items()})
            log_step_samples(run, step, props, solved)
            append_tasks(run, step, props)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                with run.timer("eval"):
                    ev = evaluate(policy, cfg)
                run.write_eval(ev, f"eval_step_{step}.json")
                metrics.update(eval_metrics(ev))
            run.log(step, metrics)
            bar.update(1)
            if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
                run.save_checkpoint(step, policy, {"buffers": buffers_state(buffers)})
        results = evaluate(policy, cfg)
        run.write_eval(results)
        return results
    finally:
        executor.close()
        run.close()


def headline(results: dict) -> dict:
    """The final evaluation's figures for the summary table (math and code; a skipped code eval)."""
    figures = {k: v for k, v in eval_metrics(results).items()
               if k.endswith(("greedy_acc", "eval/avg")) or "pass@" in k}
    skipped = results.get("code", {}).get("skipped")
    return {**figures, **({"code skipped": skipped} if skipped else {})}


def main(argv=None):
    common.run_cli(Config, train, argv, check=check_config, tiny=TINY, headline=headline)


if __name__ == "__main__":
    main()
