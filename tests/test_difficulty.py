"""Tests for tools/difficulty.py (RQ2 of "Towards Understanding Self-play for LLM Reasoning"): the
groups of steps, and the figures on a hand-written run folder whose trained checkpoint is a tiny
model warmed to answer 1 to every question, so that each group's solve rate is known."""
import dataclasses
import json
import pathlib
import shutil

import pytest

import absolute_zero as az
from tests import helpers
from tools import difficulty

# short solver templates (same placeholders as AZR's) so that the tiny model warms in seconds
SHORT_PROMPTS = {"wrapper": "{task}\nAssistant: <think>",
                 "solve_deduction": "output of {program} on {input}"}
ANSWER_ONE = "a</think>\n<answer>\n```output\n1\n```\n</answer>"  # read as the output 1


def _question(body: str, given: str, output: str, step: int) -> dict:
    return {"task": "deduction", "program": f"def f(x):\n    return {body}", "input": given,
            "output": output, "step": step}


RIGHT = [_question("x", "1", "1", 0), _question("x * 1", "1", "1", 0),
         _question("x - 1", "2", "1", 0)]  # 1 is their output
WRONG = [_question("x + 1", "1", "2", 0), _question("x * 3", "1", "3", 0)]


def test_steps_name_thirds_of_the_run_steps_or_ranges():
    logged = list(range(1, 11))
    groups = difficulty.choose_groups("early,mid,late,4,3-5", logged)
    assert [(g.label, g.steps) for g in groups] == [
        ("early", [1, 2, 3]), ("mid", [4, 5, 6]), ("late", [7, 8, 9, 10]), ("4", [4]),
        ("3-5", [3, 4, 5])]
    with pytest.raises(ValueError, match="3 steps or more"):
        difficulty.choose_groups("early", [1, 2])
    with pytest.raises(ValueError, match="'soon' is none of"):
        difficulty.choose_groups("early,soon", logged)


def _run_folder(tmp_path, model: str) -> pathlib.Path:
    """A run folder as absolute_zero.py leaves it, written by hand: config.json (with a --prompts
    file), proposals.jsonl and one checkpoint. Step 1 proposed two questions whose output is 1,
    step 2 one of them and one other, step 3 two others; an abduction proposal, a repeated
    question and a torn line must be left out."""
    run = tmp_path / "run"
    run.mkdir()
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(SHORT_PROMPTS))
    cfg = az.Config(model=model, output_dir=str(run), prompts=str(prompts), backend="hf",
                    max_response_tokens=24, max_model_len=1024, executor_timeout=2.0,
                    sandbox_workers=1, determinism_runs=1)
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    by_step = {1: [RIGHT[0], RIGHT[1], RIGHT[0]], 2: [RIGHT[2], WRONG[0]],
               3: [WRONG[0], WRONG[1]]}
    lines = []
    for step, questions in by_step.items():
        lines += [json.dumps(dict(q, step=step)) for q in questions]
    lines.insert(3, json.dumps(dict(WRONG[1], task="abduction", step=2)))
    (run / az.PROPOSALS_FILE).write_text("\n".join(lines) + '\n{"task": "dedu')
    return run


def test_solve_rate_and_length_per_group_of_steps(tiny_model_path, tiny_tokenizer, tmp_path,
                                                  capsys):
    """--steps early,mid,late of a 3-step run: the trained model (warmed to answer 1) solves
    all of step 1's questions, half of step 2's and none of step 3's, every answer the warm
    completion's tokens and EOS; the random base model solves none. Table, JSON and PNG."""
    run = _run_folder(tmp_path, tiny_model_path)
    cfg = az.Config(prompts=str(tmp_path / "prompts.json"))
    prompts = az.common.load_prompts(cfg.prompts, az.PROMPTS)
    pairs = [(az.solver_prompt("deduction", q, cfg, prompts), ANSWER_ONE) for q in RIGHT + WRONG]
    warm = helpers.warm_tiny_model(tiny_model_path, pairs, margin=4.0)
    checkpoint = run / "checkpoints" / "step_3"
    shutil.copytree(warm, checkpoint)
    (checkpoint / "trainer_state.json").write_text('{"step": 3}')
    code = difficulty.main([str(run), "--steps", "early,mid,late", "--n", "5", "--k", "3",
                            "--base", "tiny", "--temperature", "0.2"])
    assert code == 0
    report = json.loads((run / "difficulty.json").read_text())
    assert report["models"] == {"base": "tiny", "trained": str(checkpoint)}
    groups = report["groups"]
    # every distinct deduction question of its step: 2 of N = 5
    assert [(g["label"], g["steps"], g["questions"]) for g in groups] == [
        ("early", [1], 2), ("mid", [2], 2), ("late", [3], 2)]
    assert [g["trained"]["solve_rate"] for g in groups] == [1.0, 0.5, 0.0]
    assert sorted(groups[1]["trained"]["solve_rates"]) == [0.0, 1.0]
    assert [g["base"]["solve_rate"] for g in groups] == [0.0, 0.0, 0.0]
    warm_tokens = len(tiny_tokenizer(ANSWER_ONE)["input_ids"]) + 1  # and EOS
    assert [g["trained"]["mean_length"] for g in groups] == [warm_tokens] * 3
    assert all(0 < g["base"]["mean_length"] <= 24 for g in groups)
    shown = capsys.readouterr().out
    assert "early (step 1)" in shown and "1.000" in shown and "0.500" in shown
    assert (run / "difficulty.png").stat().st_size > 0


def test_bad_input_is_one_line_before_any_model_loads(tmp_path, capsys):
    run = _run_folder(tmp_path, "tiny")
    for argv, needle in [([str(tmp_path)], "no proposals.jsonl there"),
                         ([str(run)], "no checkpoint yet; pass --trained"),
                         ([str(run), "--trained", str(tmp_path / "nothing")], "--trained"),
                         ([str(run), "--k", "0"], "--k must be >= 1"),
                         ([str(run), "--trained", "tiny", "--steps", "early,1-2,often"],
                          "'often' is none of"),
                         ([str(run), "--trained", "tiny", "--steps", "9"],
                          "no valid deduction proposal")]:
        with pytest.raises(SystemExit) as e:
            difficulty.main(argv)
        assert e.value.code == 2 and needle in capsys.readouterr().err, argv
