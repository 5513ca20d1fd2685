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
  5. proposer_reward, solver_reward: learnability (Eq. 4), format penalties (Eq. 6)
  6. trr_update             TRR++ advantages (Eq. 8), PPO-clip (Eq. 9), one step per mini-batch
  7. evaluate               Table 1's math sets and HumanEval+/MBPP+, greedy
Run: `python absolute_zero.py --model Qwen/Qwen2.5-Coder-7B` (GPU, Table 3), or `--model tiny`.
Deviations from the official code (LeapLabTHU/Absolute-Zero-Reasoner), following the paper:
  - the solver trains on this step's proposals (azr_ray_trainer.py trains on step t-1's);
  - r_bar in {0, 1} earns 0 (Eq. 4; reward_managers.py: -0.5); TRR++ per sequence (Eq. 8);
  - learnability samples are drawn at T = 1 (master drew them with greedy validation settings);
  - determinism: j processes with their own hash seeds agree in value; outputs never truncated;
  - banned modules are checked on the AST and include os/sys/shutil (§3.3.3), for solvers too;
  - the buffer cap evicts the oldest; induction draws programs from the de-duplicated D_ded u D_abd;
  - an input is an argument list evaluated in the sandbox only; deduction answers stay literals;
  - no LiveCodeBench: eval/code/mean_greedy_acc is not Table 1's CAvg;
  - prompts in our words (PROMPTS, --prompts FILE); each proposer states its own task's difficulty.
