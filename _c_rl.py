# ==================================================================================================
# RL core: per-token log-probs, advantages, policy-gradient / SFT losses and the train steps.
# Formulas and their sources: shared/methods/rl_core.md (sections cited as "rl_core §n").
# ==================================================================================================
from __future__ import annotations

import contextlib
import math
import resource
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from _c_core import *  # merge:drop


@dataclass
class Trajectory:
    """One sampled completion to train on: prompt and completion token ids, its scalar reward and advantage
    (outcome reward broadcast to every completion token, rl_core notation), the role that produced it (used for
    per-role stats such as ``entropy/<role>``) and, when the sampler returned them, the sampler's log-probs of
    the sampled tokens at the sampling temperature (used for the truncated-IS correction and the sync check).
    ``old_logprobs`` pins pi_old when one rollout batch is split over several ``pg_step`` calls (R-Zero's
    minibatches): fill it once with ``old_logprobs(policy, trajs, temperature)`` before the first update."""
    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float = 0.0
    advantage: float = 0.0
    role: str = ""
    sampler_logprobs: list[float] | None = None
    old_logprobs: list[float] | None = None   # pi_old of the rollout batch (see old_logprobs()); None = recompute

    @classmethod
    def from_completion(cls, c, **kw) -> "Trajectory":
        """Build from a sampler ``Completion``; keyword arguments (reward, advantage, role) are passed through."""
        return cls(prompt_ids=list(c.prompt_ids), completion_ids=list(c.token_ids),
                   sampler_logprobs=None if c.logprobs is None else list(c.logprobs), **kw)


# --------------------------------------------------------------------------------------------------
# 1. Per-token log-probs (rl_core §4)
# --------------------------------------------------------------------------------------------------
_RL_LOGIT_CHUNK_BYTES = 128 * 2**20  # fp32 logits held at once by one chunk (x2 with the entropy softmax)


def _rl_micro_batches(lengths: list[int], token_budget: int, max_seqs: int | None = None) -> list[list[int]]:
    """Split sequence indices into micro-batches whose *padded* size (rows x longest row) fits the token budget.

    Sequences are sorted longest first so each micro-batch pads little; a single sequence longer than the
    budget gets a micro-batch of its own (it cannot be split without changing its attention)."""
    if token_budget <= 0:
        raise ValueError(f"token budget must be positive, got {token_budget}; set --micro-batch-tokens")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        rows = len(cur) + 1
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and (rows * longest > token_budget or (max_seqs and rows > max_seqs)):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def _rl_device(model) -> torch.device:
    return next(model.parameters()).device


