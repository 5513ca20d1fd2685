"""Update sparsity between a base model and a trained one, as released: Eq. 2 of "Towards
Understanding Self-play for LLM Reasoning" (§3.4), the share of parameters left exactly
unchanged, overall and per layer type: S(θ⁰, θ¹) = 1 − ‖θ¹ − θ⁰‖₀ / n.

    python tools/sparsity.py BASE TRAINED [--dtype base] [--out result.json]

BASE, TRAINED: 'tiny', a hub id, a folder written by save_pretrained (a run's checkpoints/step_<k>),
or a .safetensors / .bin file. Our checkpoints hold fp32 master weights, while a released checkpoint
is cast to its base's dtype (bf16 for Qwen), which rounds most small updates away, and the paper
measured released checkpoints. So by default the trained weights are cast to the dtype the base
stores each tensor in (round to nearest, as `model.to(dtype)` does) before comparing; `--dtype
float32` counts every weight the optimizer moved.
"""
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from infra.cli import ArgParser  # noqa: E402
from infra.lazy import LazyModule  # noqa: E402
from tools.evaluate import output_path  # noqa: E402

torch = LazyModule("torch", globals())  # imported on first use: --help and bad paths answer first

# --dtype: "base" compares each tensor in the dtype the base stores it in; the others cast both
DTYPES = {"base": "base", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
          "fp16": "float16", "float32": "float32", "fp32": "float32"}
_FIX = "pass 'tiny', a hub id, a folder written by save_pretrained, or a .safetensors / .bin file"


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
        raise FileNotFoundError(f"{repo_id}: not a local checkpoint, and the Hugging Face hub did "
                                f"not provide it ({type(e).__name__}); {_FIX}") from None


def checkpoint_path(name: str, flag: str) -> str:
    """A local path for a checkpoint named as the methods' --model accepts it, or a weights file."""
    if Path(name).expanduser().exists():  # a folder (config.json or not) or a weights file
        return str(Path(name).expanduser())
    common.check_model(name, flag)  # 'tiny', or a hub id (cached, when offline)
    path = common.resolve_model_path(name)  # builds 'tiny' once
    if Path(path).exists():
        return path
    return _hub_snapshot(path)


def _read_error(file, error):
    return ValueError(f"{file}: cannot read its weights ({type(error).__name__}: "
                      f"{str(error)[:200]}); pass an intact checkpoint")


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
            raise FileNotFoundError(f"{src}: no such checkpoint folder or file; {_FIX}")
        if not files:
            raise FileNotFoundError(f"{src}: no *.safetensors / *.bin weights in this folder; "
                                    f"{_FIX}")
        index = {}
        for f in files:
            try:
                index.update((_strip(k), f) for k in self._names_in(f))
            except Exception as e:  # a truncated or foreign file
                raise _read_error(f, e) from None
        return index

    @staticmethod
    def _names_in(file):
        if file.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(file), framework="pt") as h:
                return list(h.keys())
        return list(torch.load(str(file), map_location="cpu", mmap=True, weights_only=True))

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


def as_released(base, trained, dtype="base"):
    """Both tensors as checkpoints saved in `dtype` hold them (round to nearest): "base" casts the
    trained tensor to the base's dtype. Integer tensors are compared as stored."""
    if not (base.is_floating_point() and trained.is_floating_point()):
        return base, trained
    target = base.dtype
    if dtype != "base":
        target = getattr(torch, DTYPES[dtype])
    return base.to(target), trained.to(target)


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


def _shared_names(ta, tb):
    """The parameter names both sides hold (a tied head counted once), or a ValueError."""
    names = ta.keys()
    other = set(tb.keys())
    if ta.tied or tb.tied:  # a tied head is the embedding: count it once, whichever side stored it
        names = [k for k in names if k != "lm_head.weight"]
        other.discard("lm_head.weight")
    only_a = sorted(set(names) - other)
    only_b = sorted(other - set(names))
    if only_a or only_b:
        raise ValueError(f"the two checkpoints hold different parameters (only in the base: "
                         f"{only_a[:3]}, only in the trained: {only_b[:3]}); compare a trained "
                         "model with its own base")
    return names


