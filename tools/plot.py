"""tools/plot.py draws run folders' metrics.jsonl as one PNG: evaluation scores, reward and solve
rate per role, entropy, response length and seconds per phase, against the step (one line per
metric and run), the picture every run also writes at its end as metrics.png.

    python tools/plot.py runs/spice-20250101-120000                     # -> its metrics.png
    python tools/plot.py runs/spice-a runs/spice-b --out compare.png    # two runs side by side
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from infra import plot  # noqa: E402
from infra.cli import ArgParser  # noqa: E402
from infra.runfolder import read_metrics, unwritable  # noqa: E402


def build_parser() -> ArgParser:
    parser = ArgParser(prog="tools/plot.py", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run folders, each with its metrics.jsonl")
    parser.add_argument("--out", default="",
                        help="the PNG to write (default: RUN_DIR/metrics.png for one run, "
                             "metrics_compared.png here for several)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    names = [Path(run_dir).name for run_dir in args.run_dirs]
    runs = {}  # label (the folder's name, or its path where two names are the same) -> metrics
    for run_dir, name in zip(args.run_dirs, names):
        if not (Path(run_dir) / "metrics.jsonl").is_file():
            parser.error(f"{run_dir}: no metrics.jsonl there (expected a run folder)")
        label = name
        if names.count(name) > 1:
            label = run_dir
        runs[label] = read_metrics(run_dir)
    out = args.out or "metrics_compared.png"
    if not args.out and len(runs) == 1:
        out = str(Path(args.run_dirs[0]) / "metrics.png")
    why = unwritable(Path(out).parent)
    if why:
        parser.error(f"--out {out}: {why}")
    if importlib.util.find_spec("matplotlib") is None:
        parser.error("matplotlib is not installed: pip install matplotlib")
    plot.draw(runs, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
