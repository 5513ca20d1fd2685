"""The run folder's machinery: atomic writes, JSON lines, checkpoint folders written whole and read
back, the leftovers of a killed save cleaned up, and the RNG states that make a resume exact."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import random
import shutil
import sys
import tempfile
import time

import numpy as np

from infra.errors import InputError
from infra.lazy import LazyModule

torch = LazyModule("torch", globals())


NO_CHECKPOINT = ("--resume {}: no checkpoint there to resume, and its eval.json says the run "
                 "finished; pass a new --output-dir to run again")


def default_run_dir(method: str) -> str:
    """runs/<method>-<YYYYmmdd-HHMMSS>, with -2, -3, ... if a run started in the same second."""
    stamped = f"runs/{method}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder, n = stamped, 1
    while os.path.exists(folder):
        n += 1
        folder = f"{stamped}-{n}"
    return folder


# ------------------------------------------------------------------------------ finding a run
def _step_number(folder: pathlib.Path) -> int:
    return int(folder.name[len("step_"):])


def _step_folders(root: pathlib.Path) -> list[pathlib.Path]:
    """The step_<k> entries of a checkpoints/ folder (k digits only), in no particular order."""
    found = []
    for path in root.glob("step_*"):
        if path.name[len("step_"):].isdigit():
            found.append(path)
    return found


def latest_checkpoint(run_dir) -> pathlib.Path | None:
    """The newest complete checkpoints/step_<k>/ (`latest`, else the highest k), or None."""
    root = pathlib.Path(run_dir) / "checkpoints"
    candidates = []
    if (root / "latest").is_file():
        candidates.append(root / (root / "latest").read_text().strip())
    candidates += sorted(_step_folders(root), key=_step_number, reverse=True)
    for folder in candidates:
        if (folder / "trainer_state.json").is_file():
            return folder
    return None


def held_run(out) -> str:
    """The error for an --output-dir that holds a run to keep ("" if it holds none): a checkpoint
    (continue it with --resume) or a final eval.json (a finished evaluation)."""
    checkpoint = latest_checkpoint(out)
    if checkpoint is not None:
        return (f"--output-dir {out} already holds a run (checkpoints/{checkpoint.name}); continue "
                f"it with --resume {out}, or pass a new --output-dir")
    if (pathlib.Path(out) / "eval.json").is_file():
        return (f"--output-dir {out} already holds a finished run (eval.json); pass a new "
                "--output-dir")
    return ""


STOPPED_RUN_FILES = ("config.json", "metrics.jsonl", "samples.jsonl")


def restart_note(out) -> str:
    """For a folder where a run stopped before its first checkpoint: the line saying that it starts
    again there ("" for any other folder). It repeats those steps, so nothing is lost."""
    if held_run(out):
        return ""
    for name in STOPPED_RUN_FILES:
        if (pathlib.Path(out) / name).is_file():
            return (f"run folder {out}: it holds no checkpoint (the run there stopped before its "
                    "first save), so the run starts again in it")
    return ""


def clear_stopped_run(out) -> None:
    """The files a run appends to, of a run that stopped before its first checkpoint (restart_note):
    the run starting again in its folder writes them anew."""
    if restart_note(out):
        for name in ("metrics.jsonl", "samples.jsonl"):
            (pathlib.Path(out) / name).unlink(missing_ok=True)


def restart_in_place(cfg) -> str:
    """--resume of a run that stopped before its first checkpoint starts it again in its folder:
    cfg.resume cleared, cfg.output_dir that folder. The line that says so, or ""."""
    if not cfg.resume or latest_checkpoint(cfg.resume) is not None:
        return ""
    note = restart_note(cfg.resume)
    if note:
        cfg.output_dir, cfg.resume = str(cfg.resume), ""
    return note


def unwritable(out) -> str:
    """Why no run folder can be written at `out` ("" if one can): the nearest existing folder on
    its path is tried with a temporary folder, removed at once."""
    existing = pathlib.Path(out).expanduser().absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        probe = tempfile.mkdtemp(prefix=".write-test-", dir=existing)
    except OSError as e:
        return f"cannot write into {existing} ({e.strerror or e})"
    os.rmdir(probe)
    return ""


def prepare_run_folder(cfg, method: str) -> str:
    """Before anything loads: the folder the run writes (cfg.output_dir, by default
    runs/<method>-<time>) decided and checked, and the line that names it. --resume of a run with
    no checkpoint starts it again in its folder; a folder holding a run to keep, or one that
    cannot be written, is an InputError."""
    line = restart_in_place(cfg)
    if cfg.resume:
        checkpoint = latest_checkpoint(cfg.resume)
        if checkpoint is None:
            raise InputError(NO_CHECKPOINT.format(cfg.resume))
        line = (f"run folder {cfg.resume}: resuming from checkpoints/{checkpoint.name} (with its "
                "config.json; the flags given override it)")
        folder, flag = cfg.resume, "--resume"
    else:
        if not cfg.output_dir:
            cfg.output_dir = default_run_dir(method)
        if held_run(cfg.output_dir):
            raise InputError(held_run(cfg.output_dir))
        line = line or restart_note(cfg.output_dir) or f"run folder {cfg.output_dir}"
        folder, flag = cfg.output_dir, "--output-dir"
    why = unwritable(folder)
    if why:
        raise InputError(f"{flag} {folder}: {why}; pass a folder you can write to")
    return line


# ----------------------------------------------------------------------------------- RNG states
def rng_state() -> dict:
    """Python, numpy, torch (and CUDA) RNG states (JSON through json_default)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Put back what rng_state returned, also after a round trip through JSON (lists for tuples)."""
    version, internal_state, gauss_next = state["python"]
    random.setstate((version, tuple(internal_state), gauss_next))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = [torch.as_tensor(s, dtype=torch.uint8) for s in state["cuda"]]
        torch.cuda.set_rng_state_all(cuda_states)


@contextlib.contextmanager
def preserved_rng():
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


# ------------------------------------------------------------------------ atomic writes, JSON
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
    if isinstance(o, set):
        return list(o)
    if isinstance(o, pathlib.Path):
        return str(o)
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def jsonable(value):
    """A metric as JSON: numpy scalars and one-element tensors as numbers; NaN and infinities as
    null (JSON has no such numbers, and a reader of "nan" strings would have to parse them)."""
    if isinstance(value, np.generic):
        value = value.item()
    torch_loaded = "torch" in sys.modules  # a metric cannot be a tensor before torch is imported
    if torch_loaded and isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


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


def read_metrics(run_dir) -> list[dict]:
    """The records of a run folder's metrics.jsonl, in order; a torn line (a killed run) is
    skipped, and a folder without the file has none."""
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    records = []
    if not path.is_file():
        return records
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def phase_seconds(records: list[dict]) -> collections.Counter:
    """Seconds per phase and timer (their time/<name> keys) summed over metrics records."""
    seconds = collections.Counter()
    for record in records:
        for key, value in record.items():
            if key.startswith("time/") and isinstance(value, (int, float)):
                seconds[key.removeprefix("time/")] += value
    return seconds


def _in_all(n: int, what: str) -> str:
    if n == 1:
        return f"in its one {what}"
    return f"in all {n} {what}s"


def training_notes(records: list[dict]) -> list[str]:
    """What the metrics say of a run that changed no weight, in words: every logged grad norm 0
    (per role, where roles log their own), or every step of a role skipped (its */skipped)."""
    grad_norms = collections.defaultdict(list)  # role ("" for the one policy) -> its grad norms
    skipped = collections.defaultdict(list)  # role -> its */skipped flags
    for record in records:
        for key, value in record.items():
            *path, name = key.split("/")
            role = "/".join(part for part in path if part != "train")
            if name == "grad_norm" and isinstance(value, (int, float)):
                grad_norms[role].append(value)
            elif name == "skipped":
                skipped[role].append(bool(value))
    notes = []
    for role, norms in grad_norms.items():
        if any(norm > 0 for norm in norms):
            continue
        key = "/".join(filter(None, [role, "grad_norm"]))
        whose = "no weight changed"
        if role:
            whose = f"no {role} weight changed"
        notes.append(f"{whose}: {key} was 0 {_in_all(len(norms), 'training step')}")
    for role, flags in skipped.items():
        if all(flags):
            key = "/".join(filter(None, [role, "skipped"]))
            notes.append(f"the {role or 'policy'} never trained: {key} was set "
                         f"{_in_all(len(flags), 'step')}")
    return notes


def _logged_by(line: str, step: int) -> bool:
    """Whether a JSON line was logged at `step` or before; a torn line (a killed run) was not."""
    try:
        return int(json.loads(line).get("step", -1)) <= step
    except (ValueError, AttributeError):
        return False


def drop_lines_after(path, step: int) -> None:
    """Keep the lines of a JSON-lines file logged up to `step`: a resumed run logs the rest anew."""
    path = pathlib.Path(path)
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line + "\n" for line in lines if _logged_by(line, step)]
    atomic_write_text(path, "".join(kept))


# --------------------------------------------------------------------------------- checkpoints
def write_checkpoint(folder, model, tokenizer, weights: dict, optimizer_state,
                     trainer_state: dict, keep: int) -> None:
    """checkpoints/step_<k>/ whole or not at all: save_pretrained (of the full `weights`), the
    tokenizer, optimizer.pt and trainer_state.json go into a temp folder that is renamed into
    place; then `latest` names it, and all but the newest `keep` are pruned (0: none)."""
    folder = pathlib.Path(folder)
    root, name = folder.parent, folder.name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    old = root / f".old-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp), safe_serialization=True, state_dict=weights)
    tokenizer.save_pretrained(str(tmp))
    torch.save(optimizer_state, tmp / "optimizer.pt")
    atomic_write_json(tmp / "trainer_state.json", trainer_state)
    # A folder of the same step is moved aside until the new one is in place: a save killed
    # between the two renames leaves .old-<name>-<pid>/, which clean_interrupted_saves puts back.
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
    atomic_write_text(root / "latest", name + "\n")
    if keep > 0:
        prune_checkpoints(root, keep, current=name)


def prune_checkpoints(root, keep: int, current: str) -> None:
    """Delete all but the newest `keep` step_<k>/ folders in `root` (never the one `current`)."""
    folders = []
    for path in _step_folders(pathlib.Path(root)):
        if path.is_dir():
            folders.append(path)
    folders.sort(key=_step_number)
    for folder in folders[:-keep]:
        if folder.name != current:
            shutil.rmtree(folder, ignore_errors=True)


def read_trainer_state(folder) -> dict:
    """A checkpoint's trainer_state.json: step, method, world size, RNG states, method state."""
    return json.loads((pathlib.Path(folder) / "trainer_state.json").read_text())


