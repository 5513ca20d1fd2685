"""GPU benchmark of the training path: one command, about 7 minutes on one H200 (not a test).

    python tests/bench_gpu.py --out bench_gpu.json   # one GPU; torch + transformers; no vLLM, hub
    python tests/bench_gpu.py --models qwen3-4b --budget-s 200
    python tests/bench_gpu.py --dry-run              # CPU, tiny sizes: every code path, < 1 minute

Real-size architectures with random weights, nothing downloaded: Qwen3-4B-Base (SPICE),
Qwen3-1.7B-Base (small runs; R-Zero's Solver batch) and Qwen2.5-Coder-7B (Absolute Zero). Each is
built by ``Policy.load`` with the HF backend; only the weight source is replaced, so the dtype,
bf16 autocast over fp32 master weights and gradient checkpointing resolve as in a real run. Per
model, on a batch of the paper's shape:

1. ``pg_step`` with and without gradient checkpointing: completion tokens/s, model FLOP/s and MFU
   against the GPU's bf16 dense peak, peak memory. pg_step's no-grad pass (pi_old, entropy) is
   timed alone.
2. A plain PyTorch step on the same batch and micro-batches: one forward with full logits,
   cross-entropy weighted by the advantages, backward, AdamW (the policy's own optimizer). Ours /
   plain for time and peak memory, and, where ours is slower, which phase costs more.
3. HF ``generate`` (the policy's HFSampler) on the same prompts and groups: tokens/s. Then the
   trainer's log-probs of the sampled tokens against the sampler's (both bf16), and against an fp32
   trainer pass.
4. Peak memory against README.md's memory table, and the largest micro-batch that fits (a bounded
   search that catches CUDA OOM). With micro-batching, the sequences per step are not bounded by
   memory.

Every measurement first checks a global time budget and is skipped (reported as skipped) when it
would not fit, so a JSON always comes out. It is rewritten after each measurement (--out), and a
watchdog writes it and exits if a measurement overruns the budget by more than --hard-grace-s. The
4B model goes first. Where fp32 master weights do not fit (the 7B: 16 bytes per parameter, plus
AdamW's foreach temporaries), the model is measured again with bf16 weights (--dtype bfloat16
--autocast off), and reported as such.
"""
import time

T_START = time.monotonic()  # the budget clock starts before the heavy imports

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from unittest import mock  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

import common  # noqa: E402

GB = 1e9  # memory in GB of 1e9 bytes, as README's table writes it
OOM = torch.OutOfMemoryError

# The MFU denominator, bf16 dense tensor-core peak. NVIDIA's datasheets state it with 2:4 sparsity;
# dense is half. Matched against torch.cuda.get_device_name(), first match wins.
_DENSE = "BF16 Tensor Core {} TFLOPS with sparsity, dense is half"
PEAK_TFLOPS = [
    ("H200 NVL", 835.5, "NVIDIA H200 NVL datasheet: " + _DENSE.format("1,671")),
    ("H200", 989.5, "NVIDIA H200 SXM datasheet: " + _DENSE.format("1,979")),
    ("H100 NVL", 835.5, "NVIDIA H100 NVL datasheet: " + _DENSE.format("1,671")),
    ("H100 PCIe", 756.5, "NVIDIA H100 PCIe datasheet: " + _DENSE.format("1,513")),
    ("H100", 989.5, "NVIDIA H100 SXM datasheet: " + _DENSE.format("1,979")),
]

FLOPS_FORMULA = (
    "F_fwd = sum over sequences of [2*N_body*S + 2*N_head*H + 2*n_layers*n_heads*head_dim*S^2];"
    " S = prompt + completion tokens; H = completion tokens (pg_step applies the LM head to"
    " completion positions only) or S (plain step: full logits); N_body = parameters outside the"
    " embedding and LM head, N_head = vocab x hidden; the S^2 term is causal attention (QK^T and AV"
    " over half of the S x S scores). pg_step with U updates = (1 + 3U) x F_fwd (its no-grad pass,"
    " then 6*N*tokens plus attention per update); plain step = 3 x F_fwd. Recomputation (gradient"
    " checkpointing, the checkpointed LM-head chunks) is not counted: model FLOPs as in PaLM"
    " (Chowdhery et al. 2022, App. B). MFU = model FLOPs / time / peak.")


# --------------------------------------------------------------------------------------------------
# The models and the batch shapes
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Shape:
    paper: str            # whose batch this is, with its source
    prompts: int          # distinct prompts (GRPO groups)
    group: int            # samples per prompt
    prompt_len: int
    completion_len: int
    pg: dict              # the method's PGConfig fields (temperature 1.0 everywhere)
    kl_coef: float = 0.0  # > 0: also time one pg_step with the KL reference pass (R-Zero)


MODELS = {
    "qwen3-4b": dict(
        name="Qwen3-4B-Base", nominal_b=4.0, card=(4.0e9, 3.6e9),  # card: 4.0B, 3.6B non-embedding
        source="huggingface.co/Qwen/Qwen3-4B-Base/blob/main/config.json",
        config=dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, max_position_embeddings=32768, rope_theta=1000000.0,
                    rms_norm_eps=1e-6,
                    tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643),
        shape=Shape("SPICE: 8 documents x G=8 (SPICE §3.1, Table 5); 1,024 + 1,024 tokens (ours)",
                    8, 8, 1024, 1024, dict(aggregation="drgrpo", max_len=1024))),
    "qwen3-1.7b": dict(
        name="Qwen3-1.7B-Base", nominal_b=1.7, card=(1.7e9, 1.4e9),  # card: 1.7B, 1.4B non-emb.
        source="huggingface.co/Qwen/Qwen3-1.7B-Base/blob/main/config.json",
        config=dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                    head_dim=128, max_position_embeddings=32768, rope_theta=1000000.0,
                    rms_norm_eps=1e-6,
                    tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643),
        shape=Shape("R-Zero Solver: 12 questions x G=5 (R-Zero examples/config.yaml, n=5);"
                    " 512 + 1,536 tokens (ours; the limits are 2,048 / 4,096)", 12, 5, 512, 1536,
                    dict(aggregation="seq-mean-token-mean", clip_high=0.3, dual_clip=3.0),
                    kl_coef=0.01)),
    "qwen2.5-coder-7b": dict(
        name="Qwen2.5-Coder-7B", nominal_b=7.0, card=(7.61e9, 6.53e9),  # card: 7.61B, 6.53B n.-e.
        source="huggingface.co/Qwen/Qwen2.5-Coder-7B/blob/main/config.json",
        config=dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                    intermediate_size=18944,
                    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                    max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, use_sliding_window=False, bos_token_id=151643,
                    eos_token_id=151643),
        shape=Shape("Absolute Zero: 32 trajectories, one rollout each (a quarter of the"
                    " 128-trajectory mini-batch of AZR scripts/selfplay/coder7b.sh);"
                    " 1,024 + 1,024 tokens (ours)",
                    32, 1, 1024, 1024,
                    dict(aggregation="seq-mean-token-mean", entropy_coef=0.001, max_len=1024))),
}