def _rl_head_logprobs(head, hidden, targets, temperature: float, with_entropy: bool):
    """Log-prob of ``targets`` (and the exact entropy) for a chunk of hidden states: logits in fp32, divided by
    the sampling temperature, log_softmax via logsumexp (rl_core §4 numerics)."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    # H = -sum_v p_v log p_v = lse - sum_v p_v z_v   (z = logits / T)
    ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, ent


def _rl_forward(model, prompts, completions, *, temperature=1.0, with_entropy=False, chunk_rows=None):
    """One micro-batch: right-padded forward of prompt+completion, then the LM head applied to the completion
    positions only, in row chunks. Returns flat (over all completion tokens, row-major) log-probs and entropies.

    Shift: for a prompt of P tokens and completion of R tokens the hidden state at position P-1+t predicts
    completion token t (t = 0..R-1), i.e. positions P-1 .. P+R-2 (rl_core §4).
    Padding: rows are right-padded with attention_mask 0; padded positions are never gathered, and with right
    padding the real tokens' positions and causal attention are exactly those of the unpadded sequence.
    Memory: the full-vocabulary logits exist for at most ``chunk_rows`` tokens at a time; with grad enabled
    each chunk is recomputed in backward (activation checkpointing), so autograd stores only hidden states.
    """
    device = _rl_device(model)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (the first completion token is predicted from it)")
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    att = torch.zeros(len(seqs), width, dtype=torch.long)
    rows, cols, tgts = [], [], []
    for b, (p, c) in enumerate(zip(prompts, completions)):
        ids[b, :len(seqs[b])] = torch.tensor(seqs[b], dtype=torch.long)
        att[b, :len(seqs[b])] = 1
        rows += [b] * len(c)
        cols += range(len(p) - 1, len(p) - 1 + len(c))
        tgts += list(c)
    ids, att = ids.to(device), att.to(device)
    n_tok = len(tgts)
    if n_tok == 0:
        z = torch.zeros(0, device=device)
        return z, (z if with_entropy else None)
    # through the root forward (core's final_hidden_states), so FSDP2/DDP hooks see the call (#10)
    hidden = final_hidden_states(model, ids, att)
    hidden = hidden[torch.tensor(rows, device=device), torch.tensor(cols, device=device)]  # [n_tok, d]
    targets = torch.tensor(tgts, dtype=torch.long, device=device)
    head = getattr(model, "module", model).get_output_embeddings()
    if chunk_rows is None:
        chunk_rows = max(1, _RL_LOGIT_CHUNK_BYTES // (4 * head.weight.shape[0]))
    grad = torch.is_grad_enabled()
    lps, ents = [], []
    for s in range(0, n_tok, chunk_rows):
        h, t = hidden[s:s + chunk_rows], targets[s:s + chunk_rows]
        if grad:
            lp, en = torch.utils.checkpoint.checkpoint(_rl_head_logprobs, head, h, t, temperature, with_entropy,
                                                       use_reentrant=False)
        else:
            lp, en = _rl_head_logprobs(head, h, t, temperature, with_entropy)
        lps.append(lp)
        ents.append(en)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def token_logprobs(model, prompts: list[list[int]], completions: list[list[int]], *, temperature: float = 1.0,
                   token_budget: int = 16384, with_entropy: bool = False, chunk_rows: int | None = None):
    """Per-token log-probs log pi(y_t | x, y_<t) of each completion given its prompt, at the *sampling*
    temperature (logits / T, rl_core §4), optionally with the exact full-distribution entropy of the same
    tempered distribution at each position.

    Micro-batched so that (rows x longest row) <= ``token_budget`` padded tokens per forward pass; the LM head
    is applied in chunks of ``chunk_rows`` completion tokens (default: 128 MiB of fp32 logits, ~220 rows at
    Qwen's 151,936 vocabulary), so the full-vocabulary fp32 logits of a whole batch never exist at once.
    Differentiable when grad is enabled (chunks are then checkpointed). Returns ``(logps, entropies)``: lists of
    1-D fp32 tensors, one per completion, in input order (``entropies`` is None unless ``with_entropy``)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens (got {temperature}); greedy samples are "
                         "scored at T=1")
    out_lp: list = [None] * len(prompts)
    out_en: list = [None] * len(prompts)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    for mb in _rl_micro_batches(lengths, token_budget):
        lp, en = _rl_forward(model, [prompts[i] for i in mb], [completions[i] for i in mb],
                             temperature=temperature, with_entropy=with_entropy, chunk_rows=chunk_rows)
        sizes = [len(completions[i]) for i in mb]
        for i, x in zip(mb, lp.split(sizes)):
            out_lp[i] = x
        if with_entropy:
            for i, x in zip(mb, en.split(sizes)):
                out_en[i] = x
    return out_lp, (out_en if with_entropy else None)


# --------------------------------------------------------------------------------------------------
# 2. Advantages (rl_core §1)
# --------------------------------------------------------------------------------------------------
def _rl_as_float64(x) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float64).flatten()
    if not torch.isfinite(t).all():
        raise ValueError("rewards must be finite (got NaN or inf); give failed samples an explicit reward")
    return t


def _rl_normalise(r: torch.Tensor, idx: list[int], *, use_std: bool, eps: float,
                  weights: torch.Tensor | None = None) -> torch.Tensor:
    """(r - mean) / (std + eps) on one group, with the degenerate cases defined: a group of one sample, or a
    group whose rewards are all equal, has advantage exactly 0 (it carries no signal; rl_core §1)."""
    g = r[idx]
    if len(idx) < 2 or bool((g == g[0]).all()):
        return torch.zeros_like(g)
    if weights is None:
        centred = g - g.mean()
        if not use_std:
            return centred
        return centred / (g.std(correction=1) + eps)
    # token-weighted whitening (veRL masked_whiten over token-level returns): token-weighted mean, Bessel-
    # corrected token-weighted variance (divide by sum(w) - 1), then (r - mean) * rsqrt(var + eps)
    w = weights[idx]
    mean = (w * g).sum() / w.sum()
    var = (w * (g - mean) ** 2).sum() / (w.sum() - 1)
    return (g - mean) * torch.rsqrt(var + eps)


