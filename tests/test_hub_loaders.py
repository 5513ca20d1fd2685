"""Every hub loader through the real `datasets` library, minus the download: the test writes local
parquet or JSON files in each hub dataset's own column layout, and `datasets.load_dataset(<hub id>)`
is pointed at them (only the hub id -> local file mapping is replaced; building, streaming and
iterating are `datasets`' own). Also the pass@k plot: drawn, readable, its legend off the curves."""
import json

import pytest

datasets = pytest.importorskip("datasets")

import common  # noqa: E402
from tools.evaluate import plot_pass_at_k  # noqa: E402
import spice  # noqa: E402
import star  # noqa: E402

# hub id -> {split: rows}, each row with the dataset's columns (names and types as on the hub)
HUB = {
    "openai/gsm8k": {
        "train": [{"question": "Ann has 2 boxes of 600 pens. How many pens?",
                   "answer": "2 * 600 = <<2*600=1200>>1200\n#### 1,200"}],
        "test": [{"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"},
                 {"question": "Tom reads 20 pages a day for 5 days. Pages?",
                  "answer": "20*5=100\n#### 100"}]},
    "HuggingFaceH4/MATH-500": {"test": [
        {"problem": "Compute $\\frac{1}{2}+\\frac{1}{4}$.",
         "solution": "... $\\boxed{\\frac{3}{4}}$", "answer": "\\frac{3}{4}",
         "subject": "Prealgebra", "level": 2, "unique_id": "test/prealgebra/1.json"}]},
    "HuggingFaceH4/aime_2024": {"train": [
        {"id": 60, "problem": "Find the remainder of 2024 divided by 1000.", "solution": "24",
         "answer": "024", "url": "https://artofproblemsolving.com/x", "year": "2024"}]},
    "MathArena/aime_2025": {"train": [
        {"problem_idx": 1, "problem": "Find the sum of all bases b > 9 ...", "answer": 70,
         "problem_type": ["Number Theory"]}]},
    "math-ai/amc23": {"test": [{"id": 0, "question": "What is 27?", "answer": 27.0,
                                "url": "https://x"}]},
    "math-ai/minervamath": {"test": [{"question": "Compute the speed of light in m/s.",
                                      "answer": "3e8"}]},
    "Hothan/OlympiadBench": {"train": [
        {"id": 1606, "question": "Find all x with x^2 = 1.", "solution": ["x = 1 or x = -1"],
         "final_answer": ["$1$", "$-1$"], "context": None, "image_1": None,
         "modality": "Text-only", "difficulty": "Competition", "is_multiple_answer": True,
         "unit": None, "answer_type": "Numerical", "error": None, "question_type": "Open-ended",
         "subfield": "Algebra", "subject": "Math", "language": "English"},
        {"id": 1607, "question": "A row without an answer.", "solution": [], "final_answer": [],
         "context": "", "image_1": None, "modality": "Text-only", "difficulty": "Competition",
         "is_multiple_answer": False, "unit": None, "answer_type": "Numerical", "error": None,
         "question_type": "Open-ended", "subfield": "Algebra", "subject": "Math",
         "language": "English"}]},
    "TIGER-Lab/MMLU-Pro": {"test": [
        {"question_id": 70, "question": "Which is a prime?", "options": ["4", "6", "7", "N/A", "9"],
         "answer": "C", "answer_index": 2, "cot_content": "", "category": "math",
         "src": "ori_mmlu-math"}]},
    "Idavidrein/gpqa": {"train": [
        {"Pre-Revision Question": "q", "Pre-Revision Correct Answer": "a",
         "Question": "Which gas is inert?", "Correct Answer": "Argon",
         "Incorrect Answer 1": "Oxygen", "Incorrect Answer 2": "Chlorine",
         "Incorrect Answer 3": "Fluorine",
         "Explanation": "noble gas", "Subdomain": "Chemistry (general)",
         "High-level domain": "Chemistry", "Record ID": "rec1"}]},
    "m-a-p/SuperGPQA": {"train": [
        {"uuid": "u1", "question": "What is 2 + 2?", "options": ["3", "4", "5", "22"],
         "answer": "4", "answer_letter": "B", "discipline": "Science", "field": "Mathematics",
         "subfield": "Arithmetic", "difficulty": "easy", "is_calculation": True}]},
    "BBEH/bbeh": {"train": [{"input": "Is 7 prime? Options: (A) yes (B) no", "target": "(A)",
                             "mini": 1, "task": "boolean", "canary": "BENCHMARK DATA"}]},
    "evalplus/humanevalplus": {"test": [
        {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n",
         "canonical_solution": "    return a + b\n", "entry_point": "add",
         "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"}]},
    "evalplus/mbppplus": {"test": [
        {"task_id": 2, "code": "def similar(a, b):\n    return set(a) & set(b)\n",
         "prompt": "Write a function to find the shared elements from the given two lists.",
         "source_file": "Benchmark Questions Verification V2.ipynb",
         "test_imports": ["import math"],
         "test_list": ["assert set(similar((3, 4), (4, 5))) == set((4,))"],
         "test": "inputs = [[(3, 4), (4, 5)]]\nfor i in inputs:\n    similar(*i)\n"}]},
    "tau/commonsense_qa": {
        "train": [{"id": "t1", "question": "Where do fish live?", "question_concept": "fish",
                   "choices": {"label": list("ABCDE"),
                               "text": ["tree", "water", "desert", "sky", "car"]},
                   "answerKey": "B"}],
        "validation": [{"id": "v1", "question": "What melts ice?", "question_concept": "ice",
                        "choices": {"label": list("ABCDE"),
                                    "text": ["heat", "cold", "snow", "dark", "wind"]},
                        "answerKey": "A"}]},
    "open-web-math/open-web-math": {"train": [
        {"url": f"https://math.example/{i}",
         "text": f"Lemma {i}. Every square of an odd number is odd.", "date": "2023-01-01",
         "metadata": "{}"} for i in range(3)]},
    "HuggingFaceFW/fineweb-edu": {"train": [
        {"text": f"Photosynthesis lesson {i}: plants turn light into sugar.", "id": f"<urn:{i}>",
         "dump": "CC-MAIN-2024-10", "url": f"https://edu.example/{i}", "file_path": "s3://x",
         "language": "en", "language_score": 0.97, "token_count": 12, "score": 3.1,
         "int_score": 3} for i in range(3)]},
}
# these as parquet, the others as JSON lines: both of the hub's file formats are exercised
PARQUET = {"openai/gsm8k", "Hothan/OlympiadBench", "TIGER-Lab/MMLU-Pro", "evalplus/mbppplus",
           "tau/commonsense_qa", "HuggingFaceFW/fineweb-edu"}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """datasets.load_dataset(<hub id>, [config], split=...) reads this test's local files."""
    real = datasets.load_dataset
    calls = []

    def load_dataset(path, name=None, *args, split=None, **kw):
        if path not in HUB:
            raise FileNotFoundError(f"{path} is not in this test's local hub")
        calls.append((path, name, split, kw.get("streaming", False)))
        files = {}
        for sp, rows in HUB[path].items():
            f = tmp_path / "hub" / path / f"{sp}.{'parquet' if path in PARQUET else 'jsonl'}"
            f.parent.mkdir(parents=True, exist_ok=True)
            if path in PARQUET:
                datasets.Dataset.from_list(rows).to_parquet(str(f))
            else:
                f.write_text("".join(json.dumps(r) + "\n" for r in rows))
            files[sp] = str(f)
        return real("parquet" if path in PARQUET else "json", data_files=files, split=split, **kw)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