"""
from __future__ import annotations

import ast
import collections
import functools
import random
import re
import symtable
import sys
from dataclasses import dataclass

import common

TASKS = ("deduction", "abduction", "induction")


@dataclass
class Config(common.RunConfig):
    model: str = "Qwen/Qwen2.5-Coder-7B"  # §4.1, Table 1
    steps: int = 500  # §4.1 (scripts/selfplay/coder7b.sh: 960)
    batch_size: int = 64  # B, prompts per task-role, 6B trajectories per step (Table 3)
    references: int = 6  # K, past triplets shown to a proposer (Table 3, io_n=6)
    seed_factor: int = 4  # S, seed buffers hold S*B tasks (§3.3.1, Table 3)
    seed_max_rounds: int = 64  # not in the paper: proposal rounds per seeding phase, then go on
    buffer_cap: int = 16384  # entries per buffer, the oldest evicted (Table 3)
    induction_inputs: int = 10  # N per induction task, half shown, half held out (constructor.py)
    learnability_samples: int = 8  # n, solver samples per valid proposal (Eq. 4, Table 3)
    temperature: float = 1.0  # rollouts (Table 3); learnability samples always at T = 1
    top_p: float = 1.0  # Table 3
    max_prompt_tokens: int = 6144  # Table 3; references are dropped until a prompt fits
    max_response_tokens: int = 8096  # Table 3
    max_model_len: int = 16384  # vLLM context, prompt + response (Table 3)
    lr: float = 1e-6  # AdamW, constant (Table 3)
    weight_decay: float = 0.01  # azr_ppo_trainer.yaml, paper branch (master: 0)
    grad_clip: float = 1.0  # Table 3
    clip_ratio: float = 0.2  # PPO epsilon (Eq. 9)
    mini_batch: int = 128  # trajectories per AdamW step (coder7b.sh ppo_mini_batch_size)
    entropy_coef: float = 0.001  # Table 3 (master: 0)
    aggregation: str = "seq-mean-token-mean"  # Eq. 9 (master: token-mean)
    executor_timeout: float = 10.0  # seconds per program run (Table 3)
    determinism_runs: int = 2  # j, independent runs that must agree (§3.3.3)
    sandbox_workers: int = 4  # not in the paper: parallel sandbox processes
    max_output_chars: int = 4000  # not in the paper: longer outputs are invalid, never truncated
    reject_multiple_defs: bool = True  # one def per proposal (rewards/code_reward.py)
    eval_benchmarks: str = "aime24,aime25,amc23,math500,minerva,olympiadbench"  # Table 1 math
    eval_max_tokens: int = 16000  # evaluation/math_eval/eval_math_nodes.sh
    eval_code: bool = True  # Table 1's HumanEval+/MBPP+ (--no-eval-code skips them)
    eval_code_benchmarks: str = "humaneval+,mbpp+"  # EvalPlus from the hub, or local JSONL files


# --model tiny: a one-minute smoke run (flags still override)
TINY = {"steps": 2, "batch_size": 2, "references": 2, "induction_inputs": 2,
        "learnability_samples": 2, "seed_max_rounds": 1, "max_prompt_tokens": 1500,
        "max_response_tokens": 48, "max_model_len": 2048, "sandbox_workers": 2,
        "executor_timeout": 2.0, "eval_benchmarks": f"{common.TINY_DATA}/azr_eval.jsonl",
        "eval_code_benchmarks": f"{common.TINY_DATA}/code_tiny.jsonl", "eval_max_tokens": 16}
ZERO_TRIPLET = {"program": "def f(x):\n    return x", "input": "'Hello World'",
                "output": "'Hello World'"}  # Fig. 5
# Fig. 8's modules, os/sys/shutil (§3.3.3), and the other ways out of a program
BANNED_MODULES = frozenset("""
    logging random multiprocessing pebble subprocess threading datetime time hashlib hmac bcrypt
    calendar os sys shutil importlib builtins __builtin__ imp ctypes gc inspect socket signal
    resource pathlib tempfile io glob pickle marshal uuid secrets asyncio concurrent _thread
    select mmap code codeop pty fcntl platform sysconfig site urllib http requests ftplib smtplib
    webbrowser faulthandler tracemalloc atexit""".split())
BANNED_NAMES = frozenset("""__import__ eval exec compile open input breakpoint exit quit help
    globals locals vars __builtins__ __loader__ __spec__""".split())  # unless bound locally
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
    # evaluation/math_eval/eval/utils.py, template "azr": the Assistant turn is left unopened
    "eval_math": _PREAMBLE + "User: {question}\n\nAssistant:",
    "eval_code": _PREAMBLE + "User: {task} Put the code inside your <answer> tags.\n\nAssistant:",
}
_BANNED_LIST = ", ".join(sorted(m for m in BANNED_MODULES if not m.startswith("_")))
_load_prompts = functools.lru_cache(maxsize=8)(lambda path: common.load_prompts(path, PROMPTS))
_fence = "```{}\n{}\n```".format  # _fence(kind, text): a fenced block


def templates(cfg: Config) -> dict[str, str]:
    """Our templates, or those of --prompts FILE in their place."""
    return _load_prompts(cfg.prompts) if cfg.prompts else PROMPTS


def render(cfg: Config, name: str, single_def: bool = False, **fields) -> str:
    """Template `name` in the wrapper with its {code_rules}; str.format skips unused fields."""
    t = templates(cfg)
    rules = t["code_rules"].format(
        timeout=f"{cfg.executor_timeout:g}", banned=_BANNED_LIST,
        definitions=t["definitions_single" if single_def else "definitions_helpers"])
    return t["wrapper"].format(task=t[name].format(code_rules=rules, **fields))


def proposer_prompt(task: str, refs: list[dict], cfg: Config, program: str = "") -> str:
    shown = "\n\n".join(f"Earlier puzzle {k + 1}:\n{_fence('python', r['program'])}\n"
                        f"{_fence('input', r['input'])}\n{_fence('output', r['output'])}"
                        for k, r in enumerate(refs))
    return render(cfg, f"propose_{task}", cfg.reject_multiple_defs, program=program,
                  n=cfg.induction_inputs, references=shown or "(none yet)")


def solver_prompt(task: str, e: dict, cfg: Config) -> str:
    """Induction shows the first half of the pairs; solver programs may have helpers."""
    shown = e.get("inputs", [])[:len(e.get("inputs", [])) // 2]
    pairs = "\n".join(_fence(f"input_{k + 1}", i) + "\n" + _fence(f"output_{k + 1}", o)
                      for k, (i, o) in enumerate(zip(shown, e.get("outputs", []))))
    return render(cfg, f"solve_{task}", program=e["program"], input=e.get("input"),
                  output=e.get("output"), message=e.get("message"), pairs=pairs)


def _fits(tokenizer, prompt: str, cfg: Config) -> bool:
    return len(common.encode_prompt(tokenizer, prompt)) <= cfg.max_prompt_tokens


# --- Parsing untrusted model output (nothing here may raise) and the safety checks (§3.3.3)
_FORMAT_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>", re.S)
_BLOCK_RE = re.compile(r"```[ \t]*([A-Za-z_]\w*)?[ \t]*\n?(.*?)```", re.S)  # body may share a line
_MAX_INPUT_CHARS, _MAX_PROGRAM_CHARS = 100_000, 8000  # not in the paper: longer ones are invalid
_PARSE_ERRORS = (SyntaxError, ValueError, RecursionError, MemoryError)
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


def extract_answer(completion: str) -> str | None:
    """The last <answer> block, if the response has the R1 format (the prompt opened <think>)."""
    text = "<think>" + completion
    last = text.rsplit("<answer>", 1)[-1]
    return last.split("</answer>")[0] if _FORMAT_RE.match(text) and "</answer>" in last else None


def blocks(answer: str, *kinds: str) -> list[str]:
    """The bodies of the fenced blocks tagged with one of `kinds` (any block if none is given)."""
    return [b.strip() for k, b in _BLOCK_RE.findall(answer) if not kinds or k.lower() in kinds]


def solver_answer(completion: str, task: str) -> str | None:
    """What is graded (reward_managers.py): the last output/input block, else the whole <answer>;
    induction: the last python block, else the last of any kind. None is a format error."""
    if (answer := extract_answer(completion)) is None:
        return None
    if task == "induction":
        return (blocks(answer, "python", "py", "python3") or blocks(answer) or [None])[-1]
    return (blocks(answer, "output" if task == "deduction" else "input") or [answer.strip()])[-1]


def parse_proposal(completion: str, task: str, n: int = 0) -> dict:
    """{'reason': 'format'} if incomplete, else deduction/abduction: the first ```python and
    ```input block; induction: the last n (--induction-inputs) ```input blocks and ```message.
    Inputs are checked where they run (Executor.call)."""
    answer = extract_answer(completion) or ""
    inputs, programs, messages = (blocks(answer, k) for k in ("input", "python", "message"))
    if task != "induction" and programs and inputs:
        return {"reason": None, "program": programs[0], "input": inputs[0]}
    if task == "induction" and len(inputs) >= n and messages and messages[-1]:
        return {"reason": None, "inputs": inputs[-n:], "message": messages[-1][:2000]}
    return {"reason": "format"}


def _check_ast(source: str, mode: str = "exec"):
    """(reason or None, tree): syntax if it does not parse; banned for a relative or banned import,
    a banned attribute, or a BANNED_NAMES name that may be the builtin (in a module or class body,
    or global in a function: symtable's scopes)."""
    try:
        tree, tables = ast.parse(source, mode=mode), [symtable.symtable(source, "<program>", mode)]
        for table in tables:  # grows as it goes: every nested scope
            tables += table.get_children()
    except _PARSE_ERRORS:
        return "syntax", None
    nodes = list(ast.walk(tree))
    imported = [a.name for n in nodes if isinstance(n, ast.Import) for a in n.names] + [
        "." * n.level + (n.module or "") for n in nodes if isinstance(n, ast.ImportFrom)]
    names = {s.get_name() for table in tables for s in table.get_symbols() if not s.is_free()
             and (table.get_type() in ("module", "class") or s.is_global())}
    attrs = {n.attr for n in nodes if isinstance(n, ast.Attribute)}
    bad = any(m.split(".")[0] in BANNED_MODULES or m.startswith(".") for m in imported)
    return ("banned" if bad or names & BANNED_NAMES or attrs & BANNED_ATTRS else None), tree


def check_input(text: str, program: str = "") -> str | None:
    """None if `text` is the argument list of one call f(<text>) (templates.py), else the reason:
    the AST only, nothing banned, no call of the program's own functions (it could search)."""
    if not isinstance(text, str) or len(text) > _MAX_INPUT_CHARS:  # jobs may come from a file
        return "too_large" if isinstance(text, str) else "syntax"
    reason, tree = _check_ast(f"_(\n{text.strip()}\n)", "eval")
    call = getattr(tree, "body", None)
    if not (isinstance(call, ast.Call) and getattr(call.func, "id", 0) == "_"
            and call.args + call.keywords):
        return "syntax"
    try:  # a buffer (an edited checkpoint) may hold a program that does not parse
        own = {"f"} | {n.name for n in ast.parse(program).body if isinstance(n, _DEFS)}
    except _PARSE_ERRORS:
        own = {"f"}
    calls_own = any(isinstance(n, ast.Name) and n.id in own for n in ast.walk(call))
    return reason or ("banned" if calls_own else None)


def static_check(program: str, single_def: bool = False):
    """(reason or None, program whose entry function is `f`); `single_def`: a second def anywhere
    is invalid (code_reward.py's reject_multiple_functions)."""
    if len(program) > _MAX_PROGRAM_CHARS:
        return "too_large", program
    reason, tree = _check_ast(program)
    if reason or single_def and sum(isinstance(n, _DEFS) for n in ast.walk(tree)) > 1:
        return reason or "multiple_defs", program
    defs = [n for n in tree.body if isinstance(n, _DEFS)]
    entry = [n for n in defs if n.name == "f"] or (defs if len(defs) == 1 else [])
    if not entry or any(isinstance(n, ast.AsyncFunctionDef) for n in entry):
        return "syntax", program
    return None, program if entry[0].name == "f" else f"{program.rstrip()}\n\nf = {entry[0].name}"


def strip_program(program: str) -> str:
    """Seed programs keep imports and definitions only, without docstrings or comments (§3.3.1);
    "" (invalid) if the program cannot be rewritten."""
    keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)
    try:
        module = ast.Module(body=[n for n in ast.parse(program).body if isinstance(n, keep) or (
            isinstance(n, ast.Assign) and [getattr(t, "id", 0) for t in n.targets] == ["f"])],
            type_ignores=[])  # "f = g" is static_check's
        for node in (n for n in ast.walk(module) if isinstance(n, (*_DEFS, ast.ClassDef))):
            if ast.get_docstring(node, False) is not None:
                node.body = node.body[1:] or [ast.Pass()]
        return ast.unparse(module)
    except _PARSE_ERRORS:
        return ""


