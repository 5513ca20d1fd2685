"""Greedy accuracy and pass@k of a checkpoint on the benchmarks of common.BENCHMARKS (or local
JSONL files), and pass@k curves against k, as in Fig. 1 of "Towards Understanding Self-play for LLM
Reasoning" (RQ1: does the base catch up with the trained model at large k?).

    python tools/evaluate.py --model runs/spice-.../checkpoints/step_640 \
        --benchmarks gsm8k,math500 --n 16 --k 1,4,16 --compare Qwen/Qwen3-4B-Base --out eval/
    python tools/evaluate.py --plot runs/base/eval.json runs/azr/eval.json --out rq1.png

--compare evaluates both models under this tool's generic prompt. --plot draws saved evaluations
instead, one curve per file and benchmark with the 95% intervals they hold: the eval.json of each
method's `--eval-only` (the base) and of a run (the trained model) compare the two under the
method's own protocol.
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from infra.cli import ArgParser  # noqa: E402
import infra.logs  # noqa: E402


def eval_model(args, model):
    cfg = common.RunConfig(model=model, backend=args.backend, seed=args.seed, dtype=args.dtype,
                           max_model_len=args.max_model_len,
                           gpu_memory_utilization=args.gpu_memory_utilization)
    path = common.resolve_model_path(model)
    sampler = common.make_sampler(path, common.load_tokenizer(path), cfg)
    try:
        out = common.evaluate(sampler, args.benchmarks, n=args.n, k=args.k,
                              temperature=args.temperature, top_p=args.top_p,
                              max_tokens=args.max_tokens, limit=args.limit, seed=args.seed)
    finally:
        sampler.close()
    return {**out, "model": model}


class Curve(typing.NamedTuple):
    """One curve of a pass@k plot: a model (or eval file) on a benchmark, with its 95% interval."""
    label: str
    benchmark: str
    ks: list
    values: list
    lows: list
    highs: list


MARKERS = "osD^vP"  # hollow and shrinking, so that a curve under another still shows
LINESTYLES = ("-", "--", ":", "-.")
MAX_LABEL = 32  # characters of a legend label


def short_label(path: str) -> str:
    """A legend label for a model or a saved evaluation: its last names, not its path
    (runs/azr-x/eval.json -> azr-x; runs/azr-x/eval_step_4.json -> azr-x/eval_step_4;
    runs/azr-x/checkpoints/step_8 -> azr-x/step_8; Qwen/Qwen3-4B-Base as it is)."""
    parts = [part for part in Path(path).parts if part not in ("/", "checkpoints")]
    if parts and parts[-1].endswith(".json"):  # a saved evaluation: its run folder names it
        file_stem = Path(parts.pop()).stem
        parts = parts[-1:]
        if file_stem != "eval":  # eval_step_4.json: say which one
            parts.append(file_stem)
    label = "/".join(parts[-2:]) or path
    if len(label) > MAX_LABEL:  # keep the end, which names the run and the step
        label = "..." + label[3 - MAX_LABEL:]
    return label


def short_benchmark(name: str) -> str:
    """A panel title: a local benchmark file by its stem, a built-in benchmark by its name."""
    if name.endswith((".jsonl", ".json")):
        return Path(name).stem
    return name


def results_in(report: dict) -> dict:
    """The common.evaluate() results a saved JSON holds, by name: an eval.json is one result
    (named ""); this tool's --compare output or R-Zero's eval.json holds several side by side."""
    if isinstance(report.get("benchmarks"), dict):
        return {"": report}
    found = {}
    for name, value in report.items():
        if isinstance(value, dict) and isinstance(value.get("benchmarks"), dict):
            found[name] = value
    return found


def pass_at_k_curves(results: list, labels: list) -> list:
    """A Curve per result and benchmark with pass@k figures (code benchmarks included), its
    interval the pass@k_ci the result holds (none, if an older file has none)."""
    curves = []
    for result, label in zip(results, labels):
        benchmarks = dict(result["benchmarks"])
        if isinstance(result.get("code"), dict):  # Absolute Zero's --eval-code, beside the math
            benchmarks.update(result["code"].get("benchmarks") or {})
        for bench, figures in benchmarks.items():
            if not isinstance(figures, dict):
                continue
            pass_at = figures.get("pass@k") or {}
            intervals = figures.get("pass@k_ci") or {}
            ks = sorted(int(k) for k in pass_at)
            values = [pass_at[str(k)] for k in ks]
            lows, highs = [], []
            for k, value in zip(ks, values):
                low, high = intervals.get(str(k), (value, value))
                lows.append(low)
                highs.append(high)
            if ks:
                curves.append(Curve(label, short_benchmark(bench), ks, values, lows, highs))
    return curves


def curve_style(i: int) -> dict:
    """The i-th label's look: a color, a dash and a hollow marker, which shrinks from one label to
    the next so that a curve drawn over another leaves the one below it visible."""
    return {"color": f"C{i % 10}", "linestyle": LINESTYLES[i % len(LINESTYLES)],
            "marker": MARKERS[i % len(MARKERS)], "markersize": 9 - 2 * (i % 3),
            "markerfacecolor": "none"}


def format_panel(ax, title: str, ks: list) -> None:
    """pass@k from 0 to 1 against k on a log scale, a tick at each k measured."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.set(xlabel="k", ylabel="pass@k", title=title, ylim=(0, 1))
    ax.grid(alpha=0.3)


