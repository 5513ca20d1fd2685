"""Tests for the built-in hub benchmarks of common.load_benchmark and for multiple-choice grading in
common.evaluate. Nothing is downloaded: a fake `datasets` module serves rows with the columns of each real
dataset (see the comments above common.BENCHMARKS), and a stand-in sampler returns fixed completions."""
import json
import random
import sys
import types

import pytest

import common
import infra.benchmarks
from common import BenchmarkUnavailable, choice_letter, gold_option_letter, load_benchmark, option_letter


def _fake_datasets(rows_by_key, fail=None, calls=None):
    """A `datasets` stand-in: load_dataset(path, name=None, split=None) serves rows_by_key[(path, name, split)]
    (a KeyError for anything else, as for a wrong id), records each call, or raises `fail`."""
    def load_dataset(path, name=None, split=None):
        if calls is not None:
            calls.append((path, name, split))
        if fail is not None:
            raise fail
        return list(rows_by_key[(path, name, split)])
    return types.SimpleNamespace(load_dataset=load_dataset)


# Rows with exactly the columns of the real datasets (values made up, shapes as on the hub).
GSM8K = {"question": "Tom has 1,200 apples and buys 34 more. How many?",
         "answer": "He has 1200 + 34 = <<1200+34=1234>>1234.\n#### 1,234"}
MATH500 = {"problem": "What is $1+1$?", "solution": "It is $\\boxed{2}$.", "answer": "2", "subject": "Algebra",
           "level": 1, "unique_id": "test/algebra/1.json"}
AIME24 = {"id": 60, "problem": "Find the remainder ...", "solution": "...", "answer": "204",
          "url": "https://artofproblemsolving.com/wiki/...", "year": "2024"}
AIME25 = {"problem_idx": 1, "problem": "Find the sum of all integer bases $b>9$ ...", "answer": 70,
          "problem_type": ["Number Theory"]}
AMC23 = {"id": 0, "question": "Cities $A$ and $B$ are $45$ miles apart ...", "answer": 27.0,
         "url": "https://artofproblemsolving.com/wiki/index.php/2023_AMC_12A_Problems/Problem_1"}
MINERVA = {"question": "Each of the two Magellan telescopes has a diameter of $6.5 \\mathrm{~m}$ ...",
           "answer": "1.6e-8"}


def _olympiad(i, final_answer, context=None, question=None):
    return {"id": 1606 + i, "question": question or f"Olympiad problem {i}: find $x$.",
            "solution": ["A long solution ..."], "final_answer": final_answer, "context": context,
            "image_1": None, "image_2": None, "image_3": None, "image_4": None, "image_5": None,
            "modality": "Text-only", "difficulty": "Competition", "is_multiple_answer": len(final_answer) > 1,
            "unit": None, "answer_type": "Numerical", "error": None, "question_type": "Open-ended",
            "subfield": "Algebra", "subject": "Math", "language": "English"}


OLYMPIAD = [_olympiad(0, ["$\\frac{1}{2}$"]), _olympiad(1, ["$1$", "$2$"]), _olympiad(2, []),
            _olympiad(3, ["$x=3$, $x=4$"], context="A sequence is defined by $a_1=1$.")]
MMLU_PRO = [
    {"question_id": 70, "question": "Which of these is a prime number?",
     "options": ["4", "6", "8", "9", "10", "12", "14", "15", "17", "21"], "answer": "I", "answer_index": 8,
     "cot_content": "", "category": "math", "src": "ori_mmlu-high_school_mathematics"},
    {"question_id": 71, "question": "Typical markup question?",
     "options": ["10%", "20%", "30%", "N/A", "N/A"], "answer": "B", "answer_index": 1, "cot_content": "",
     "category": "business", "src": "stemez-Business"},
]
SUPERGPQA = {"uuid": "c0ffee", "question": "What is the SI unit of force?",
             "options": ["joule", "watt", "newton", "pascal", "tesla", "henry", "volt", "ohm", "farad", "weber"],
             "answer": "newton", "answer_letter": "C", "discipline": "Science", "field": "Physics",
             "subfield": "Mechanics", "difficulty": "easy", "is_calculation": False}
BBEH = {"task": "boolean_expressions", "input": "Evaluate: not ( True and False ) or False. Options: (A) True (B) "
        "False", "target": "(A)", "mini": True, "canary": "BENCHMARK DATA SHOULD NEVER APPEAR ..."}