# --- The executor and the buffers: gold values never enter the sandbox, outputs come back as repr
_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+>")  # '<Node object at 0x7f..>', not hex(12345678)
_STATUS_REASON = {"ok": None, "forbidden": "banned", "timeout": "timeout",
                  "output_limit": "too_large"}  # any other status: "error"


class Executor:
    """Runs f(<input>) jobs; run j in sandbox j (own processes, PYTHONHASHSEED = j). Under torchrun
    rank 0 runs every program and broadcasts the outcomes, so all ranks keep the same buffers."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.sandboxes = [common.PythonSandbox(cfg.sandbox_workers, cfg.executor_timeout,
                                               max_output_chars=cfg.max_output_chars, hash_seed=j)
                          for j in range(cfg.determinism_runs)]

    def call(self, jobs: list[tuple[str, str]], run: int = 0) -> list[tuple[str, str, object]]:
        """[(status, output repr, value)] per (program, input) job; status "ok" or a reason."""
        if common.dist_info()[0] > 0:
            return common.broadcast_object(None)
        refused = [check_input(text, program) for program, text in jobs]  # jobs may be edited
        # the newlines keep a comment in the input off the closing parenthesis
        todo = [(p, f"f(\n{t.strip()}\n)") for (p, t), r in zip(jobs, refused) if r is None]
        results = iter(self.sandboxes[run].run_many(todo) if todo else [])
        out = [(r, "", None) if r else self._classify(next(results)) for r in refused]
        return common.broadcast_object(out)

    def _classify(self, res) -> tuple[str, str, object]:
        """The output must be a finite literal that survives a repr round trip, with no address."""
        if res.status != "ok" or _ADDRESS_RE.search(res.value):
            reason = _STATUS_REASON.get(res.status, "error") or "nondeterministic"
            return reason, res.error or res.value or "", None
        try:  # the sandbox capped the output at --max-output-chars
            return "ok", res.value, common.parse_literal(res.value, max_chars=len(res.value))
        except ValueError:
            return "non_literal", res.value, None

    def run_checked(self, jobs: list[tuple[str, str]]) -> list[tuple[str | None, str]]:
        """[(reason or None, gold output)]: all j runs succeed with the same value and type (a set
        prints in hash-seed order; 1 and 1.0 are no agreement); run 0's text."""
        out = []
        for runs in zip(*[self.call(jobs, run=j) for j in range(len(self.sandboxes))]):
            bad, value = next((s for s, _, _ in runs if s != "ok"), None), runs[0][2]
            if bad is None and any(type(v) is not type(value) or v != value for _, _, v in runs):
                bad = "nondeterministic"
            out.append((bad, "") if bad else (None, runs[0][1]))
        return out

    def close(self):
        for sb in self.sandboxes:
            sb.close()


