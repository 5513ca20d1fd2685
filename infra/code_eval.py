"""Code benchmarks (HumanEval+, MBPP+ and local JSONL files): loading them, and grading solutions
with their tests in the sandbox."""
import os
import typing

from infra.benchmarks import load_rows


# name -> (hub id, split): HumanEval+ 164 rows, MBPP+ 378 rows (the datasets' cards)
CODE_BENCHMARKS = {"humaneval+": ("evalplus/humanevalplus", "test"),
                   "mbpp+": ("evalplus/mbppplus", "test")}


CODE_STATUSES = ("passed", "failed", "error", "timeout", "no_code")  # failed: an assertion failed


MAX_PROGRAM_CHARS = 32_000_000  # HumanEval+ tests inline thousands of inputs


CODE_SHAPE = ('each line must be one object: {"task_id", "prompt", "test", "entry_point"} '
               '(HumanEval style: "test" defines check(candidate), run as check(<entry_point>)) or '
               '{"task_id", "prompt", "test"} (MBPP style: "test" is a script that calls the '
               'function by name)')


CODE_INSTRUCTION = ("Write a complete, self-contained Python solution (with its imports) in one "
                     "```python block.")


def _mbpp_style(row):
    """An MBPP+ hub row in MBPP style: the prose with the first assert (EvalPlus shows it: it names
    the function and calls it), and the test script with its imports."""
    prompt = [str(row["prompt"]).strip()]
    for assertion in row["test_list"][:1]:
        prompt.append(str(assertion).strip())
    test = "\n".join([*row["test_imports"], row["test"]])
    return {"task_id": f"Mbpp/{row['task_id']}", "prompt": "\n".join(prompt), "test": test}


def _code_problem(obj, where):
    """The code problem {"task_id", "prompt", "test", "entry_point"} of one row, checked."""
    if "task_id" not in obj:
        raise ValueError(f'{where}: missing "task_id"; {CODE_SHAPE}')
    prompt = obj.get("prompt")
    test = obj.get("test")
    entry = obj.get("entry_point")
    if not isinstance(prompt, str) or not isinstance(test, str) or not test.strip():
        raise ValueError(f'{where}: "prompt" and "test" must be strings and "test" non-empty; '
                         f"{CODE_SHAPE}")
    if entry is not None and not (isinstance(entry, str) and entry.isidentifier()):
        raise ValueError(f'{where}: "entry_point" must be a Python identifier, got '
                         f"{str(entry)[:60]!r}")
    return {"task_id": str(obj["task_id"]), "prompt": prompt, "test": test, "entry_point": entry}


def load_code_benchmark(name_or_path, limit=0):
    """Code problems of "humaneval+", "mbpp+" or a local JSONL file (the styles: CODE_SHAPE)."""
    name = str(name_or_path).strip()
    hub_id, split = CODE_BENCHMARKS.get(name.lower(), (None, None))
    is_file = name.endswith((".jsonl", ".json")) or os.path.isfile(name)
    if hub_id is None and not is_file:
        raise ValueError(f"unknown code benchmark {name!r}: use one of "
                         f"{sorted(CODE_BENCHMARKS)} or a local .jsonl file; {CODE_SHAPE}")

    def problem(i, obj):
        if hub_id == "evalplus/mbppplus":
            obj = _mbpp_style(obj)
        where = f"{hub_id} row {i}" if hub_id else f"{name}:{i}"
        return _code_problem(obj, where)
    hub = None
    if hub_id:
        hub = (hub_id, None, split, False)
    return load_rows("code benchmark", name, limit, problem, CODE_SHAPE, hub)


def code_task_prompt(problem):
    """The task: HumanEval style shows the function stub to complete, MBPP style the prose."""
    if problem.get("entry_point"):
        return (f"Complete this Python function.\n```python\n{problem['prompt'].rstrip()}\n```\n"
                f"{CODE_INSTRUCTION}")
    return f"{problem['prompt'].strip()}\n\n{CODE_INSTRUCTION}"