def _gpqa(i):
    return {"Question": f"GPQA question number {i}: which reagent gives product {i}?",
            "Correct Answer": f"right {i}", "Incorrect Answer 1": f"wrong-1 {i}",
            "Incorrect Answer 2": f"wrong-2 {i}", "Incorrect Answer 3": f"wrong-3 {i}",
            "Explanation": "...", "Record ID": f"rec{i:03d}", "Subdomain": "Organic Chemistry",
            "High-level domain": "Chemistry"}


GPQA = [_gpqa(i) for i in range(24)]

HUB = {("openai/gsm8k", "main", "test"): [GSM8K],
       ("HuggingFaceH4/MATH-500", None, "test"): [MATH500],
       ("HuggingFaceH4/aime_2024", None, "train"): [AIME24],
       ("MathArena/aime_2025", None, "train"): [AIME25],
       ("math-ai/amc23", None, "test"): [AMC23],
       ("math-ai/minervamath", None, "test"): [MINERVA],
       ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"): OLYMPIAD,
       ("TIGER-Lab/MMLU-Pro", None, "test"): MMLU_PRO,
       ("Idavidrein/gpqa", "gpqa_diamond", "train"): GPQA,
       ("m-a-p/SuperGPQA", None, "train"): [SUPERGPQA],
       ("BBEH/bbeh", None, "train"): [BBEH]}


@pytest.fixture
def hub(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets(HUB, calls=calls))
    return calls


# ---------------------------------------------------------------------------------------------- hub row mapping
def test_every_builtin_asks_for_its_verified_id_config_and_split(hub):
    expected = {"gsm8k": ("openai/gsm8k", "main", "test"), "math500": ("HuggingFaceH4/MATH-500", None, "test"),
                "aime24": ("HuggingFaceH4/aime_2024", None, "train"), "aime25": ("MathArena/aime_2025", None, "train"),
                "amc23": ("math-ai/amc23", None, "test"), "minerva": ("math-ai/minervamath", None, "test"),
                "olympiadbench": ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"),
                "mmlu_pro": ("TIGER-Lab/MMLU-Pro", None, "test"),
                "gpqa_diamond": ("Idavidrein/gpqa", "gpqa_diamond", "train"),
                "supergpqa": ("m-a-p/SuperGPQA", None, "train"), "bbeh": ("BBEH/bbeh", None, "train")}
    assert set(common.BENCHMARKS) == set(expected)
    for name, key in expected.items():
        hub.clear()
        assert load_benchmark(name)
        assert hub == [key], name
    assert load_benchmark("GPQA_Diamond") == load_benchmark("gpqa_diamond")  # names are case-insensitive


def test_free_form_sets_map_question_and_answer(hub):
    assert load_benchmark("gsm8k") == [{"question": GSM8K["question"], "answer": "1234"}]
    assert load_benchmark("math500") == [{"question": "What is $1+1$?", "answer": "2"}]
    assert load_benchmark("aime24") == [{"question": AIME24["problem"], "answer": "204"}]
    assert load_benchmark("aime25") == [{"question": AIME25["problem"], "answer": "70"}]      # int64 column
    assert load_benchmark("amc23") == [{"question": AMC23["question"], "answer": "27"}]       # 27.0 -> "27"
    assert load_benchmark("minerva") == [{"question": MINERVA["question"], "answer": "1.6e-8"}]
    assert load_benchmark("bbeh") == [{"question": BBEH["input"], "answer": "(A)"}]
    for p in load_benchmark("bbeh") + load_benchmark("minerva"):
        assert "choices" not in p


def test_olympiadbench_final_answer_list(hub):
    rows = load_benchmark("olympiadbench")
    assert [r["answer"] for r in rows] == ["\\frac{1}{2}", "1, 2", "$x=3$, $x=4$"]  # row without an answer dropped
    assert rows[0]["question"] == OLYMPIAD[0]["question"] and "choices" not in rows[0]
    assert rows[2]["question"] == "A sequence is defined by $a_1=1$.\n\n" + OLYMPIAD[3]["question"]
    assert len(load_benchmark("olympiadbench", limit=2)) == 2


def test_mmlu_pro_options_and_letter(hub):
    a, b = load_benchmark("mmlu_pro")
    assert a == {"question": MMLU_PRO[0]["question"], "choices": MMLU_PRO[0]["options"], "answer": "I"}
    assert a["choices"][ord(a["answer"]) - 65] == "17"
    assert b["choices"] == ["10%", "20%", "30%"] and b["answer"] == "B"  # "N/A" padding dropped