def sample(buffer, k: int, rng: random.Random, replace: bool = False) -> list[dict]:
    """k entries of a buffer (D_ded, D_abd or D_ind: a capped deque of JSON-able tasks)."""
    if replace:
        return [rng.choice(buffer) for _ in range(k if buffer else 0)]
    return rng.sample(buffer, min(k, len(buffer)))


# --- Grading (Eq. 5), rewards (Eqs. 4, 6) and TRR++ (Eq. 8)
def _equal(pred_text: str, gold_text: str) -> bool:
    """Value equality in trusted code (Eq. 5): sets order-free, 1 == 1.0, a tuple is no list."""
    try:
        return bool(common.parse_literal(pred_text, require_roundtrip=False)
                    == common.parse_literal(gold_text))
    except (ValueError, RecursionError, MemoryError):
        return False


def check_solutions(executor: Executor, task: str | list[str], entries: list[dict],
                    completions: list[str]) -> list[tuple[bool, bool]]:
    """(formatted, correct) per answer (Eq. 5), `task` for all or one per entry: deduction compares
    literals (never run), abduction runs f(input), induction's program (any defs) must reproduce
    every held-out pair."""
    tasks = [task] * len(entries) if isinstance(task, str) else task
    out, tests = [(False, False)] * len(completions), []  # tests: (k, program, input, gold)
    for k, (t, e, text) in enumerate(zip(tasks, entries, completions)):
        pred = solver_answer(text, t)
        if pred is None:
            continue
        new = [(k, e["program"], pred, e["output"])] if t == "abduction" else []
        if t == "induction" and (checked := static_check(pred))[0] is None:
            half = len(e["inputs"]) // 2  # the held-out pairs
            new = [(k, checked[1], i, o) for i, o in zip(e["inputs"][half:], e["outputs"][half:])]
        out[k] = (True, _equal(pred, e["output"]) if t == "deduction" else bool(new))
        tests += new
    runs = executor.call([(program, i) for _, program, i, _ in tests])
    for (k, _, _, gold), (status, value, _) in zip(tests, runs):  # every test must pass
        out[k] = (True, out[k][1] and status == "ok" and _equal(value, gold))
    return out


