"""The run folder's machinery: atomic writes, JSON lines, checkpoints found and resumed, and the
RNG states that make a resume exact."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import random
import sys

import numpy as np

from infra.lazy import LazyModule

torch = LazyModule("torch", globals())


def latest_checkpoint(run_dir) -> pathlib.Path | None:
    """The newest complete checkpoints/step_<k>/ (`latest`, else the highest k), or None."""
    root = pathlib.Path(run_dir) / "checkpoints"
    found = sorted((p for p in root.glob("step_*") if p.name[5:].isdigit()),
                   key=lambda p: -int(p.name[5:]))
    if (root / "latest").is_file():
        found.insert(0, root / (root / "latest").read_text().strip())
    return next((p for p in found if (p / "trainer_state.json").is_file()), None)


def held_run(out) -> str:
    """The error for an --output-dir that already holds a run ("" if it holds none)."""
    path = pathlib.Path(out)
    old = sorted(p.name for p in (path / "checkpoints").glob("step_*"))
    held = f"checkpoints/{old[-1]}" if old else next(
        (n for n in ("config.json", "metrics.jsonl") if (path / n).is_file()), "")
    return held and (f"--output-dir {out} already holds a run ({held}); continue it with "
                     f"--resume {out}, or pass a new --output-dir")


NO_CHECKPOINT = ("--resume {}: no checkpoint there yet (the run stopped before its first "
                       "save); start it again with a new --output-dir")


def rng_state() -> dict:
    """Python, numpy, torch (and CUDA) RNG states (JSON through json_default)."""
    st = {"python": random.getstate(), "numpy": np.random.get_state(),
          "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate((st["python"][0], tuple(st["python"][1]), st["python"][2]))
    np.random.set_state(tuple(st["numpy"]))
    torch.set_rng_state(torch.as_tensor(st["torch"], dtype=torch.uint8))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.as_tensor(s, dtype=torch.uint8) for s in st["cuda"]])


@contextlib.contextmanager
def preserved_rng():
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def atomic_write_text(path, text: str) -> None:
    """A temp file in the same folder, fsynced, renamed over `path`: never a half-written file."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def json_default(o):
    if hasattr(o, "tolist"):  # numpy and torch scalars and arrays
        return o.tolist()
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, (set, pathlib.Path)):
        return list(o) if isinstance(o, set) else str(o)
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def jsonable(v):
    """A metric as JSON: numpy scalars and one-element tensors as numbers, inf/nan as strings."""
    if isinstance(v, np.generic) or "torch" in sys.modules and isinstance(v, torch.Tensor) \
            and v.numel() == 1:
        return v.item()
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


def atomic_write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=json_default) + "\n")


def iter_jsonl(path, *, shape: str, error: type = ValueError, errors: str = "strict"):
    """(line number, object) per non-empty line, lazily. A missing file, non-UTF-8 text or a line
    not one JSON object raises `error` naming file and line, ending with `shape` (the fix)."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise error(f"{path}: file does not exist; {shape}")
    with p.open("r", encoding="utf-8", errors=errors, newline=None) as f:
        try:
            for lineno, line in enumerate(f, 1):  # newlines only, never U+2028 inside a string
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
                    msg = getattr(e, "msg", str(e))[:80]
                    raise error(f"{path}:{lineno}: not valid JSON ({msg}); {shape}") from None
                if not isinstance(row, dict):
                    raise error(f"{path}:{lineno}: expected a JSON object (this line is a "
                                f"{type(row).__name__}, not an object); {shape}")
                yield lineno, row
        except UnicodeDecodeError as e:
            raise error(f"{path}: not UTF-8 text ({e}); {shape}") from None


def load_safetensors_dir(path) -> dict:
    """A folder's *.safetensors tensors on the CPU, mapped privately (page cache, not our RAM)."""
    from safetensors.torch import load_file
    files = sorted(pathlib.Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (an incomplete or non-safetensors "
                                "checkpoint?)")
    return {k: v for f in files for k, v in load_file(str(f)).items()}
