"""Absolute Zero Reasoner (AZR): Zhao et al., "Absolute Zero: Reinforced Self-play Reasoning with
Zero Data", arXiv:2505.03335v2.

One model proposes and solves tasks on (program p, input i, output o) triplets in three modes:
deduction (o from p, i), abduction (an i with p(i) == o) and induction (p from I/O pairs and a
message); a Python sandbox is the only judge. The loop (Alg. 1, §3.3), one function per step:
  0. seed_buffers           the zero triplet (Fig. 5) grows into D_seed, then D_ind (§3.3.1)
  1. propose                B prompts per task type, K past triplets as references (§3.3.2)
  2. validate               integrity, safety, determinism over j runs (§3.3.3)
  3. estimate_learnability  n solver samples at T = 1 per valid proposal (Eq. 4)
  4. solve                  this step's tasks, back-filled from the buffers to B, graded (Eq. 5)
  5. reward_proposals, solver_reward: learnability (Eq. 4), format penalties (Eq. 6)
  6. trr_update             TRR++ advantages (Eq. 8), PPO-clip (Eq. 9), one step per mini-batch
  7. evaluate               Table 1's math sets; HumanEval+/MBPP+ as run_evalplus.sh (Table 1)
Run: `python absolute_zero.py --model Qwen/Qwen2.5-Coder-7B` (GPU, Table 3), `--model tiny`, or
`--eval-only`. "Towards Understanding Self-play" (README, Analyses): --freeze-proposer (RQ3),
--proposer-reward uncertainty (RQ5), proposals.jsonl for tools/difficulty.py (RQ2). Our prompts;
the official ones go in --prompts FILE (TOML): math as eval_math = '''...''' ({input} as
{question}), evalplus's words as eval_code_evalplus and eval_code_evalplus_response.
Deviations from the official code (LeapLabTHU/Absolute-Zero-Reasoner), following the paper:
  - the solver trains on this step's tasks (azr_ray_trainer.py: step t-1's; both fill from buffers);
  - r_bar in {0, 1} earns 0 (Eq. 4; reward_managers.py: -0.5); TRR++ per sequence (Eq. 8);
  - learnability samples are drawn at T = 1 (master drew them with greedy validation settings);
  - determinism: j processes with their own hash seeds agree in value; outputs never truncated;
  - banned modules are checked on the AST and include os/sys/shutil (§3.3.3), for solvers too;
  - the buffer cap evicts the oldest; induction draws programs from the de-duplicated D_ded u D_abd.
Following the official code, not the paper: the loss averages over a mini-batch's tokens (veRL
core_algos.py, dp_actor.py; Eq. 9 per sequence: --aggregation seq-mean-token-mean), 3 AdamW steps
an iteration (mini-batch 2B, coder7b.sh), code scored as evalplus (its instruct prompt, greedy,
768 new tokens; --eval-code-protocol azr: our wrapper). Ours, for safety or where neither says:
  - banned names too (eval, vars, globals, __mro__, ...); an input may not call f or its helpers;
  - induction answers run without the gold program's imports (official: prepended to them);
  - size caps: programs 8,000 chars, messages 2,000, inputs 100,000, outputs --max-output-chars;
  - a deduction answer to a literal output must be a literal (official: any expression);
  - an output that is no literal is valid if its repr evaluates back to it (nan, inf named) in the
    program's namespace, and is compared there (official: any repr);
  - references are dropped until a proposer prompt fits (official: resampled); a task whose solver
    prompt does not fit is invalid, -1 (official: -0.5);
  - no LiveCodeBench: eval/code/mean_greedy_acc is not Table 1's CAvg; each proposer states its
    own task's difficulty in its prompt.
"""
from __future__ import annotations

import ast
import collections
import dataclasses
import json
import random
import re
import symtable
import sys
import typing
from dataclasses import dataclass
from typing import NamedTuple

import common

TASKS = ("deduction", "abduction", "induction")
TABLE1_MATH = "aime24,aime25,amc23,math500,minerva,olympiadbench"  # Table 1's math benchmarks


@dataclass
class Config(common.RunConfig):
    """Absolute Zero: one model proposes and solves code-reasoning tasks, judged by a sandbox."""
    RANGES: typing.ClassVar[dict] = {
        "temperature": "(0, inf)", "top_p": "(0, 1]", "clip_ratio": "[0, 1)",
        "entropy_coef": "[0, inf)"}
    model: str = "Qwen/Qwen2.5-Coder-7B"  # the one model that proposes and solves (§4.1, Table 1)
    steps: int = 500  # self-play iterations (§4.1; scripts/selfplay/coder7b.sh: 960)
    batch_size: int = 64  # B, prompts per task type and role: 6B trajectories a step (Table 3)
    references: int = 6  # K, past triplets shown to a proposer (Table 3, io_n=6)
    seed_factor: int = 4  # S: seeding fills the buffers with S*B tasks (§3.3.1, Table 3)
    seed_max_rounds: int = 64  # proposal rounds per seeding phase, then training starts (ours)
    buffer_cap: int = 16384  # entries per buffer, the oldest evicted (Table 3)
    induction_inputs: int = 10  # N inputs per induction task, half of them shown (constructor.py)
    learnability_samples: int = 8  # n solver samples per valid proposal, at T = 1 (Eq. 4, Table 3)
    temperature: float = 1.0  # sampling temperature of the rollouts (Table 3)
    top_p: float = 1.0  # nucleus sampling of the rollouts (Table 3)
    max_prompt_tokens: int = 6144  # longest prompt; a proposer drops references to fit (Table 3)
    max_response_tokens: int = 8096  # new tokens per rollout (Table 3)
    max_model_len: int = 16384  # vLLM context length: prompt + response tokens (Table 3)
    lr: float = 1e-6  # AdamW learning rate, constant (Table 3)
    weight_decay: float = 0.01  # AdamW weight decay (paper branch: veRL fsdp_workers.py; master: 0)
    grad_clip: float = 1.0  # gradient-norm clip per AdamW step (Table 3)
    clip_ratio: float = 0.2  # PPO clip epsilon (Eq. 9)
    mini_batch: int = 0  # trajectories per AdamW step; unset: a task's 2B, B if frozen (coder7b.sh)
    entropy_coef: float = 0.001  # weight of the entropy bonus in the loss (Table 3; master: 0)
    aggregation: str = "token-mean"  # loss averaging: token-mean|seq-mean-token-mean|drgrpo (veRL)
    executor_timeout: float = 10.0  # seconds per program run (Table 3)
    determinism_runs: int = 2  # j, independent runs of a program that must agree (§3.3.3)
    sandbox_workers: int = 4  # parallel sandbox processes (ours)
    max_output_chars: int = 4000  # longest program output, longer is invalid, never cut (ours)
    reject_multiple_defs: bool = True  # a second def makes a proposal invalid (code_reward.py)
    eval_benchmarks: str = TABLE1_MATH  # math benchmarks: names, .jsonl files, name@N (Table 1)
    eval_max_tokens: int = 16000  # new tokens per math answer (math_eval/eval_math_nodes.sh)
    eval_code: bool = True  # evaluate code too, --no-eval-code skips it (Table 1)
    eval_code_benchmarks: str = "humaneval+,mbpp+"  # code benchmarks: names, .jsonl files (Table 1)
    eval_code_protocol: str = "evalplus"  # code prompt and budget: evalplus | azr (run_evalplus.sh)
    eval_code_max_tokens: int = 768  # new tokens per code answer under evalplus (evalplus codegen)
    # the analyses of "Towards Understanding Self-play for LLM Reasoning": RQ3, RQ5 (its Eq. 3)
    freeze_proposer: bool = False  # proposer trajectories get no gradient (analyses' RQ3, §3.3)
    proposer_reward: str = "learnability"  # of r_bar: learnability | uncertainty (Eq. 4 | Eq. 3)

    def __post_init__(self):
        if not self.mini_batch:  # a task type's trajectories; config.json records the size used
            self.mini_batch = self.batch_size if self.freeze_proposer else 2 * self.batch_size