def proposer_reward(valid: bool, solve_rate: float | None) -> float:
    """Eq. 6 for an invalid proposal (a format error), else Eq. 4's learnability."""
    return common.learnability_reward(solve_rate) if valid else common.FORMAT_ERROR


def solver_reward(formatted: bool, correct: bool) -> float:
    """Eq. 6 around Eq. 5: 1 correct, -0.5 wrong but formatted, -1 a format error."""
    return common.azr_composite_reward(1.0, formatted=formatted, passable=correct)


def keyed_advantages(rewards, keys, eps: float = 1e-6):
    """TRR++ (Eq. 8): A = (r - mu_k) / (sigma_k + eps) per (role, task) key k; one key: Eq. 10."""
    return common.group_advantages(rewards, keys, scale="std", eps=eps)


# --- The loop: one function per step of Alg. 1
def _generate(policy, prompts: list[str], n: int, cfg: Config, **sampling):
    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, **sampling}
    return policy.generate(prompts, n=n, max_tokens=cfg.max_response_tokens,
                           **sampling) if prompts else []


def _answers(policy, executor: Executor, tasks: list[tuple[str, dict]], n: int, cfg: Config,
             **sampling) -> list[tuple[str, list[tuple]]]:
    """(solver prompt, n graded answers [(completion, formatted, correct)]) per (type, entry)."""
    prompts = [solver_prompt(t, e, cfg) for t, e in tasks]
    groups = _generate(policy, prompts, n, cfg, **sampling)
    graded = iter(check_solutions(executor, [t for t, _ in tasks for _ in range(n)],
                                  [e for _, e in tasks for _ in range(n)],
                                  [c.text for g in groups for c in g]))
    return [(p, [(c, *next(graded)) for c in g]) for p, g in zip(prompts, groups)]


def seed_buffers(policy, executor: Executor, cfg: Config, rng: random.Random) -> dict:
    """Step 0 (§3.3.1, _init_seed_dataset), no updates: deduction and abduction rounds fill
    D_seed = D_ded = D_abd with S*B stripped triplets, then induction rounds D_ind on them."""
    target, cap = cfg.seed_factor * cfg.batch_size, cfg.buffer_cap
    seed = collections.deque([dict(ZERO_TRIPLET, step=0)], maxlen=cap)
    views = {"deduction": seed, "abduction": seed, "induction": collections.deque(maxlen=cap)}
    for buf, tasks in ((seed, TASKS[:2]), (views["induction"], TASKS[2:])):
        for task in [tasks[r % len(tasks)] for r in range(cfg.seed_max_rounds)]:
            if len(buf) >= target:
                break
            new = [p for p in propose(policy, executor, views, cfg, rng, 0, tasks=(task,))[task]
                   if p["reason"] is None]
            if task != "induction":  # stripped, then validated again
                new = [dict(p, program=strip_program(p["program"]), entry=None) for p in new]
                validate(executor, task, new, cfg, 0, policy.tokenizer)
            buf.extend([p["entry"] for p in new if p["reason"] is None][:target - len(buf)])
    if len(seed) < target or len(views["induction"]) < target:
        print(f"[absolute_zero] seeding stopped after {cfg.seed_max_rounds} rounds per phase: "
              f"{len(seed)} triplets, {len(views['induction'])} induction tasks (target {target})",
              file=sys.stderr)
    return {t: collections.deque(views[t], maxlen=cap) for t in TASKS}  # D_ded, D_abd apart