def update_sparsity(a, b, dtype="base"):
    """Eq. 2 between a base `a` and a trained `b` (models, state dicts or checkpoints), tensor by
    tensor on the CPU, exact equality after `as_released(dtype)`, a tied head counted once.
    {"sparsity", "n_params", "n_unchanged", "dtype", "stored_dtype", "n_tensors", "tied",
    "per_type": {type: {"sparsity", "n_params"}}}; "dtype" is the one compared in."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    ta = Tensors(a)
    tb = Tensors(b)
    names = _shared_names(ta, tb)
    n_params = {}  # per layer type
    n_unchanged = {}
    compared = set()  # the dtypes compared in
    stored = {"base": set(), "trained": set()}
    for k in names:
        x = ta.get(k).cpu()
        y = tb.get(k).cpu()
        if x.shape != y.shape:
            raise ValueError(f"{k} has shape {tuple(x.shape)} in the base but {tuple(y.shape)} "
                             "in the trained model; compare a trained model with its own base")
        stored["base"].add(_dtype_name(x))
        stored["trained"].add(_dtype_name(y))
        x, y = as_released(x, y, dtype)
        compared.add(_dtype_name(x))
        kind = layer_type(k)
        n_params[kind] = n_params.get(kind, 0) + x.numel()
        n_unchanged[kind] = n_unchanged.get(kind, 0) + unchanged(x, y)
    total = sum(n_params.values())
    if total == 0:
        raise ValueError("no parameters to compare; pass checkpoints that hold weights")
    total_unchanged = sum(n_unchanged.values())
    per_type = {}
    for kind in sorted(n_params):
        per_type[kind] = {"sparsity": n_unchanged[kind] / n_params[kind],
                          "n_params": n_params[kind]}
    return {"sparsity": total_unchanged / total,
            "n_params": total,
            "n_unchanged": total_unchanged,
            "dtype": ",".join(sorted(compared)),
            "stored_dtype": {side: ",".join(sorted(kinds)) for side, kinds in stored.items()},
            "n_tensors": len(names),
            "tied": ta.tied or tb.tied,
            "per_type": per_type}


def headline(result: dict) -> str:
    """The plain line printed before the JSON."""
    by_type = []
    for kind, figures in result["per_type"].items():
        by_type.append(f"{kind} {figures['sparsity']:.1%}")
    return (f"{result['sparsity']:.1%} of parameters unchanged; by layer type: "
            f"{', '.join(by_type)} ({result['n_params']:,} parameters, compared in "
            f"{result['dtype']})")


def build_parser():
    parser = ArgParser(
        prog="sparsity.py",
        description="Measure the update sparsity of a trained model against its base: the share "
                    "of parameters left exactly unchanged (Eq. 2 of 'Towards Understanding "
                    "Self-play for LLM Reasoning'), overall and per layer type.")
    parser.add_argument("base", help="the base model: 'tiny', a hub id, a save_pretrained folder, "
                                     "or a .safetensors / .bin file")
    parser.add_argument("trained", help="the trained model (a run's checkpoints/step_<k>), as BASE")
    parser.add_argument("--dtype", default="base", choices=list(DTYPES),
                        help="compare in this dtype; 'base' (default) casts the trained weights "
                             "to the base's dtype, as a released checkpoint is cast")
    parser.add_argument("--out", default="",
                        help="also write the JSON result to this file (or a folder, for "
                             "sparsity.json in it)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        out = None
        if args.out:
            out = output_path(args.out, "sparsity.json")  # created and checked writable first
        base = checkpoint_path(args.base, "base")
        trained = checkpoint_path(args.trained, "trained")
        result = update_sparsity(base, trained, args.dtype)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    result.update(base=args.base, trained=args.trained)
    text = json.dumps(result, indent=2)
    print(headline(result))
    print(text)
    if out is not None:
        out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