# --model tiny: a one-minute smoke run (flags still override)
TINY = {"steps": 2, "batch_size": 2, "references": 2, "induction_inputs": 2,
        "learnability_samples": 2, "seed_max_rounds": 1, "sandbox_workers": 2,
        "executor_timeout": 2.0, "max_prompt_tokens": 1500, "max_response_tokens": 48,
        "max_model_len": 2048, "eval_max_tokens": 16, "eval_code_max_tokens": 16,
        "eval_benchmarks": f"{common.TINY_DATA}/azr_eval.jsonl",
        "eval_code_benchmarks": f"{common.TINY_DATA}/code_tiny.jsonl"}
ZERO_TRIPLET = {"program": "def f(x):\n    return x", "input": "'Hello World'",
                "output": "'Hello World'"}  # Fig. 5: the identity, the seed of every buffer


def validate_config(cfg: Config) -> None:
    """A bad value is a one-line ValueError naming the flag (exit 2 from the command line)."""
    common.check_benchmark_names(cfg.eval_benchmarks)
    # --prompts FILE: unknown names, wrong placeholders or a bad file fail here, before any load
    common.load_prompts(cfg.prompts, PROMPTS)
    n = cfg.induction_inputs
    if n < 2 or n % 2:
        raise ValueError(f"--induction-inputs {n}: needs an even number >= 2 "
                         "(half shown, half held out)")
    if not cfg.temperature > 0:  # the rollouts are sampled
        raise ValueError(f"--temperature {cfg.temperature} must be > 0")
    for name in ("seed_factor", "buffer_cap"):  # the other sizes: parse_config's limit check
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.max_prompt_tokens >= cfg.max_model_len:
        raise ValueError(f"--max-prompt-tokens {cfg.max_prompt_tokens} must be below "
                         f"--max-model-len {cfg.max_model_len}")
    choices = {"aggregation": ("token-mean", "seq-mean-token-mean", "drgrpo"),
               "eval_code_protocol": ("evalplus", "azr"),
               "proposer_reward": ("learnability", "uncertainty")}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(cfg, name)!r}: use one of "
                             f"{', '.join(allowed)}")
    if cfg.eval_only and cfg.resume:  # its eval.json would replace the run's own
        raise ValueError("--eval-only evaluates a model, not a run to resume: pass the checkpoint "
                         "as --model RUN/checkpoints/step_N and a new --output-dir")
    if cfg.eval_code:  # after the others
        common.check_code_benchmark_names(cfg.eval_code_benchmarks)


# Fig. 8's modules, os/sys/shutil (§3.3.3), and the other ways out of a program
BANNED_MODULES = frozenset("""
    logging random multiprocessing pebble subprocess threading datetime time hashlib hmac bcrypt
    calendar os sys shutil importlib builtins __builtin__ imp ctypes gc inspect socket signal
    resource pathlib tempfile io glob pickle marshal uuid secrets asyncio concurrent _thread
    select mmap code codeop pty fcntl platform sysconfig site urllib http requests ftplib smtplib
    webbrowser faulthandler tracemalloc atexit""".split())
# names a program may not use unless it binds them itself: builtins, and the helpers of _SAME_VALUE
BANNED_NAMES = frozenset("""__import__ eval exec compile open input breakpoint exit quit help
    globals locals vars __builtins__ __loader__ __spec__ __azr_same__ __azr_value__""".split())
BANNED_ATTRS = frozenset("""__subclasses__ __globals__ __builtins__ __code__ __import__ __loader__
    __bases__ __mro__ f_globals f_back gi_frame""".split())  # the ways to the builtins
REJECT_REASONS = ("format", "syntax", "banned", "multiple_defs", "error", "timeout",
                  "nondeterministic", "non_literal", "too_large")

# --- Prompts: R1-style plain text, our words for every instruction of the paper's prompt figures
# (data_construction/prompts.py); everything parsed sits in fenced blocks.
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
    "code_rules": (  # proposers and the induction solver; {definitions} is one of the two below
        "Rules for the program:\n"
        "- The entry function is named `f`; it takes at least one argument and returns a value.\n"
        "{definitions}"
        "- It is deterministic: no randomness, dates or clocks, file or network I/O, printing or "
        "logging, and no outside state.\n"
        "- Imports and classes come first, at the top; the program ends with the return of `f`: "
        "nothing follows.\n"
        "- It finishes well within {timeout} seconds on a modern CPU.\n"
        "- These modules may not be imported or used: {banned}.\n"),
    "definitions_single": (  # --reject-multiple-defs
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
    # Evaluation. Math: ours, shaped as the official "azr" template (evaluation/math_eval/eval/
    # utils.py): the preamble, the question, the Assistant turn left unopened.
    "eval_math": _PREAMBLE + "User: {question}\n\nAssistant:",
    # Code, --eval-code-protocol azr: ours, the math wrapper around the task
    "eval_code": _PREAMBLE + "User: {task} Put the code inside your <answer> tags.\n\nAssistant:",
    # Code, --eval-code-protocol evalplus: ours, shaped as evalplus's instruct prompt (codegen's
    # make_raw_chat_prompt): a request for a script and the task in a code block, then the response
    # prefix that opens the Assistant's ```python block
    "eval_code_evalplus": (
        "Write a complete, self-contained Python script that solves the problem below, in one "
        "markdown code block:\n```\n{problem}\n```\n"),
    "eval_code_evalplus_response": "Here is a self-contained Python script for the problem:\n"
                                   "```python\n",
}
# the banned modules as the prompts name them (the private ones need no mention)
_BANNED_LIST = ", ".join(sorted(m for m in BANNED_MODULES if not m.startswith("_")))


def _fence(kind: str, text: str) -> str:
    """A fenced block: ```kind, the text, ```."""
    return f"```{kind}\n{text}\n```"


def render(prompts: dict, cfg: Config, name: str, single_def: bool = False, **fields) -> str:
    """Template `name` with its {code_rules}, inside the wrapper; str.format skips unused fields."""
    if single_def:
        definitions = prompts["definitions_single"]
    else:
        definitions = prompts["definitions_helpers"]
    code_rules = prompts["code_rules"].format(
        timeout=f"{cfg.executor_timeout:g}", banned=_BANNED_LIST, definitions=definitions)
    task = prompts[name].format(code_rules=code_rules, **fields)
    return prompts["wrapper"].format(task=task)


def proposer_prompt(task: str, refs: list[dict], cfg: Config, program: str = "",
                    prompts: dict = PROMPTS) -> str:
    """Step 1's prompt: K reference triplets (deduction, abduction), or the program that the
    induction proposer writes inputs for."""
    puzzles = []
    for k, ref in enumerate(refs):
        puzzles.append("\n".join([f"Earlier puzzle {k + 1}:",
                                  _fence("python", ref["program"]),
                                  _fence("input", ref["input"]),
                                  _fence("output", ref["output"])]))
    references = "\n\n".join(puzzles) or "(none yet)"
    return render(prompts, cfg, f"propose_{task}", cfg.reject_multiple_defs, program=program,
                  n=cfg.induction_inputs, references=references)


