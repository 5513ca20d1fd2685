"""The laptop laboratory (tests/lab.py): the addition domain is exact and in star.py's layout, the
splits are disjoint, and the reduced STaR experiment (--quick: a smaller model, one round, a few
questions) runs end to end through the real star.py into metrics, a table and a PNG."""
import json
import os
import pathlib
import random
import subprocess
import sys

import lab
import star

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_scratchpad_answers_are_exact_and_read_by_star():
    rng = random.Random(0)
    for _ in range(2000):
        a, b = rng.randint(0, 99999), rng.randint(0, 99999)
        pad = lab.scratchpad(a, b)
        work, last = pad.split("\n")
        assert last == f"#### {a + b}"
        assert work.rstrip(".").split(" ")[-1] == str(a + b)  # the last 'so far' is the sum
        assert star.extract_answer(star.trim_rationale(pad + "\n\nQ: next", "math"),
                                   "math") == str(a + b)


def test_blocks_are_star_prompts():
    shots = lab.exemplars()
    ex = {"question": lab.question(12, 9), "answer": "21"}
    for hint in (False, True):
        prompt = star.build_prompt(ex, [{**s, "choices": None} for s in shots], hint=hint)
        expected = "\n\n".join(lab.block(*map(int, s["question"][8:-1].split(" + ")), hint)
                               for s in shots)
        assert prompt == expected + "\n\n" + lab.block(12, 9, hint).split("\nA: ")[0] + "\nA:"


def test_splits_are_disjoint():
    tests = [json.loads(t)["question"] for t in lab.test_lines("full")]
    assert len(tests) == len(set(tests)) == 300
    train = lab.problems(random.Random(7), 400, (1, 1, 1, 1, 1), set(tests))
    assert not {lab.question(a, b) for a, b in train} & set(tests)
    assert not {s["question"] for s in lab.exemplars()} & set(tests)


def test_a_finished_run_is_reused_only_on_the_same_base_model(tmp_path):
    run = tmp_path / "seed0"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": "/cache/base-a"}))
    assert not lab.finished(run, "/cache/base-a")  # it has not ended: no eval.json
    (run / "eval.json").write_text("{}")
    assert lab.finished(run, pathlib.Path("/cache/base-a"))
    assert not lab.finished(run, "/cache/base-b")  # the base changed (new prompts, new corpus)


def test_quick_star_experiment_end_to_end(tmp_path):
    env = {**os.environ, "SELFPLAY_CACHE": os.environ.get("SELFPLAY_CACHE", str(tmp_path))}
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "lab.py"), "star", "--quick",
                          "--seeds", "0", "--out", str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "decontamination: 0 of 50 held-out questions" in out.stdout
    work = tmp_path / "star"
    for name in ("with_rationalization_seed0", "without_rationalization_seed0"):
        rows = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
        acc = [r for r in rows if "test/accuracy" in r]
        assert [r["step"] for r in acc] == [0, 1]  # the base model, then round 1
        assert any("train/coverage" in r for r in rows)
        # trained behind the exemplars, where it is evaluated (see lab.star's --few-shot-train)
        config = json.loads((work / name / "config.json").read_text())
        assert config["few_shot_train"]
        # every training question is trained on: the lab chooses no round, so it has no dev split
        assert config["dev_data"] == "none" and not any("dev/accuracy" in r for r in rows)
        assert f"{name.replace('_', ' ')}" in out.stdout
    assert "beats base beyond CI" in out.stdout
    png = work / "star.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
