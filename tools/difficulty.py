"""How hard the proposed tasks get over training: RQ2 of "Towards Understanding Self-play for LLM
Reasoning" (§3.2, Fig. 2). Questions proposed at chosen steps of an Absolute Zero run are solved
again by the base model and by a trained checkpoint: per step, their solve rate and the mean
length of the answers.

    python tools/difficulty.py RUN_DIR --steps early,mid,late --n 32 --k 8 \\
        [--base MODEL] [--trained CHECKPOINT] [--task deduction] [--out FILE.json]

RUN_DIR is an Absolute Zero run folder, whose proposals.jsonl holds every valid proposal by step.
--steps names early, mid and late (the first, middle and last third of the steps logged), steps, or
ranges A-B. From each, N distinct proposals of --task (deduction, as in the paper) are drawn, and
each is answered K times by --base (default: the model the run started from) and by --trained
(default: the run's latest checkpoint), with the run's own solver prompts (its --prompts file too)
and settings, sampled as the learnability estimate is (T = 1 unless --temperature, top-p 1, the
<answer> read alone: r_bar of Eq. 4) and graded in the sandbox as in training. The length counts
completion tokens. A table is printed; the JSON (default RUN_DIR/difficulty.json) and a PNG beside
it are written.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import absolute_zero as az  # noqa: E402
import common  # noqa: E402
from infra.cli import ArgParser, saved_config  # noqa: E402
from infra.runfolder import latest_checkpoint  # noqa: E402
from tools.evaluate import output_path, short_label  # noqa: E402

THIRDS = ("early", "mid", "late")  # --steps names: thirds of the steps logged, in order
MODELS = ("base", "trained")
COLUMNS = ("questions", "base solve", "base length", "trained solve", "trained length")


class Group(typing.NamedTuple):
    """Steps whose proposals are pooled into one row of the table."""
    label: str  # as --steps names it
    steps: list  # the steps logged that it covers


def read_proposals(run_dir: Path, task: str) -> dict[int, list[dict]]:
    """Step -> the valid proposals of `task` logged at it; a torn line (a killed run) is skipped."""
    by_step = {}
    text = (run_dir / az.PROPOSALS_FILE).read_text(encoding="utf-8", errors="replace")
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("task") == task and isinstance(row.get("step"), int):
            by_step.setdefault(row["step"], []).append(row)
    return by_step


def choose_groups(spec: str, logged: list[int]) -> list[Group]:
    """The groups --steps names: early, mid, late (thirds of the `logged` steps), a step, or a
    range A-B (the steps logged within it)."""
    groups = []
    for part in [part.strip() for part in spec.split(",")]:
        if part in THIRDS:
            if len(logged) < 3:
                raise common.InputError(f"--steps {part}: needs proposals from 3 steps or more "
                                        f"(the run logged {len(logged)}); pass step numbers")
            third = THIRDS.index(part)
            start = third * len(logged) // 3
            end = (third + 1) * len(logged) // 3
            groups.append(Group(part, logged[start:end]))
        elif re.fullmatch(r"\d+", part):
            groups.append(Group(part, [int(part)]))
        elif re.fullmatch(r"\d+-\d+", part):
            first, last = part.split("-")
            within = [step for step in logged if int(first) <= step <= int(last)]
            groups.append(Group(part, within))
        else:
            raise common.InputError(f"--steps {spec}: {part!r} is none of early, mid, late, a "
                                    "step number or a range A-B")
    return groups


def draw_questions(groups: list[Group], proposals: dict, n: int, seed: int,
                   task: str) -> dict[str, list[dict]]:
    """Per group, n distinct proposals (program and input(s)) of its steps, drawn at random."""
    rng = random.Random(seed)
    drawn = {}
    for group in groups:
        distinct = {}  # (program, input or inputs) -> the first proposal of it
        for step in group.steps:
            for row in proposals.get(step, []):
                given = row.get("input", row.get("inputs"))
                distinct.setdefault((row.get("program"), json.dumps(given)), row)
        if not distinct:
            raise common.InputError(f"--steps {group.label}: no valid {task} proposal was logged "
                                    f"there (steps {group.steps or 'none'}); choose other steps")
        drawn[group.label] = rng.sample(list(distinct.values()), min(n, len(distinct)))
    return drawn


def solve_again(model: str, drawn: dict, cfg: az.Config, prompts: dict, args) -> dict:
    """Per group: the solve rate of `model`'s K answers per question (their mean over questions)
    and the mean length of all its answers, in completion tokens."""
    path = common.resolve_model_path(model)
    common.seed_everything(args.seed)  # both models sample from the same state
    sampler = common.make_sampler(path, common.load_tokenizer(path), cfg)
    executor = az.Executor(cfg)
    try:
        tasks = [(args.task, row) for rows in drawn.values() for row in rows]
        graded = iter(az.graded_answers(sampler, executor, tasks, args.k, cfg, prompts,
                                        r1_format=False, temperature=args.temperature,
                                        top_p=1.0))
    finally:
        executor.close()
        sampler.close()
    figures = {}
    for label, rows in drawn.items():
        solve_rates, lengths = [], []
        for _ in rows:
            _, answers = next(graded)  # (its prompt, its K graded answers)
            solved = sum(answer.correct for answer in answers)
            solve_rates.append(solved / len(answers))
            lengths += [len(answer.completion.token_ids) for answer in answers]
        figures[label] = {
            "solve_rate": sum(solve_rates) / len(solve_rates),
            "mean_length": sum(lengths) / len(lengths),
            "solve_rates": solve_rates,  # per question, in the order drawn
        }
    return figures


def table(report: dict) -> str:
    """The report as a plain table, a row per group of steps (COLUMNS)."""
    lines = ["steps".ljust(24) + "".join(name.rjust(16) for name in COLUMNS)]
    for group in report["groups"]:
        cells = [str(group["questions"])]
        for model in MODELS:
            figures = group[model]
            cells.append(f"{figures['solve_rate']:.3f}")
            cells.append(f"{figures['mean_length']:.1f}")
        lines.append(group_name(group).ljust(24) + "".join(cell.rjust(16) for cell in cells))
    return "\n".join(lines)


def group_name(group: dict) -> str:
    """A report row's name in the table and the plot: "early (steps 1-33)", "step 5"."""
    steps = group["steps"]
    where = f"steps {steps[0]}-{steps[-1]}"
    if len(steps) == 1:
        where = f"step {steps[0]}"
    if group["label"].isdigit():
        return where
    return f"{group['label']} ({where})"