def solver_prompt(task: str, entry: dict, cfg: Config, prompts: dict = PROMPTS) -> str:
    """The solver's prompt for a buffer entry. Induction shows the first half of the pairs (the
    rest is held out); solver programs may have helpers."""
    inputs = entry.get("inputs", [])
    shown = inputs[:len(inputs) // 2]
    pairs = []
    for k, (shown_input, output) in enumerate(zip(shown, entry.get("outputs", []))):
        pairs.append(_fence(f"input_{k + 1}", shown_input) + "\n"
                     + _fence(f"output_{k + 1}", output))
    return render(prompts, cfg, f"solve_{task}", program=entry["program"],
                  input=entry.get("input"), output=entry.get("output"),
                  message=entry.get("message"), pairs="\n".join(pairs))


def _fits(tokenizer, prompt: str, cfg: Config) -> bool:
    """Whether `prompt` is within --max-prompt-tokens."""
    return len(common.encode_prompt(tokenizer, prompt)) <= cfg.max_prompt_tokens


# --- Parsing untrusted model output (nothing here may raise) and the safety checks (§3.3.3)
_FORMAT_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>", re.S)
_BLOCK_RE = re.compile(r"```[ \t]*([A-Za-z_]\w*)?[ \t]*\n?(.*?)```", re.S)  # body may share a line
_MAX_INPUT_CHARS = 100_000  # not in the paper: a longer input is invalid
_MAX_PROGRAM_CHARS = 8000  # not in the paper: a longer program is invalid
_MAX_MESSAGE_CHARS = 2000  # not in the paper: an induction message is cut here
_PARSE_ERRORS = (SyntaxError, ValueError, RecursionError, MemoryError)
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


class Checked(NamedTuple):
    reason: str | None  # None: the program passed
    program: str  # the program, its single entry function bound to the name f


def extract_answer(completion: str, r1_format: bool = True) -> str | None:
    """The last <answer> block, if the response has the R1 format (the prompt opened <think>).
    Without `r1_format`, as the official learnability samples (custom_evaluate.extract_answer):
    the text after the last <answer>, up to </answer> if it comes."""
    if not r1_format:
        if "<answer>" not in completion:
            return None
        return completion.rsplit("<answer>", 1)[-1].split("</answer>")[0]
    text = "<think>" + completion
    if not _FORMAT_RE.match(text):
        return None
    last = text.rsplit("<answer>", 1)[-1]
    if "</answer>" not in last:
        return None
    return last.split("</answer>")[0]


def blocks(answer: str, *kinds: str) -> list[str]:
    """The bodies of the fenced blocks tagged with one of `kinds` (any block if none is given)."""
    bodies = []
    for kind, body in _BLOCK_RE.findall(answer):
        if not kinds or kind.lower() in kinds:
            bodies.append(body.strip())
    return bodies


def solver_answer(completion: str, task: str, r1_format: bool = True) -> str | None:
    """What is graded (reward_managers.py): the last output/input block, else the whole <answer>;
    induction: the last python block, else the last of any kind. None is a format error."""
    answer = extract_answer(completion, r1_format)
    if answer is None:
        return None
    if task == "induction":
        programs = blocks(answer, "python", "py", "python3") or blocks(answer)
        return programs[-1] if programs else None
    kind = "output" if task == "deduction" else "input"
    candidates = blocks(answer, kind) or [answer.strip()]
    return candidates[-1]


def parse_proposal(completion: str, task: str, n: int = 0) -> dict:
    """{'reason': 'format'} if incomplete, else deduction/abduction: the first ```python and
    ```input block; induction: the last n (--induction-inputs) ```input blocks and ```message.
    Inputs are checked where they run (Executor.call)."""
    answer = extract_answer(completion) or ""
    inputs = blocks(answer, "input")
    if task != "induction":
        programs = blocks(answer, "python")
        if programs and inputs:
            return {"reason": None, "program": programs[0], "input": inputs[0]}
        return {"reason": "format"}
    messages = blocks(answer, "message")
    if len(inputs) >= n and messages and messages[-1]:
        message = messages[-1][:_MAX_MESSAGE_CHARS]
        return {"reason": None, "inputs": inputs[-n:], "message": message}
    return {"reason": "format"}


def _check_ast(source: str, mode: str = "exec"):
    """(reason or None, tree): syntax if it does not parse; banned for a relative or banned import,
    a banned attribute, or a BANNED_NAMES name that may be the builtin (in a module or class body,
    or global in a function: symtable's scopes)."""
    try:
        tree = ast.parse(source, mode=mode)
        scopes = [symtable.symtable(source, "<program>", mode)]
        for scope in scopes:  # the list grows as it goes: every nested scope is visited
            scopes += scope.get_children()
    except _PARSE_ERRORS:
        return "syntax", None
    imported, attributes = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported.append("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Attribute):
            attributes.add(node.attr)
    maybe_builtins = set()  # a name that the program does not bind in a function of its own
    for scope in scopes:
        at_top = scope.get_type() in ("module", "class")
        for symbol in scope.get_symbols():
            if not symbol.is_free() and (at_top or symbol.is_global()):
                maybe_builtins.add(symbol.get_name())
    banned_import = any(m.split(".")[0] in BANNED_MODULES or m.startswith(".") for m in imported)
    if banned_import or maybe_builtins & BANNED_NAMES or attributes & BANNED_ATTRS:
        return "banned", tree
    return None, tree


def _top_level_functions(program: str) -> set[str]:
    try:  # a buffer (an edited checkpoint) may hold a program that does not parse
        return {node.name for node in ast.parse(program).body if isinstance(node, _DEFS)}
    except _PARSE_ERRORS:
        return set()


def check_input(text: str, program: str = "") -> str | None:
    """None if `text` is the argument list of one call f(<text>) (templates.py), else the reason:
    the AST only, nothing banned, no call of the program's own functions (it could search)."""
    if not isinstance(text, str):  # jobs may come from a file
        return "syntax"
    if len(text) > _MAX_INPUT_CHARS:
        return "too_large"
    reason, tree = _check_ast(f"_(\n{text.strip()}\n)", "eval")
    call = getattr(tree, "body", None)
    one_call = isinstance(call, ast.Call) and getattr(call.func, "id", None) == "_"
    if not one_call or not (call.args or call.keywords):
        return "syntax"
    if reason:
        return reason
    own_functions = {"f"} | _top_level_functions(program)
    for node in ast.walk(call):
        if isinstance(node, ast.Name) and node.id in own_functions:
            return "banned"
    return None


def static_check(program: str, single_def: bool = False) -> Checked:
    """Checked(reason or None, program whose entry function is `f`); `single_def`: a second def
    anywhere is invalid (code_reward.py's reject_multiple_functions)."""
    if len(program) > _MAX_PROGRAM_CHARS:
        return Checked("too_large", program)
    reason, tree = _check_ast(program)
    if reason:
        return Checked(reason, program)
    if single_def and sum(isinstance(node, _DEFS) for node in ast.walk(tree)) > 1:
        return Checked("multiple_defs", program)
    defs = [node for node in tree.body if isinstance(node, _DEFS)]
    entry = [node for node in defs if node.name == "f"]
    if not entry and len(defs) == 1:  # a single function is the entry under any name
        entry = defs
    if not entry or any(isinstance(node, ast.AsyncFunctionDef) for node in entry):
        return Checked("syntax", program)
    if entry[0].name == "f":
        return Checked(None, program)
    return Checked(None, f"{program.rstrip()}\n\nf = {entry[0].name}")


def strip_program(program: str) -> str:
    """Seed programs keep imports and definitions only, without docstrings or comments (§3.3.1);
    "" (invalid) if the program cannot be rewritten."""
    keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)
    try:
        body = []
        for node in ast.parse(program).body:
            # "f = g" stays: static_check binds a single entry function to f this way
            names_f = isinstance(node, ast.Assign) and [
                getattr(target, "id", None) for target in node.targets] == ["f"]
            if isinstance(node, keep) or names_f:
                body.append(node)
        module = ast.Module(body=body, type_ignores=[])
        for node in ast.walk(module):
            if not isinstance(node, (*_DEFS, ast.ClassDef)):
                continue
            if ast.get_docstring(node, False) is not None:
                node.body = node.body[1:] or [ast.Pass()]
        return ast.unparse(module)
    except _PARSE_ERRORS:
        return ""


# --- The executor and the buffers: outputs come back as repr. A literal is compared here, in
# trusted code; any other output (a Counter, a NaN) in the sandbox, in the program's namespace.
_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+>")  # '<Node object at 0x7f..>', not hex(12345678)
# the sandbox's statuses that are a reason of their own; any other failure is an "error"
_STATUS_REASON = {"forbidden": "banned", "timeout": "timeout", "output_limit": "too_large"}
# Eq. 5 for an output that is no literal, appended to the program and called by the sandbox's
# expression: the gold repr is evaluated in the program's namespace (its imports and classes;
# nan and inf named, as repr writes them) and compared with ==; a NaN equals NaN through its
# repr. As in the official check ({gold_output} == f(input)), a program's own __eq__ decides,
# which only concerns its own task; BANNED_NAMES keeps a program from naming the helpers.
_SAME_VALUE = '''

def __azr_value__(text):
    return eval(text, {"nan": float("nan"), "inf": float("inf"), **globals()})

def __azr_same__(value, gold, same_type):
    expected = __azr_value__(gold)
    if type(expected) is not type(value):
        return not same_type and bool(expected == value)
    return bool(expected == value) or repr(expected) == repr(value)
'''


class NonLiteral:
    """An Outcome's value when the output's repr is no Python literal: it is compared in the
    sandbox (Executor.compare). Tested with isinstance, so it survives a broadcast."""


class Outcome(NamedTuple):
    status: str  # "ok" or the reason the run failed
    output: str  # the value's repr (on failure, the error)
    value: object  # the parsed literal, or a NonLiteral


class Comparison(NamedTuple):
    """One test of Eq. 5 that runs in the sandbox (Executor.compare)."""
    program: str
    answer: str  # an input that f is called on, or (call=False) a deduction answer
    gold: str  # the gold output's repr
    call: bool = True
    same_type: bool = False  # the j runs' agreement; Eq. 5 itself has 1 == 1.0


def _call(text: str) -> str:
    """The expression f(<text>); the newlines keep a comment in the input off the parenthesis."""
    return f"f(\n{text.strip()}\n)"


def _parenthesized(text: str) -> str:
    """A deduction answer as one expression: "1, 2" is a tuple, as an input's arguments are."""
    return f"(\n{text.strip()}\n)"


class Executor:
    """Runs f(<input>) jobs; run j in sandbox j (own processes, PYTHONHASHSEED = j). Under torchrun
    rank 0 runs every program and broadcasts the outcomes, so all ranks keep the same buffers."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.sandboxes = []
        for j in range(cfg.determinism_runs):
            self.sandboxes.append(common.PythonSandbox(
                cfg.sandbox_workers, cfg.executor_timeout,
                max_output_chars=cfg.max_output_chars, hash_seed=j))

    def _run(self, jobs: list[tuple[str, str, str]], run: int) -> list:
        """(program, input or answer, expression) jobs in sandbox `run`, on rank 0 only: per job
        the reason check_input refuses its text (jobs may be edited), else the ExecResult."""
        refused = [check_input(text, program) for program, text, _ in jobs]
        todo = []
        for (program, _, expression), reason in zip(jobs, refused):
            if reason is None:
                todo.append((program, expression))
        finished = iter(self.sandboxes[run].run_many(todo) if todo else [])
        return [reason or next(finished) for reason in refused]

    def call(self, jobs: list[tuple[str, str]], run: int = 0) -> list[Outcome]:
        """One Outcome per (program, input) job, from sandbox `run`."""
        rank, _ = common.dist_info()
        if rank > 0:
            return common.broadcast_object(None)
        outcomes = []
        for result in self._run([(program, text, _call(text)) for program, text in jobs], run):
            if isinstance(result, str):
                outcomes.append(Outcome(result, "", None))
            else:
                outcomes.append(_classify(result))
        return common.broadcast_object(outcomes)

    def compare(self, jobs: list[Comparison], run: int = 0) -> list[str]:
        """Per Comparison "ok" (equal), "wrong", or why its run failed; from sandbox `run`."""
        rank, _ = common.dist_info()
        if rank > 0:
            return common.broadcast_object(None)
        runs = []
        for job in jobs:
            value = _call(job.answer)
            if not job.call:  # a deduction answer may write nan and inf too
                value = f"__azr_value__({_parenthesized(job.answer)!r})"
            expression = f"__azr_same__({value}, {job.gold!r}, {job.same_type})"
            runs.append((job.program + _SAME_VALUE, job.answer, expression))
        verdicts = []
        for result in self._run(runs, run):
            if isinstance(result, str):
                verdicts.append(result)
            elif result.status != "ok":
                verdicts.append(_STATUS_REASON.get(result.status, "error"))
            else:
                verdicts.append("ok" if result.value == "True" else "wrong")
        return common.broadcast_object(verdicts)

    def run_checked(self, jobs: list[tuple[str, str]]) -> list[tuple[str | None, str]]:
        """[(reason or None, gold output)]: all j runs succeed with the same value and type (a set
        prints in hash-seed order; 1 and 1.0 are no agreement); run 0's text. An output that is no
        literal must equal its own repr evaluated back (else non_literal) in every run."""
        first = self.call(jobs, run=0)
        literal, other = [], []
        for k, outcome in enumerate(first):
            if isinstance(outcome.value, NonLiteral):
                other.append(k)
            else:
                literal.append(k)
        later = []
        for j in range(1, len(self.sandboxes)):
            later.append(self.call([jobs[k] for k in literal], run=j))
        checked = [None] * len(jobs)
        for m, k in enumerate(literal):
            checked[k] = _agreement([first[k]] + [outcomes[m] for outcomes in later])
        if other:  # rank 0's outcomes decide: the same on every rank
            tests = []
            for k in other:
                program, text = jobs[k]
                tests.append(Comparison(program, text, first[k].output, same_type=True))
            verdicts = [self.compare(tests, run=j) for j in range(len(self.sandboxes))]
            for m, k in enumerate(other):
                checked[k] = _round_trip([per_run[m] for per_run in verdicts], first[k].output)
        return checked

    def close(self):
        for sandbox in self.sandboxes:
            sandbox.close()


def _classify(result) -> Outcome:
    """An output with an address (it differs from run to run) is nondeterministic; one that is no
    literal gets a NonLiteral value."""
    if result.status != "ok":
        reason = _STATUS_REASON.get(result.status, "error")
        return Outcome(reason, result.error or result.value or "", None)
    if _ADDRESS_RE.search(result.value):
        return Outcome("nondeterministic", result.value, None)
    try:  # the sandbox capped the output at --max-output-chars
        value = common.parse_literal(result.value, max_chars=len(result.value))
    except ValueError:
        return Outcome("ok", result.value, NonLiteral())
    return Outcome("ok", result.value, value)


def _agreement(outcomes: list[Outcome]) -> tuple[str | None, str]:
    """(reason or None, run 0's output) for one job's literal outcomes in the j runs."""
    for outcome in outcomes:
        if outcome.status != "ok":
            return outcome.status, ""
    first = outcomes[0]
    for outcome in outcomes:
        if type(outcome.value) is not type(first.value) or outcome.value != first.value:
            return "nondeterministic", ""
    return None, first.output


def _round_trip(verdicts: list[str], output: str) -> tuple[str | None, str]:
    """(reason or None, output) for an output that is no literal, from the j runs' comparisons
    of f(input) with run 0's repr: failing in run 0 is non_literal, later nondeterministic."""
    for run, verdict in enumerate(verdicts):
        if verdict in ("wrong", "error"):
            return ("non_literal" if run == 0 else "nondeterministic"), ""
        if verdict != "ok":
            return verdict, ""
    return None, output


def sample(buffer, k: int, rng: random.Random, replace: bool = False) -> list[dict]:
    """k entries of a buffer (D_ded, D_abd or D_ind: a capped deque of JSON-able tasks)."""
    if not replace:
        return rng.sample(buffer, min(k, len(buffer)))
    if not buffer:
        return []
    return [rng.choice(buffer) for _ in range(k)]


# --- Grading (Eq. 5), rewards (Eqs. 4, 6) and TRR++ (Eq. 8)
class Graded(NamedTuple):
    formatted: bool  # the answer has the R1 format and something to grade
    correct: bool


def _literal(text: str):
    """The literal `text` holds, or a NonLiteral."""
    try:
        return common.parse_literal(text)
    except (ValueError, RecursionError, MemoryError):
        return NonLiteral()


def _equal(pred_text: str, gold_text: str) -> bool:
    """Value equality in trusted code (Eq. 5): sets order-free, 1 == 1.0, a tuple is no list."""
    try:
        pred = common.parse_literal(pred_text, require_roundtrip=False)
        gold = common.parse_literal(gold_text)
        return bool(pred == gold)
    except (ValueError, RecursionError, MemoryError):
        return False


def check_solutions(executor: Executor, task: str | list[str], entries: list[dict],
                    completions: list[str], r1_format: bool = True) -> list[Graded]:
    """Graded(formatted, correct) per answer (Eq. 5), `task` for all or one per entry: deduction
    compares the answer with the output, abduction runs f(input), induction's program (any defs)
    must reproduce every held-out pair. `r1_format`: see extract_answer."""
    tasks = [task] * len(entries) if isinstance(task, str) else task
    graded = [Graded(False, False)] * len(completions)
    tests = []  # (k, Comparison): the tests that answer k must pass
    for k, (t, entry, text) in enumerate(zip(tasks, entries, completions)):
        pred = solver_answer(text, t, r1_format)
        if pred is None:  # a format error
            continue
        new_tests = []
        if t == "deduction":
            new_tests = [Comparison(entry["program"], pred, entry["output"], call=False)]
        elif t == "abduction":
            new_tests = [Comparison(entry["program"], pred, entry["output"])]
        elif t == "induction":
            checked = static_check(pred)
            if checked.reason is None:
                half = len(entry["inputs"]) // 2  # the held-out pairs
                held_out = zip(entry["inputs"][half:], entry["outputs"][half:])
                new_tests = [Comparison(checked.program, i, gold) for i, gold in held_out]
        graded[k] = Graded(True, bool(new_tests))
        tests += [(k, test) for test in new_tests]
    passed = run_tests(executor, [test for _, test in tests])
    for (k, _), test_passed in zip(tests, passed):  # every test must pass
        graded[k] = Graded(True, graded[k].correct and test_passed)
    return graded


def run_tests(executor: Executor, tests: list[Comparison]) -> list[bool]:
    """Whether each test holds. A literal gold output is compared here: a deduction answer as a
    literal (never run), f(input) by its repr; any other gold output in the sandbox."""
    literal = [not isinstance(_literal(test.gold), NonLiteral) for test in tests]
    runs, in_sandbox = [], []
    for test, is_literal in zip(tests, literal):
        if not is_literal:
            in_sandbox.append(test)
        elif test.call:
            runs.append((test.program, test.answer))
    # called even with no tests: under torchrun every rank takes part in the broadcasts
    outcomes = iter(executor.call(runs))
    verdicts = iter(executor.compare(in_sandbox))
    passed = []
    for test, is_literal in zip(tests, literal):
        if not is_literal:
            passed.append(next(verdicts) == "ok")
        elif test.call:
            outcome = next(outcomes)
            passed.append(outcome.status == "ok" and _equal(outcome.output, test.gold))
        else:
            passed.append(_equal(test.answer, test.gold))
    return passed


def proposer_reward(valid: bool, solve_rate: float | None, kind: str = "learnability") -> float:
    """Eq. 6 for an invalid proposal (a format error), else the shape `kind` of r_bar in common:
    learnability (Eq. 4), or uncertainty (Eq. 3 of the analyses paper), 1 - 2|r_bar - 1/2|."""
    if not valid:
        return common.FORMAT_ERROR
    return common.proposer_reward(solve_rate, kind)


def solver_reward(formatted: bool, correct: bool) -> float:
    """Eq. 6 around Eq. 5: 1 correct, -0.5 wrong but formatted, -1 a format error."""
    return common.azr_composite_reward(1.0, formatted=formatted, passable=correct)


def keyed_advantages(rewards, keys, eps: float = 1e-6):
    """TRR++ (Eq. 8): A = (r - mu_k) / (sigma_k + eps) per (role, task) key k; one key: Eq. 10."""
    return common.group_advantages(rewards, keys, scale="std", eps=eps)


# --- The loop: one function per step of Alg. 1
class Answer(NamedTuple):
    completion: object  # common.Completion
    formatted: bool
    correct: bool


def _generate(policy, prompts: list[str], n: int, cfg: Config, **sampling):
    """n completions per prompt, at the rollout settings unless `sampling` overrides them."""
    if not prompts:
        return []
    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, **sampling}
    return policy.generate(prompts, n=n, max_tokens=cfg.max_response_tokens, **sampling)


def graded_answers(policy, executor: Executor, tasks: list[tuple[str, dict]], n: int,
                   cfg: Config, prompts: dict, r1_format: bool = True,
                   **sampling) -> list[tuple[str, list[Answer]]]:
    """(solver prompt, n graded Answers) per (task type, entry); `r1_format`: extract_answer's.
    `policy` may be any sampler (tools/difficulty.py re-solves proposals with checkpoints)."""
    solver_prompts = [solver_prompt(t, entry, cfg, prompts) for t, entry in tasks]
    groups = _generate(policy, solver_prompts, n, cfg, **sampling)
    task_per_answer = [t for t, _ in tasks for _ in range(n)]
    entry_per_answer = [entry for _, entry in tasks for _ in range(n)]
    texts = [completion.text for group in groups for completion in group]
    graded = iter(check_solutions(executor, task_per_answer, entry_per_answer, texts, r1_format))
    out = []
    for prompt, group in zip(solver_prompts, groups):
        answers = []
        for completion in group:
            grade = next(graded)
            answers.append(Answer(completion, grade.formatted, grade.correct))
        out.append((prompt, answers))
    return out


def seed_buffers(policy, executor: Executor, cfg: Config, rng: random.Random,
                 prompts: dict = PROMPTS) -> dict:
    """Step 0 (§3.3.1, _init_seed_dataset), no updates: deduction and abduction rounds fill
    D_seed = D_ded = D_abd with S*B stripped triplets, then induction rounds D_ind on them."""
    target = cfg.seed_factor * cfg.batch_size
    seed = collections.deque([dict(ZERO_TRIPLET, step=0)], maxlen=cfg.buffer_cap)
    induction = collections.deque(maxlen=cfg.buffer_cap)
    views = {"deduction": seed, "abduction": seed, "induction": induction}
    phases = [(seed, ("deduction", "abduction")), (induction, ("induction",))]
    for buffer, phase_tasks in phases:
        for round_ in range(cfg.seed_max_rounds):
            if len(buffer) >= target:
                break
            task = phase_tasks[round_ % len(phase_tasks)]
            proposals = propose(policy, executor, views, cfg, rng, 0, tasks=(task,),
                                prompts=prompts)[task]
            valid = [p for p in proposals if p["reason"] is None]
            if task != "induction":  # stripped, then validated again
                valid = [dict(p, program=strip_program(p["program"]), entry=None) for p in valid]
                validate(executor, task, valid, cfg, 0, policy.tokenizer, prompts)
            entries = [p["entry"] for p in valid if p["reason"] is None]
            buffer.extend(entries[:target - len(buffer)])
    if len(seed) < target or len(induction) < target:
        print(f"[absolute_zero] seeding stopped after {cfg.seed_max_rounds} rounds per phase: "
              f"{len(seed)} triplets, {len(induction)} induction tasks (target {target})",
              file=sys.stderr)
    return {t: collections.deque(views[t], maxlen=cfg.buffer_cap) for t in TASKS}  # D_ded, D_abd


def _new_proposal(policy, task: str, buffers: dict, programs: list[str], cfg: Config,
                  rng: random.Random, prompts: dict) -> dict | None:
    """A proposer prompt that fits --max-prompt-tokens: deduction and abduction drop references
    until it fits (the one without is kept even if too long); induction tries up to 4 programs of
    `programs` and gives up (None) if none fits."""
    if task == "induction":
        for _ in range(4 if programs else 0):
            program = rng.choice(programs)
            prompt = proposer_prompt(task, [], cfg, program=program, prompts=prompts)
            if _fits(policy.tokenizer, prompt, cfg):
                return {"task": task, "program": program, "prompt": prompt}
        return None
    refs = sample(buffers[task], cfg.references, rng)
    for k in range(len(refs), 0, -1):
        prompt = proposer_prompt(task, refs[:k], cfg, prompts=prompts)
        if _fits(policy.tokenizer, prompt, cfg):
            return {"task": task, "program": "", "prompt": prompt}
    prompt = proposer_prompt(task, [], cfg, prompts=prompts)
    return {"task": task, "program": "", "prompt": prompt}


def propose(policy, executor: Executor, buffers: dict, cfg: Config, rng: random.Random,
            step: int, tasks=TASKS, prompts: dict = PROMPTS) -> dict[str, list[dict]]:
    """Step 1: B proposals per task type, parsed and validated (the caller keeps the valid). A
    prompt's K references are dropped until it fits; induction: a D_ded u D_abd program."""
    triplets = [entry for t in ("deduction", "abduction") for entry in buffers[t]]
    programs = list(dict.fromkeys(entry["program"] for entry in triplets))
    proposals = {t: [] for t in tasks}
    for t in tasks:
        for _ in range(cfg.batch_size):
            proposal = _new_proposal(policy, t, buffers, programs, cfg, rng, prompts)
            if proposal is not None:
                proposals[t].append(proposal)
    flat = [p for t in tasks for p in proposals[t]]
    groups = _generate(policy, [p["prompt"] for p in flat], 1, cfg)
    for proposal, group in zip(flat, groups):
        completion = group[0]  # n = 1
        proposal["completion"] = completion
        proposal.update(parse_proposal(completion.text, proposal["task"], cfg.induction_inputs))
    for t in tasks:
        validate(executor, t, proposals[t], cfg, step, policy.tokenizer, prompts)
    return proposals


def validate(executor: Executor, task: str, proposals: list[dict], cfg: Config, step: int = 0,
             tokenizer=None, prompts: dict = PROMPTS) -> list[dict]:
    """Step 2 (§3.3.3): sets p['reason'] (None = valid) and p['entry']: static checks (induction's
    programs, from the buffers, passed them), then j agreeing runs give the gold outputs; a solver
    prompt that does not fit is too_large."""
    for p in proposals:
        p.setdefault("reason", None)
        if p["reason"] is None and task != "induction":
            checked = static_check(p["program"], cfg.reject_multiple_defs)
            p["reason"], p["program"] = checked.reason, checked.program
    todo = [p for p in proposals if p["reason"] is None]
    inputs = [p["inputs"] if task == "induction" else [p["input"]] for p in todo]
    jobs = [(p["program"], i) for p, task_inputs in zip(todo, inputs) for i in task_inputs]
    results = iter(executor.run_checked(jobs))
    for p, task_inputs in zip(todo, inputs):
        runs = [next(results) for _ in task_inputs]  # (reason or None, gold output) per input
        p["reason"] = next((reason for reason, _ in runs if reason), None)
        if p["reason"]:
            p["entry"] = None
            continue
        outputs = [output for _, output in runs]
        if task == "induction":
            gold = {"inputs": task_inputs, "outputs": outputs, "message": p["message"]}
        else:
            gold = {"input": task_inputs[0], "output": outputs[0]}
        p["entry"] = {"program": p["program"], **gold, "step": step}
        if tokenizer is not None:
            prompt = solver_prompt(task, p["entry"], cfg, prompts)
            if not _fits(tokenizer, prompt, cfg):
                p["reason"], p["entry"] = "too_large", None
    return proposals


def estimate_learnability(policy, executor: Executor, props: dict, cfg: Config,
                          prompts: dict = PROMPTS) -> None:
    """Step 3 (Eq. 4): p['solve_rate'] = r_bar over n samples at T = 1, top-p 1, each read from its
    <answer> alone, with no R1 format required (reward_managers.py: extract_answer)."""
    valid = [p for t in props for p in props[t] if p["reason"] is None]
    tasks = [(p["task"], p["entry"]) for p in valid]
    graded = graded_answers(policy, executor, tasks, cfg.learnability_samples, cfg, prompts,
                            r1_format=False, temperature=1.0, top_p=1.0)
    for p, (_, answers) in zip(valid, graded):
        correct = sum(answer.correct for answer in answers)
        p["solve_rate"] = correct / cfg.learnability_samples


def solve(policy, executor: Executor, props: dict, buffers: dict, cfg: Config,
          rng: random.Random, step: int, prompts: dict = PROMPTS) -> dict[str, list[dict]]:
    """Step 4: this step's valid tasks back-filled from older ones, one answer each, graded."""
    batch = []  # (task type, entry, whether it is this step's)
    for t in TASKS:
        new = [p["entry"] for p in props[t] if p["reason"] is None][:cfg.batch_size]
        # older tasks fill the batch (all of the buffer when every task in it is this step's)
        older = [entry for entry in buffers[t] if entry.get("step") != step] or list(buffers[t])
        need = cfg.batch_size - len(new)
        backfill = sample(older, need, rng, replace=need > len(older))
        batch += [(t, entry, True) for entry in new] + [(t, entry, False) for entry in backfill]
    tasks = [(t, entry) for t, entry, _ in batch]
    graded = graded_answers(policy, executor, tasks, 1, cfg, prompts)
    solved = {t: [] for t in TASKS}
    for (t, entry, new), (prompt, [answer]) in zip(batch, graded):
        reward = solver_reward(answer.formatted, answer.correct)
        solved[t].append({"entry": entry, "new": new, "prompt": prompt,
                          "completion": answer.completion, "correct": answer.correct,
                          "reward": reward})
    return solved


def reward_proposals(props: dict, cfg: Config) -> None:
    """Step 5, the proposer's half: p['reward'] by --proposer-reward (proposer_reward)."""
    for t in TASKS:
        for p in props[t]:
            p["reward"] = proposer_reward(p["reason"] is None, p.get("solve_rate"),
                                          cfg.proposer_reward)


def build_trajectories(props: dict, solved: dict) -> list:
    """The 6B batch in task order, each with its TRR++ advantage keyed '<role>/<task>' (Eq. 8)."""
    records, keys = [], []
    for t in TASKS:
        for role, role_records in (("proposer", props[t]), ("solver", solved[t])):
            for record in role_records:
                if record["completion"].token_ids:  # an empty completion has nothing to train
                    records.append(record)
                    keys.append(f"{role}/{t}")
    advantages = keyed_advantages([r["reward"] for r in records], keys).tolist()
    trajectories = []
    for record, key, advantage in zip(records, keys, advantages):
        record["advantage"] = advantage
        trajectories.append(common.Trajectory.from_completion(
            record["completion"], reward=record["reward"], role=key, advantage=advantage))
    return trajectories


def trr_update(policy, props: dict, solved: dict, cfg: Config) -> dict:
    """Step 6: PPO-clip (Eq. 9), one AdamW step per mini-batch; pg_step syncs the sampler. The
    official veRL averages the loss, entropy bonus included, over a mini-batch's tokens; its
    mini-batch of 2B trajectories, in task order, makes one step per task type (coder7b.sh).
    --freeze-proposer (RQ3 of the analyses paper): the proposer's trajectories keep their
    advantages but leave the update, which sees the 3B solver trajectories in mini-batches of B
    (the default then), still one step per task type; a no-grad pass measures their entropies.
    Returns pg_step's figures, its batch entropies replaced by entropy_figures' of both roles."""
    trajectories = build_trajectories(props, solved)
    if not trajectories:
        return {}
    trained, frozen = trajectories, []
    if cfg.freeze_proposer:
        trained = [t for t in trajectories if t.role.startswith("solver/")]
        frozen = [t for t in trajectories if t.role.startswith("proposer/")]
    update, per_key = {}, {}  # the update's figures; the entropies per '<role>/<task>'
    if frozen:  # before the update, as pg_step's: the weights that sampled them
        per_key = frozen_entropies(policy, frozen, cfg)
    if trained:
        pg = common.PGConfig(clip_low=cfg.clip_ratio, clip_high=cfg.clip_ratio,
                             entropy_coef=cfg.entropy_coef, aggregation=cfg.aggregation,
                             max_len=cfg.max_response_tokens, temperature=cfg.temperature,
                             mini_batch=cfg.mini_batch)
        for key, value in common.pg_step(policy, trained, pg).items():
            if key in ("entropy", "nll_entropy"):  # of `trained` alone: entropy_figures' instead
                continue
            if key.startswith("entropy"):
                per_key[key] = value
            else:
                update[key] = value
    # in this order on the progress bar: loss, then the policy's and each role's entropy
    return {**update, **entropy_figures(per_key, trajectories), **per_key}


def frozen_entropies(policy, trajectories: list, cfg: Config) -> dict:
    """pg_step's entropies of the trajectories it does not train: per '<role>/<task>' key,
    entropy/<key> (Eq. 1 of the analyses paper, -log pi of the sampled tokens) and
    entropy_exact/<key>, each the mean over sequences of their token means. Every rank scores
    all of them, so that FSDP2's forwards stay in step."""
    import torch
    policy.sampler.sleep()  # --vllm-sleep: the engine frees its memory, as for pg_step
    with torch.no_grad():
        logps, entropies = common.token_logprobs(
            policy.model, [t.prompt_ids for t in trajectories],
            [t.completion_ids for t in trajectories], temperature=cfg.temperature,
            token_budget=policy.cfg.micro_batch_tokens, with_entropy=True)
    token_means = collections.defaultdict(list)  # figure -> each sequence's token mean
    for trajectory, logp, entropy in zip(trajectories, logps, entropies):
        token_means[f"entropy/{trajectory.role}"].append(float(-logp.mean()))
        token_means[f"entropy_exact/{trajectory.role}"].append(float(entropy.mean()))
    return {name: _mean(values) for name, values in token_means.items()}


def entropy_figures(per_key: dict, trajectories: list) -> dict:
    """RQ3's figures from those per '<role>/<task>' key in `per_key`: for each role over its
    three task types (entropy/proposer, ...) and for the policy (entropy, entropy_exact), each
    the mean over all their sequences (a key's figure weighted by its sequences). As in every
    method's metrics, `entropy` is Eq. 1 and `entropy_exact` the exact entropy."""
    sequences = collections.Counter(t.role for t in trajectories)
    groups = {"": "", "/proposer": "proposer/", "/solver": "solver/"}  # name suffix -> key prefix
    out = {}
    for estimator in ("entropy", "entropy_exact"):
        for suffix, prefix in groups.items():
            total, weight = 0.0, 0
            for key, count in sequences.items():
                figure = per_key.get(f"{estimator}/{key}")
                if key.startswith(prefix) and figure is not None:
                    total += figure * count
                    weight += count
            if weight:
                out[estimator + suffix] = total / weight
    return out


def self_play_step(policy, executor: Executor, buffers: dict, cfg: Config, rng: random.Random,
                   step: int, prompts: dict = PROMPTS) -> tuple[dict, dict, dict]:
    """One iteration of Alg. 1, steps 1-6: (proposals, solver records, update statistics). Every
    valid proposal joins its buffer."""
    props = propose(policy, executor, buffers, cfg, rng, step, prompts=prompts)
    for t in TASKS:
        buffers[t].extend(p["entry"] for p in props[t] if p["reason"] is None)
    estimate_learnability(policy, executor, props, cfg, prompts)
    reward_proposals(props, cfg)
    solved = solve(policy, executor, props, buffers, cfg, rng, step, prompts)
    stats = trr_update(policy, props, solved, cfg)
    return props, solved, stats


# --- Metrics per task type (the tasks' solve rate and program length over training, §4.4)
def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def step_metrics(props: dict, solved: dict, buffers: dict, stats: dict | None = None) -> dict:
    """Per task type, overall, and trr_update's `stats`: its entropies of the step's rollouts as
    they are (entropy/..., entropy_exact/...: trained or not), the update's figures as train/..."""
    metrics = {}
    for key, value in (stats or {}).items():
        if key.split("/")[0] in ("entropy", "entropy_exact"):
            metrics[key] = value
        else:
            metrics[f"train/{key}"] = value
    for t in TASKS:
        proposals, answers = props[t], solved[t]
        valid = [p for p in proposals if p["reason"] is None]
        metrics[f"{t}/valid_rate"] = _mean(p["reason"] is None for p in proposals)
        for reason in REJECT_REASONS:
            metrics[f"{t}/reject/{reason}"] = sum(p["reason"] == reason for p in proposals)
        metrics[f"{t}/buffer_size"] = len(buffers[t])
        metrics[f"{t}/solver_acc"] = _mean(a["correct"] for a in answers)
        metrics[f"{t}/proposer_reward"] = _mean(p["reward"] for p in proposals)
        metrics[f"{t}/new_task_solve_rate"] = _mean(p["solve_rate"] for p in valid)
        metrics[f"{t}/program_chars"] = _mean(len(p["entry"]["program"]) for p in valid)
        metrics[f"len/proposer/{t}"] = _mean(len(p["completion"].token_ids) for p in proposals)
        metrics[f"len/solver/{t}"] = _mean(len(a["completion"].token_ids) for a in answers)
    for name in ("valid_rate", "solver_acc"):  # the mean over the three task types
        metrics[name] = _mean(metrics[f"{t}/{name}"] for t in TASKS)
    return metrics


def log_step_samples(run, step: int, props: dict, solved: dict) -> None:
    """Every proposal and answer of the step, with its prompt and reward, to samples.jsonl."""
    roles = (("proposer", props, ("reason", "entry", "solve_rate")),
             ("solver", solved, ("entry", "new", "correct")))
    for t in TASKS:
        for role, records, keys in roles:
            rows = []
            for record in records[t]:
                row = {"completion": record["completion"].text}
                for key in ("prompt", *keys, "reward"):
                    row[key] = record.get(key)
                rows.append(row)
            run.log_samples(step, f"{role}/{t}", rows)


PROPOSALS_FILE = "proposals.jsonl"  # every valid proposal: what tools/difficulty.py re-solves


def log_proposals(run, step: int, props: dict) -> None:
    """Every valid proposal of the step, its task type and buffer entry, to proposals.jsonl (RQ2:
    how hard the proposed tasks are over training)."""
    if not run.is_main:
        return
    lines = []
    for t in TASKS:
        for p in props[t]:
            if p["reason"] is None:
                lines.append(json.dumps({"task": t, **p["entry"], "step": step}) + "\n")
    with open(run.dir / PROPOSALS_FILE, "a", encoding="utf-8") as f:
        f.writelines(lines)


def keep_proposals(run, step: int) -> None:
    """proposals.jsonl as of the checkpoint a run starts from (step 0: none): the later steps'
    lines, which the run logs again, are dropped, and so is a torn line of a killed run."""
    path = run.dir / PROPOSALS_FILE
    if not run.is_main or not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            logged_at = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if logged_at <= step:
            kept.append(line + "\n")
    common.atomic_write_text(path, "".join(kept))


# --- Step 7: evaluation. Math as evaluation/math_eval/eval_math_nodes.sh --template azr (a base
# model there gets a boxed template, official issue #27: give one as eval_math with --prompts);
# code as code_eval/scripts/run_evalplus.sh (evalplus.codegen --greedy), or in our wrapper.
_EVALPLUS_STOPS = ("\nif __name__", "\ndef main(", "\nprint(")  # where evalplus ends an answer
_SCRIPT_NODES = (ast.Import, ast.ImportFrom, *_DEFS, ast.ClassDef, ast.Assign, ast.AnnAssign)
_RESPONSE_END = "<<the response prefix ends here>>"  # as evalplus's _MAGIC_SPLITTER_


def eval_answer(text: str) -> str | None:
    """extract_azr_answer (evaluation/math_eval/eval/parser.py): the last <answer> (its \\boxed{}
    if any), else the last \\boxed{}, else the first \\[ ... \\]."""
    if "<answer>" in text:
        answer = text.split("<answer>")[-1].split("</answer>")[0].strip()
        if "boxed" in answer:
            return common.extract_boxed(answer)
        return answer or None
    if "boxed" in text:
        return common.extract_boxed(text)
    display = re.search(r"\\\[(.*?)\\\]", text)
    if display is None:
        return None
    return display.group(1).strip() or None


def evalplus_prompt(problem: dict, tokenizer, prompts: dict = PROMPTS) -> str:
    """evalplus's instruct prompt (codegen's make_raw_chat_prompt) from our templates: the request
    with the task in a code block is the User turn, and the Assistant turn opens with the response
    prefix, which opens a ```python block. Without a chat template both are plain text (evalplus
    would give the bare task)."""
    request = prompts["eval_code_evalplus"].format(problem=problem["prompt"].strip())
    response = prompts["eval_code_evalplus_response"]
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return f"{request}\n{response}"
    messages = [{"role": "user", "content": request},
                {"role": "assistant", "content": response + _RESPONSE_END}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False)
    return chat.split(_RESPONSE_END)[0]


def evalplus_code(text: str) -> str | None:
    """The script of an answer to evalplus_prompt, whose block the prompt opened: the text up to
    the closing fence or an evalplus stop string, the lines of a truncated end dropped until it
    parses; then, as evalplus's sanitizer keeps, its imports, definitions and assignments."""
    lines = []
    for line in str(text).splitlines():
        if line.strip().startswith("```"):
            break
        lines.append(line)
    code = "\n".join(lines)
    for stop in _EVALPLUS_STOPS:
        code = code.split(stop)[0]
    lines = code.splitlines()
    while lines:
        try:
            body = [node for node in ast.parse("\n".join(lines)).body
                    if isinstance(node, _SCRIPT_NODES)]
            return ast.unparse(ast.Module(body=body, type_ignores=[])) or None
        except _PARSE_ERRORS:
            lines.pop()
    return None


def _named(prompt_fn, name: str, cfg: Config):
    """`prompt_fn` named for eval.json's settings, with the --prompts file that shaped it."""
    source = f" ({cfg.prompts})" if cfg.prompts else ""
    prompt_fn.__name__ = f"absolute_zero.{name}{source}"
    return prompt_fn


def evaluate_code(policy, cfg: Config, prompts: dict = PROMPTS) -> dict:
    """The code benchmarks under --eval-code-protocol: evalplus as Table 1 (evalplus_prompt, greedy,
    --eval-code-max-tokens new tokens, evalplus_code) or azr (eval_code, our wrapper, with
    --eval-max-tokens and the last ```python block). One that cannot load is skipped, with why."""
    if cfg.eval_code_protocol == "azr":
        def code_eval_prompt(problem, tokenizer=None):
            return prompts["eval_code"].format(task=common.code_task_prompt(problem))
        prompt_fn = _named(code_eval_prompt, "code_eval_prompt", cfg)
        return common.evaluate_code_config(policy, cfg, "absolute_zero", prompt_fn=prompt_fn)

    def code_prompt(problem, tokenizer=None):
        return evalplus_prompt(problem, tokenizer, prompts)
    evalplus_budget = dataclasses.replace(cfg, eval_max_tokens=cfg.eval_code_max_tokens)
    return common.evaluate_code_config(policy, evalplus_budget, "absolute_zero",
                                       prompt_fn=_named(code_prompt, "evalplus_prompt", cfg),
                                       extract_fn=evalplus_code)


def evaluate(policy, cfg: Config, run=None, name: str = "eval.json",
             prompts: dict = PROMPTS) -> dict:
    """Math (Table 1's sets) and, with --eval-code, code benchmarks; written to `run`'s `name`."""
    results = {}
    if cfg.eval_benchmarks.strip():
        def eval_prompt(problem, tokenizer=None):
            return prompts["eval_math"].format(question=problem["question"].strip())
        results = common.evaluate_config(policy, cfg, extract_fn=eval_answer,
                                         prompt_fn=_named(eval_prompt, "eval_prompt", cfg))
    if cfg.eval_code:
        results["code"] = evaluate_code(policy, cfg, prompts)
    if run is not None:
        run.write_eval(results, name)
    return results


# --- The run
def train(cfg: Config) -> dict:
    validate_config(cfg)
    prompts = common.load_prompts(cfg.prompts, PROMPTS)
    common.seed_everything(cfg.seed)
    run = common.Run(cfg, "absolute_zero")
    policy = common.Policy.load(cfg)
    if cfg.eval_only:  # e.g. the base model of a run, under the same protocol
        run.note("--eval-only: the model as loaded was evaluated, nothing trained")
        try:
            return evaluate(policy, cfg, run, prompts=prompts)
        finally:
            run.close()
    executor = Executor(cfg)
    try:
        start, state = run.load_checkpoint(policy) or (0, {})
        keep_proposals(run, start)
        buffers = {}
        for t, entries in state.get("buffers", {}).items():
            buffers[t] = collections.deque(entries, maxlen=cfg.buffer_cap)
        if not buffers:  # a fresh run
            buffers = seed_buffers(policy, executor, cfg, random.Random(cfg.seed), prompts)
            run.log(0, {f"{t}/buffer_size": len(buffers[t]) for t in TASKS})
        bar = run.progress(cfg.steps, initial=start)
        for step in range(start + 1, cfg.steps + 1):
            rng = random.Random(cfg.seed * 1_000_003 + step)  # resumable without RNG state
            props, solved, stats = self_play_step(policy, executor, buffers, cfg, rng, step,
                                                  prompts)
            metrics = step_metrics(props, solved, buffers, stats)
            log_step_samples(run, step, props, solved)
            log_proposals(run, step, props)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                results = evaluate(policy, cfg, run, f"eval_step_{step}.json", prompts)
                metrics.update(common.eval_metrics(results))
            run.log(step, metrics)
            bar.update(1)
            if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
                saved = {"buffers": {t: list(buffers[t]) for t in TASKS}}
                run.save_checkpoint(step, policy, saved)
        return evaluate(policy, cfg, run, prompts=prompts)
    finally:
        executor.close()
        run.close()


def headline(results: dict) -> dict:
    """The final evaluation's figures for the summary (math, code, or why code was skipped)."""
    figures = {}
    for key, value in common.eval_metrics(results).items():
        if key.endswith("greedy_acc") or "pass@" in key:
            figures[key] = value
    skipped = results.get("code", {}).get("skipped")
    if skipped:
        figures["code skipped"] = skipped
    return figures


def main(argv=None):
    common.run_cli(Config, train, argv, check=validate_config, tiny=TINY, headline=headline)


if __name__ == "__main__":
    main()
