"""Greedy accuracy and pass@k of a checkpoint on the benchmarks of common.BENCHMARKS (or local
JSONL files), optionally beside a base model with pass@k curves (the understanding paper's Fig. 1).

    python tools/evaluate.py --model runs/spice-.../checkpoints/step_640 \
        --benchmarks gsm8k,math500 --n 16 --k 1,4,16 --compare Qwen/Qwen3-4B-Base --out eval/
"""
from __future__ import annotations

import difflib
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from infra.cli import ArgParser  # noqa: E402


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
    benches = list(results[0]["benchmarks"])
    fig, axes = plt.subplots(1, len(benches), figsize=(4.2 * len(benches), 3.4), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        for result, label in zip(results, labels):
            pass_at = result["benchmarks"][bench]["pass@k"]
            intervals = result["benchmarks"][bench]["pass@k_ci"]
            ks = sorted(int(k) for k in pass_at)
            lows, highs = [], []
            for k in ks:
                low, high = intervals[str(k)]
                lows.append(low)
                highs.append(high)
            ax.plot(ks, [pass_at[str(k)] for k in ks], marker="o", label=label)
            ax.fill_between(ks, lows, highs, alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="k", ylabel="pass@k", title=bench)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def eval_out_path(out: str, model: str) -> str:
    """The JSON path of `--out`: a folder (existing, ending in '/', or without .json) gets
    eval_<model>.json inside; the folder is created and checked writable before any work."""
    name = "eval_" + re.sub(r"[^\w.-]+", "_", model.strip("/")) + ".json"
    path = Path(out) if out else Path(name)
    if out:
        is_folder = path.is_dir() or out.endswith(("/", os.sep)) or path.suffix.lower() != ".json"
        if is_folder:
            path = path / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.parent / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise common.InputError(f"--out {out or path}: cannot write into {path.parent} "
                                f"({e.strerror or e}); pass a folder you can write to") from None
    return str(path)


def build_parser():
    parser = ArgParser(
        prog="evaluate.py", description="greedy accuracy and pass@k of a model on benchmarks")
    parser.add_argument("--model", default="", help="hub id, local folder (a checkpoint) or 'tiny'")
    parser.add_argument("--benchmarks", default="gsm8k,math500",
                        help=f"comma-separated: {', '.join(common.BENCHMARKS)} or JSONL files")
    parser.add_argument("--n", type=int, default=1,
                        help="samples per problem for pass@k (1 = greedy only)")
    parser.add_argument("--k", default="1", help="comma-separated k values, each <= n")
    for flag, default in (("--temperature", 0.6), ("--top-p", 0.95), ("--max-tokens", 2048),
                          ("--seed", 0), ("--dtype", "auto"), ("--max-model-len", 8192),
                          ("--gpu-memory-utilization", 0.85)):
        parser.add_argument(flag, type=type(default), default=default)
    parser.add_argument("--limit", type=int, default=0,
                        help="first N problems per benchmark (0 = all)")
    parser.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--compare", default="",
                        help="also evaluate this base model and plot pass@k curves")
    parser.add_argument("--out", default="",
                        help="output JSON file, or a folder (created) for eval_<model>.json; "
                             "default eval_<model>.json here")
    return parser


def reject_unknown(parser, unknown):
    """A typo ends the run naming the closest flag."""
    flags = [f for f in parser._option_string_actions if f.startswith("--")]
    flag = unknown[0].split("=", 1)[0]
    close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]}?" if close else ""
    parser.error(f"unknown argument {unknown[0]}{hint}")


def main(argv=None):
    """`python tools/evaluate.py --model M --benchmarks gsm8k,math500 --n 16 --k 1,4,16
    [--compare BASE] [--out file.json]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        reject_unknown(parser, unknown)
    if not args.model:
        parser.error("--model is required (a hub id, a local folder or 'tiny')")
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
    if args.compare:
        base = eval_model(args, args.compare)
        report = {"trained": trained, "base": base}
        runs = [("trained ", trained), ("base ", base)]
        labels = [f"base: {args.compare}", f"trained: {args.model}"]
        png = plot_pass_at_k([base, trained], labels, str(Path(out).with_suffix(".png")))
        if png:
            report["plot"] = png
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    for label, result in runs:
        for bench, figures in result["benchmarks"].items():
            pass_at = ", ".join(f"pass@{k}={v:.3f}" for k, v in figures["pass@k"].items())
            print(f"{label}{result['model']} {bench}: greedy={figures['greedy_acc']:.3f} {pass_at}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