def test_supergpqa_options_and_letter(hub):
    [p] = load_benchmark("supergpqa")
    assert p == {"question": SUPERGPQA["question"], "choices": SUPERGPQA["options"], "answer": "C"}
    assert p["choices"][2] == SUPERGPQA["answer"]


def test_gpqa_shuffle_is_fixed_per_question_and_points_at_the_correct_answer(hub, monkeypatch):
    rows = load_benchmark("gpqa_diamond")
    assert len(rows) == len(GPQA)
    for raw, p in zip(GPQA, rows):
        assert p["question"] == raw["Question"]
        assert sorted(p["choices"]) == sorted(raw[c] for c in ("Correct Answer", "Incorrect Answer 1",
                                                                 "Incorrect Answer 2", "Incorrect Answer 3"))
        assert p["choices"]["ABCD".index(p["answer"])] == raw["Correct Answer"]
    # the same question gets the same order on every load and wherever its row is
    assert load_benchmark("gpqa_diamond") == rows
    reversed_rows = {**HUB, ("Idavidrein/gpqa", "gpqa_diamond", "train"): GPQA[::-1]}
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets(reversed_rows))
    assert load_benchmark("gpqa_diamond") == rows[::-1]
    # different questions get different orders: the gold letter is spread over A-D, not always A
    assert len({tuple(p["choices"]) for p in rows}) == len(rows)
    assert len({p["answer"] for p in rows}) >= 3
    # the seed is SHA-256 of the question (pinned: Python's salted hash() would change between runs)
    q = "GPQA question number 0: which reagent gives product 0?"
    seed = int.from_bytes(__import__("hashlib").sha256(q.encode()).digest()[:8], "big")
    order = [0, 1, 2, 3]
    random.Random(seed).shuffle(order)
    assert infra.benchmarks.gpqa_option_order(q) == order == infra.benchmarks.gpqa_option_order("  " + q + "\n")


def test_hf_spec_and_old_style_tuple_entries(hub, monkeypatch):
    HUB2 = {**HUB, ("someone/qa", "cfg", "validation"): [{"q": "2+2?", "a": 4}]}
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets(HUB2))
    assert load_benchmark("hf:someone/qa:cfg:validation:q:a") == [{"question": "2+2?", "answer": "4"}]
    assert load_benchmark("hf:openai/gsm8k:main:test:question:answer")[0]["answer"] == "1234"
    monkeypatch.setitem(common.BENCHMARKS, "mine", ("someone/qa", "cfg", "validation", "q", "a"))
    assert load_benchmark("mine") == [{"question": "2+2?", "answer": "4"}]
    with pytest.raises(KeyError, match=r"no column\(s\) \['answer'\].*'q', 'a'"):
        load_benchmark("hf:someone/qa:cfg:validation:q:answer")


def test_rows_that_do_not_map_are_clear_errors(monkeypatch):
    bad = {**MMLU_PRO[0], "answer": "K"}           # not one of the 10 options' letters
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets({("TIGER-Lab/MMLU-Pro", None, "test"): [bad]}))
    with pytest.raises(ValueError, match=r"'mmlu_pro' \(TIGER-Lab/MMLU-Pro\) row 0.*gold letter 'K'"):
        load_benchmark("mmlu_pro")
    renamed = {k: v for k, v in SUPERGPQA.items() if k != "answer_letter"}
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets({("m-a-p/SuperGPQA", None, "train"): [renamed]}))
    with pytest.raises(KeyError, match=r"m-a-p/SuperGPQA has no column\(s\) \['answer_letter'\]"):
        load_benchmark("supergpqa")


# ---------------------------------------------------------------------------------------------- errors
def test_missing_datasets_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(BenchmarkUnavailable, match="pip install datasets.*local JSONL"):
        load_benchmark("mmlu_pro")
    with pytest.raises(RuntimeError, match="huggingface-cli login.*accept its terms"):  # gated: says so up front
        load_benchmark("gpqa_diamond")