def propose(policy, executor: Executor, buffers: dict, cfg: Config,
            rng: random.Random, step: int, tasks=TASKS) -> dict[str, list[dict]]:
    """Step 1: B proposals per task type, parsed and validated (the caller keeps the valid). A
    prompt's K references are dropped until it fits; induction: a D_ded u D_abd program, 4 draws."""
    programs = list(dict.fromkeys(e["program"] for t in TASKS[:2] for e in buffers[t]))
    props = {t: [] for t in tasks}
    for t in (t for t in tasks for _ in range(cfg.batch_size)):
        if t == "induction":
            tries = (([], rng.choice(programs)) for _ in range(4 if programs else 0))
        else:
            refs = sample(buffers[t], cfg.references, rng)
            tries = ((refs[:k], "") for k in range(len(refs), -1, -1))
        for refs, program in tries:  # the last reference-free prompt is kept even if too long
            prompt = proposer_prompt(t, refs, cfg, program=program)
            if _fits(policy.tokenizer, prompt, cfg) or not refs and not program:
                props[t].append({"task": t, "program": program, "prompt": prompt})
                break
    flat = [p for t in tasks for p in props[t]]
    for p, group in zip(flat, _generate(policy, [p["prompt"] for p in flat], 1, cfg)):
        p["completion"] = group[0]
        p.update(parse_proposal(group[0].text, p["task"], cfg.induction_inputs))
    for t in tasks:
        validate(executor, t, props[t], cfg, step, policy.tokenizer)
    return props


def validate(executor: Executor, task: str, proposals: list[dict], cfg: Config, step: int = 0,
             tokenizer=None) -> list[dict]:
    """Step 2 (§3.3.3): sets p['reason'] (None = valid) and p['entry']: static checks (induction's
    programs, from the buffers, passed them), then j agreeing runs give the gold outputs; a solver
    prompt that does not fit is too_large."""
    for p in proposals:
        if p.setdefault("reason", None) is None and task != "induction":
            p["reason"], p["program"] = static_check(p["program"], cfg.reject_multiple_defs)
    todo = [(p, p["inputs"] if task == "induction" else [p["input"]]) for p in proposals
            if p["reason"] is None]
    results = iter(executor.run_checked([(p["program"], i) for p, ins in todo for i in ins]))
    for p, ins in todo:
        reasons, outs = zip(*[next(results) for _ in ins])
        p["reason"] = next(filter(None, reasons), None)
        gold = ({"inputs": ins, "outputs": list(outs), "message": p["message"]}
                if task == "induction" else {"input": ins[0], "output": outs[0]})
        p["entry"] = None if p["reason"] else {"program": p["program"], **gold, "step": step}
        prompt = p["entry"] and tokenizer is not None and solver_prompt(task, p["entry"], cfg)
        if prompt and not _fits(tokenizer, prompt, cfg):
            p["reason"], p["entry"] = "too_large", None
    return proposals


def estimate_learnability(policy, executor: Executor, props: dict, cfg: Config) -> None:
    """Step 3 (Eq. 4): p['solve_rate'] = r_bar over n samples at T = 1, top-p 1."""
    valid = [p for t in props for p in props[t] if p["reason"] is None]
    graded = _answers(policy, executor, [(p["task"], p["entry"]) for p in valid],
                      cfg.learnability_samples, cfg, temperature=1.0, top_p=1.0)
    for p, (_, answers) in zip(valid, graded):
        p["solve_rate"] = sum(correct for _, _, correct in answers) / cfg.learnability_samples


def solve(policy, executor: Executor, props: dict, buffers: dict, cfg: Config,
          rng: random.Random, step: int) -> dict[str, list[dict]]:
    """Step 4: this step's valid tasks back-filled from older ones, one answer each, graded."""
    work = []
    for t in TASKS:
        new = [p["entry"] for p in props[t] if p["reason"] is None][: cfg.batch_size]
        old = [e for e in buffers[t] if e.get("step") != step] or list(buffers[t])
        need = cfg.batch_size - len(new)
        work += [(t, e, k < len(new)) for k, e in enumerate(
            new + sample(old, need, rng, replace=need > len(old)))]
    solved = {t: [] for t in TASKS}
    for (t, e, new), (prompt, [(c, formatted, correct)]) in zip(
            work, _answers(policy, executor, [(t, e) for t, e, _ in work], 1, cfg)):
        solved[t].append({"entry": e, "new": new, "prompt": prompt, "completion": c,
                          "correct": correct, "reward": solver_reward(formatted, correct)})
    return solved


