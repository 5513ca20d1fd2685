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
    for ax, b in zip(axes[0], benches):
        for res, lab in zip(results, labels):
            pk, ci = res["benchmarks"][b]["pass@k"], res["benchmarks"][b]["pass@k_ci"]
            ks = sorted(int(x) for x in pk)
            ax.plot(ks, [pk[str(x)] for x in ks], marker="o", label=lab)
            ax.fill_between(ks, [ci[str(x)][0] for x in ks], [ci[str(x)][1] for x in ks], alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="k", ylabel="pass@k", title=b)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def eval_out_path(out: str, model: str) -> str:
    """The JSON path of `--out`: a folder (existing, ending in '/', or without .json) gets
    eval_<model>.json inside; the folder is created and checked writable before any work."""
    name = "eval_" + re.sub(r"[^\w.-]+", "_", model.strip("/")) + ".json"
    p = Path(out) if out else Path(name)
    if out and (p.is_dir() or out.endswith(("/", os.sep)) or p.suffix.lower() != ".json"):
        p = p / name
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        probe = p.parent / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise common.InputError(f"--out {out or p}: cannot write into {p.parent} "
                                f"({e.strerror or e}); pass a folder you can write to") from None
    return str(p)


def main(argv=None):
    """`python tools/evaluate.py --model M --benchmarks gsm8k,math500 --n 16 --k 1,4,16
    [--compare BASE] [--out file.json]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ev = ap = common.ArgParser(
        prog="evaluate.py", description="greedy accuracy and pass@k of a model on benchmarks")
    ev.add_argument("--model", default="", help="hub id, local folder (a checkpoint) or 'tiny'")
    ev.add_argument("--benchmarks", default="gsm8k,math500",
                    help=f"comma-separated: {', '.join(common.BENCHMARKS)} or JSONL files")
    ev.add_argument("--n", type=int, default=1,
                    help="samples per problem for pass@k (1 = greedy only)")
    ev.add_argument("--k", default="1", help="comma-separated k values, each <= n")
    for flag, default in (("--temperature", 0.6), ("--top-p", 0.95), ("--max-tokens", 2048),
                          ("--seed", 0), ("--dtype", "auto"), ("--max-model-len", 8192),
                          ("--gpu-memory-utilization", 0.85)):
        ev.add_argument(flag, type=type(default), default=default)
    ev.add_argument("--limit", type=int, default=0, help="first N problems per benchmark (0 = all)")
    ev.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    ev.add_argument("--compare", default="",
                    help="also evaluate this base model and plot pass@k curves")
    ev.add_argument("--out", default="", help="output JSON file, or a folder (created) for "
                                              "eval_<model>.json; default eval_<model>.json here")
    args, unknown = ap.parse_known_args(argv)
    if unknown:  # a typo: name the closest flag
        flags = [f for f in ev._option_string_actions if f.startswith("--")]
        close = difflib.get_close_matches(unknown[0].split("=", 1)[0], flags, n=1, cutoff=0.5)
        ap.error(f"unknown argument {unknown[0]}"
                 f"{f'; did you mean {close[0]}?' if close else ''}")
    if not args.model:
        ap.error("--model is required (a hub id, a local folder or 'tiny')")
    try:  # everything a user can get wrong is checked before a model is loaded
        for flag, m in (("--model", args.model), ("--compare", args.compare)):
            if m:
                common.check_model(m, flag)
        common.check_benchmark_names(args.benchmarks, "--benchmarks")
        out = eval_out_path(args.out, args.model)
    except ValueError as e:
        ap.error(str(e))
    res = report = eval_model(args, args.model)
    runs = [("", res)]
    if args.compare:
        base = eval_model(args, args.compare)
        report, runs = {"trained": res, "base": base}, [("trained ", res), ("base ", base)]
        png = plot_pass_at_k([base, res], [f"base: {args.compare}", f"trained: {args.model}"],
                             str(Path(out).with_suffix(".png")))
        if png:
            report["plot"] = png
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    for label, r in runs:
        for b, v in r["benchmarks"].items():
            pk = ", ".join(f"pass@{x}={y:.3f}" for x, y in v["pass@k"].items())
            print(f"{label}{r['model']} {b}: greedy={v['greedy_acc']:.3f} {pk}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