EXPECTED = {  # benchmark -> its first problem
    "gsm8k": {"question": "What is 3 + 4?", "answer": "7"},
    "math500": {"question": "Compute $\\frac{1}{2}+\\frac{1}{4}$.", "answer": "\\frac{3}{4}"},
    "aime24": {"question": "Find the remainder of 2024 divided by 1000.", "answer": "024"},
    "aime25": {"question": "Find the sum of all bases b > 9 ...", "answer": "70"},
    "amc23": {"question": "What is 27?", "answer": "27"},
    "minerva": {"question": "Compute the speed of light in m/s.", "answer": "3e8"},
    "olympiadbench": {"question": "Find all x with x^2 = 1.", "answer": "1, -1"},
    "mmlu_pro": {"question": "Which is a prime?", "answer": "C", "choices": ["4", "6", "7", "9"]},
    "supergpqa": {"question": "What is 2 + 2?", "answer": "B", "choices": ["3", "4", "5", "22"]},
    "bbeh": {"question": "Is 7 prime? Options: (A) yes (B) no", "answer": "(A)"},
}


def test_every_benchmark_loads_through_datasets_in_its_hub_layout(hub):
    assert set(EXPECTED) | {"gpqa_diamond"} == set(common.BENCHMARKS)  # a new entry: add a row
    for name, first in EXPECTED.items():
        rows = common.load_benchmark(name)
        assert rows[0] == first, name
    assert len(common.load_benchmark("olympiadbench")) == 1  # the row without an answer is left out
    assert len(common.load_benchmark("gsm8k", limit=1)) == 1
    gpqa = common.load_benchmark("gpqa_diamond")[0]
    assert sorted(gpqa["choices"]) == ["Argon", "Chlorine", "Fluorine", "Oxygen"]
    assert gpqa["choices"]["ABCD".index(gpqa["answer"])] == "Argon"
    spec = common.BENCHMARKS["gsm8k"]
    assert ("openai/gsm8k", "main", "test", False) in hub and spec.config == "main"
    custom = common.load_benchmark("hf:math-ai/minervamath:test:question:answer")  # an hf: name
    assert custom == [EXPECTED["minerva"]]


