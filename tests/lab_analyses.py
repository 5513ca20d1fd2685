"""The laptop laboratory, the analyses of "Towards Understanding Self-play for LLM Reasoning"
(RQ1-RQ5) run on the Absolute Zero lab, with the tools a user runs on their own runs.

    python tests/lab_analyses.py --seeds 0,1

It builds (once, cached) the Absolute Zero lab's base model and runs, or reuses, three of its
experiments per seed (tests/lab_absolute_zero.py): the standard run, `frozen` (--freeze-proposer)
and `uncertainty` (--proposer-reward uncertainty). Then:
- RQ1 (Fig. 1): pass@k for k = 1..64 on the lab's 180 held-out tasks, base vs each standard run:
  64 answers per task at T = 1, absolute_zero.py's solver prompts and sandboxed grader; 95%
  intervals by a bootstrap over tasks.
- RQ2 (Fig. 2): tools/difficulty.py on each standard run: deduction questions proposed early, mid
  and late, each answered 8 times by the base and by the trained model.
- RQ3 (Figs. 3-4): entropy/proposer and entropy/solver (Eq. 1) per step from metrics.jsonl, the
  standard run against the frozen proposer.
- RQ4 (Fig. 5): tools/sparsity.py in bfloat16 (the lab's bases are stored in float32, where every
  weight AdamW touched differs; the paper compares bf16 checkpoints) of each Absolute Zero run,
  beside SFT (STaR's lab, `tests/lab.py star`) and RLVR (GRPO on exact labels, `tests/lab_r_zero.py
  control`), each against its own base. A missing run is named with the command that makes it.
- RQ5 (Fig. 6): greedy held-out accuracy (95% Wilson CI) and entropy, --proposer-reward
  uncertainty (Eq. 3) against learnability (Eq. 4).
It prints a table per question and writes summary.json and analyses.png under
runs/lab/absolute_zero/analyses/. `--quick` runs the reduced lab (CI's end-to-end check).
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import lab_absolute_zero as azlab  # noqa: E402 (the lab's)
from infra.runfolder import latest_checkpoint  # noqa: E402
from lab import wilson  # noqa: E402

SAMPLES = {"full": 64, "quick": 2}  # RQ1's answers per held-out task
DIFFICULTY = {"full": ("16", "8"), "quick": ("2", "2")}  # RQ2's questions per group, answers each
VARIANTS = {"run": "standard", "frozen": "frozen proposer", "uncertainty": "uncertainty reward"}
# RQ4's other runs: (label, the run folder under --out, the checkpoint in it, the command)
OTHER_RUNS = [
    ("SFT (STaR lab)", "star/with_rationalization_seed{seed}", "",
     "python tests/lab.py star --seeds {seed}"),
    ("RLVR (R-Zero lab control)", "r_zero_direct0.5/exact_labels_seed{seed}", "final/solver",
     "python tests/lab_r_zero.py control --seeds {seed}"),
]


def run_variants(args) -> dict[str, Path]:
    """Each variant's folder, its runs and evaluations made (or kept) by the Absolute Zero lab."""
    folders = {}
    for variant in VARIANTS:
        argv = [variant, "--seeds", args.seeds, "--out", args.out]
        if args.kind == "quick":
            argv.append("--quick")
        print(f"\n$ python tests/lab_absolute_zero.py {' '.join(argv)}", flush=True)
        azlab.main(argv)
        folders[variant] = azlab.lab_folder(args)
        if variant in azlab.VARIANTS:
            subfolder, _flags = azlab.VARIANTS[variant]
            folders[variant] = folders[variant] / subfolder
    return folders


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def checkpoint(run: Path) -> Path:
    found = latest_checkpoint(run)
    if found is None:
        raise SystemExit(f"{run}: no checkpoint; delete the folder and run the lab again")
    return found


# ---------------------------------------------------------------------------- RQ1: pass@k
def pass_curve(correct: list[int], n: int, ks: list[int]) -> list[float]:
    """Mean over tasks of the unbiased pass@k (Chen et al. 2021) from `correct` of `n` answers."""
    import common
    return [sum(common.pass_at_k(n, c, k) for c in correct) / len(correct) for k in ks]


