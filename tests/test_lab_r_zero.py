"""The R-Zero laboratory (tests/lab_r_zero.py): the arithmetic oracle is exact and parses only the
domain's form, the pretraining documents are r_zero.py's formats, the held-out set is disjoint
from the corpus, and the reduced experiment (--quick: a smaller model, one iteration, one step a
phase) runs end to end through the real r_zero.py into a table and a PNG."""
import json
import os
import pathlib
import random
import subprocess
import sys

import pytest

import lab_r_zero as lab
import r_zero

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_oracle_is_exact_and_strict():
    rng = random.Random(0)
    for _ in range(2000):
        nums, ops = lab.sample_problem(rng, (1, 1, 1, 1), (1, 1))
        expect = nums[0] + sum(n if o == "+" else -n for o, n in zip(ops, nums[1:]))
        q = lab.question(nums, ops)
        assert lab.oracle(q) == expect
        assert lab.solution(nums, ops).endswith(f"\\boxed{{{expect}}}")
    assert lab.oracle("What is 12 + 7 - 3?") == 16
    for bad in ("What is 12 * 7?", "What is 12 +  7?", "What is 12?", "What is __import__('os')?",
                "what is 1 + 2?", "What is 1 + 2"):
        assert lab.oracle(bad) is None


def test_documents_are_r_zero_formats():
    q = lab.question([12, 7], ["+"])
    doc = lab.challenger_document([12, 7], ["+"])
    assert r_zero.PROMPTS["challenger_system"].format() in doc
    reply = doc.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    assert r_zero.extract_question(reply) == q
    sol = lab.solver_document([12, 7], ["+"])
    assert r_zero.PROMPTS["solver_system"].format() in sol and f"user\n{q}<|im_end|>" in sol
    import common
    assert common.extract_boxed(sol) == "19" and "12 + 7 = 19." in sol
    direct = lab.solver_document([12, 7], ["+"], direct=True)  # the answer alone, no working
    assert direct.endswith("assistant\n\\boxed{19}<|im_end|>\n") and " = " not in direct


def test_held_out_set_is_disjoint_from_pretraining_questions():
    tests = lab.test_rows("full")
    assert len(tests) == len({lab.words(t["question"]) for t in tests}) == 320
    held = {lab.words(t["question"]) for t in tests}
    lengths = {len(w) for w in held}
    assert lab.contaminates(tests[0]["question"], held, lengths)
    assert lab.contaminates(tests[0]["question"][:-1] + " + 1?", held, lengths)  # a prefix
    one = {lab.words("What is 1 + 82 + 1?")}  # across a question and its working
    assert lab.contaminates("What is 1 - 82?\n1 - 82 = -81.", one, {5})
    assert not lab.contaminates("What is 1 - 82?\n", one, {5})