PRECISIONS = {
    "fp32-master": "fp32 master weights and AdamW state, bf16 autocast compute (the GPU default)",
    "bf16": "bf16 weights and AdamW state, no autocast (--dtype bfloat16 --autocast off)",
}

DRY_SEQ = 12 + 10  # the dry run's prompt + completion tokens (tiny_shape)


def tiny_arch(config: dict, vocab: int) -> dict:
    """The dry run's version of an architecture: the tiny test model's sizes, the rest kept."""
    return {**config, "vocab_size": vocab, "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64}


def tiny_shape(shape: Shape) -> Shape:
    """The dry run's batch: 6 (or 4) sequences of 12 + 10 tokens, the method's loss kept."""
    pg = {**shape.pg, "max_len": 10} if "max_len" in shape.pg else dict(shape.pg)
    return dataclasses.replace(shape, prompts=2 if shape.group > 1 else 4,
                               group=min(shape.group, 3), prompt_len=12, completion_len=10, pg=pg)


def param_counts(model) -> dict:
    """Parameter counts for the FLOP formula; a tied LM head is counted once in `total`."""
    cfg = model.config
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head is emb
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {"total": total, "non_embedding": total - emb.numel(),
            "body": total - emb.numel() - (0 if tied else head.numel()), "head": head.numel(),
            "tied": tied, "layers": cfg.num_hidden_layers,
            "attn_width": cfg.num_attention_heads * head_dim}


def forward_flops(counts: dict, seqs: list, full_logits: bool = False) -> float:
    """F_fwd of FLOPS_FORMULA for sequences given as (prompt tokens, completion tokens)."""
    total = 0.0
    for p, r in seqs:
        s = p + r
        total += (2 * counts["body"] * s + 2 * counts["head"] * (s if full_logits else r)
                  + 2 * counts["layers"] * counts["attn_width"] * s * s)
    return total


def readme_memory(path: pathlib.Path) -> dict:
    """README.md's memory table (model size, GPUs, GB per GPU, training state GB) and its bytes per
    parameter rule."""
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    rule = re.search(r"about (\d+) bytes per\s+parameter", text)
    row = r"^\|\s*([\d.]+)B\s*\|\s*(\d+)\s*x\s*([\d.]+)\s*GB[^|]*\|\s*~?\s*([\d.]+)\s*GB\s*\|"
    rows = [{"model_b": float(m[0]), "gpus": int(m[1]), "gpu_gb": float(m[2]),
             "state_gb": float(m[3])} for m in re.findall(row, text, flags=re.M)]
    return {"bytes_per_param": float(rule.group(1)) if rule else None, "rows": rows}


def largest_fit(probe, known_fit: int, cap: int, max_probes: int) -> dict:
    """Largest m in [1, cap] with probe(m) True (fits); False is an OOM; None stops (no budget).

    Doubling from known_fit (0: none known) until an OOM or cap, then bisection until the gap is at
    most an eighth of the fit; at most max_probes calls. Assumes fitting is monotone in m."""
    lo, hi, probes = known_fit, None, []
    m = min(cap, max(1, 2 * known_fit))
    while len(probes) < max_probes and m > lo and (hi is None or m < hi):
        ok = probe(m)
        if ok is None:
            break
        probes.append([m, bool(ok)])
        if ok:
            lo = m
        else:
            hi = m
        if hi is None:
            if m >= cap:
                break
            m = min(cap, 2 * m)
        elif hi - lo <= max(1, lo // 8):
            break
        else:
            m = (lo + hi) // 2
    close = hi is not None and hi - lo <= max(1, lo // 8)
    return {"largest_fit": lo, "first_oom": hi, "capped": hi is None and lo >= cap,
            "resolved": close or (hi is None and lo >= cap), "probes": probes}


class SimulatedMemory:
    """--dry-run only: raises CUDA's OOM error where a small GPU would run out, so that the OOM
    handling, the largest-fit search and the bf16 fallback run on the CPU. Out of memory: a
    micro-batch over `max_tokens` padded tokens, or fp32 master weights of a model in `fp32_oom`."""

    def __init__(self, max_tokens: int, fp32_oom: set):
        self.max_tokens, self.fp32_oom = max_tokens, fp32_oom

    def check(self, key: str, precision: str, mb_tokens: int) -> None:
        if mb_tokens > self.max_tokens or (precision == "fp32-master" and key in self.fp32_oom):
            raise OOM(f"simulated out of memory (dry run): {key}, {precision}, "
                      f"{mb_tokens} tokens per micro-batch")


# --------------------------------------------------------------------------------------------------
# Budget, results, JSON
# --------------------------------------------------------------------------------------------------
def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def rnd(x, nd=3):
    return None if x is None else round(float(x), nd)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def cuda_gb(what: str):
    """torch.cuda.<what>() in GB, or None on the CPU (no per-step peak there)."""
    return rnd(getattr(torch.cuda, what)() / GB, 2) if torch.cuda.is_available() else None


class Bench:
    def __init__(self, args):
        self.args = args
        self.deadline = T_START + args.budget_s
        self.lock = threading.RLock()
        self.current = "start"
        self.rate = None  # FLOP/s of the latest timed training step, for the estimates
        self.policy = None  # the policy under test, whose gradients an OOM may leave behind
        self.res = {"bench": "tests/bench_gpu.py", "dry_run": args.dry_run,
                    "budget_s": args.budget_s, "flops_formula": FLOPS_FORMULA,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "memory_unit": "GB = 1e9 bytes (as README); peak: max_memory_allocated",
                    "models": {}, "skipped": [], "errors": []}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - T_START

    def est_train(self, flops: float) -> float:
        rate = self.rate or (250e12 if torch.cuda.is_available() else 5e9)
        return 1.0 + 1.3 * flops / rate

    def model(self, key: str) -> dict:
        return self.res["models"].setdefault(key, {"measurements": {}})

    def run(self, key: str, name: str, est_s: float, fn, reserve_s: float = 0.0, into=None) -> dict:
        """fn() -> dict as measurement `name` of model `key`, if est_s (plus reserve_s kept for
        later models) fits the budget. Records ok / oom / error / skipped in `into` (default: the
        model's measurements) and rewrites the JSON."""
        if est_s + reserve_s > self.left():
            rec = {"status": "skipped", "reason": f"budget: needs ~{est_s:.0f} s"
                   + (f" + {reserve_s:.0f} s kept for later models" if reserve_s else "")
                   + f", {max(0.0, self.left()):.0f} s left"}
            self.res["skipped"].append(f"{key}/{name}: {rec['reason']}")
        else:
            self.current = f"{key}/{name}"
            log(f"[{self.elapsed():6.1f} s] {self.current} (~{est_s:.0f} s, "
                f"{self.left():.0f} s left)")
            t0 = time.monotonic()
            err = None
            try:
                rec = fn()
                rec.setdefault("status", "ok")
            except OOM as e:
                rec = {"status": "oom", "error": first_line(e)}
            except Exception as e:  # noqa: BLE001 -- one failing measurement must not lose the rest
                err = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:])[-1500:]
                rec = {"status": "error", "error": f"{type(e).__name__}: {e}"[:300]}
            if rec["status"] != "ok" and self.policy is not None:
                self.policy.optimizer.zero_grad(set_to_none=True)  # gradients of a step cut short
            free_memory()
            rec["wall_s"] = round(time.monotonic() - t0, 2)
            if err:
                self.res["errors"].append(f"{key}/{name}: {err}")
            self.current = "between measurements"
        with self.lock:
            (self.model(key)["measurements"] if into is None else into)[name] = rec
            self.save()
        return rec

    def save(self) -> None:
        with self.lock:
            self.res["elapsed_s"] = round(self.elapsed(), 1)
            if self.args.out:
                common.atomic_write_json(self.args.out, self.res)

    def abort_report(self) -> str:
        """The watchdog's work when a measurement overruns: mark, write and return the JSON."""
        self.lock.acquire(timeout=5)
        a = self.args
        self.res["aborted"] = (f"hard deadline ({a.budget_s:.0f} + {a.hard_grace_s:.0f} s) passed"
                               f" during {self.current}")
        self.save()
        return json.dumps(condensed(self), default=str)


# --------------------------------------------------------------------------------------------------
# Building a policy with random weights
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Ctx:
    """One model under test: its Policy, batch and bookkeeping."""
    key: str
    shape: Shape
    policy: object
    precision: str
    counts: dict
    mb_tokens: int
    sim: SimulatedMemory | None
    trajs: list = dataclasses.field(default_factory=list)
    mb_used: dict = dataclasses.field(default_factory=dict)  # "gc"/"nogc" -> micro-batch that fit

    @property
    def seq_len(self) -> int:
        return self.shape.prompt_len + self.shape.completion_len

    def check(self, mb_tokens: int) -> None:
        if self.sim is not None:
            self.sim.check(self.key, self.precision, mb_tokens)


def _random_from_pretrained(path, *args, dtype=None, **kwargs):
    """Stands in for AutoModelForCausalLM.from_pretrained inside Policy.load: the architecture of
    path/config.json with random weights, initialised on the device (no weights file, no hub)."""
    config = transformers.AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    with torch.device(common.default_device()):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def build_policy(folder: pathlib.Path, arch: dict, tokenizer, precision: str, mb_tokens: int,
                 max_len: int):
    """Policy.load on a folder holding only config.json and a tokenizer; the weights are random."""
    folder.mkdir(parents=True, exist_ok=True)
    transformers.AutoConfig.for_model(**arch).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    if precision == "fp32-master":  # on the CPU "auto" means no autocast: ask for what the GPU gets
        dtype, autocast = "auto", ("auto" if torch.cuda.is_available() else "bfloat16")
    else:
        dtype, autocast = "bfloat16", "off"
    cfg = common.RunConfig(model=str(folder), output_dir=str(folder / "run"), backend="hf",
                           dtype=dtype, autocast=autocast, gradient_checkpointing=True, lr=1e-6,
                           micro_batch_tokens=mb_tokens, max_model_len=max_len, seed=0)
    with mock.patch.object(transformers.AutoModelForCausalLM, "from_pretrained",
                           _random_from_pretrained):
        return common.Policy.load(cfg)


def set_checkpointing(policy, on: bool) -> None:
    if on:  # the call Policy.load makes
        policy.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        policy.model.gradient_checkpointing_disable()


def make_batch(shape: Shape, vocab: int, n: int | None = None, seed: int = 0) -> list:
    """A GRPO-shaped batch: `shape.group` completions per prompt, random token ids (no special
    tokens), rewards alternating 0/1 in each group, so every advantage (group_advantages) is
    non-zero."""
    n = shape.prompts * shape.group if n is None else n
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (shape.prompt_len,), generator=g).tolist()
               for _ in range(-(-n // shape.group))]
    groups = [i // shape.group for i in range(n)]
    rewards = [float(i % 2) for i in range(n)]
    adv = (common.group_advantages(rewards, groups) if shape.group > 1
           else torch.tensor(rewards) - 0.5)
    return [common.Trajectory(prompt_ids=prompts[groups[i]],
                              completion_ids=torch.randint(3, vocab, (shape.completion_len,),
                                                           generator=g).tolist(),
                              reward=rewards[i], advantage=float(adv[i]), role="bench")
            for i in range(n)]


# --------------------------------------------------------------------------------------------------
# The steps
# --------------------------------------------------------------------------------------------------
def pg_config(shape: Shape, **kw):
    return common.PGConfig(temperature=1.0, **{**shape.pg, **kw})


def with_mfu(bench: "Bench", rec: dict) -> dict:
    """MFU against the datasheet peak, and the share of the bf16 matmul rate measured here."""
    peak = bench.res.get("peak_tflops")
    ceiling = bench.res.get("matmul_bf16", {}).get("tflops")
    if peak and rec.get("tflops") is not None:
        rec["mfu"] = rnd(rec["tflops"] / peak, 4)
    if ceiling and rec.get("tflops") is not None:
        rec["of_measured_matmul"] = rnd(rec["tflops"] / ceiling, 4)
    return rec


def ours_step(bench: Bench, ctx: Ctx, trajs: list, mb_tokens: int, pg=None, ref=None) -> dict:
    """One common.pg_step, timed from outside (synchronised), with its peak memory."""
    ctx.check(mb_tokens)
    ctx.policy.cfg.micro_batch_tokens = mb_tokens
    pg = pg or pg_config(ctx.shape)
    seqs = [(len(t.prompt_ids), len(t.completion_ids)) for t in trajs]
    flops = (1 + 3 * pg.updates_per_batch) * forward_flops(ctx.counts, seqs)
    n_comp = sum(r for _, r in seqs)
    sync()
    reset_peak()
    t0 = time.perf_counter()
    stats = common.pg_step(ctx.policy, trajs, pg, ref_weights=ref)
    sync()
    dt = time.perf_counter() - t0
    return {"time_s": rnd(dt), "completion_tokens": n_comp,
            "completion_tokens_per_s": rnd(n_comp / dt, 1), "flops": flops,
            "tflops": rnd(flops / dt / 1e12, 2), "peak_gb": cuda_gb("max_memory_allocated"),
            "peak_reserved_gb": cuda_gb("max_memory_reserved"),
            "allocated_after_gb": cuda_gb("memory_allocated"), "micro_batch_tokens": mb_tokens,
            "loss": rnd(stats.get("loss"), 6), "grad_norm": rnd(stats.get("grad_norm"), 6)}


def plain_step(bench: Bench, ctx: Ctx, trajs: list, mb_tokens: int) -> dict:
    """The baseline. Per micro-batch: one forward with full logits over every position,
    cross-entropy of the completion tokens weighted by the advantages (token-mean), backward; then
    clip and AdamW. Same model, optimizer, precision, checkpointing and micro-batches as pg_step; no
    no-grad pass and no chunked LM head."""
    ctx.check(mb_tokens)
    model, opt = ctx.policy.model, ctx.policy.optimizer
    dev = next(model.parameters()).device
    dtype = getattr(ctx.policy.model, "selfplay_autocast", None)  # set by Policy.load
    compute = (torch.autocast(dev.type, dtype=dtype) if dtype is not None
               else contextlib.nullcontext())
    p_len, r_len = len(trajs[0].prompt_ids), len(trajs[0].completion_ids)
    if any(len(t.prompt_ids) != p_len or len(t.completion_ids) != r_len for t in trajs):
        raise ValueError("plain_step takes equal-length sequences only")
    per_mb = max(1, mb_tokens // (p_len + r_len))
    m_tok = len(trajs) * r_len
    flops = 3 * forward_flops(ctx.counts, [(p_len, r_len)] * len(trajs), full_logits=True)
    sync()
    reset_peak()
    t_fwd = t_bwd = 0.0
    t_start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    for s in range(0, len(trajs), per_mb):
        mb = trajs[s:s + per_mb]
        t0 = time.perf_counter()
        ids = torch.tensor([t.prompt_ids + t.completion_ids for t in mb], device=dev)
        adv = torch.tensor([t.advantage for t in mb], device=dev)
        with compute:
            logits = model(input_ids=ids, use_cache=False).logits  # [b, S, V]: every position
        logits = logits[:, p_len - 1:-1].float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, p_len:].reshape(-1),
                             reduction="none").view(len(mb), r_len)
        loss = (ce * adv[:, None]).sum() / m_tok  # -(A * log p), token-mean
        sync()
        t1 = time.perf_counter()
        loss.backward()
        del logits, ce, loss
        sync()
        t_fwd, t_bwd = t_fwd + t1 - t0, t_bwd + time.perf_counter() - t1
    t0 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                   ctx.policy.cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    t_opt = time.perf_counter() - t0
    dt = time.perf_counter() - t_start
    return {"time_s": rnd(dt), "forward_loss_s": rnd(t_fwd), "backward_s": rnd(t_bwd),
            "adamw_s": rnd(t_opt), "completion_tokens_per_s": rnd(m_tok / dt, 1), "flops": flops,
            "tflops": rnd(flops / dt / 1e12, 2), "peak_gb": cuda_gb("max_memory_allocated"),
            "peak_reserved_gb": cuda_gb("max_memory_reserved"), "micro_batch_tokens": mb_tokens}


def train_measure(bench: Bench, ctx: Ctx, gc_on: bool, step) -> dict:
    """Warm-up on one micro-batch (on OOM the micro-batch is halved, at most twice), then the timed
    step on the whole batch. `step` is ours_step or plain_step (at the micro-batch ours fitted)."""
    set_checkpointing(ctx.policy, gc_on)
    mode = "gc" if gc_on else "nogc"
    mb = ctx.mb_used.get(mode, ctx.mb_tokens) if step is plain_step else ctx.mb_tokens
    ooms = []
    for attempt in range(3):
        try:
            step(bench, ctx, ctx.trajs[:max(1, min(len(ctx.trajs), mb // ctx.seq_len))], mb)
            break
        except OOM as e:
            ooms.append({"micro_batch_tokens": mb, "error": first_line(e)})
        ctx.policy.optimizer.zero_grad(set_to_none=True)
        free_memory()
        if attempt == 2 or mb // 2 < ctx.seq_len:
            raise OOM(f"warm-up out of memory at micro-batches of "
                      f"{[o['micro_batch_tokens'] for o in ooms]} tokens: {ooms[-1]['error']}")
        mb //= 2
    rec = step(bench, ctx, ctx.trajs, mb)
    if step is ours_step:
        ctx.mb_used[mode] = mb
        bench.rate = rec["flops"] / rec["time_s"]
    rec["gradient_checkpointing"] = gc_on
    if ooms:
        rec["oom_before"] = ooms
    return with_mfu(bench, rec)


def nograd_measure(bench: Bench, ctx: Ctx) -> dict:
    """pg_step's first phase alone: token_logprobs with the entropy, no grad, same micro-batches."""
    mb = ctx.mb_used.get("gc", ctx.mb_tokens)
    ctx.check(mb)
    prompts, comps = [t.prompt_ids for t in ctx.trajs], [t.completion_ids for t in ctx.trajs]
    flops = forward_flops(ctx.counts, [(len(p), len(c)) for p, c in zip(prompts, comps)])
    sync()
    reset_peak()
    t0 = time.perf_counter()
    with torch.no_grad():
        common.token_logprobs(ctx.policy.model, prompts, comps, temperature=1.0, token_budget=mb,
                              with_entropy=True)
    sync()
    dt = time.perf_counter() - t0
    return with_mfu(bench, {"time_s": rnd(dt), "tflops": rnd(flops / dt / 1e12, 2),
                            "peak_gb": cuda_gb("max_memory_allocated"), "micro_batch_tokens": mb})


def compare(ours: dict, plain: dict, nograd: dict) -> dict:
    """Ours / plain for time and peak memory; where ours is slower, which phase costs more."""
    if ours.get("status") != "ok" or plain.get("status") != "ok":
        return {"status": "skipped", "reason": "needs both steps measured"}
    out = {"time_ratio": rnd(ours["time_s"] / plain["time_s"]),
           "memory_ratio": rnd(ours["peak_gb"] / plain["peak_gb"])
           if ours.get("peak_gb") and plain.get("peak_gb") else None,
           "micro_batch_tokens": [ours["micro_batch_tokens"], plain["micro_batch_tokens"]]}
    ng = nograd.get("time_s") if nograd.get("status") == "ok" else None
    if ng is not None:
        update = ours["time_s"] - ng
        out.update(ours_nograd_s=ng, ours_update_s=rnd(update), plain_s=plain["time_s"],
                   time_ratio_without_nograd=rnd(update / plain["time_s"]))
    if out["time_ratio"] > 1.05:
        if ng is None:
            out["slower_phase"] = "unknown (the no-grad pass was not timed)"
        else:
            what = ("the no-grad pass (pi_old and the exact entropy; the plain step has none)"
                    if ng >= update - plain["time_s"] else
                    "the update pass (forward, checkpointed LM-head chunks, backward, AdamW)")
            out["slower_phase"] = (
                f"{what}: no-grad pass {ng:.2f} s; update pass {update:.2f} s vs plain "
                f"{plain['time_s']:.2f} s (forward+loss {plain['forward_loss_s']:.2f}, backward "
                f"{plain['backward_s']:.2f}, AdamW {plain['adamw_s']:.2f})")
    return out


def generate_measure(bench: Bench, ctx: Ctx, store: dict, reserve_s: float) -> dict:
    """policy.generate (HFSampler: samples from the trainer module under its autocast) on the
    batch's prompts x group at T=1. A short call first (warm-up, time per token), then as many new
    tokens as the completion length and the budget (less reserve_s) allow."""
    shape = ctx.shape
    prompts = list({id(t.prompt_ids): t.prompt_ids for t in ctx.trajs}.values())  # one per group
    short = min(bench.args.gen_probe_tokens, shape.completion_len)
    sync()
    t0 = time.perf_counter()
    ctx.policy.generate(prompts, n=shape.group, temperature=1.0, max_tokens=short, seed=0)
    sync()
    per_token = (time.perf_counter() - t0) / short
    want = min(bench.args.gen_tokens, shape.completion_len)
    tokens = max(short, min(want, int(max(0.0, bench.left() - reserve_s) / (1.3 * per_token))))
    sync()
    reset_peak()
    t0 = time.perf_counter()
    out = ctx.policy.generate(prompts, n=shape.group, temperature=1.0, max_tokens=tokens, seed=1)
    sync()
    dt = time.perf_counter() - t0
    comps = [c for group in out for c in group]
    n_new = sum(len(c.token_ids) for c in comps)
    store.update(prompts=[c.prompt_ids for c in comps], comps=[c.token_ids for c in comps],
                 lps=[c.logprobs for c in comps])
    return {"sequences": len(comps), "prompt_len": shape.prompt_len, "max_new_tokens": tokens,
            "max_new_tokens_wanted": want, "new_tokens": n_new, "time_s": rnd(dt),
            "tokens_per_s": rnd(n_new / dt, 1), "ms_per_step": rnd(1000 * dt / max(1, tokens), 2),
            "peak_gb": cuda_gb("max_memory_allocated")}


def _abs_diff_stats(a: list, b: list) -> dict:
    d = torch.cat([(x.float().cpu() - y.float().cpu()).abs() for x, y in zip(a, b)])
    if d.numel() == 0:
        return {"tokens": 0}
    q = torch.quantile(d[:1_000_000], torch.tensor([0.5, 0.99])).tolist()
    return {"tokens": d.numel(), "mean": rnd(d.mean(), 6), "p50": rnd(q[0], 6), "p99": rnd(q[1], 6),
            "max": rnd(d.max(), 6)}


def agreement_measure(bench: Bench, ctx: Ctx, store: dict) -> dict:
    """The trainer's log-probs (token_logprobs under bf16 autocast, as in pg_step) of the tokens HF
    generate sampled, against the log-probs generate scored them with; then an fp32 trainer pass
    (autocast off) over the first few sequences as the reference for both."""
    if not store.get("comps"):
        return {"status": "skipped", "reason": "no generated samples"}
    mb = ctx.mb_used.get("gc", ctx.mb_tokens)
    model = ctx.policy.model
    samp = [torch.tensor(x) for x in store["lps"]]
    with torch.no_grad():
        lp, _ = common.token_logprobs(model, store["prompts"], store["comps"], temperature=1.0,
                                      token_budget=mb)
    rec = {"trainer_vs_sampler": _abs_diff_stats(lp, samp),
           "mean_logprob": rnd(torch.cat([x.float().cpu() for x in lp]).mean(), 4),
           "note": "random weights give flatter logits than a trained model's; its bf16 gaps are"
                   " larger"}
    core = ctx.policy.model
    compute = getattr(core, "selfplay_autocast", None)
    k = min(bench.args.fp32_seqs, len(store["comps"]))
    if compute is not None and k:
        core.selfplay_autocast = None  # read by common's forward passes: the same pass, no autocast
        try:
            with torch.no_grad():
                ref, _ = common.token_logprobs(model, store["prompts"][:k], store["comps"][:k],
                                               temperature=1.0, token_budget=mb)
        finally:
            core.selfplay_autocast = compute
        rec.update(fp32_reference_seqs=k, trainer_bf16_vs_fp32=_abs_diff_stats(lp[:k], ref),
                   sampler_vs_fp32=_abs_diff_stats(samp[:k], ref))
    return rec


def memory_vs_readme(bench: Bench, counts: dict, spec: dict, meas: dict) -> dict:
    """Peak of the timed pg_step against README's table: its row for this size on one GPU, else its
    bytes-per-parameter rule (the table gives training state: weights, gradients, AdamW moments)."""
    table = bench.res["readme_memory"]
    rows = [r for r in table["rows"] if r["model_b"] == spec["nominal_b"] and r["gpus"] == 1]
    bpp = table["bytes_per_param"] or 16.0
    out = {"rule_gb": rnd(bpp * counts["total"] / GB, 1),
           "rule": f"{bpp:g} bytes x {counts['total']:,}"}
    if rows:
        out["readme_row"] = rows[0]
    out["compared_with_gb"] = ref = rows[0]["state_gb"] if rows else out["rule_gb"]
    for mode in ("gc", "nogc"):
        m = meas.get(f"pg_step_{mode}", {})
        if m.get("status") == "ok" and m.get("peak_gb") is not None:
            out[f"peak_gb_{mode}"] = m["peak_gb"]
            out[f"persistent_gb_{mode}"] = m.get("allocated_after_gb")  # weights + AdamW moments
            out[f"ratio_{mode}"] = rnd(m["peak_gb"] / ref)
            out[f"within_10pct_{mode}"] = abs(m["peak_gb"] / ref - 1) <= 0.10
    return out


def search_measure(bench: Bench, ctx: Ctx, gc_on: bool, reserve_s: float) -> dict:
    """Largest micro-batch (sequences of the shape's length, one micro-batch a step) that fits."""
    set_checkpointing(ctx.policy, gc_on)
    mode = "gc" if gc_on else "nogc"
    vocab = ctx.policy.model.config.vocab_size
    timed = bench.model(ctx.key)["measurements"].get(f"pg_step_{mode}", {})
    per_token = [timed["time_s"] / (len(ctx.trajs) * ctx.seq_len)] if timed.get("time_s") else [0.0]
    peaks = {}

    def probe(m: int):
        if 2.0 + 1.3 * per_token[0] * m * ctx.seq_len + reserve_s > bench.left():
            return None
        try:
            rec = ours_step(bench, ctx, make_batch(ctx.shape, vocab, n=m, seed=m), m * ctx.seq_len)
        except OOM:
            ctx.policy.optimizer.zero_grad(set_to_none=True)
            free_memory()
            return False
        per_token[0] = rec["time_s"] / (m * ctx.seq_len)
        peaks[str(m)] = rec["peak_gb"]
        return True

    res = largest_fit(probe, ctx.mb_used.get(mode, 0) // ctx.seq_len, bench.args.search_cap,
                      bench.args.search_probes)
    res.update(gradient_checkpointing=gc_on, seq_len=ctx.seq_len,
               largest_micro_batch_tokens=res["largest_fit"] * ctx.seq_len, peak_gb_by_seqs=peaks)
    return res


def kl_measure(bench: Bench, ctx: Ctx) -> dict:
    """R-Zero's pg_step with the KL term: reference weights on the CPU (get_weights), swapped into
    the trainer for one more no-grad pass."""
    set_checkpointing(ctx.policy, True)
    t0 = time.perf_counter()
    ref = ctx.policy.get_weights()
    t_get = time.perf_counter() - t0
    rec = ours_step(bench, ctx, ctx.trajs, ctx.mb_used.get("gc", ctx.mb_tokens),
                    pg=pg_config(ctx.shape, kl_coef=ctx.shape.kl_coef), ref=ref)
    del ref
    rec.update(get_weights_s=rnd(t_get), kl_coef=ctx.shape.kl_coef,
               note="FLOPs do not count the reference pass")
    return with_mfu(bench, rec)


def matmul_measure(bench: Bench) -> dict:
    """The bf16 matrix rate on random data here: a reachable ceiling beside the datasheet's peak."""
    n = 8192 if torch.cuda.is_available() else 256
    dev = common.default_device()
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    return {"n": n, "tflops": rnd(2 * n ** 3 / ((time.perf_counter() - t0) / 10) / 1e12, 1)}


# --------------------------------------------------------------------------------------------------
# Per model, then the summary
# --------------------------------------------------------------------------------------------------
def core_estimate(bench: Bench, spec: dict, shape: Shape) -> float:
    """Rough seconds of a model's must-have measurements (build, two pg_steps, plain, generate)."""
    if bench.args.dry_run:
        return 5.0
    n = spec["card"][0]
    tokens = shape.prompts * shape.group * (shape.prompt_len + shape.completion_len)
    step = bench.est_train(8 * n * tokens)
    return 30.0 + n * 4 / 20e9 + 3.4 * step


def bench_model(bench: Bench, key: str, spec: dict, shape: Shape, arch: dict, tokenizer, workdir,
                reserve_s: float) -> None:
    args = bench.args
    entry = bench.model(key)
    entry.update(name=spec["name"], source=spec["source"], architecture=arch,
                 shape=dataclasses.asdict(shape))
    meas = entry["measurements"]
    sim = SimulatedMemory(args.sim_max_tokens, {"qwen2.5-coder-7b"}) if args.dry_run else None
    seq = shape.prompt_len + shape.completion_len
    mb_tokens = max(seq, args.micro_batch_tokens)
    holder = {}

    def build(precision):
        def fn():
            t0 = time.perf_counter()
            policy = build_policy(pathlib.Path(workdir) / f"{key}-{precision}", arch, tokenizer,
                                  precision, mb_tokens, seq + 8)
            sync()
            counts = param_counts(policy.model)
            ctx = Ctx(key, shape, policy, precision, counts, mb_tokens, sim)
            ctx.trajs = make_batch(shape, arch["vocab_size"])
            holder["ctx"], bench.policy = ctx, policy
            p = next(policy.model.parameters())
            auto = getattr(policy.model, "selfplay_autocast", None)
            entry.update(precision=precision, precision_label=PRECISIONS[precision], params=counts,
                         card_params=spec["card"])
            return {"time_s": rnd(time.perf_counter() - t0), "param_dtype": str(p.dtype),
                    "device": str(p.device), "autocast": str(auto),
                    "allocated_gb": cuda_gb("memory_allocated"),
                    "fp32_master_bf16_autocast": p.dtype == torch.float32
                    and auto == torch.bfloat16}
        return fn

    n = spec["card"][0]
    bench.run(key, "build", 5.0 + n * 4 / 20e9, build("fp32-master"))
    if "ctx" not in holder:
        return
    ctx = holder["ctx"]
    flops_step = 4 * forward_flops(ctx.counts, [(shape.prompt_len, shape.completion_len)]
                                   * len(ctx.trajs))
    rec = bench.run(key, "pg_step_gc", 1.4 * bench.est_train(flops_step),
                    lambda: train_measure(bench, ctx, True, ours_step))
    if rec["status"] == "oom" and args.fallback_bf16:
        meas["pg_step_gc_fp32_master"] = meas.pop("pg_step_gc")
        entry["fp32_master"] = {"status": "oom", "error": rec.get("error"),
                                "state_gb_16_bytes_per_param": rnd(16 * ctx.counts["total"] / GB,
                                                                   1)}
        ctx = None  # the fp32 model goes before the bf16 one is built
        holder.clear()
        bench.policy = None
        free_memory()
        bench.run(key, "build_bf16", 5.0 + n * 2 / 20e9, build("bf16"))
        if "ctx" not in holder:
            return
        ctx = holder["ctx"]
        rec = bench.run(key, "pg_step_gc", 1.4 * bench.est_train(flops_step),
                        lambda: train_measure(bench, ctx, True, ours_step))
    trained = rec["status"] == "ok"
    step_est = bench.est_train(flops_step)
    if trained:
        bench.run(key, "nograd_pass", 0.35 * step_est, lambda: nograd_measure(bench, ctx))
        bench.run(key, "pg_step_nogc", 1.3 * step_est,
                  lambda: train_measure(bench, ctx, False, ours_step))
        if meas["pg_step_nogc"]["status"] == "ok":
            bench.run(key, "plain_nogc", 1.2 * step_est,
                      lambda: train_measure(bench, ctx, False, plain_step))
    store = {}
    on_gpu = torch.cuda.is_available()
    gen_est = 3.0 + (min(args.gen_tokens, shape.completion_len) * arch["num_hidden_layers"] * 1.5e-3
                     if on_gpu else 1.0)
    bench.run(key, "generate", gen_est,
              lambda: generate_measure(bench, ctx, store, reserve_s + 0.6 * step_est * trained))
    bench.run(key, "agreement", 0.3 * step_est, lambda: agreement_measure(bench, ctx, store))
    store.clear()
    if trained:
        bench.run(key, "plain_gc", 1.2 * step_est,
                  lambda: train_measure(bench, ctx, True, plain_step), reserve_s=reserve_s)
    ng = meas.get("nograd_pass", {})
    for mode in ("nogc", "gc"):
        entry[f"ours_vs_plain_{mode}"] = compare(meas.get(f"pg_step_{mode}", {}),
                                                 meas.get(f"plain_{mode}", {}), ng)
    entry["memory_vs_readme"] = memory_vs_readme(bench, ctx.counts, spec, meas)
    bench.save()
    if trained and not args.no_search:
        for gc_on in (True, False):
            mode = "gc" if gc_on else "nogc"
            if meas.get(f"pg_step_{mode}", {}).get("status") == "ok":
                bench.run(key, f"largest_fit_{mode}", 3 * step_est,
                          lambda: search_measure(bench, ctx, gc_on, reserve_s), reserve_s=reserve_s)
    if trained and shape.kl_coef > 0:
        bench.run(key, "pg_step_kl", 1.5 * step_est + n * 4 / 5e9, lambda: kl_measure(bench, ctx),
                  reserve_s=reserve_s)
    ctx = None  # the model goes before the next one is built
    holder.clear()
    bench.policy = None
    free_memory()


def targets(bench: Bench) -> dict:
    """The issue's targets, checked on what was measured (met: None = not measured)."""
    models = bench.res["models"]
    m4 = models.get("qwen3-4b", {})
    mfus = {k: m4["measurements"][k]["mfu"] for k in ("pg_step_gc", "pg_step_nogc")
            if m4.get("measurements", {}).get(k, {}).get("mfu") is not None}
    mem = m4.get("memory_vs_readme", {})
    ratios = {f"{key}/{mode}": e[f"ours_vs_plain_{mode}"]["time_ratio"]
              for key, e in models.items() for mode in ("nogc", "gc")
              if e.get(f"ours_vs_plain_{mode}", {}).get("time_ratio") is not None}
    return {
        "mfu_4b_at_least_40pct": {"mfu": mfus, "met": max(mfus.values()) >= 0.40 if mfus else None},
        "peak_4b_within_10pct_of_readme": {"peak_gb_gc": mem.get("peak_gb_gc"),
                                           "readme_gb": mem.get("compared_with_gb"),
                                           "met": mem.get("within_10pct_gc")},
        "ours_vs_plain_time_at_most_1.05": {"ratios": ratios,
                                            "met": all(r <= 1.05 for r in ratios.values()) if ratios
                                            else None}}


def condensed(bench: Bench) -> dict:
    """The printed JSON summary (the full results are in --out)."""
    keep = ("status", "time_s", "completion_tokens_per_s", "tokens_per_s", "tflops", "mfu",
            "peak_gb", "micro_batch_tokens", "largest_fit", "largest_micro_batch_tokens",
            "resolved", "reason", "error", "trainer_vs_sampler", "trainer_bf16_vs_fp32",
            "max_new_tokens")
    res = bench.res
    out = {k: res[k] for k in ("device", "dry_run", "elapsed_s", "budget_s", "peak_tflops",
                               "peak_source", "aborted", "targets", "skipped", "errors")
           if k in res}
    out["matmul_bf16_tflops"] = res.get("matmul_bf16", {}).get("tflops")
    out["models"] = {key: {"precision": e.get("precision"),
                           "measurements": {n: {k: v for k, v in m.items() if k in keep}
                                            for n, m in e["measurements"].items()},
                           **{k: e[k] for k in ("ours_vs_plain_nogc", "ours_vs_plain_gc",
                                                "memory_vs_readme") if k in e}}
                     for key, e in res["models"].items()}
    return out


def table(bench: Bench) -> str:
    head = (f"{'model':16s} {'measurement':22s} {'status':7s} {'time_s':>7s} {'tok/s':>8s} "
            f"{'TFLOP/s':>7s} {'MFU':>6s} {'peak_GB':>7s}  note")
    lines = [head, "-" * len(head)]

    def num(v, fmt, width):
        return format(v, fmt) if v is not None else " " * width

    for key, e in bench.res["models"].items():
        for name, m in e["measurements"].items():
            note = m.get("reason") or m.get("error") or ""
            if name.startswith("largest_fit") and m.get("status") == "ok":
                note = (f"fits {m['largest_fit']} x {m['seq_len']} tokens per micro-batch"
                        + ("" if m["resolved"] else ", unresolved")
                        + (", cap" if m["capped"] else ""))
            elif m.get("micro_batch_tokens"):
                note = f"micro-batch {m['micro_batch_tokens']} tokens. {note}"
            mfu = m.get("mfu")
            mfu = f"{100 * mfu:5.1f}%" if mfu is not None else " " * 6
            lines.append(" ".join([
                f"{key:16s} {name:22s} {m.get('status', ''):7s}", num(m.get("time_s"), "7.2f", 7),
                num(m.get("completion_tokens_per_s", m.get("tokens_per_s")), "8,.0f", 8),
                num(m.get("tflops"), "7.1f", 7), mfu, num(m.get("peak_gb"), "7.1f", 7),
                " " + note[:80]]))
    return "\n".join(lines)


def summary_lines(bench: Bench) -> list:
    out = []
    for key, e in bench.res["models"].items():
        if e.get("precision") not in (None, "fp32-master"):
            out.append(f"{key}: fp32 master weights did not fit ({e['fp32_master']['error'][:70]});"
                       f" measured with {PRECISIONS[e['precision']]}")
        for mode in ("nogc", "gc"):
            c = e.get(f"ours_vs_plain_{mode}", {})
            if c.get("time_ratio") is not None:
                mem = c["memory_ratio"] if c.get("memory_ratio") is not None else "n/a"
                out.append(f"{key} ({mode}): ours / plain = {c['time_ratio']:.2f} time, {mem}"
                           " memory" + (f"; slower in {c['slower_phase']}"
                                        if c.get("slower_phase") else ""))
        mem = e.get("memory_vs_readme", {})
        if mem.get("peak_gb_gc") is not None:
            against = "README's row" if mem.get("readme_row") else f"README's rule, {mem['rule']}"
            out.append(f"{key}: pg_step peak {mem['peak_gb_gc']} GB with checkpointing vs "
                       f"{mem['compared_with_gb']} GB ({against})")
        ag = e.get("measurements", {}).get("agreement", {}).get("trainer_vs_sampler")
        if ag and ag.get("tokens"):
            out.append(f"{key}: |trainer - sampler| log-prob in bf16: mean {ag['mean']}, "
                       f"p99 {ag['p99']}, max {ag['max']} over {ag['tokens']:,} tokens")
    for name, t in bench.res.get("targets", {}).items():
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        out.append(f"target {name}: {verdict}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = ap.add_argument
    add("--out", default="bench_gpu.json", help="JSON file, rewritten after each measurement")
    add("--budget-s", type=float, default=None, help="time budget (default 420; dry run 300)")
    add("--hard-grace-s", type=float, default=40.0, help="watchdog: exit this long after it")
    add("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    add("--dry-run", action="store_true", help="CPU, the tiny model's sizes, simulated OOMs")
    add("--peak-tflops", type=float, default=None, help="MFU denominator (default: by GPU)")
    add("--micro-batch-tokens", type=int, default=None, help="default: RunConfig's")
    add("--gen-tokens", type=int, default=256, help="new tokens per sequence in generate")
    add("--gen-probe-tokens", type=int, default=8, help="new tokens of generate's warm-up")
    add("--fp32-seqs", type=int, default=8, help="sequences of the fp32 reference pass")
    add("--search-cap", type=int, default=128, help="largest micro-batch probed, sequences")
    ap.add_argument("--search-probes", type=int, default=5, help="probes per largest-fit search")
    ap.add_argument("--no-search", action="store_true", help="skip the largest-fit searches")
    ap.add_argument("--no-fallback-bf16", dest="fallback_bf16", action="store_false",
                    help="no bf16-weights run where fp32 master weights do not fit")
    args = ap.parse_args(argv)
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    bad = [k for k in keys if k not in MODELS]
    if bad:
        ap.error(f"--models: unknown {', '.join(bad)}; choose from {', '.join(MODELS)}")
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device here: use --dry-run to check the code paths on the CPU")
    if args.budget_s is None:
        args.budget_s = 300.0 if args.dry_run else 420.0
    if args.micro_batch_tokens is None:
        args.micro_batch_tokens = (2 * DRY_SEQ if args.dry_run
                                   else common.RunConfig.micro_batch_tokens)
    args.sim_max_tokens = 5 * DRY_SEQ  # dry run: a micro-batch of 6+ sequences is "out of memory"
    if args.dry_run:
        args.gen_tokens, args.gen_probe_tokens = min(args.gen_tokens, 6), 2
        args.search_cap, args.fp32_seqs = min(args.search_cap, 16), min(args.fp32_seqs, 2)
    transformers.logging.set_verbosity_error()
    bench = Bench(args)

    def on_deadline():
        print(bench.abort_report(), flush=True)
        os._exit(2)

    watchdog = threading.Timer(max(0.0, bench.deadline + args.hard_grace_s - time.monotonic()),
                               on_deadline)
    watchdog.daemon = True
    watchdog.start()
    res = bench.res
    on_gpu = torch.cuda.is_available()
    res.update(device=torch.cuda.get_device_name() if on_gpu else "cpu", torch=torch.__version__,
               transformers=transformers.__version__, cuda=torch.version.cuda,
               alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
               tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
               readme_memory=readme_memory(ROOT / "README.md"))
    if on_gpu:
        res["gpu_memory_gb"] = rnd(torch.cuda.get_device_properties(0).total_memory / GB, 1)
    found = next(((tf, src) for name, tf, src in PEAK_TFLOPS if name in res["device"]),
                 (None, "unknown device: give --peak-tflops"))
    res["peak_tflops"], res["peak_source"] = ((args.peak_tflops, "--peak-tflops")
                                              if args.peak_tflops else found)
    bench.run("device", "matmul_bf16", 3.0, lambda: matmul_measure(bench), into=res)
    tokenizer = common.load_tokenizer(common.resolve_model_path("tiny"))
    workdir = tempfile.mkdtemp(prefix="bench_gpu_")
    try:
        for i, key in enumerate(keys):
            spec = MODELS[key]
            arch = tiny_arch(spec["config"], len(tokenizer)) if args.dry_run else spec["config"]
            shape = tiny_shape(spec["shape"]) if args.dry_run else spec["shape"]
            reserve = sum(core_estimate(bench, MODELS[k], MODELS[k]["shape"]) for k in keys[i + 1:])
            bench_model(bench, key, spec, shape, arch, tokenizer, workdir, reserve)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    res["targets"] = targets(bench)
    res["summary"] = summary_lines(bench)
    watchdog.cancel()
    bench.save()
    print(json.dumps(condensed(bench), default=str))
    print()
    print(table(bench))
    print()
    print("\n".join(res["summary"]))
    print(f"\nelapsed {bench.elapsed():.0f} s of a {args.budget_s:.0f} s budget; "
          f"full JSON: {args.out or '(not written)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