def plot(report: dict, path: Path) -> bool:
    """Fig. 2's two panels, response length and solve rate against the group of steps, a line
    per model; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)", file=sys.stderr)
        return False
    groups = report["groups"]
    names = [group_name(group) for group in groups]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    # the trained model's line dashed, with hollow markers: it shows where the two coincide
    styles = {"base": dict(marker="o"), "trained": dict(marker="s", linestyle="--", mfc="none")}
    for model in MODELS:
        name = f"{model}: {short_label(report['models'][model])}"
        lengths = [group[model]["mean_length"] for group in groups]
        rates = [group[model]["solve_rate"] for group in groups]
        left.plot(names, lengths, label=name, **styles[model])
        right.plot(names, rates, label=name, **styles[model])
    left.set(title="mean response length (tokens)", xlabel="proposed at")
    right.set(title="solve rate", xlabel="proposed at", ylim=(-0.02, 1.02))
    right.legend(fontsize="small")
    run = short_label(report["run"])
    fig.suptitle(f"{report['task']} tasks of {run}, {report['k']} answers each")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def build_parser() -> ArgParser:
    parser = ArgParser(prog="tools/difficulty.py", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="an Absolute Zero run folder")
    parser.add_argument("--steps", default="early,mid,late",
                        help="comma-separated: early, mid, late (thirds of the steps logged), "
                             "step numbers, or ranges A-B")
    parser.add_argument("--n", type=int, default=32, help="distinct questions drawn per group")
    parser.add_argument("--k", type=int, default=8, help="answers per question and model")
    parser.add_argument("--base", default="", metavar="MODEL",
                        help="the base model (default: the run's --model)")
    parser.add_argument("--trained", default="", metavar="CHECKPOINT",
                        help="the trained model (default: the run's latest checkpoint)")
    parser.add_argument("--task", default="deduction", choices=az.TASKS,
                        help="the task type of the questions (the paper's: deduction)")
    parser.add_argument("--temperature", type=float, default=1.0, metavar="T",
                        help="sampling temperature (the learnability estimate's: 1)")
    parser.add_argument("--backend", default="", choices=("vllm", "hf"),
                        help="the sampler (default: the run's --backend)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the draw and the sampling")
    parser.add_argument("--out", default="",
                        help="the JSON file, the PNG beside it (default RUN_DIR/difficulty.json)")
    return parser


class Plan(typing.NamedTuple):
    """What the command line asks for, checked (prepare)."""
    cfg: az.Config  # the run's, with --backend and --seed
    prompts: dict  # the run's solver templates
    groups: list  # the Groups of steps --steps names
    drawn: dict  # group label -> the questions drawn from it
    out: Path  # the JSON file


def run_settings(parser, args) -> tuple[az.Config, dict]:
    """The run's config (--backend, --seed applied) and its prompt templates; the models to
    compare filled in (--base: the run's --model; --trained: its latest checkpoint)."""
    run_dir = Path(args.run_dir)
    if not (run_dir / az.PROPOSALS_FILE).is_file():
        raise common.InputError(f"{run_dir}: no {az.PROPOSALS_FILE} there; pass the folder of an "
                                "Absolute Zero run (runs log every valid proposal there)")
    cfg = az.Config(**saved_config(az.Config, parser, str(run_dir)))
    cfg = dataclasses.replace(cfg, backend=args.backend or cfg.backend, seed=args.seed)
    prompts = common.load_prompts(cfg.prompts, az.PROMPTS)
    args.base = args.base or cfg.model
    if not args.trained:
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            raise common.InputError(f"{run_dir}: no checkpoint yet; pass --trained CHECKPOINT")
        args.trained = str(checkpoint)
    for flag in MODELS:
        common.check_model(getattr(args, flag), f"--{flag}")
    return cfg, prompts


def prepare(parser, args) -> Plan:
    """Everything a user can get wrong, checked before a model loads."""
    if args.n < 1 or args.k < 1:
        raise common.InputError("--n and --k must be >= 1")
    if not args.temperature > 0:
        raise common.InputError("--temperature must be > 0 (the answers are sampled)")
    cfg, prompts = run_settings(parser, args)
    proposals = read_proposals(Path(args.run_dir), args.task)
    groups = choose_groups(args.steps, sorted(proposals))
    drawn = draw_questions(groups, proposals, args.n, args.seed, args.task)
    out = output_path(args.out or str(Path(args.run_dir) / "difficulty.json"), "difficulty.json")
    return Plan(cfg, prompts, groups, drawn, out)


def build_report(args, plan: Plan, figures: dict) -> dict:
    """The settings, the models and a row per group: its steps, its questions, each model's
    figures (solve_again)."""
    report = {
        "run": args.run_dir,
        "task": args.task,
        "n": args.n,
        "k": args.k,
        "temperature": args.temperature,
        "max_tokens": plan.cfg.max_response_tokens,
        "seed": args.seed,
        "models": {model: getattr(args, model) for model in MODELS},
        "groups": [],
    }
    for group in plan.groups:
        row = {"label": group.label, "steps": group.steps,
               "questions": len(plan.drawn[group.label])}
        for model in MODELS:
            row[model] = figures[model][group.label]
        report["groups"].append(row)
    return report


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = prepare(parser, args)
    except ValueError as e:  # InputError too
        parser.error(str(e))
    figures = {}
    for model in MODELS:
        model_name = getattr(args, model)
        figures[model] = solve_again(model_name, plan.drawn, plan.cfg, plan.prompts, args)
    report = build_report(args, plan, figures)
    out = plan.out
    print(table(report))
    common.atomic_write_text(out, json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    if plot(report, out.with_suffix(".png")):
        print(f"wrote {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