def bootstrap_interval(correct: list[int], n: int, ks: list[int], resamples: int = 1000,
                       seed: int = 0) -> tuple[list[float], list[float]]:
    """95% percentile interval of each pass@k over tasks drawn with replacement."""
    rng = random.Random(seed)
    curves = []
    for _ in range(resamples):
        drawn = [rng.choice(correct) for _ in correct]
        curves.append(pass_curve(drawn, n, ks))
    low, high = [], []
    for column in zip(*curves):
        ordered = sorted(column)
        low.append(ordered[int(0.025 * resamples)])
        high.append(ordered[int(0.975 * resamples) - 1])
    return low, high


def rq1(args, folders: dict, out: Path) -> dict:
    """pass@k of the base and each standard run on every held-out task, SAMPLES answers each."""
    work = folders["run"]
    n = SAMPLES[args.kind]
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n]
    models = {"base": json.loads((work / "eval_base.json").read_text())["model"]}
    for seed in args.seed_list:
        models[f"seed {seed}"] = str(checkpoint(work / f"seed{seed}"))
    backend = azlab.EVAL[args.kind][2]
    result = {"k": ks, "n": n, "models": {}}
    print(f"\nRQ1: pass@k on the {len(azlab.TASKS)} task types' held-out tasks, {n} answers each "
          "at T = 1 (95% bootstrap interval over tasks)")
    for name, model in models.items():
        path = out / f"passk_{name.replace(' ', '')}.json"
        if not path.exists() or json.loads(path.read_text()).get("model") != model:
            subprocess.run([sys.executable, azlab.__file__, "_eval", model, str(work / "test.json"),
                            str(path), str(n), str(azlab.EVAL[args.kind][1]), backend, "0"],
                           check=True, cwd=ROOT, env=azlab._env())
        evaluation = json.loads(path.read_text())
        per_type = {t: evaluation[t]["correct_samples"] for t in azlab.TASKS}
        every_task = [c for t in azlab.TASKS for c in per_type[t]]
        low, high = bootstrap_interval(every_task, n, ks)
        curves = {"all": pass_curve(every_task, n, ks), "low": low, "high": high}
        for t in azlab.TASKS:
            curves[t] = pass_curve(per_type[t], n, ks)
        result["models"][name] = curves
        cells = [f"{v:.3f} [{lo:.3f}, {hi:.3f}]" for v, lo, hi in zip(curves["all"], low, high)]
        print(f"  {name:8s} " + "  ".join(f"k={k}: {c}" for k, c in zip(ks, cells)))
    return result


# ------------------------------------------------------------------- RQ2: difficulty over steps
def rq2(args, folders: dict, out: Path) -> dict:
    """tools/difficulty.py on each standard run: early, mid and late deduction questions."""
    questions, answers = DIFFICULTY[args.kind]
    result = {}
    for seed in args.seed_list:
        path = out / f"difficulty_seed{seed}.json"
        done = subprocess.run([sys.executable, str(ROOT / "tools" / "difficulty.py"),
                               str(folders["run"] / f"seed{seed}"), "--steps", "early,mid,late",
                               "--n", questions, "--k", answers, "--seed", str(seed),
                               "--out", str(path)],
                              cwd=ROOT, env=azlab._env(), stderr=subprocess.PIPE, text=True)
        if done.returncode == 2:  # its one-line error: a run with too few proposals to draw from
            error = done.stderr.strip().splitlines()[-1]
            print(f"RQ2, seed {seed}: not measured: {error}")
            continue
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
        done.check_returncode()
        result[f"seed {seed}"] = json.loads(path.read_text())
    return result


# ---------------------------------------------------------------------- RQ3 and RQ5: entropy
ENTROPY_KEYS = ("entropy/proposer", "entropy/solver")


def entropy_series(run: Path) -> dict[str, list]:
    """(step, value) of each ENTROPY_KEYS figure the run logged, by key."""
    series = {key: [] for key in ENTROPY_KEYS}
    for row in read_metrics(run):
        for key in ENTROPY_KEYS:
            if row.get(key) is not None and row.get("step", 0) >= 1:
                series[key].append((row["step"], row[key]))
    return series


def rq3(args, folders: dict) -> dict:
    result = {}
    print("\nRQ3: Eq. 1 entropy per role, first step -> last step")
    for variant in ("run", "frozen"):
        for seed in args.seed_list:
            series = entropy_series(folders[variant] / f"seed{seed}")
            name = f"{VARIANTS[variant]}, seed {seed}"
            result[name] = series
            cells = []
            for key, points in series.items():
                if points:
                    cells.append(f"{key} {points[0][1]:.3f} -> {points[-1][1]:.3f}")
            print(f"  {name:28s} " + "   ".join(cells))
    return result