def test_unreachable_hub_and_gated_set_are_clear_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets({}, fail=ConnectionError("no route to host")))
    with pytest.raises(BenchmarkUnavailable, match=r"could not load benchmark 'minerva' \(math-ai/minervamath, "
                       r"split test\).*no route to host.*HF_HUB_OFFLINE.*local JSONL") as e:
        load_benchmark("minerva")
    assert "is gated" not in str(e.value)   # only gated sets get the log-in-and-accept-terms line
    gated_error = PermissionError("Dataset 'Idavidrein/gpqa' is a gated dataset on the Hub. You must be "
                                  "authenticated to access it.")
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets({}, fail=gated_error))
    with pytest.raises(BenchmarkUnavailable, match=r"\(Idavidrein/gpqa, config gpqa_diamond, split train\).*"
                       r"Idavidrein/gpqa is gated: log in \(`huggingface-cli login`, or set HF_TOKEN\) and accept "
                       r"its terms at https://huggingface.co/datasets/Idavidrein/gpqa"):
        load_benchmark("gpqa_diamond")
    with pytest.raises(ValueError, match="unknown benchmark 'gpqa'.*gpqa_diamond"):
        load_benchmark("gpqa")


# ---------------------------------------------------------------------------------------------- letters
def test_choice_letter_surface_forms():
    for s in ("B", "B)", "B.", "(B)", "(b)", "b", "B) Mercury", "\\boxed{B}", "\\boxed{(B)}", "\\boxed{B) Mercury}",
              "\\text{B}", "\\textbf{(B)}", "$B$", "**B**", "the answer is B", "The answer is (B).", "Answer: B",
              "Option B", "work... \\boxed{A} then \\boxed{B}"):
        assert choice_letter(s) == "B", s
    for s in ("Because", "Mercury", "a dog", "the answer is photosynthesis", "\\boxed{Mercury}", "", None, 2):
        assert choice_letter(s) is None, s


def test_option_letter_range_and_fallback():
    assert option_letter("\\boxed{C}", None, 4) == "C" and option_letter("C", None, 2) is None  # C is not an option
    text = "First I thought the answer is A. Checking again, the answer is (C)."
    assert option_letter(None, text, 4) == "C"                 # nothing boxed: the last "answer is" statement
    assert option_letter("Venus", text, 4) is None            # something boxed that is not a letter: no fallback
    assert option_letter(None, "the answer is probably Because", 4) is None


def test_gold_option_letter():
    ch = ["Venus", "Mercury", "Mars", "Earth"]
    assert [gold_option_letter({"answer": a, "choices": ch}) for a in ("B", "(b)", "b)", " mercury ", "D")] == \
        ["B", "B", "B", "B", "D"]
    assert gold_option_letter({"answer": "E", "choices": ch}) is None          # no option E
    assert gold_option_letter({"answer": "Pluto", "choices": ch}) is None
    assert gold_option_letter({"answer": "B"}) is None                          # free-form


# ---------------------------------------------------------------------------------------------- grading
class StandIn:
    """A sampler that answers prompt p (the question, see by_question) with texts[p]: the first for greedy, the
    first n when sampling."""

    tokenizer = None

    def __init__(self, texts: dict):
        self.texts = texts

    def generate(self, prompts, n=1, temperature=1.0, max_tokens=16, top_p=1.0, seed=None):
        return [[common.Completion(prompt_ids=[0], token_ids=[1, 2], text=t, finish_reason="stop")
                 for t in (self.texts[p][:n] if n > 1 else self.texts[p][:1])] for p in prompts]


def by_question(problem, tokenizer=None):
    return problem["question"]


PLANETS = ["Venus", "Mercury", "Mars", "Earth"]   # gold B
RIGHT = ["Thinking... so \\boxed{B}", "\\boxed{(B)}", "\\boxed{B) Mercury}", "\\boxed{\\text{B}}",
         "The closest planet is Mercury, so the answer is B.", "**Answer:** (B)", "\\boxed{b}"]