def test_a_renamed_hub_column_is_an_error_naming_the_columns(hub, monkeypatch):
    monkeypatch.setitem(HUB, "math-ai/minervamath", {"test": [{"problem": "q", "answer": "1"}]})
    with pytest.raises(KeyError, match=r"no column\(s\) \['question'\].*'problem'"):
        common.load_benchmark("minerva")


def test_evalplus_code_benchmarks_load_through_datasets(hub):
    he = common.load_code_benchmark("humaneval+")
    row = HUB["evalplus/humanevalplus"]["test"][0]
    assert he == [{"task_id": "HumanEval/0", "prompt": row["prompt"], "test": row["test"],
                   "entry_point": "add"}]
    (mb,) = common.load_code_benchmark("mbpp+")
    assert mb["task_id"] == "Mbpp/2" and mb["entry_point"] is None
    assert mb["prompt"].endswith("assert set(similar((3, 4), (4, 5))) == set((4,))")  # call shown
    assert mb["test"].startswith("import math\n") and "similar(*i)" in mb["test"]


def test_spice_default_corpus_streams_both_hub_sets(hub, tiny_tokenizer):
    cfg = spice.Config(model="tiny", corpus=spice.DEFAULT_CORPUS, corpus_docs=4)
    docs = spice.load_corpus(cfg, tiny_tokenizer, chunk_tokens=512)
    assert {c[0] for c in hub} == {"open-web-math/open-web-math", "HuggingFaceFW/fineweb-edu"}
    assert all(streaming for *_, streaming in hub)  # streamed, as from the hub
    assert ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True) in hub
    assert sum("Lemma" in d for d in docs) == 2  # equal shares of the two sets
    assert sum("Photosynthesis" in d for d in docs) == 2


def test_star_hub_tasks_load_through_datasets(hub):
    train = star.load_task("gsm8k", "train")
    assert train[0]["answer"] == "1200" and train[0]["choices"] is None  # final number, no comma
    assert [r["answer"] for r in star.load_task("gsm8k", "test")] == ["7", "100"]
    (cqa,) = star.load_task("commonsense_qa", "train")
    assert cqa["answer"] == "b" and cqa["choices"] == ["tree", "water", "desert", "sky", "car"]
    assert star.load_task("cqa", "test")[0]["answer"] == "a"  # validation = the paper's dev set
    assert ("tau/commonsense_qa", None, "validation", False) in hub


# ------------------------------------------------------------------------------------- pass@k plot
def _result(points):
    pk = {str(k): v for k, v in points.items()}
    ci = {str(k): [max(0.0, v - 0.05), min(1.0, v + 0.05)] for k, v in points.items()}
    return {"benchmarks": {"gsm8k": {"pass@k": pk, "pass@k_ci": ci},
                           "math500": {"pass@k": pk, "pass@k_ci": ci}}}


def test_pass_at_k_png_is_drawn_readable_and_the_legend_covers_no_point(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.figure
    import matplotlib.image
    figs = []
    save = matplotlib.figure.Figure.savefig

    def keep(self, *a, **k):
        figs.append(self)
        return save(self, *a, **k)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    # curves that fill the panel (low on the left, high on the right): no free corner inside it
    base = _result({1: 0.05, 2: 0.3, 4: 0.5, 8: 0.7, 16: 0.95})
    trained = _result({1: 0.2, 2: 0.5, 4: 0.9, 8: 0.95, 16: 0.97})
    labels = ["base: Qwen/Qwen3-4B-Base", "trained: runs/x/final"]
    png = plot_pass_at_k([base, trained], labels, str(tmp_path / "eval.png"))
    img = matplotlib.image.imread(png)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400  # a real picture
    assert img.std() > 0.01
    (fig,) = figs
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)  # pyplot closed the figure; draw it again as it was saved
    canvas.draw()
    renderer = canvas.get_renderer()
    legends = [a.get_legend() for a in fig.axes if a.get_legend() is not None] + list(fig.legends)
    assert legends, "no legend"
    for ax in fig.axes:
        for line in ax.get_lines():
            pts = ax.transData.transform(line.get_xydata())
            for leg in legends:
                box = leg.get_window_extent(renderer)
                inside = [(x, y) for x, y in pts if box.x0 <= x <= box.x1 and box.y0 <= y <= box.y1]
                assert not inside, f"the legend covers {inside} of {line.get_label()!r}"