def held_out_accuracy(evaluation: dict) -> dict:
    """Greedy accuracy over every held-out task and its 95% Wilson interval."""
    solved = sum(sum(evaluation[t]["greedy"]) for t in azlab.TASKS)
    tasks = sum(len(evaluation[t]["greedy"]) for t in azlab.TASKS)
    low, high = wilson(solved, tasks)
    return {"accuracy": solved / tasks, "low": max(0.0, low), "high": high}


def rq5(args, folders: dict) -> dict:
    """Greedy held-out accuracy and the mean Eq. 1 entropy over the steps, per proposer reward
    and seed, beside the base."""
    base = json.loads((folders["run"] / "eval_base.json").read_text())
    result = {"base": held_out_accuracy(base)}
    for variant in ("run", "uncertainty"):
        for seed in args.seed_list:
            evaluation = json.loads((folders[variant] / f"eval_seed{seed}.json").read_text())
            entry = held_out_accuracy(evaluation)
            for key, points in entropy_series(folders[variant] / f"seed{seed}").items():
                values = [value for _, value in points]
                entry[key] = sum(values) / len(values) if values else None
            result[f"{VARIANTS[variant]}, seed {seed}"] = entry
    print("\nRQ5: --proposer-reward, greedy held-out accuracy [95% Wilson CI], mean entropy")
    for label, entry in result.items():
        extra = "  ".join(f"{key} {entry[key]:.3f}" for key in ENTROPY_KEYS
                          if entry.get(key) is not None)
        print(f"  {label:32s} {entry['accuracy']:.3f} [{entry['low']:.3f}, {entry['high']:.3f}]"
              f"  {extra}")
    return result