def build_trajectories(props: dict, solved: dict) -> list:
    """The 6B batch in task order, each with its TRR++ advantage keyed '<role>/<task>' (Eq. 8)."""
    records = [(r, f"{role}/{t}") for t in TASKS
               for role, recs in (("proposer", props[t]), ("solver", solved[t]))
               for r in recs if r["completion"].token_ids]
    adv = keyed_advantages([r["reward"] for r, _ in records], [k for _, k in records]).tolist()
    for (r, _), a in zip(records, adv):
        r["advantage"] = a
    return [common.Trajectory.from_completion(r["completion"], reward=r["reward"], role=k,
                                              advantage=r["advantage"]) for r, k in records]


def trr_update(policy, props: dict, solved: dict, cfg: Config) -> dict:
    """Step 6: PPO-clip (Eq. 9), one AdamW step per --mini-batch; pg_step syncs the sampler."""
    if not (trajs := build_trajectories(props, solved)):
        return {}
    return common.pg_step(policy, trajs, common.PGConfig(
        clip_low=cfg.clip_ratio, clip_high=cfg.clip_ratio, entropy_coef=cfg.entropy_coef,
        aggregation=cfg.aggregation, max_len=cfg.max_response_tokens,
        temperature=cfg.temperature, mini_batch=cfg.mini_batch))


def self_play_step(policy, executor: Executor, buffers: dict, cfg: Config, rng: random.Random,
                   step: int) -> tuple[dict, dict, dict]:
    """One iteration of Alg. 1: steps 1-6; every valid proposal joins its buffer."""
    props = propose(policy, executor, buffers, cfg, rng, step)
    for t in TASKS:
        buffers[t].extend(p["entry"] for p in props[t] if p["reason"] is None)
    estimate_learnability(policy, executor, props, cfg)
    for p in (p for t in TASKS for p in props[t]):
        p["reward"] = proposer_reward(p["reason"] is None, p.get("solve_rate"))
    solved = solve(policy, executor, props, buffers, cfg, rng, step)
    return props, solved, trr_update(policy, props, solved, cfg)


# --- Metrics per task type (the tasks' solve rate and program length over training, §4.4)
def _mean(xs) -> float:
    return sum(xs) / len(xs) if (xs := list(xs)) else 0.0


def step_metrics(props: dict, solved: dict, buffers: dict, stats: dict | None = None) -> dict:
    """Per task type, overall, and trr_update's `stats` as train/..."""
    m = {f"train/{k}": v for k, v in (stats or {}).items()}
    for t in TASKS:
        ps, ss = props[t], solved[t]
        valid = [p for p in ps if p["reason"] is None]
        m[f"{t}/valid_rate"] = _mean(p["reason"] is None for p in ps)
        m.update({f"{t}/reject/{r}": sum(p["reason"] == r for p in ps) for r in REJECT_REASONS})
        m[f"{t}/buffer_size"] = len(buffers[t])
        m[f"{t}/solver_acc"] = _mean(s["correct"] for s in ss)
        m[f"{t}/proposer_reward"] = _mean(p["reward"] for p in ps)
        m[f"{t}/new_task_solve_rate"] = _mean(p["solve_rate"] for p in valid)
        m[f"{t}/program_chars"] = _mean(len(p["entry"]["program"]) for p in valid)
        m[f"len/proposer/{t}"] = _mean(len(p["completion"].token_ids) for p in ps)
        m[f"len/solver/{t}"] = _mean(len(s["completion"].token_ids) for s in ss)
    return m | {k: _mean(m[f"{t}/{k}"] for t in TASKS) for k in ("valid_rate", "solver_acc")}


def log_step_samples(run, step: int, props: dict, solved: dict) -> None:
    for t in TASKS:
        for role, recs, keys in (("proposer", props[t], ("reason", "entry", "solve_rate")),
                                 ("solver", solved[t], ("entry", "new", "correct"))):
            run.log_samples(step, f"{role}/{t}", [{"completion": r["completion"].text, **{
                k: r.get(k) for k in ("prompt", *keys, "reward")}} for r in recs])


# --- Step 7: evaluation as evaluation/math_eval/eval_math_nodes.sh --template azr (a base model
# there gets a boxed template, official issue #27: give one as eval_math with --prompts)
def eval_answer(text: str) -> str | None:
    """extract_azr_answer (evaluation/math_eval/eval/parser.py): the last <answer> (its \\boxed{}
    if any), else the last \\boxed{}, else the first \\[ ... \\]."""
    if "<answer>" in text:
        answer = text.split("<answer>")[-1].split("</answer>")[0].strip()
        return common.extract_boxed(answer) if "boxed" in answer else answer or None
    if "boxed" in text:
        return common.extract_boxed(text)
    m = re.search(r"\\\[(.*?)\\\]", text)
    return m.group(1).strip() or None if m else None