WRONG = ["\\boxed{C}", "\\boxed{Venus}", "\\boxed{Mercury}", "\\boxed{E}", "No idea.", "\\boxed{B} no wait \\boxed{C}",
         "The answer is B, so \\boxed{A}", "\\boxed{\\text{Because of gravity}}"]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_multiple_choice_graded_by_exact_letter(tmp_path):
    texts = RIGHT + WRONG
    rows = [{"question": f"Q{i}: which planet is closest to the Sun?", "choices": PLANETS, "answer": "B"}
            for i in range(len(texts))]
    # free-form problems are unaffected: math_equal as before, no letter fallback without a box
    free = [({"question": "F0: 6*7?", "answer": "42"}, "\\boxed{42}", True),
            ({"question": "F1: letter-gold, no choices", "answer": "B"}, "\\boxed{B) 149 km}", True),
            ({"question": "F2: 5+7?", "answer": "12"}, "the answer is 12", False),
            ({"question": "F3: planet?", "answer": "Mercury"}, "\\boxed{Mercury}", True)]
    bench = _write(tmp_path / "mc.jsonl", rows + [p for p, _, _ in free])
    sampler = StandIn({**{r["question"]: [t] for r, t in zip(rows, texts)}, **{p["question"]: [t] for p, t, _ in free}})
    res = common.evaluate(sampler, bench, prompt_fn=by_question, n_boot=50)
    r = res["benchmarks"][bench]
    got = [x["greedy_correct"] for x in r["per_problem"]]
    assert got == [True] * len(RIGHT) + [False] * len(WRONG) + [ok for _, _, ok in free]
    assert r["n_multiple_choice"] == len(texts) and r["n_choices_without_gold_letter"] == 0
    letters = [x.get("greedy_letter") for x in r["per_problem"]]
    assert letters[:len(RIGHT)] == ["B"] * len(RIGHT)
    assert letters[len(RIGHT):len(texts)] == ["C", None, None, None, None, "C", "A", None]
    assert all("greedy_letter" not in x for x in r["per_problem"][len(texts):])
    assert r["greedy_no_answer_frac"] == pytest.approx(6 / len(got))  # MC: no letter; free-form: no box
    assert "option letter" in res["settings"]["multiple_choice"]
    assert common.eval_metrics(res)["eval/mc/n_multiple_choice"] == len(texts)


def test_multiple_choice_samples_and_text_golds(tmp_path):
    rows = [{"question": "Which animal barks?", "choices": ["dog", "cat", "fish"], "answer": "dog"},  # gold: text
            {"question": "Which is a fruit?", "choices": ["car", "apple"], "answer": "(b)"},
            {"question": "Unresolvable gold", "choices": ["x", "y"], "answer": "z"}]
    bench = _write(tmp_path / "mc2.jsonl", rows)
    sampler = StandIn({"Which animal barks?": ["\\boxed{A}", "\\boxed{dog}", "answer is A", "\\boxed{(A)}"],
                       "Which is a fruit?": ["\\boxed{B}", "\\boxed{A}", "\\boxed{C}", "\\boxed{apple}"],
                       "Unresolvable gold": ["\\boxed{z}", "\\boxed{A}", "\\boxed{z}", "\\boxed{z}"]})
    res = common.evaluate(sampler, bench, prompt_fn=by_question, n=4, k="1,4", temperature=1.0, n_boot=50)
    r = res["benchmarks"][bench]
    assert [x["greedy_correct"] for x in r["per_problem"]] == [True, True, True]
    assert [x["correct_samples"] for x in r["per_problem"]] == [3, 1, 3]   # the last one is graded free-form
    assert r["n_multiple_choice"] == 2 and r["n_choices_without_gold_letter"] == 1
    assert r["pass@k"]["1"] == pytest.approx((3 / 4 + 1 / 4 + 3 / 4) / 3)


def test_name_at_n_scores_that_benchmark_by_mean_at_n(tmp_path):
    """"bench@N" (SPICE's AIME protocol, mean@32 at T 0.6): N samples for that benchmark only, its "score" is
    mean@N while the others keep the greedy score; eval_metrics names it bench@N and averages the scores."""
    a = _write(tmp_path / "a.jsonl", [{"question": "A1", "answer": "1"}, {"question": "A2", "answer": "2"}])
    b = _write(tmp_path / "b.jsonl", [{"question": "B1", "answer": "3"}])
    sampler = StandIn({"A1": ["\\boxed{1}", "\\boxed{0}", "\\boxed{1}", "\\boxed{0}"],   # greedy right, mean 1/2
                       "A2": ["\\boxed{0}", "\\boxed{2}", "\\boxed{2}", "\\boxed{2}"],   # greedy wrong, mean 3/4
                       "B1": ["\\boxed{3}", "\\boxed{0}", "\\boxed{0}", "\\boxed{0}"]})
    res = common.evaluate(sampler, f"{a}@4,{b}", prompt_fn=by_question, k="1,4", n_boot=50)
    ra, rb = res["benchmarks"][f"{a}@4"], res["benchmarks"][b]
    assert ra["greedy_acc"] == 0.5 and ra["n_samples"] == 4 and ra["mean@n"] == pytest.approx(5 / 8)
    assert (ra["score"], ra["score_source"]) == (pytest.approx(5 / 8), "mean@4") and set(ra["pass@k"]) == {"1", "4"}
    assert (rb["score"], rb["score_source"], rb["pass@k_source"]) == (1.0, "greedy", "greedy")  # n = 1: no samples
    flat = common.eval_metrics(res)
    assert flat["eval/a@4/score"] == pytest.approx(5 / 8) and flat["eval/b/score"] == 1.0
    assert flat["eval/mean_score"] == pytest.approx((5 / 8 + 1) / 2) and flat["eval/mean_greedy_acc"] == 0.75
    one = common.evaluate(sampler, f"{a}@1", prompt_fn=by_question, n_boot=50)["benchmarks"][f"{a}@1"]
    assert (one["n_samples"], one["score"], one["score_source"]) == (1, 0.5, "mean@1")   # A1 right, A2 wrong
    assert common.parse_benchmark_spec("aime24@32") == ("aime24", 32)
    assert common.parse_benchmark_spec(a) == (a, None) and len(common.load_benchmark(f"{a}@4")) == 2
    with pytest.raises(ValueError, match="must be >= 1"):
        common.parse_benchmark_spec("aime24@0")