def group_advantages(rewards, group_ids, scale: str = "std", eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages, one scalar per response, the baseline taken over the responses to one prompt.

    ``scale="std"``: GRPO (DeepSeekMath, arXiv:2402.03300, §4.1.2 outcome supervision):
        A_i = (r_i - mean_g r) / (std_g r + eps)
      with the *unbiased* std (divide by G-1; ``correction=1`` passed explicitly). Why unbiased: it is what the
      reference code of the paper that uses GRPO here does (R-Zero's EasyR1/veRL, also TRL: ``torch.std``
      default), so R-Zero's numbers are reproduced; within a fixed-size group it differs from the population std
      only by the constant sqrt((G-1)/G) (an lr rescale), but not when group sizes vary within a batch
      (rl_core §1 table: {1,0} -> +-0.707 unbiased, +-1.0 population). eps default 1e-6 as EasyR1/veRL.
    ``scale="none"``: Dr. GRPO (Liu et al., arXiv:2503.20783, §3.1, their Eq. for A_i without std): A_i = r_i - mean_g r.

    Degenerate groups: all rewards equal -> exactly 0 (not (r - mean)/eps, which float round-off can blow up);
    a group of size 1 -> 0 (the unbiased std is undefined there; veRL would give A = r instead).
    ``group_ids`` are any hashables, one per reward. Returns a float32 tensor in input order."""
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' (GRPO) or 'none' (Dr. GRPO), got {scale!r}")
    r = _rl_as_float64(rewards)
    group_ids = list(group_ids)
    if len(group_ids) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(group_ids)} group ids")
    groups: dict = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    adv = torch.zeros_like(r)
    for idx in groups.values():
        adv[idx] = _rl_normalise(r, idx, use_std=scale == "std", eps=eps)
    return adv.float()


def keyed_advantages(rewards, keys, eps: float = 1e-6, *, lengths=None, token_weighted: bool = False) -> torch.Tensor:
    """REINFORCE++ / Task-Relative REINFORCE++ advantages: a separate baseline and normalisation per key.

    TRR++ (Absolute Zero, arXiv:2505.03335, §3.3.5, Eq. 8): A = (r - mu_key) / sigma_key, key = (task, role),
    6 baselines. REINFORCE++ (as restated in Absolute Zero App. A, Eq. 10) is the special case of one key for the
    whole batch. sigma is the unbiased std (``correction=1``), as in the official code's ``masked_whiten``;
    eps is added to sigma. A key whose rewards are all equal, or a key with a single sample, gets exactly 0.

    ``token_weighted=True`` follows the official code instead of the paper: it whitens *token-level* returns
    over each key (veRL ``masked_whiten``), so every response counts with weight |y_i| (``lengths``, required)
    in the mean and in the Bessel-corrected variance, and A = (r - mu) * rsqrt(var + eps) (official eps 1e-8).
    Default is the paper's per-sequence Eq. 8 (rl_core §1)."""
    r = _rl_as_float64(rewards)
    keys = list(keys)
    if len(keys) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(keys)} keys")
    w = None
    if token_weighted:
        if lengths is None:
            raise ValueError("token_weighted=True needs lengths (completion token counts)")
        w = torch.as_tensor(list(lengths), dtype=torch.float64)
        if len(w) != len(r) or bool((w < 1).any()):
            raise ValueError("lengths must give one positive token count per reward")
    groups: dict = defaultdict(list)
    for i, k in enumerate(keys):
        groups[k].append(i)
    adv = torch.zeros_like(r)
    for idx in groups.values():
        adv[idx] = _rl_normalise(r, idx, use_std=True, eps=eps, weights=w)
    return adv.float()


# --------------------------------------------------------------------------------------------------
# 3. Policy loss and aggregation (rl_core §2, §3, §5)
# --------------------------------------------------------------------------------------------------
_RL_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "drgrpo")


@dataclass
class PGConfig:
    """Options of the policy-gradient update; each method file sets the paper's values (rl_core §8)."""
    clip_low: float = 0.2             # PPO epsilon below 1 (Schulman et al. 2017, Eq. 7)
    clip_high: float = 0.2            # epsilon above 1; >clip_low is DAPO's "clip-higher" (R-Zero: 0.3)
    dual_clip: float = 0.0            # c of dual-clip PPO for A<0 (Ye et al. 2020; R-Zero code: 3); 0 = off
    kl_coef: float = 0.0              # beta of the k3 KL to a reference model (R-Zero: 0.01); 0 = off
    entropy_coef: float = 0.0         # c_H of the entropy bonus (Absolute Zero paper: 0.001)
    aggregation: str = "token-mean"   # token-mean | seq-mean-token-mean | drgrpo (rl_core §3)
    max_len: int = 0                  # L_max for drgrpo: the generation limit (max_tokens)
    temperature: float = 1.0          # sampling temperature the rollouts used; log-probs are scored at it
    tis_cap: float = 0.0              # truncated importance-sampling cap C (oat: 2); 0 = off (rl_core §5)
    updates_per_batch: int = 1        # optimizer steps per rollout batch (>1 makes clipping matter)

    def __post_init__(self):
        if self.aggregation not in _RL_AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {_RL_AGGREGATIONS}, got {self.aggregation!r}")
        if self.aggregation == "drgrpo" and self.max_len <= 0:
            raise ValueError("aggregation='drgrpo' needs max_len = the generation limit L_max (> 0)")
        if self.temperature <= 0:
            raise ValueError("PGConfig.temperature is the sampling temperature of the rollouts and must be > 0")
        if self.updates_per_batch < 1:
            raise ValueError("updates_per_batch must be >= 1")


def pg_token_loss(logp, old_logp, adv, cfg: PGConfig, *, ref_logp=None, entropy=None, sampler_logp=None):
    """Per-token policy loss L_{i,t} = w_IS * L^clip + beta * k3 - c_H * H_t (rl_core §2), all inputs of the
    same shape (advantages already broadcast to tokens). Returns ``(loss, clipped)``: the per-token loss and a
    bool tensor marking tokens where the clipped branch was selected (for clip_frac).

    - L^clip = -min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A), rho = exp(l - l_old): PPO-clip (Schulman et al.
      2017, arXiv:1707.06347, Eq. 7) as used by GRPO (DeepSeekMath Eq. 3) with DAPO's decoupled eps
      (arXiv:2503.14476, Eq. 10).
    - dual clip (Ye et al. 2020, arXiv:1912.09729, Eq. 5 / veRL ``compute_policy_loss``): for A < 0,
      L = min(L^clip, -c*A).
    - k3 KL (Schulman's estimator, as in DeepSeekMath Eq. 4): delta = l_ref - l, k3 = exp(delta) - delta - 1,
      clamped to [-10, 10] as EasyR1.
    - truncated IS (rl_core §5, oat): w = min(exp(l_old - l_sampler), C), detached, multiplies L^clip.
    - entropy bonus: -c_H * H_t (Absolute Zero's trainer config; exact full-distribution entropy).
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = torch.maximum(unclipped, clipped_loss)  # = -min(rho*A, clip(rho)*A)
    clipped = clipped_loss > unclipped
    if cfg.dual_clip > 0:
        loss = torch.where(adv < 0, torch.minimum(loss, -cfg.dual_clip * adv), loss)
    if cfg.tis_cap > 0:
        if sampler_logp is None:
            raise ValueError("tis_cap > 0 needs sampler log-probs (request logprobs from the sampler)")
        loss = loss * torch.clamp(torch.exp(old_logp - sampler_logp), max=cfg.tis_cap).detach()
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference log-probs (pass ref_weights to pg_step)")
        delta = ref_logp - logp
        loss = loss + cfg.kl_coef * torch.clamp(torch.exp(delta) - delta - 1.0, -10.0, 10.0)
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        loss = loss - cfg.entropy_coef * entropy
    return loss, clipped


def aggregation_weights(lengths, mode: str, *, num_seqs: int, num_tokens: int, max_len: int = 0) -> torch.Tensor:
    """Weight of every token of every sequence in the aggregated loss (flat, row-major), given GLOBAL
    normalisers: ``num_seqs`` = N and ``num_tokens`` = M counted over the whole batch (all micro-batches and all
    ranks), so that summing the weighted losses of micro-batches gives exactly the full-batch loss (rl_core §3
    micro-batch pitfall):

    - ``token-mean``: 1/M (DAPO, arXiv:2503.14476, Eq. 8/12 token-level loss; veRL ``token-mean``).
    - ``seq-mean-token-mean``: 1/(N |y_i|) (GRPO, DeepSeekMath Eq. 3; Absolute Zero Eq. 9).
    - ``drgrpo``: 1/(N L_max) (Dr. GRPO, arXiv:2503.20783, §3.1 and oat's ``masked_sum`` with constant
      normaliser ``generate_max_length``)."""
    lengths = [int(x) for x in lengths]
    if mode == "token-mean":
        per_seq = [1.0 / num_tokens] * len(lengths)
    elif mode == "seq-mean-token-mean":
        per_seq = [1.0 / (num_seqs * n) if n else 0.0 for n in lengths]
    elif mode == "drgrpo":
        if max_len <= 0:
            raise ValueError("drgrpo aggregation needs max_len = L_max > 0")
        if max(lengths, default=0) > max_len:
            raise ValueError(f"a completion has {max(lengths)} tokens > max_len {max_len}: max_len must be the "
                             "generation limit")
        per_seq = [1.0 / (num_seqs * max_len)] * len(lengths)
    else:
        raise ValueError(f"aggregation must be one of {_RL_AGGREGATIONS}, got {mode!r}")
    return torch.tensor([w for w, n in zip(per_seq, lengths) for _ in range(n)], dtype=torch.float32)


def aggregate_loss(token_loss: torch.Tensor, mask: torch.Tensor, mode: str, *, num_seqs: int | None = None,
                   num_tokens: int | None = None, max_len: int = 0) -> torch.Tensor:
    """Aggregate a padded per-token loss ``[B, T]`` under ``mask`` (1 = completion token, 0 = padding; padding
    never contributes) with the rule of ``mode`` (see ``aggregation_weights``). Pass the global N and M when
    this is one micro-batch of a larger batch; they default to this tensor's own counts."""
    mask = mask.to(token_loss.dtype)
    lengths = mask.sum(1).round().long().tolist()
    n = token_loss.shape[0] if num_seqs is None else num_seqs
    m = int(sum(lengths)) if num_tokens is None else num_tokens
    w_flat = aggregation_weights(lengths, mode, num_seqs=n, num_tokens=max(m, 1), max_len=max_len)
    w = torch.zeros_like(token_loss)
    w[mask.bool()] = w_flat.to(token_loss.device, token_loss.dtype)  # rows are left-aligned (right padding)
    return (token_loss * w * mask).sum()


# Distributed hooks (#10). Counts and micro-batch numbers are summed / maxed over ranks when torch.distributed
# is initialised, so the global normalisers M, N are the same on every rank; the grad scale undoes the
# gradient *averaging* of DDP/FSDP, because our per-rank losses are already divided by the global count.
def _rl_all_reduce(values: list[float], op: str = "sum") -> list[float]:
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    backend = dist.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def _rl_grad_scale() -> float:
    import torch.distributed as dist
    return float(dist.get_world_size()) if dist.is_available() and dist.is_initialized() else 1.0


@contextlib.contextmanager
def _rl_swapped_weights(model, weights: dict):
    """Temporarily copy ``weights`` (e.g. a CPU reference state dict) into the trainer model's own parameter
    storage, restoring the current weights afterwards. GPU memory is not doubled: the reference lives on the
    CPU and only ever occupies the trainer's existing tensors; the backup of the current weights is on the CPU
    too. Tied weights (lm_head = embed_tokens) may be absent from ``weights``."""
    backup = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected:
            raise ValueError(f"reference weights have names the model lacks: {unexpected[:5]}")
        sd = model.state_dict()
        loaded_ptrs = {sd[k].data_ptr() for k in sd if k not in missing}
        really_missing = [k for k in missing if sd[k].data_ptr() not in loaded_ptrs]
        if really_missing:
            raise ValueError(f"reference weights lack {really_missing[:5]}")
        yield
    finally:
        model.load_state_dict(backup, strict=False)


def _rl_release_sampler(policy) -> None:
    """With --vllm-sleep the engine frees its GPU memory for the training pass; the next sync or generate
    wakes it (core's ``Policy.release_sampler_memory``; a no-op otherwise)."""
    release = getattr(policy, "release_sampler_memory", None)
    if callable(release):
        release()


def _rl_clip_and_step(policy, params, max_norm: float) -> float:
    """Clip the global grad norm and step; goes through ``policy.clip_and_step`` (where FSDP hides, #10) when
    clipping is on. Returns the pre-clip norm."""
    if math.isfinite(max_norm) and hasattr(policy, "clip_and_step"):
        return float(policy.clip_and_step())
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    policy.optimizer.step()
    return float(norm)


def _rl_peak_mem_gb(device: torch.device) -> float:
    """Peak memory: CUDA max_memory_allocated since the step began, else the process's peak RSS (Linux
    ru_maxrss, whole process lifetime)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _rl_seq_mean(values: list[torch.Tensor]) -> float:
    """Mean over sequences of the per-sequence token mean (how analysis.md Eq. 1 aggregates entropy)."""
    vals = [v.mean().item() for v in values if v.numel()]
    return sum(vals) / len(vals) if vals else float("nan")


def _rl_local_shard(policy, items: list) -> tuple[list, bool]:
    """This rank's share of a batch that every rank holds in full (core's ``Policy.shard``; identity in one
    process). A rank left with nothing gets the first item back as a zero-weight stand-in, so it still runs
    the forward/backward passes that FSDP's collectives expect; the bool says whether the items are real."""
    local = policy.shard(items) if hasattr(policy, "shard") else items
    return (local, True) if local else (items[:1], False)


def _rl_swap(policy, weights: dict):
    """Reference weights in the trainer for one no-grad pass: core's ``Policy.swapped_weights`` (FSDP-safe)
    when available, else an in-place copy into the plain model."""
    if hasattr(policy, "swapped_weights"):
        return policy.swapped_weights(weights)
    return _rl_swapped_weights(policy.model, weights)


@torch.no_grad()
def old_logprobs(policy, trajs: list[Trajectory], temperature: float = 1.0) -> None:
    """Fill ``t.old_logprobs`` for a whole rollout batch in one no-grad pass, before its first update, so later
    ``pg_step`` calls on minibatches of it keep the rollout policy as pi_old (R-Zero's code: several optimizer
    minibatches per rollout batch, clip and dual clip active from the second one on)."""
    _rl_release_sampler(policy)
    budget = int(getattr(policy.cfg, "micro_batch_tokens", 16384))
    lp, _ = token_logprobs(policy.model, [t.prompt_ids for t in trajs], [t.completion_ids for t in trajs],
                           temperature=temperature, token_budget=budget)
    for t, x in zip(trajs, lp):
        t.old_logprobs = x.tolist()


def pg_step(policy, trajs: list[Trajectory], cfg: PGConfig, ref_weights: dict | None = None) -> dict:
    """One policy-gradient update on a rollout batch (rl_core §2-§5), then ``policy.sync()``.

    0. Under torchrun every rank passes the FULL batch and trains on its shard (``policy.shard``); the
       normalisers below are global. ``policy.release_sampler_memory()`` lets a sleeping vLLM free GPU memory.
    1. No-grad pass: l_old (the policy that sampled, rl_core §2; or ``t.old_logprobs`` when every trajectory
       carries them), exact entropy, and l_ref if cfg.kl_coef > 0.
       Reference choice: the reference weights are kept on the CPU (``ref_weights``, e.g. ``policy.get_weights()``
       at phase start) and swapped into the trainer model's own tensors for this one no-grad pass
       (``policy.swapped_weights``), then the current weights are swapped back; so GPU memory is not doubled and
       the sampler keeps serving the current policy.
    2. ``cfg.updates_per_batch`` times: zero grads; for every micro-batch (``policy.cfg.micro_batch_tokens``
       padded tokens) forward with grad, per-token loss (``pg_token_loss``), aggregation with the GLOBAL
       normalisers N and M (``aggregation_weights``), backward (gradients accumulate by summation, no extra
       division by the number of micro-batches); clip the grad norm to ``policy.cfg.grad_clip``; optimizer step.
    3. ``policy.sync()`` pushes the new weights into the sampler.

    Returns stats: loss (global), grad_norm (pre-clip), clip_frac (share of tokens where the clipped branch was
    taken), approx_kl (k3 estimate of KL(pi_old || pi), 0 when on-policy) -- these four averaged over the
    updates and, except grad_norm, summed over ranks --, kl_ref (if kl_coef > 0), entropy (exact token entropy
    of the tempered distribution), nll_entropy (analysis Eq. 1: mean NLL of the sampled tokens, sequence-mean
    of token-means; an entropy estimate only at T=1), entropy/<role> (Eq. 1 per role) and
    entropy_exact/<role>, tokens_per_s (completion tokens through forward+backward per second over the whole
    step), time_s, peak_mem_gb, zero_adv_frac (share of trajectories with advantage exactly 0),
    logprob_diff_vs_sampler (mean |l_old - l_sampler| over tokens whose sampler log-probs are known; logged
    whenever available since a jump means a broken weight sync), n_tokens, n_seqs. Entropies, zero_adv_frac
    and the log-prob diff are over this rank's shard. The loss value is ~ -mean(A) ~ 0 on-policy; that is
    expected (rl_core §2).
    """
    if not trajs:
        raise ValueError("pg_step got no trajectories")
    for t in trajs:
        if t.sampler_logprobs is not None and len(t.sampler_logprobs) != len(t.completion_ids):
            raise ValueError("sampler_logprobs must have one entry per completion token")
        if t.old_logprobs is not None and len(t.old_logprobs) != len(t.completion_ids):
            raise ValueError("old_logprobs must have one entry per completion token")
    if cfg.tis_cap > 0 and any(t.sampler_logprobs is None for t in trajs):
        raise ValueError("tis_cap > 0 needs sampler_logprobs on every trajectory (the sampler's log-probs)")
    if cfg.kl_coef > 0 and ref_weights is None:
        raise ValueError("PGConfig.kl_coef > 0 needs ref_weights (e.g. policy.get_weights() at phase start)")
    model, opt, pcfg = policy.model, policy.optimizer, policy.cfg
    _rl_release_sampler(policy)
    device = _rl_device(model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    T = cfg.temperature
    trajs, real = _rl_local_shard(policy, trajs)
    prompts = [t.prompt_ids for t in trajs]
    comps = [t.completion_ids for t in trajs]
    lens = [len(c) for c in comps]
    budget = int(getattr(pcfg, "micro_batch_tokens", 16384))
    mbs = _rl_micro_batches([len(p) + len(c) for p, c in zip(prompts, comps)], budget)
    n_glob, m_glob = (int(x) for x in _rl_all_reduce([len(trajs) * real, sum(lens) * real], "sum"))
    n_mb_glob = int(_rl_all_reduce([len(mbs)], "max")[0])
    if m_glob == 0:
        raise ValueError("all completions are empty: nothing to train on")

    # 1. old / reference log-probs, no grad
    with torch.no_grad():
        old, ent = token_logprobs(model, prompts, comps, temperature=T, token_budget=budget, with_entropy=True)
        if all(t.old_logprobs is not None for t in trajs):
            old = [torch.tensor(t.old_logprobs, dtype=torch.float32, device=device) for t in trajs]
        ref = None
        if cfg.kl_coef > 0:
            with _rl_swap(policy, ref_weights):
                ref, _ = token_logprobs(model, prompts, comps, temperature=T, token_budget=budget)
    samp = [None if t.sampler_logprobs is None else torch.tensor(t.sampler_logprobs, dtype=torch.float32,
                                                                   device=device) for t in trajs]
    adv_tok = [torch.full((n,), float(t.advantage), device=device) for t, n in zip(trajs, lens)]
    weights = (aggregation_weights(lens, cfg.aggregation, num_seqs=n_glob, num_tokens=m_glob, max_len=cfg.max_len)
               * float(real)).to(device).split(lens)
    grad_scale = _rl_grad_scale()
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = pcfg.grad_clip if getattr(pcfg, "grad_clip", 0) and pcfg.grad_clip > 0 else float("inf")

    # 2. updates: micro-batched forward/backward with gradient accumulation, clip, step
    total, norms, clip_n, kl_sum = 0.0, [], 0.0, 0.0
    for _ in range(cfg.updates_per_batch):
        opt.zero_grad(set_to_none=True)
        for k in range(n_mb_glob):
            # ranks with fewer micro-batches re-run their first one at weight 0 so FSDP collectives match (#10)
            mb, live = (mbs[k], float(real)) if k < len(mbs) else (mbs[0], 0.0)
            lp, en = _rl_forward(model, [prompts[i] for i in mb], [comps[i] for i in mb], temperature=T,
                                 with_entropy=cfg.entropy_coef > 0)

            def cat(xs):
                return torch.cat([xs[i] for i in mb])
            tok_loss, clipped = pg_token_loss(lp, cat(old), cat(adv_tok), cfg,
                                              ref_logp=cat(ref) if ref is not None else None, entropy=en,
                                              sampler_logp=cat(samp) if cfg.tis_cap > 0 else None)
            loss = (tok_loss * cat(weights)).sum() * live
            (loss * grad_scale).backward()
            total += loss.item()
            with torch.no_grad():
                clip_n += clipped.float().sum().item() * live
                d = lp.detach() - cat(old)
                kl_sum += ((torch.exp(d) - 1 - d).sum().item()) * live
        norms.append(_rl_clip_and_step(policy, params, max_norm))
    opt.zero_grad(set_to_none=True)
    # 3. new weights into the sampler before the next generation
    policy.sync()

    elapsed = time.perf_counter() - t0
    n_tok = sum(lens) * real
    total, clip_n, kl_sum = _rl_all_reduce([total, clip_n, kl_sum], "sum")
    upd = cfg.updates_per_batch
    nll = [-x for x in old]
    stats = {
        "loss": total / upd,
        "grad_norm": sum(norms) / len(norms),
        "clip_frac": clip_n / (m_glob * upd),
        "approx_kl": kl_sum / (m_glob * upd),
        "entropy": _rl_seq_mean(ent),
        "nll_entropy": _rl_seq_mean(nll),
        "tokens_per_s": n_tok * (upd + 1) / elapsed,
        "time_s": elapsed,
        "peak_mem_gb": _rl_peak_mem_gb(device),
        "zero_adv_frac": sum(t.advantage == 0 for t in trajs) / len(trajs),
        "n_tokens": m_glob,
        "n_seqs": n_glob,
        "mean_len": m_glob / max(n_glob, 1),
    }
    if ref is not None:
        stats["kl_ref"] = _rl_seq_mean([torch.exp(r - o) - (r - o) - 1 for r, o in zip(ref, old)])
    diffs = [(o - s).abs() for o, s in zip(old, samp) if s is not None and o.numel()]
    if diffs:
        stats["logprob_diff_vs_sampler"] = torch.cat(diffs).mean().item()
    by_role: dict = defaultdict(list)
    for i, t in enumerate(trajs):
        by_role[t.role].append(i)
    for role, idx in by_role.items():
        if role:
            stats[f"entropy/{role}"] = _rl_seq_mean([nll[i] for i in idx])
            stats[f"entropy_exact/{role}"] = _rl_seq_mean([ent[i] for i in idx])
    return stats


# --------------------------------------------------------------------------------------------------
# 4. SFT (STaR, rl_core §6)
# --------------------------------------------------------------------------------------------------
def sft_step(policy, examples: list[tuple[list[int], list[int]]], *, batch_size: int | None = None) -> dict:
    """One supervised step for STaR (Zelikman et al. 2022, arXiv:2203.14465, §3.1: fine-tune on the filtered
    rationales with the language-modelling loss): token cross-entropy -log p(target_t | prompt, target_<t)
    on the target tokens only, masked by the prompt's token length (the prompt gets no loss, hence no
    gradient), averaged over ALL target tokens of the batch (rl_core §6). ``target_ids`` must end with EOS.
    Micro-batched by ``policy.cfg.micro_batch_tokens`` padded tokens (and at most ``batch_size`` sequences per
    micro-batch if given), gradients summed with the global token count as normaliser; grad clip; ONE
    optimizer step; no sampler sync (the caller syncs once after its SFT epochs). Under torchrun every rank
    passes the full batch and trains on its shard (``policy.shard``); the token count is global.
    Returns loss, grad_norm, n_tokens, tokens_per_s, time_s, peak_mem_gb."""
    if not examples:
        raise ValueError("sft_step got no examples")
    model, opt, pcfg = policy.model, policy.optimizer, policy.cfg
    _rl_release_sampler(policy)
    device = _rl_device(model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    examples, real = _rl_local_shard(policy, list(examples))
    prompts = [list(p) for p, _ in examples]
    targets = [list(t) for _, t in examples]
    n_tok = sum(len(t) for t in targets) * real
    budget = int(getattr(pcfg, "micro_batch_tokens", 16384))
    mbs = _rl_micro_batches([len(p) + len(t) for p, t in zip(prompts, targets)], budget, batch_size)
    m_glob, n_mb_glob = int(_rl_all_reduce([n_tok])[0]), int(_rl_all_reduce([len(mbs)], "max")[0])
    if m_glob == 0:
        raise ValueError("all SFT targets are empty")
    grad_scale = _rl_grad_scale()
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for k in range(n_mb_glob):
        mb, live = (mbs[k], float(real)) if k < len(mbs) else (mbs[0], 0.0)
        lp, _ = _rl_forward(model, [prompts[i] for i in mb], [targets[i] for i in mb])
        loss = -lp.sum() / m_glob * live
        (loss * grad_scale).backward()
        total += loss.item()
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = pcfg.grad_clip if getattr(pcfg, "grad_clip", 0) and pcfg.grad_clip > 0 else float("inf")
    norm = _rl_clip_and_step(policy, params, max_norm)
    opt.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - t0
    total = _rl_all_reduce([total])[0]
    return {"loss": total, "grad_norm": float(norm), "n_tokens": m_glob, "tokens_per_s": n_tok / elapsed,
            "time_s": elapsed, "peak_mem_gb": _rl_peak_mem_gb(device)}
