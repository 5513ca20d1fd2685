"""Code benchmarks (HumanEval+, MBPP+ and local JSONL files): loading them, and grading solutions
with their tests in the sandbox."""
import os

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


def load_code_benchmark(name_or_path, limit=0):
    """Code problems of "humaneval+", "mbpp+" or a local JSONL file (the styles: CODE_SHAPE)."""
    name = str(name_or_path).strip()
    hub_id, split = CODE_BENCHMARKS.get(name.lower(), (None, None))
    if hub_id is None and not name.endswith((".jsonl", ".json")) and not os.path.isfile(name):
        raise ValueError(f"unknown code benchmark {name!r}: use one of "
                         f"{sorted(CODE_BENCHMARKS)} or a local .jsonl file; {CODE_SHAPE}")

    def problem(i, obj):
        if hub_id == "evalplus/mbppplus":  # EvalPlus shows the first assert: the name and call
            prompt = [str(obj["prompt"]).strip()] + [str(t).strip() for t in obj["test_list"][:1]]
            test = "\n".join([*obj["test_imports"], obj["test"]])
            obj = {"task_id": f"Mbpp/{obj['task_id']}", "prompt": "\n".join(prompt), "test": test}
        where = f"{hub_id} row {i}" if hub_id else f"{name}:{i}"
        if "task_id" not in obj:
            raise ValueError(f'{where}: missing "task_id"; {CODE_SHAPE}')
        prompt, test, entry = obj.get("prompt"), obj.get("test"), obj.get("entry_point")
        if not isinstance(prompt, str) or not isinstance(test, str) or not test.strip():
            raise ValueError(f'{where}: "prompt" and "test" must be strings and "test" non-empty; '
                             f"{CODE_SHAPE}")
        if entry is not None and not (isinstance(entry, str) and entry.isidentifier()):
            raise ValueError(f'{where}: "entry_point" must be a Python identifier, got '
                             f"{str(entry)[:60]!r}")
        return {"task_id": str(obj["task_id"]), "prompt": prompt, "test": test,
                "entry_point": entry}
    return load_rows("code benchmark", name, limit, problem, CODE_SHAPE,
                    hub_id and (hub_id, None, split, False))


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
        if b.lower() not in CODE_BENCHMARKS and not (b.endswith((".jsonl", ".json"))
                                                     and os.path.isfile(b)):
            raise ValueError(f"{flag}: {b!r} is neither one of {sorted(CODE_BENCHMARKS)} nor an "
                             "existing .jsonl file")
    if any(b.lower() in CODE_BENCHMARKS for b in code) and not find_spec("datasets"):
        raise ValueError("--eval-code: HumanEval+/MBPP+ need the `datasets` package: pip install "
                         "datasets, or local JSONL files, or --no-eval-code")


def extract_code(text):
    """The last closed ```python (```py, ```python3, untagged) block, or None; line by line, so
    another block's closing fence (```input) never opens one, and a truncated block never counts."""
    found, body, tag = None, None, ""
    for line in str(text).splitlines():
        fence = line.strip().startswith("```")
        if body is None and fence:
            tag, body = line.strip()[3:].strip().lower(), []
        elif body is not None and fence:
            if tag in ("python", "py", "python3", ""):
                found = "\n".join(body)
            body = None
        elif body is not None:
            body.append(line)
    return found if found and found.strip() else None


def run_solutions(sandbox, extract_fn, timeout, probs, texts):
    """[(problem index, text)] -> [(passed, status, message)]. A run passes only if the program
    ends by evaluating a fresh random token: exiting early or forging a result frame cannot pass."""
    token = f"all tests ran {os.urandom(8).hex()}"
    jobs = [(probs[i], extract_fn(t)) for i, t in texts]
    todo = [i for i, (_, c) in enumerate(jobs) if c is not None]
    # HumanEval style keeps the prompt (its imports; a bare body completes the stub)
    progs = [(f"{p['prompt']}\n{c}\n\n{p['test']}\n\ncheck({p['entry_point']})\n"
              if p.get("entry_point") else f"{c}\n\n{p['test']}\n", repr(token))
             for p, c in (jobs[i] for i in todo)]
    res = sandbox.run_many(progs, timeout_s=timeout)
    again = [m for m, r in enumerate(res) if r.status == "sandbox_error"]  # not the program's fault
    for m, r in zip(again, sandbox.run_many([progs[m] for m in again], timeout_s=timeout)):
        res[m] = r
    out = [("no_code", None)] * len(jobs)
    for i, r in zip(todo, res):
        if r.status == "ok":
            out[i] = (("passed", None) if r.value == repr(token)
                      else ("error", "the program forged its result"))
        elif r.status == "timeout":
            out[i] = ("timeout", r.error)
        elif r.status == "error" and (r.error or "").startswith("AssertionError"):
            out[i] = ("failed", r.error)
        else:
            out[i] = ("error", f"{r.status}: {r.error}")
    return [(s == "passed", s, msg) for s, msg in out]