def _eval_json(folder, benchmarks, code=None):
    """A run folder's eval.json, in common.evaluate's layout (and Absolute Zero's code results)."""
    report = {"benchmarks": {}, "settings": {"n": 16}}
    for bench, points in benchmarks.items():
        report["benchmarks"][bench] = {"greedy_acc": points[1], "pass@k_source": "samples",
                                       **_result(points)["benchmarks"]["gsm8k"]}
    if code:
        report["code"] = {"benchmarks": {"humaneval+": _result(code)["benchmarks"]["gsm8k"]},
                          "settings": {}}
    folder.mkdir(parents=True)
    (folder / "eval.json").write_text(json.dumps(report))
    return folder / "eval.json", report


def test_plot_of_two_eval_files_draws_their_figures_readably(tmp_path, monkeypatch, capsys):
    """RQ1's base-vs-trained plot from two runs' eval.json: every figure and 95% interval the files
    hold drawn as given, y from 0 to 1, short labels, markers, the legend outside the panels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.figure
    from tools.evaluate import main as evaluate_main
    figs = []
    save = matplotlib.figure.Figure.savefig

    def keep(self, *a, **k):
        figs.append(self)
        return save(self, *a, **k)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    held_out = str(tmp_path / "a" / "very" / "long" / "path" / "held_out.jsonl")
    files = {"azr-base": _eval_json(tmp_path / "runs" / "azr-base",
                                    {held_out: {1: 0.2, 4: 0.5, 16: 0.8, 64: 0.9},
                                     "gsm8k": {1: 0.1, 2: 0.2}}),
             "azr-trained": _eval_json(tmp_path / "runs" / "azr-trained",
                                       {held_out: {1: 0.4, 4: 0.6, 16: 0.8, 64: 0.88},
                                        "gsm8k": {1: 0.1, 2: 0.2}},
                                       code={1: 0.3, 8: 0.5})}
    png = tmp_path / "rq1.png"
    argv = ["--plot"] + [str(path) for path, _ in files.values()] + ["--out", str(png)]
    assert evaluate_main(argv) == 0
    assert capsys.readouterr().out.strip() == f"wrote {png}" and png.stat().st_size > 10_000
    (fig,) = figs
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert set(panels) == {"held_out", "gsm8k", "humaneval+"}
    markers = {}
    for label, (_, report) in files.items():
        benchmarks = dict(report["benchmarks"])
        benchmarks.update(report.get("code", {}).get("benchmarks", {}))
        for bench, figures in benchmarks.items():
            ax = panels[bench.rsplit("/", 1)[-1].removesuffix(".jsonl")]
            (line,) = [line for line in ax.get_lines() if line.get_label() == label]
            ks = sorted(int(k) for k in figures["pass@k"])
            assert list(line.get_xdata()) == ks
            assert list(line.get_ydata()) == [figures["pass@k"][str(k)] for k in ks]
            (band,) = [c for c in ax.collections if c.get_gid() == label]
            corners = band.get_paths()[0].vertices
            for k in ks:
                at_k = corners[corners[:, 0] == k][:, 1]
                assert [at_k.min(), at_k.max()] == figures["pass@k_ci"][str(k)], (label, bench, k)
            assert line.get_marker() not in (None, "None", "")
            markers.setdefault(label, set()).add((line.get_marker(), line.get_markersize()))
    assert not markers["azr-base"] & markers["azr-trained"]  # one curve never hides the other
    for ax in panels.values():
        assert ax.get_ylim() == (0.0, 1.0)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    (legend,) = fig.legends
    assert [text.get_text() for text in legend.get_texts()] == ["azr-base", "azr-trained"]
    box = legend.get_window_extent(renderer)
    for ax in panels.values():
        assert not box.overlaps(ax.get_window_extent(renderer)), "the legend sits on a panel"


def test_plot_of_a_file_that_holds_no_evaluation_is_one_line(tmp_path, capsys):
    from tools.evaluate import main as evaluate_main
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n')
    config = tmp_path / "config.json"
    config.write_text('{"model": "tiny"}')
    empty = tmp_path / "eval.json"
    empty.write_text('{"benchmarks": {"gsm8k": {"pass@k": {}}}, "settings": {}}')
    for path, must in ((metrics, "cannot read it as JSON"), (config, "holds no evaluation"),
                       (tmp_path / "missing.json", "cannot read it as JSON"),
                       (empty, "no pass@k figures")):
        with pytest.raises(SystemExit) as stop:
            evaluate_main(["--plot", str(path), "--out", str(tmp_path / "plots" / "")])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert stop.value.code == 2 and len(lines) == 1 and must in lines[0], lines
        assert "eval.json files of runs or of --eval-only" in lines[0]
        assert not (tmp_path / "plots").exists()  # nothing written, not even the folder
    with pytest.raises(SystemExit) as stop:
        evaluate_main(["--plot", str(config), "--model", "tiny"])
    assert stop.value.code == 2 and "drop --model" in capsys.readouterr().err