# ------------------------------------------------------------------------- RQ4: sparsity
def sparsity(base: str, trained: Path, path: Path) -> dict:
    subprocess.run([sys.executable, str(ROOT / "tools" / "sparsity.py"), base, str(trained),
                    "--dtype", "bfloat16", "--out", str(path)],
                   check=True, cwd=ROOT, env=azlab._env(), stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def rq4(args, folders: dict, out: Path) -> dict:
    """bf16 sparsity of each Absolute Zero run and of the SFT and RLVR labs' runs found under
    --out, each against the model its run started from (config.json's --model)."""
    runs = []
    for seed in args.seed_list:
        run = folders["run"] / f"seed{seed}"
        runs.append(("Absolute Zero", seed, run, checkpoint(run)))
    missing = []
    for label, folder, inside, command in OTHER_RUNS:
        for seed in args.seed_list:
            run = Path(args.out) / folder.format(seed=seed)
            trained = None
            if inside and (run / inside / "config.json").is_file():
                trained = run / inside
            elif not inside and (run / "config.json").is_file():
                trained = latest_checkpoint(run)  # None: the run stopped before its first
            if trained is None:
                missing.append(command.format(seed=seed))
            else:
                runs.append((label, seed, run, trained))
    result = {}
    print("\nRQ4: parameters unchanged in bfloat16 against the run's own base (Eq. 2)")
    for label, seed, run, trained in runs:
        base = json.loads((run / "config.json").read_text())["model"]
        name = f"{label}, seed {seed}"
        slug = name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
        figures = sparsity(base, trained, out / f"sparsity_{slug}.json")
        result[name] = figures
        kinds = ", ".join(f"{kind} {v['sparsity']:.1%}" for kind, v in figures["per_type"].items())
        print(f"  {name:36s} {figures['sparsity']:.1%} ({kinds})")
    for command in missing:
        print(f"  not found, so not compared: the run of `{command}`")
    return result


# ------------------------------------------------------------------------------- the figure
def plot(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    passk, difficulty, length = axes[0]
    entropy, sparse, rewards = axes[1]
    ks = summary["rq1"]["k"]
    for i, (name, curve) in enumerate(summary["rq1"]["models"].items()):
        passk.plot(ks, curve["all"], marker="o", color=f"C{i}", label=name,
                   linestyle="-" if name == "base" else "--")
        passk.fill_between(ks, curve["low"], curve["high"], color=f"C{i}", alpha=0.15)
    passk.set(xlabel="k", ylabel="pass@k, all held-out tasks",
              title="RQ1: pass@k, base vs trained (Fig. 1)")
    passk.set_xscale("log", base=2)
    passk.legend(fontsize=8)
    for i, (name, report) in enumerate(summary["rq2"].items()):
        labels = [group["label"] for group in report["groups"]]
        for model, style in (("base", "-"), ("trained", "--")):
            difficulty.plot(labels, [g[model]["solve_rate"] for g in report["groups"]],
                            marker="o", linestyle=style, color=f"C{i}", label=f"{model}, {name}")
            length.plot(labels, [g[model]["mean_length"] for g in report["groups"]],
                        marker="o", linestyle=style, color=f"C{i}", label=f"{model}, {name}")
    difficulty.set(ylim=(-0.02, 1.02), xlabel="deduction questions proposed",
                   ylabel="solve rate", title="RQ2: difficulty of proposed questions (Fig. 2)")
    length.set(xlabel="deduction questions proposed", ylabel="mean answer length (tokens)",
               title="RQ2: answer length")
    if summary["rq2"]:
        difficulty.legend(fontsize=7)
    for j, key in enumerate(ENTROPY_KEYS):  # the mean over seeds, a line per role and variant
        for variant, style in (("standard", "-"), ("frozen proposer", "--")):
            per_step = {}
            for name, series in summary["rq3"].items():
                if name.startswith(variant):
                    for step, value in series[key]:
                        per_step.setdefault(step, []).append(value)
            steps = sorted(per_step)
            entropy.plot(steps, [sum(per_step[t]) / len(per_step[t]) for t in steps],
                         color=f"C{j}", linestyle=style, label=f"{key.split('/')[1]}, {variant}")
    entropy.set(xlabel="step", ylabel="Eq. 1 entropy (nats per token), mean of seeds",
                title="RQ3: entropy by role (Figs. 3-4)")
    entropy.legend(fontsize=7)
    names = list(summary["rq4"])
    values = [100 * summary["rq4"][n]["sparsity"] for n in names]
    bars = sparse.barh(names, values, color=[f"C{i % 10}" for i in range(len(names))])
    sparse.bar_label(bars, fmt="%.1f%%", fontsize=7)
    sparse.set(xlabel="% parameters unchanged in bf16", title="RQ4: update sparsity (Fig. 5)")
    sparse.tick_params(axis="y", labelsize=7)
    names = list(summary["rq5"])
    accuracy = [summary["rq5"][n]["accuracy"] for n in names]
    errors = [[a - summary["rq5"][n]["low"] for a, n in zip(accuracy, names)],
              [summary["rq5"][n]["high"] - a for a, n in zip(accuracy, names)]]
    rewards.bar(range(len(names)), accuracy, yerr=errors, capsize=3,
                color=[f"C{i}" for i in range(len(names))])
    rewards.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=7)
    rewards.set(ylabel="greedy held-out accuracy (95% CI)",
                title="RQ5: proposer reward (Fig. 6)")
    fig.suptitle("Towards Understanding Self-play for LLM Reasoning, on the Absolute Zero lab",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
    print(f"\nwrote {path}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--out", default=str(ROOT / "runs" / "lab"))
    ap.add_argument("--quick", dest="kind", action="store_const", const="quick", default="full")
    ap.add_argument("--plot", metavar="SUMMARY", default="",
                    help="only draw the figure again from a summary.json this script wrote")
    args = ap.parse_args(argv)
    if args.plot:
        summary_file = Path(args.plot)
        return plot(json.loads(summary_file.read_text()), summary_file.with_name("analyses.png"))
    args.seed_list = [int(s) for s in args.seeds.split(",")]
    # the lab's own flags for its default base model
    lab_args = argparse.Namespace(out=args.out, kind=args.kind, seeds=args.seeds,
                                  pretrain_steps=0, direct=azlab.DIRECT)
    folders = run_variants(lab_args)
    out = folders["run"] / "analyses"
    out.mkdir(exist_ok=True)
    summary = {"rq1": rq1(args, folders, out), "rq2": rq2(args, folders, out),
               "rq3": rq3(args, folders), "rq4": rq4(args, folders, out),
               "rq5": rq5(args, folders)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, out / "analyses.png")


if __name__ == "__main__":
    main()