def check_code_benchmark_names(names: str, flag: str = "--eval-code-benchmarks") -> None:
    """A method's up-front check of a code benchmark list: CODE_BENCHMARKS names (they need the
    `datasets` package) or existing JSONL files; ValueError naming the entry and the fix."""
    from importlib.util import find_spec
    code = [b.strip() for b in str(names).split(",") if b.strip()]
    for b in code:
        is_file = b.endswith((".jsonl", ".json")) and os.path.isfile(b)
        if b.lower() not in CODE_BENCHMARKS and not is_file:
            raise ValueError(f"{flag}: {b!r} is neither one of {sorted(CODE_BENCHMARKS)} nor an "
                             "existing .jsonl file")
    from_hub = any(b.lower() in CODE_BENCHMARKS for b in code)
    if from_hub and not find_spec("datasets"):
        raise ValueError("--eval-code: HumanEval+/MBPP+ need the `datasets` package: pip install "
                         "datasets, or local JSONL files, or --no-eval-code")


def extract_code(text):
    """The last closed ```python (```py, ```python3, untagged) block, or None; line by line, so
    another block's closing fence (```input) never opens one, and a truncated block never counts."""
    found = None
    body = None  # the lines of the block being read, None outside a block
    tag = ""
    for line in str(text).splitlines():
        fence = line.strip().startswith("```")
        if body is None and fence:
            tag = line.strip()[3:].strip().lower()
            body = []
        elif body is not None and fence:
            if tag in ("python", "py", "python3", ""):
                found = "\n".join(body)
            body = None
        elif body is not None:
            body.append(line)
    if found and found.strip():
        return found
    return None


class CodeVerdict(typing.NamedTuple):
    """evaluate_code's verdict on one completion."""
    correct: bool  # the status is "passed"
    status: str  # one of CODE_STATUSES
    message: str | None  # what went wrong, if anything


def _program(problem, code):
    """The program that runs a solution with its tests: HumanEval style keeps the prompt (its
    imports; a bare body completes the stub) and calls check(<entry_point>)."""
    if problem.get("entry_point"):
        return (f"{problem['prompt']}\n{code}\n\n{problem['test']}\n\n"
                f"check({problem['entry_point']})\n")
    return f"{code}\n\n{problem['test']}\n"


def _verdict(result, token_literal):
    """The CodeVerdict of a sandbox result: passed only if the sandbox got to evaluate
    `token_literal` after the program (the repr of its value is the literal again)."""
    if result.status == "ok" and result.value == token_literal:
        return CodeVerdict(True, "passed", None)
    if result.status == "ok":
        return CodeVerdict(False, "error", "the program forged its result")
    if result.status == "timeout":
        return CodeVerdict(False, "timeout", result.error)
    if result.status == "error" and (result.error or "").startswith("AssertionError"):
        return CodeVerdict(False, "failed", result.error)
    return CodeVerdict(False, "error", f"{result.status}: {result.error}")


def run_solutions(sandbox, extract_fn, timeout, probs, texts):
    """[(problem index, text)] -> [CodeVerdict]. A run passes only if the sandbox evaluates a
    fresh random token after the program: one that exits early, raises or writes a canned result
    fails. The token is no secret from the program, which shares its process with its tests: one
    written to read it (from the runner's stack frame) or to defeat the tests' asserts passes, as
    under EvalPlus, whose tests run in the solution's process too."""
    token = f"all tests ran {os.urandom(8).hex()}"
    token_literal = repr(token)
    no_code = CodeVerdict(False, "no_code", None)
    verdicts = [no_code] * len(texts)
    to_run, programs = [], []  # the completions with code, and their (program, expression)
    for k, (i, text) in enumerate(texts):
        code = extract_fn(text)
        if code is not None:
            to_run.append(k)
            programs.append((_program(probs[i], code), token_literal))
    results = sandbox.run_many(programs, timeout_s=timeout)
    again = []  # a sandbox error is not the program's fault: it runs once more
    for m, result in enumerate(results):
        if result.status == "sandbox_error":
            again.append(m)
    retried = sandbox.run_many([programs[m] for m in again], timeout_s=timeout)
    for m, result in zip(again, retried):
        results[m] = result
    for k, result in zip(to_run, results):
        verdicts[k] = _verdict(result, token_literal)
    return verdicts
