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
        self.tied = False  # the head is the embedding: counted once
        self.sd = None  # name -> tensor, for a module or a state dict
        self.files = None  # name -> the checkpoint file that holds it
        self._bins = {}  # a .bin / .pt file -> its memory-mapped state dict
        if not isinstance(src, (torch.nn.Module, dict, str, Path)):
            if isinstance(getattr(src, "model", None), torch.nn.Module):
                src = src.model  # a Policy
        if isinstance(src, str) and not Path(src).expanduser().exists():
            if re.fullmatch(r"[\w.-]+/[\w.-]+", src):  # a hub id
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
        """The tensors of a state dict, a tensor that shares another's storage (tied) left out."""
        storages, sd = set(), {}
        for k, v in src.items():
            if not torch.is_tensor(v):
                continue
            storage = None
            if v.numel():
                storage = (v.data_ptr(), tuple(v.shape), v.dtype)
            if storage is not None and storage in storages:  # the same storage twice = tied
                self.tied = True
                continue
            storages.add(storage)
            sd[k] = v
        # copies (Policy.get_weights()) share no storage: a head equal to the embedding is tied
        emb = _name_ending(sd, "embed_tokens.weight")
        head = _name_ending(sd, "lm_head.weight")
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
        if self.sd is not None:
            return list(self.sd)
        return list(self.files)

    def get(self, k):
        if self.sd is not None:
            return self.sd[k].detach()
        f = self.files[k]
        if f.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(f), framework="pt") as h:
                stored_name = {_strip(x): x for x in h.keys()}[k]
                return h.get_tensor(stored_name)
        if f not in self._bins:  # memory-mapped: loading the dict does not read the tensors
            sd = torch.load(str(f), map_location="cpu", mmap=True, weights_only=True)
            self._bins[f] = {_strip(x): v for x, v in sd.items()}
        return self._bins[f][k]


def _name_ending(names, suffix):
    for name in names:
        if name.endswith(suffix):
            return name
    return None


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
        same_size_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
        if same_size_int is not None:  # compare the bits
            a_bits = a.contiguous().view(same_size_int)
            b_bits = b.contiguous().view(same_size_int)
            return int((a_bits == b_bits).sum())
    if a.dtype != b.dtype:
        a, b = a.float(), b.float()
    return int((a == b).sum())


def _dtype_name(tensor):
    return str(tensor.dtype).replace("torch.", "")


def update_sparsity(a, b):
    """Eq. 2 between models, state dicts or checkpoints, tensor by tensor on the CPU, exact equality
    in the stored dtype (bf16 storage rounds small updates away), a tied head counted once.
    {"sparsity", "n_params", "n_unchanged", "dtype", "n_tensors", "tied", "per_type"}."""
    ta = Tensors(a)
    tb = Tensors(b)
    ka = ta.keys()
    kb = set(tb.keys())
    tied = ta.tied or tb.tied
    if tied:  # a tied head is the embedding: count it once, whichever side stored it
        ka = [k for k in ka if k != "lm_head.weight"]
        kb.discard("lm_head.weight")
    only_a = sorted(set(ka) - kb)
    only_b = sorted(kb - set(ka))
    if only_a or only_b:
        raise ValueError(f"update_sparsity: the two checkpoints hold different parameters: only "
                         f"in A {only_a[:5]}{'...' if len(only_a) > 5 else ''}, only in B "
                         f"{only_b[:5]}. Compare checkpoints of the same architecture.")
    n_params = {}  # per layer type
    n_unchanged = {}
    dtypes = set()
    for k in ka:
        x = ta.get(k).cpu()
        y = tb.get(k).cpu()
        if x.shape != y.shape:
            raise ValueError(f"update_sparsity: {k} has shape {tuple(x.shape)} in A but "
                             f"{tuple(y.shape)} in B")
        dtype = _dtype_name(x)
        if x.dtype != y.dtype:
            dtype += "/" + _dtype_name(y)
        dtypes.add(dtype)
        kind = layer_type(k)
        n_params[kind] = n_params.get(kind, 0) + x.numel()
        n_unchanged[kind] = n_unchanged.get(kind, 0) + unchanged(x, y)
    total = sum(n_params.values())
    if total == 0:
        raise ValueError("update_sparsity: no parameters to compare")
    total_unchanged = sum(n_unchanged.values())
    per_type = {}
    for kind in sorted(n_params):
        per_type[kind] = {"sparsity": n_unchanged[kind] / n_params[kind],
                          "n_params": n_params[kind]}
    return {"sparsity": total_unchanged / total,
            "n_params": total,
            "n_unchanged": total_unchanged,
            "dtype": ",".join(sorted(dtypes)),
            "n_tensors": len(ka),
            "tied": tied,
            "per_type": per_type}


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