def test_benchmark_names_are_checked_up_front(tmp_path):
    common.check_benchmark_names(f"gsm8k, aime24@32,hf:x/y:test:q:a,{_write(tmp_path / 'ok.jsonl', [])}@2,")
    for bad, needle in [("gsm8k,gsm8kk", "did you mean gsm8k"), ("mmlu-pro", "did you mean mmlu_pro"),
                        (str(tmp_path / "missing.jsonl"), "does not exist")]:
        with pytest.raises(ValueError, match=needle):
            common.check_benchmark_names(bad)


def test_hub_multiple_choice_through_evaluate(hub):
    """GPQA's shuffled options through the default prompt: the letter of the correct answer's position counts,
    the correct answer's text or another letter does not."""
    probs = load_benchmark("gpqa_diamond")
    prompts = [common.default_eval_prompt(p) for p in probs]
    for p, prompt in zip(probs, prompts):
        for letter, c in zip("ABCD", p["choices"]):
            assert f"\n{letter}) {c}" in prompt
    right = {pr: [f"\\boxed{{{p['answer']}}}"] for p, pr in zip(probs, prompts)}
    res = common.evaluate(StandIn(right), "gpqa_diamond", n_boot=50)
    assert res["benchmarks"]["gpqa_diamond"]["greedy_acc"] == 1.0
    as_text = {pr: [f"\\boxed{{{p['choices']['ABCD'.index(p['answer'])]}}}"] for p, pr in zip(probs, prompts)}
    off_by_one = {pr: [f"\\boxed{{{'ABCD'[('ABCD'.index(p['answer']) + 1) % 4]}}}"] for p, pr in zip(probs, prompts)}
    for texts in (as_text, off_by_one):
        assert common.evaluate(StandIn(texts), "gpqa_diamond", n_boot=50)["benchmarks"]["gpqa_diamond"][
            "greedy_acc"] == 0.0


def test_local_jsonl_choices_limit(tmp_path):
    bad = _write(tmp_path / "eleven.jsonl", [{"question": "q", "choices": [str(i) for i in range(11)], "answer": "A"}])
    with pytest.raises(ValueError, match="at most 10"):
        load_benchmark(bad)
    ten = _write(tmp_path / "ten.jsonl", [{"question": "q", "choices": [str(i) for i in range(10)], "answer": "J"}])
    [p] = load_benchmark(ten)
    assert "\nJ) 9" in common.default_eval_prompt(p) and gold_option_letter(p) == "J"


def test_method_defaults_evaluate_on_the_papers_suites_by_builtin_name():
    """Each method's default --eval-benchmarks is its paper's table, and every name is one load_benchmark knows."""
    import absolute_zero
    import r_zero
    import spice
    suites = {spice: 11, r_zero: 10, absolute_zero: 6}  # SPICE Table 1; R-Zero 7 math + 3 general; AZR Table 1 math
    for module, n in suites.items():
        names = [common.parse_benchmark_spec(b)[0] for b in module.Config().eval_benchmarks.split(",")]
        assert len(set(names)) == n and all(b in common.BENCHMARKS for b in names), (module.__name__, names)
        common.check_benchmark_names(module.Config().eval_benchmarks)
    assert {"minerva", "olympiadbench", "gpqa_diamond", "bbeh", "aime24@32", "aime25@32"} <= \
        set(spice.Config().eval_benchmarks.split(","))  # App. A: AIME is the mean of 32 samples at T 0.6
    import inspect
    assert spice.Config().eval_n == 1 and inspect.signature(common.evaluate).parameters["temperature"].default == 0.6
