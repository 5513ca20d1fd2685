"""A picture of a run: its metrics.jsonl as one PNG, a panel each for the evaluation scores, reward
and solve rate per role, entropy, response length and seconds per phase, against the step; of one
run folder, or of several with one line per run. Every run draws its own at the end
(Run.write_plot); tools/plot.py draws any from the command line."""
from __future__ import annotations

import importlib.util
import math
import pathlib
import re

from infra.runfolder import read_metrics

# The panels, in order, and the metric keys each draws: the methods' own names (challenger/reward,
# deduction/proposer_reward, reasoner/accuracy, solver_acc, entropy/solver/abduction,
# len/proposer/induction, eval/<benchmark>/score, ...). An evaluation's keys (eval/, test/) and
# the timers (time/) go to their own panels only.
PANELS = {
    "evaluation": re.compile(r"^test/accuracy$|^eval/(.+/)?(score|overall|math_avg|mean_score)$"
                             r"|^eval/code/.+/greedy_acc$"),
    "reward per role": re.compile(r"(^|/|_)reward$"),
    "solve and valid rate": re.compile(
        r"(^|/|_)(accuracy|acc|solve_rate|valid_rate|solved_direct|coverage)$"),
    "entropy": re.compile(r"(^|/)entropy(/|$)"),
    "response length (tokens)": re.compile(r"^len/|(^|/)(mean_len|rationale_tokens)$"),
    "seconds per phase": re.compile(r"^time/"),
}
_OWN_PANEL = {"eval/": "evaluation", "test/": "evaluation", "time/": "seconds per phase"}
_RATES = ("evaluation", "solve and valid rate")  # fractions: drawn from 0 to 1
_LINE_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "v", "D", "x", "+", "<", ">", "*")


def panel_of(key: str) -> str | None:
    """The panel that draws metric `key`, or None."""
    for prefix, title in _OWN_PANEL.items():
        if key.startswith(prefix):
            return title if PANELS[title].search(key) else None
    for title, pattern in PANELS.items():
        if title not in _OWN_PANEL.values() and pattern.search(key):
            return title
    return None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(records: list[dict]) -> dict[str, dict[str, tuple[list, list]]]:
    """Panel title -> metric key -> (steps, values): every finite number the panel draws, by step.
    A key logged twice at one step (a final evaluation's line after the last training step's)
    keeps its last value; a timer adds up, as the seconds of both lines were spent at that step."""
    by_step = {title: {} for title in PANELS}  # title -> key -> step -> value
    for record in records:
        step = record.get("step")
        if not _is_number(step):
            continue
        for key, value in record.items():
            title = panel_of(key)
            if title is None or not _is_number(value):
                continue
            values = by_step[title].setdefault(key, {})
            if key.startswith("time/"):
                value += values.get(step, 0)
            values[step] = value
    panels = {}
    for title, keys in by_step.items():
        panels[title] = {}
        for key, values in keys.items():
            steps = sorted(values)
            panels[title][key] = (steps, [values[step] for step in steps])
    return panels


def draw(runs: dict[str, list[dict]], out) -> dict[str, dict[str, tuple[list, list]]]:
    """One PNG at `out` of the runs' metrics (label -> records): a panel per PANELS entry, a line
    per metric key and run (several runs: one colour each). What each panel holds, read back from
    the figure's lines: panel title -> line label -> (steps, values)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(16, 9), squeeze=False, sharex=True)
    per_run = {label: series(records) for label, records in runs.items()}
    for ax, title in zip(axes.flat, PANELS):
        for run_index, (label, panels) in enumerate(per_run.items()):
            for key_index, (key, (steps, values)) in enumerate(sorted(panels[title].items())):
                # hollow markers of several shapes: lines that lie on each other stay visible
                style = {"marker": _MARKERS[key_index % len(_MARKERS)], "markersize": 5,
                         "fillstyle": "none", "linewidth": 1.2, "label": key}
                if len(runs) > 1:
                    style["label"] = f"{label}: {key}"
                    style["color"] = f"C{run_index % 10}"
                    style["linestyle"] = _LINE_STYLES[key_index % len(_LINE_STYLES)]
                ax.plot(steps, values, **style)
        _finish_panel(ax, title)
    names = ", ".join(runs)
    fig.suptitle(f"{names}: metrics.jsonl against the step", fontsize=11)
    fig.tight_layout()
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    drawn = {}
    for ax in axes.flat:
        lines = {}
        for line in ax.get_lines():
            lines[line.get_label()] = (list(line.get_xdata()), list(line.get_ydata()))
        drawn[ax.get_title()] = lines
    plt.close(fig)
    return drawn


def _finish_panel(ax, title: str) -> None:
    """Title, axis labels, legend; rates from 0 to 1; a note where the run logged nothing."""
    from matplotlib.ticker import MaxNLocator
    ax.set_title(title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_tick_params(labelbottom=True)  # every panel's steps, though they share them
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if not ax.lines:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", color="gray",
                transform=ax.transAxes)
        return
    values = [value for line in ax.lines for value in line.get_ydata()]
    if title in _RATES and 0 <= min(values) and max(values) <= 1:
        ax.set_ylim(-0.03, 1.03)
    ax.legend(fontsize="xx-small", loc="best")


def plot_run_folder(run_dir) -> str:
    """metrics.png in a run folder, drawn from its metrics.jsonl: its path, or why there is none,
    in one line. Never raises: a finished run does not fail for its picture."""
    if importlib.util.find_spec("matplotlib") is None:
        return "none: matplotlib is not installed (pip install matplotlib)"
    records = read_metrics(run_dir)
    if not records:
        return "none: metrics.jsonl holds no step"
    out = pathlib.Path(run_dir) / "metrics.png"
    try:
        draw({pathlib.Path(run_dir).name: records}, out)
    except Exception as e:  # a picture is never worth a finished run
        return f"none: drawing it failed ({type(e).__name__}: {e})"
    return str(out)