@pytest.mark.slow
def test_quick_r_zero_experiment_end_to_end(tmp_path):
    env = {**os.environ, "SELFPLAY_CACHE": os.environ.get("SELFPLAY_CACHE", str(tmp_path))}
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "lab_r_zero.py"), "run", "--quick",
                          "--seeds", "0", "--out", str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=800, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "decontamination: 0 of 40 held-out questions" in out.stdout
    work = tmp_path / f"r_zero_quick_direct{lab.DIRECT:g}"
    run = work / "seed0"
    assert (run / "dataset_iter1.jsonl").is_file() and (run / "eval_iter1.json").is_file()
    assert (run / "dev_iter1.json").is_file()
    summary = json.loads((work / "summary.json").read_text())
    assert summary["0"]["base"][1] == summary["0"]["solver"][0][1] == 40  # the whole test set
    assert summary["0"]["chosen"] == 1 and "the dev set chose iteration 1" in out.stdout
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (ds,) = [m for m in logged if "dataset/voted" in m]  # r_zero.py's own counts of the dataset
    lab0 = summary["0"]["labels"][0]
    assert (lab0["voted"], lab0["kept"]) == (ds["dataset/voted"], ds["dataset/kept"])
    assert len(summary["0"]["tokens"]) == 2 and all(t > 0 for t in summary["0"]["tokens"])
    assert "pseudo-label accuracy" in out.stdout and "beats base" in out.stdout
    assert (work / "r_zero.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lab_writes_under_runs_lab_by_default():
    """--out defaults to runs/lab in the repository, as the other labs do, never a folder that
    exists on one machine only."""
    assert lab.parser().parse_args(["run"]).out == str(ROOT / "runs" / "lab")
    assert lab.workdir(lab.parser().parse_args(["run", "--quick"])).is_relative_to(ROOT / "runs")


def test_dev_set_is_disjoint_from_the_held_out_set(tmp_path):
    """dev.jsonl (r_zero.py's --dev-benchmarks, which choose the best iteration) holds no held-out
    question, in either kind; write_sets writes both files."""
    held = {lab.words(t["question"]) for t in lab.test_rows("full")}
    for kind, size in (("full", 80), ("quick", 12)):
        dev = lab.dev_rows(kind)
        assert len(dev) == len({lab.words(d["question"]) for d in dev}) == size
        assert not {lab.words(d["question"]) for d in dev} & held
        assert all(lab.oracle(d["question"]) == int(d["answer"]) for d in dev)
    tests = lab.write_sets(tmp_path, "quick")
    assert len(tests) == 40 and len((tmp_path / "dev.jsonl").read_text().splitlines()) == 12


def test_label_accuracy_reads_the_run_folder(tmp_path):
    rows = [{"question": "What is 12 + 7 - 3?", "label": "16", "kept": True},
            {"question": "What is 2 + 2?", "label": "5", "kept": True},
            {"question": "What is 9 - 10?", "label": "-1", "kept": False},
            {"question": "How many legs has a cat?", "label": "4", "kept": True}]
    (tmp_path / "dataset_iter1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = lab.label_accuracy(tmp_path, 1)
    assert (got["kept"], got["kept_in_domain"], got["kept_correct"]) == (3, 2, 1)
    assert (got["all"], got["all_in_domain"], got["all_correct"]) == (4, 3, 2)
    assert got["kept_operands"] == 2.5


def test_shuffled_control_permutes_only_the_solvers_rewards(monkeypatch):
    import common
    seen = []
    monkeypatch.setattr(r_zero, "filter_dataset", r_zero.filter_dataset)  # restored after
    monkeypatch.setattr(r_zero, "grpo_update", lambda policy, trajs, *a, **k: seen.append(
        [t.reward for t in trajs]))

    def main(argv):
        assert "--shuffle-rewards" not in argv
        for role in (r_zero.CHALLENGER, r_zero.SOLVER):
            r_zero.grpo_update(None, [common.Trajectory([1], [2], reward=float(i), role=role)
                                      for i in range(40)], [0] * 40, None, None, 0)
    monkeypatch.setattr(r_zero, "main", main)
    lab.r_zero_exact_labels(["--seed", "0", "--shuffle-rewards"])
    challenger, solver = seen
    assert challenger == [float(i) for i in range(40)]
    assert solver != challenger and sorted(solver) == challenger


def test_budgets_leave_the_lab_default_as_it_was():
    import argparse
    args = argparse.Namespace(kind="full", budget="lab", solver_steps=0)
    assert lab.lab_flags(args) == (lab.FLAGS["full"], "")  # the same flags, the same folders
    args.budget = "paper"
    flags, name = lab.lab_flags(args, iterations=1)
    assert name == "paper" and flags["iterations"] == 1
    assert (flags["solver_batch"], flags["solver_minibatch"], flags["solver_steps"]) == (
        256, 128, 15)
    assert flags["question_pool"] >= 2 * flags["solver_batch"]  # the kept set (~60%) holds a batch
    args.solver_steps = 10
    assert lab.lab_flags(args)[0]["solver_steps"] == 10
    assert lab.lab_flags(args)[1] == "paper_steps10"
    cfg = r_zero.Config()  # the paper's own proportions, r_zero.py's defaults
    assert (cfg.solver_batch, cfg.solver_minibatch, cfg.solver_steps) == (512, 128, 15)