def read_optimizer_state(folder, map_location) -> dict:
    return torch.load(pathlib.Path(folder) / "optimizer.pt", weights_only=True,
                      map_location=map_location)


def saved_rng_state(trainer_state: dict, rank: int, world_size: int) -> dict:
    """This rank's saved RNG state: its own if all ranks' were saved (torchrun), else rank 0's."""
    per_rank = trainer_state.get("rng_per_rank") or []
    if len(per_rank) == world_size:
        return per_rank[rank]
    return trainer_state["rng"]


def clean_interrupted_saves(run_dir) -> None:
    """A save killed half-way (in checkpoints/, the run folder, R-Zero's roles/) leaves
    .tmp-<name>-<pid>/ (deleted); one killed between its two renames leaves .old-<name>-<pid>/
    without <name>/ (put back)."""
    run_dir = pathlib.Path(run_dir)
    for root in (run_dir / "checkpoints", run_dir, run_dir / "roles"):
        for old in sorted(root.glob(".old-*")):
            name = old.name[len(".old-"):].rsplit("-", 1)[0]
            if not (root / name).exists():
                os.replace(old, root / name)
        leftovers = [*root.glob(".old-*"), *root.glob(".tmp-*")]
        for leftover in leftovers:
            shutil.rmtree(leftover, ignore_errors=True)


def load_safetensors_dir(path) -> dict:
    """A folder's *.safetensors tensors on the CPU, mapped privately (page cache, not our RAM)."""
    from safetensors.torch import load_file
    files = sorted(pathlib.Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (an incomplete or non-safetensors "
                                "checkpoint?)")
    tensors = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors
