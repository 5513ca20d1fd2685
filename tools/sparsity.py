"""Parameter update sparsity between two checkpoints (the understanding paper's Eq. 2):
S(θ⁰, θ¹) = 1 − ‖θ¹ − θ⁰‖₀ / n, the share of parameters left exactly unchanged.

    python tools/sparsity.py CKPT_A CKPT_B [--out result.json]

CKPT_A / CKPT_B: folders written by save_pretrained, .safetensors / .bin files, or hub ids.
"""
import argparse
import json
import re
import sys
from pathlib import Path

import torch


def _strip(k):
    for pre in ("module.", "_orig_mod.", "_fsdp_wrapped_module."):
        k = k.replace(pre, "")
    return k


def _hub_snapshot(repo_id):
    """Local folder of a hub model's weights (downloaded into the HF cache if needed)."""
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(repo_id, allow_patterns=["*.safetensors", "*.json"])
    except Exception as e:
        raise FileNotFoundError(f"{repo_id}: not a local checkpoint folder, and the Hugging Face "
                                f"hub did not provide it ({type(e).__name__}: {str(e)[:200]}). "
                                "Pass a local folder written by save_pretrained, or check the id / "
                                "network.") from None


class Tensors:
    """Streaming access to a model's parameters: nn.Module (or a Policy), state dict, or a
    checkpoint folder / file (safetensors tensor by tensor; .bin / .pt memory-mapped)."""

    def __init__(self, src):
        self.tied, self.sd, self.files, self._bins = False, None, None, {}
        if not isinstance(src, (torch.nn.Module, dict, str, Path)) and isinstance(
                getattr(src, "model", None), torch.nn.Module):
            src = src.model  # a Policy
        if isinstance(src, str) and not Path(src).expanduser().exists() and re.fullmatch(
                r"[\w.-]+/[\w.-]+", src):
            src = _hub_snapshot(src)
        if isinstance(src, torch.nn.Module):
            self.tied = bool(getattr(getattr(src, "config", None), "tie_word_embeddings", False))
            self.sd = dict(src.named_parameters())  # tied weights appear once
        elif isinstance(src, dict):
            self.sd = self._dedup(src)
        else:
            self.files = self._index(Path(str(src)).expanduser(), src)
        if self.sd is not None:
            self.sd = {_strip(k): v for k, v in self.sd.items()}

    def _dedup(self, src):
        seen, sd = set(), {}
        for k, v in src.items():
            if not torch.is_tensor(v):
                continue
            key = (v.data_ptr(), tuple(v.shape), v.dtype) if v.numel() else None
            if key is not None and key in seen:  # the same storage twice = tied
                self.tied = True
                continue
            seen.add(key)
            sd[k] = v
        # copies (Policy.get_weights()) share no storage: a head equal to the embedding is tied
        emb = next((k for k in sd if k.endswith("embed_tokens.weight")), None)
        head = next((k for k in sd if k.endswith("lm_head.weight")), None)
        if emb and head and sd[emb].shape == sd[head].shape and torch.equal(sd[emb], sd[head]):
            self.tied = True
        return sd

    def _index(self, p, src):
        if p.is_dir():
            if (p / "config.json").is_file():
                try:
                    cfg = json.loads((p / "config.json").read_text())
                    self.tied = bool(cfg.get("tie_word_embeddings", False))
                except Exception:
                    pass
            files = (sorted(p.glob("*.safetensors"))
                     or sorted(p.glob("*.bin")) + sorted(p.glob("*.pt")))
            files = [f for f in files if f.name not in ("optimizer.pt", "training_args.bin")]
        elif p.is_file():
            files = [p]
        else:
            raise FileNotFoundError(f"{src}: no such checkpoint folder or file (pass a folder "
                                    "written by save_pretrained, a .safetensors file, a model or "
                                    "a state dict)")
        if not files:
            raise FileNotFoundError(f"{src}: no *.safetensors / *.bin weights in this folder")
        index = {}
        for f in files:
            if f.suffix == ".safetensors":
                from safetensors import safe_open
                with safe_open(str(f), framework="pt") as h:
                    index.update((_strip(k), f) for k in h.keys())
            else:
                sd = torch.load(str(f), map_location="cpu", mmap=True, weights_only=True)
                index.update((_strip(k), f) for k in sd)
        return index

    def keys(self):
        return list(self.sd if self.sd is not None else self.files)

    def get(self, k):
        if self.sd is not None:
            return self.sd[k].detach()
        f = self.files[k]
        if f.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(f), framework="pt") as h:
                return h.get_tensor({_strip(x): x for x in h.keys()}[k])
        if f not in self._bins:  # memory-mapped: loading the dict does not read the tensors
            sd = torch.load(str(f), map_location="cpu", mmap=True, weights_only=True)
            self._bins[f] = {_strip(x): v for x, v in sd.items()}
        return self._bins[f][k]


def layer_type(name):
    n = name.lower()
    for kind, marks in (("norm", ("norm",)), ("embedding", ("embed", "wte", "wpe")),
                        ("lm_head", ("lm_head",)),
                        ("attention", ("attn", "attention", "q_proj", "k_proj", "v_proj",
                                       "o_proj")),
                        ("mlp", ("mlp", "gate_proj", "up_proj", "down_proj", "ffn", "experts"))):
        if any(m in n for m in marks):
            return kind
    return "other"


def unchanged(a, b):
    """Exactly-equal entries (bitwise in the stored dtype: NaN == NaN); float32 if dtypes differ."""
    if a.dtype == b.dtype and a.is_floating_point():
        int_t = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
        if int_t is not None:
            return int((a.contiguous().view(int_t) == b.contiguous().view(int_t)).sum())
    if a.dtype != b.dtype:
        a, b = a.float(), b.float()
    return int((a == b).sum())


def update_sparsity(a, b):
    """Eq. 2 between models, state dicts or checkpoints, tensor by tensor on the CPU, exact equality
    in the stored dtype (bf16 storage rounds small updates away), a tied head counted once.
    {"sparsity", "n_params", "n_unchanged", "dtype", "n_tensors", "tied", "per_type"}."""
    ta, tb = Tensors(a), Tensors(b)
    ka, kb = ta.keys(), set(tb.keys())
    tied = ta.tied or tb.tied
    if tied:  # a tied head is the embedding: count it once, whichever side stored it
        ka = [k for k in ka if k != "lm_head.weight"]
        kb.discard("lm_head.weight")
    only_a, only_b = sorted(set(ka) - kb), sorted(kb - set(ka))
    if only_a or only_b:
        raise ValueError(f"update_sparsity: the two checkpoints hold different parameters: only "
                         f"in A {only_a[:5]}{'...' if len(only_a) > 5 else ''}, only in B "
                         f"{only_b[:5]}. Compare checkpoints of the same architecture.")
    tot = same = 0
    per, dtypes = {}, set()
    for k in ka:
        x, y = ta.get(k).cpu(), tb.get(k).cpu()
        if x.shape != y.shape:
            raise ValueError(f"update_sparsity: {k} has shape {tuple(x.shape)} in A but "
                             f"{tuple(y.shape)} in B")
        name = str(x.dtype).replace("torch.", "")
        dtypes.add(name if x.dtype == y.dtype else f"{name}/{str(y.dtype).replace('torch.', '')}")
        u, m = unchanged(x, y), x.numel()
        tot, same = tot + m, same + u
        d = per.setdefault(layer_type(k), [0, 0])
        d[0], d[1] = d[0] + m, d[1] + u
    if tot == 0:
        raise ValueError("update_sparsity: no parameters to compare")
    return {"sparsity": same / tot, "n_params": tot, "n_unchanged": same,
            "dtype": ",".join(sorted(dtypes)), "n_tensors": len(ka), "tied": tied,
            "per_type": {t: {"sparsity": u / m, "n_params": m}
                         for t, (m, u) in sorted(per.items())}}


def main(argv=None):
    ap = argparse.ArgumentParser(description="update sparsity (Eq. 2) between two checkpoints")
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--out", default="", help="also write the JSON result here")
    args = ap.parse_args(argv)
    res = update_sparsity(args.a, args.b)
    res.update(a=args.a, b=args.b)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
