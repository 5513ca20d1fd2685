"""The SPICE laboratory (tests/lab_spice.py): the oracle is exact and parses only the domain's form,
the pretraining documents are spice.py's formats (parse_task accepts the Challenger's replies),
a corpus document states its question's answer, the held-out set is disjoint from the corpora,
and the reduced experiment (--quick: a smaller model, two steps an arm) runs end to end through
the real spice.py, with and without documents, into a table and a PNG."""
import json
import os
import pathlib
import random
import re
import subprocess
import sys

import pytest

import common
import lab_spice as lab
import spice

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_oracle_is_exact_and_strict():
    rng = random.Random(0)
    for _ in range(2000):
        p = lab.sample_problem(rng, (1, 1, 1, 1), (1, 1))
        assert lab.oracle(lab.question(p)) == sum(p[1])
        assert common.extract_boxed(lab.solution(p)) == str(sum(p[1]))
    assert lab.oracle("Three wells give 37, 45 and 12 litres. How many litres in all?") == 94
    for bad in ("Two wells give 37, 45 and 12 litres. How many litres in all?",  # count word
                "Two wells give 37 and 45 apples. How many apples in all?",  # unit of another
                "Two wells give 37 and 45 litres. How many apples in all?",
                "Two wells give 37 and 45 litres.", "What is 37 + 45?"):
        assert lab.oracle(bad) is None


def reply(doc: str) -> str:
    return doc.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")


def test_documents_are_spice_formats_and_the_document_holds_the_answer():
    p, rng = (2, (37, 45, 12)), random.Random(0)
    fact = lab.fact_document(p, rng)
    assert fact.endswith("mills. They give 37, 45 and 12 sacks: the north mill gives 37, the "
                         "south mill gives 45 and the east mill gives 12. In all the mills give "
                         "94 sacks.")
    prompts = lab.templates()
    for atype in spice.ANSWER_TYPES:
        for document in (fact, None):
            doc = lab.challenger_document(p, atype, document)
            prompt = spice.challenger_prompt(document, "free", atype, "chat", prompts)
            assert doc.startswith(lab.chat(prompt, "").rsplit("<|im_start|>assistant", 1)[0])
            task, why = spice.parse_task(reply(doc), "free", atype)
            assert why == "ok" and task.gold == "94" and lab.oracle(task.question) == 94
            assert (prompts["no_document_block"] in doc) == (document is None)
    sol = lab.reasoner_document(p)
    assert spice.reasoner_prompt(lab.question(p), "chat", prompts)[1]["content"] in sol
    assert common.extract_boxed(reply(sol)) == "94" and " = " in reply(sol)
    direct = reply(lab.reasoner_document(p, direct=True))  # the answer alone, no working
    assert common.extract_boxed(direct) == "94" and " = " not in direct


def test_held_out_set_is_disjoint_and_never_flagged_by_spice_decontamination():
    tests = lab.test_rows("full")
    assert len(tests) == len({lab.signature(p) for p in lab.held_out("full")}) == 320
    docs = lab.spice_corpus(2000)
    facts = lab.held_signatures()
    for d in docs:
        assert lab.signature((next(i for i, t in enumerate(lab.THINGS) if f" {t[0]}." in d),
                              tuple(int(x) for x in re.findall(r"gives (\d+)", d)))) not in facts
    # spice.py screens its corpus and every generated question against the eval set (13-grams):
    # the domain's documents, and fresh questions of the held-out form, must pass that screen
    decon = common.Decontaminator([t["question"] for t in tests], n=13)
    assert not any(decon.flags(docs))
    rng = random.Random(5)
    fresh = [lab.question(p) for p in (lab.sample_problem(rng, (1, 1, 1, 1), (1, 1))
                                       for _ in range(500)) if lab.signature(p) not in facts]
    assert fresh and not any(decon.flags(fresh))
    assert decon.contaminated(tests[-1]["question"])


@pytest.mark.slow
def test_quick_spice_experiment_end_to_end(tmp_path):
    env = {**os.environ, "SELFPLAY_CACHE": os.environ.get("SELFPLAY_CACHE", str(tmp_path))}
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "lab_spice.py"), "run", "--quick",
                          "--seeds", "0", "--out", str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "decontamination: 0 of 40 held-out questions" in out.stdout
    work = tmp_path / "spice_quick"
    summary = json.loads((work / "summary.json").read_text())
    for arm in ("document", "no_document"):
        run = work / f"{arm}_seed0"
        cfg = json.loads((run / "config.json").read_text())
        assert cfg["no_document"] == (arm == "no_document") and cfg["eval_base"]
        curve = summary[f"{arm}_seed0"]["curve"]
        assert [s for s, _, _ in curve] == [0, 1, 2]  # the base model, each step
        assert all(n == 40 and 0 <= k <= n for _, k, n in curve)
        samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
        # the ablation's Challenger saw no document; the other arm's saw corpus documents
        excerpts = [r["document"] for r in samples]
        assert samples and all((e is None) == (arm == "no_document") for e in excerpts)
        assert all(e is None or "In all the" in e for e in excerpts)
        assert f"{arm}_seed0" in out.stdout
    # the base model is the same model under the same greedy evaluation in both arms
    assert summary["document_seed0"]["curve"][0] == summary["no_document_seed0"]["curve"][0]
    assert "beats base beyond CI" in out.stdout and "gold right" in out.stdout
    assert (work / "spice.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gold_accuracy_reads_the_run_folder(tmp_path):
    q = "Two wells give 37 and 45 litres. How many litres in all?"
    rows = [{"step": 1, "question": q, "gold": "82", "reasoner_task": True},
            {"step": 1, "question": q, "gold": "81", "reasoner_task": False},
            {"step": 1, "question": None, "gold": None, "reasoner_task": False},  # invalid
            {"step": 2, "question": "How many legs has a cat?", "gold": "4", "reasoner_task": True},
            {"step": 2, "question": q, "gold": "1,0", "reasoner_task": False}]
    rows = [{"role": "challenger", **r} for r in rows]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = lab.gold_accuracy(tmp_path)
    assert got[1] == {"valid": 2, "in_domain": 2, "right": 1, "trained": 1, "trained_right": 1}
    assert got[2] == {"valid": 2, "in_domain": 1, "right": 0, "trained": 0, "trained_right": 0}