def _eval_prompt_fn(cfg: Config, code: bool):
    """The eval_code or eval_math template as a prompt_fn, named for eval.json's settings."""
    def eval_prompt(problem, tokenizer=None):
        fields = ({"task": common.code_task_prompt(problem)} if code
                  else {"question": problem["question"].strip()})
        return templates(cfg)["eval_code" if code else "eval_math"].format(**fields)
    tag = f" ({cfg.prompts})" if cfg.prompts else ""
    eval_prompt.__name__ = f"absolute_zero.{'code_' if code else ''}eval_prompt{tag}"
    return eval_prompt


def evaluate(policy, cfg: Config, run=None, name: str = "eval.json") -> dict:
    """Math (Table 1's sets) and, with --eval-code, code benchmarks; written to `run`'s `name`."""
    results = common.evaluate_config(policy, cfg, prompt_fn=_eval_prompt_fn(cfg, code=False),
                                     extract_fn=eval_answer) if cfg.eval_benchmarks.strip() else {}
    if cfg.eval_code:  # an unavailable code benchmark is skipped: the math results stay
        results["code"] = common.evaluate_code_config(policy, cfg, "absolute_zero",
                                                      prompt_fn=_eval_prompt_fn(cfg, code=True))
    if run is not None:
        run.write_eval(results, name)
    return results


# --- The run
def check_config(cfg: Config) -> None:
    """A bad value is a one-line ValueError naming the flag (exit 2 from the command line)."""
    common.check_benchmark_names(cfg.eval_benchmarks)
    templates(cfg)  # --prompts FILE: unknown names, wrong placeholders or a bad file fail here
    checks = [
        (cfg.induction_inputs >= 2 and not cfg.induction_inputs % 2, f"--induction-inputs "
         f"{cfg.induction_inputs}: needs an even number >= 2 (half shown, half held out)"),
        (cfg.temperature > 0, f"--temperature {cfg.temperature} must be > 0"),  # sampled rollouts
        *[(getattr(cfg, k) >= 1, f"--{k.replace('_', '-')} must be >= 1")
          for k in ("seed_factor", "buffer_cap")],  # the others: parse_config's limit check
        (cfg.max_prompt_tokens < cfg.max_model_len, f"--max-prompt-tokens "
         f"{cfg.max_prompt_tokens} must be below --max-model-len {cfg.max_model_len}")]
    if errors := [msg for ok, msg in checks if not ok]:
        raise ValueError(errors[0])
    if cfg.eval_code:  # after the others
        common.check_code_benchmark_names(cfg.eval_code_benchmarks)


def train(cfg: Config) -> dict:
    check_config(cfg)
    common.seed_everything(cfg.seed)
    run = common.Run(cfg, "absolute_zero")
    policy = common.Policy.load(cfg)
    executor = Executor(cfg)
    try:
        start, state = run.load_checkpoint(policy) or (0, {})
        buffers = {t: collections.deque(b, maxlen=cfg.buffer_cap)
                   for t, b in state.get("buffers", {}).items()}
        if not buffers:
            buffers = seed_buffers(policy, executor, cfg, random.Random(cfg.seed))
            run.log(0, {f"{t}/buffer_size": len(buffers[t]) for t in TASKS})
        bar = run.progress(cfg.steps, initial=start)
        for step in range(start + 1, cfg.steps + 1):
            rng = random.Random(cfg.seed * 1_000_003 + step)  # resumable without RNG state
            props, solved, stats = self_play_step(policy, executor, buffers, cfg, rng, step)
            metrics = step_metrics(props, solved, buffers, stats)
            log_step_samples(run, step, props, solved)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                results = evaluate(policy, cfg, run, f"eval_step_{step}.json")
                metrics.update(common.eval_metrics(results))
            run.log(step, metrics)
            bar.update(1)
            if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
                run.save_checkpoint(step, policy, {"buffers": {t: list(buffers[t]) for t in TASKS}})
        return evaluate(policy, cfg, run)
    finally:
        executor.close()
        run.close()


def headline(results: dict) -> dict:
    """The final evaluation's figures for the summary (math, code, or why code was skipped)."""
    skipped = results.get("code", {}).get("skipped")
    return {**{k: v for k, v in common.eval_metrics(results).items() if k.endswith("greedy_acc")
               or "pass@" in k}, **({"code skipped": skipped} if skipped else {})}


def main(argv=None):
    common.run_cli(Config, train, argv, check=check_config, tiny=TINY, headline=headline)


if __name__ == "__main__":
    main()