def draw_pass_at_k(curves: list):
    """The figure: a panel per benchmark, a curve and its shaded 95% interval per label, one
    legend below the panels (outside them: it covers no curve)."""
    import matplotlib.pyplot as plt
    benches = list(dict.fromkeys(curve.benchmark for curve in curves))
    labels = list(dict.fromkeys(curve.label for curve in curves))
    columns = min(len(benches), 4)
    rows = math.ceil(len(benches) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False)
    panels = dict(zip(benches, axes.flat))
    ks_of_panel = {bench: set() for bench in benches}
    handles = {}
    for curve in curves:
        ax = panels[curve.benchmark]
        style = curve_style(labels.index(curve.label))
        ax.fill_between(curve.ks, curve.lows, curve.highs, color=style["color"], alpha=0.15,
                        linewidth=0, gid=curve.label)  # gid: the curve the band belongs to
        (line,) = ax.plot(curve.ks, curve.values, label=curve.label, clip_on=False, **style)
        handles.setdefault(curve.label, line)
        ks_of_panel[curve.benchmark].update(curve.ks)
    for bench, ax in panels.items():
        format_panel(ax, bench, sorted(ks_of_panel[bench]))
    for ax in list(axes.flat)[len(benches):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.legend(handles.values(), handles.keys(), loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=min(len(labels), 3), frameon=False)
    return fig


def plot_pass_at_k(results, labels, path):
    """PNG of pass@k against k per benchmark for several common.evaluate() results (the
    understanding paper's Fig. 1); the path, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no pass@k plot (pip install matplotlib)",
              file=sys.stderr)
        return None
    fig = draw_pass_at_k(pass_at_k_curves(results, labels))
    fig.savefig(path, dpi=120, bbox_inches="tight")  # "tight": the legend below is kept
    plt.close(fig)
    return path


def output_path(out: str, default_name: str) -> Path:
    """The file `--out` names: a folder (existing, ending in '/', or without default_name's
    suffix) gets default_name inside; the folder is created and checked writable before any work."""
    path = Path(default_name)
    if out:
        path = Path(out).expanduser()
        is_folder = path.is_dir() or out.endswith(("/", os.sep))
        if is_folder or path.suffix.lower() != Path(default_name).suffix:
            path = path / default_name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.parent / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise common.InputError(f"--out {out or path}: cannot write into {path.parent} "
                                f"({e.strerror or e}); pass a folder you can write to") from None
    return path


def eval_out_path(out: str, model: str) -> str:
    """The JSON path of `--out`: a file, or a folder for eval_<model>.json."""
    name = "eval_" + re.sub(r"[^\w.-]+", "_", model.strip("/")) + ".json"
    return str(output_path(out, name))


def load_saved_results(files: list) -> tuple:
    """(results, labels) of the saved evaluations --plot names; a file that holds none is a
    one-line InputError."""
    results, labels = [], []
    for file in files:
        try:
            report = json.loads(Path(file).read_text())
        except (OSError, ValueError) as e:
            raise common.InputError(f"--plot {file}: cannot read it as JSON ({e}); pass eval.json "
                                    "files of runs or of --eval-only") from None
        found = {}
        if isinstance(report, dict):
            found = results_in(report)
        if not found:
            raise common.InputError(f"--plot {file}: holds no evaluation (no 'benchmarks'); pass "
                                    "eval.json files of runs or of --eval-only")
        label = short_label(file)
        if label in labels:  # two runs of the same name in different folders
            label += f" #{len(labels) + 1}"
        for name, result in found.items():
            results.append(result)
            labels.append(label + "/" + name if name else label)
    return results, labels


def build_parser():
    parser = ArgParser(
        prog="evaluate.py",
        description="Evaluate a model's greedy accuracy and pass@k on benchmarks, or draw the "
                    "pass@k curves of saved evaluations (--plot).")
    parser.add_argument("--model", default="", help="hub id, local folder (a checkpoint) or 'tiny'")
    parser.add_argument("--benchmarks", default="gsm8k,math500",
                        help=f"comma-separated: {', '.join(common.BENCHMARKS)} or JSONL files")
    parser.add_argument("--n", type=int, default=1,
                        help="samples per problem for pass@k (1 = greedy only)")
    parser.add_argument("--k", default="1", help="comma-separated k values, each <= n")
    sampling = (("--temperature", 0.6, "sampling temperature of the pass@k samples"),
                ("--top-p", 0.95, "nucleus sampling of the pass@k samples"),
                ("--max-tokens", 2048, "tokens per completion at most"),
                ("--seed", 0, "sampling seed"),
                ("--dtype", "auto", "model weights: auto, bfloat16, float16 or float32"),
                ("--max-model-len", 8192, "prompt and completion tokens at most (vLLM)"),
                ("--gpu-memory-utilization", 0.85, "share of GPU memory vLLM may take"))
    for flag, default, text in sampling:
        parser.add_argument(flag, type=type(default), default=default, help=text)
    parser.add_argument("--limit", type=int, default=0,
                        help="first N problems per benchmark (0 = all)")
    parser.add_argument("--backend", default="vllm", choices=["vllm", "hf"],
                        help="the sampler: vLLM, or Hugging Face generate")
    parser.add_argument("--compare", default="",
                        help="also evaluate this base model and plot pass@k curves")
    parser.add_argument("--plot", nargs="+", default=[], metavar="EVAL_JSON",
                        help="draw these saved evaluations (a run's eval.json, --eval-only's, or "
                             "this tool's JSON) as pass@k curves with their 95%% intervals; "
                             "no model is loaded")
    parser.add_argument("--verbose", action="store_true",
                        help="show third-party output (vLLM's INFO lines, warnings, loading bars)")
    parser.add_argument("--out", default="",
                        help="output JSON file, or a folder (created) for eval_<model>.json; "
                             "default eval_<model>.json here. With --plot: the PNG, default "
                             "pass_at_k.png here")
    return parser


def reject_unknown(parser, unknown):
    """A typo ends the run naming the closest flag."""
    flags = [f for f in parser._option_string_actions if f.startswith("--")]
    flag = unknown[0].split("=", 1)[0]
    close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]}?" if close else ""
    parser.error(f"unknown argument {unknown[0]}{hint}")


def plot_saved(parser, args) -> int:
    """--plot: the pass@k curves of saved evaluations, one per file and benchmark."""
    if args.model or args.compare:
        parser.error("--plot draws saved evaluations: drop --model and --compare, or drop --plot "
                     "to evaluate a model")
    try:
        results, labels = load_saved_results(args.plot)
        if not pass_at_k_curves(results, labels):
            raise common.InputError(f"--plot {' '.join(args.plot)}: no pass@k figures in these "
                                    "files; pass eval.json files of runs or of --eval-only")
        png = output_path(args.out, "pass_at_k.png")
    except ValueError as e:
        parser.error(str(e))
    if plot_pass_at_k(results, labels, str(png)) is None:
        return 1
    print(f"wrote {png}")
    return 0


def main(argv=None):
    """`python tools/evaluate.py --model M --benchmarks gsm8k,math500 --n 16 --k 1,4,16
    [--compare BASE] [--out file.json]`, or `--plot BASE/eval.json TRAINED/eval.json`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        reject_unknown(parser, unknown)
    infra.logs.set_verbosity(args.verbose)  # quiet by default, before any library loads
    if args.plot:
        return plot_saved(parser, args)
    if not args.model:
        parser.error("--model is required (a hub id, a local folder or 'tiny'), or --plot with "
                     "saved eval.json files")
    try:  # everything a user can get wrong is checked before a model is loaded
        for flag, model in (("--model", args.model), ("--compare", args.compare)):
            if model:
                common.check_model(model, flag)
        common.check_benchmark_names(args.benchmarks, "--benchmarks")
        out = eval_out_path(args.out, args.model)
    except ValueError as e:
        parser.error(str(e))
    trained = eval_model(args, args.model)
    report = trained
    runs = [("", trained)]
    png = None
    if args.compare:
        base = eval_model(args, args.compare)
        report = {"trained": trained, "base": base}
        runs = [("trained ", trained), ("base ", base)]
        labels = [f"base: {short_label(args.compare)}", f"trained: {short_label(args.model)}"]
        png = plot_pass_at_k([base, trained], labels, str(Path(out).with_suffix(".png")))
        if png:
            report["plot"] = png
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    for label, result in runs:
        for bench, figures in result["benchmarks"].items():
            pass_at = ", ".join(f"pass@{k}={v:.3f}" for k, v in figures["pass@k"].items())
            print(f"{label}{result['model']} {bench}: greedy={figures['greedy_acc']:.3f} {pass_at}")
    print(f"wrote {out}")
    if png:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
