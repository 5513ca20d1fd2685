"""Time Policy.sync() (trainer weights -> the colocated vLLM engine) on a model with Qwen3-0.6B's
exact architecture and random weights, built locally (no hub), against a plain copy of the same
bytes.

    python tests/bench_sync.py [--out DIR] [--repeats 3] [--layers 28] [--profile]

Needs about 8 GB resident before the first sync (trainer and engine weights in fp32, 1 GB of KV
cache). Prints per sync its seconds, the resident size after it and the GiB of fresh pages it
touched; then a copy of the same tensors into fresh and into reused buffers; then checks that
vLLM's greedy output equals HF's after a perturbed sync. --profile splits one sync into vLLM's
per-layer work and its two kernels (the loaders' copies, the oneDNN repacking on CPU).
"""
import argparse
import cProfile
import collections
import os
import pathlib
import pstats
import resource
import shutil
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import common  # noqa: E402

# Qwen3-0.6B's config.json on the hub (Qwen/Qwen3-0.6B), the fields that fix the shapes.
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True, hidden_act="silu", torch_dtype="bfloat16")


def build(out: pathlib.Path, layers: int) -> str:
    """Random-weight Qwen3-0.6B-shaped model (``layers`` decoder layers) in ``out`` with the tiny
    test model's tokenizer."""
    if (out / "model.safetensors").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    tiny = pathlib.Path(common.resolve_model_path("tiny"))
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json",
                                                        "merges.txt", "generation_config.json"):
            shutil.copy(f, out / f.name)
    conf = transformers.Qwen3Config(**{**QWEN3_06B, "num_hidden_layers": layers})
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(conf).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


def rss_gb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 2**20


def fresh_gib() -> float:
    """GiB of pages first touched so far (minor faults): memory the kernel had to hand out."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt * resource.getpagesize() / 2**30


def profile(policy) -> None:
    """One sync: seconds per vLLM layer type (vllm/model_executor/model_loader/reload/layerwise.py
    _layerwise_process) and the top functions by own time."""
    from vllm.model_executor.model_loader.reload import layerwise
    per_layer, calls, process = collections.defaultdict(float), collections.Counter(), \
        layerwise._layerwise_process

    def timed_process(layer, info):
        t = time.perf_counter()
        process(layer, info)
        per_layer[type(layer).__name__] += time.perf_counter() - t
        calls[type(layer).__name__] += 1

    layerwise._layerwise_process = timed_process
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    policy.sync()
    prof.disable()
    total = time.perf_counter() - t
    layerwise._layerwise_process = process
    print(f"profiled sync: {total:.2f} s; per layer type (load into fresh tensors, process, copy "
          "back):")
    for name in sorted(per_layer, key=per_layer.get, reverse=True):
        print(f"  {name:28s} x{calls[name]:3d} {per_layer[name]:6.2f} s")
    pstats.Stats(prof).sort_stats("tottime").print_stats(8)


def check_greedy(policy) -> None:
    """After perturbing the trainer and a sync, vLLM's greedy tokens equal HF's on the trainer."""
    hf = common.HFSampler(policy.model_path, policy.tokenizer, policy.cfg, model=policy.model)
    prompts = ["What is 2+3?", "def f(x):"]
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in policy.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    policy.sync()
    ids = [[g[0].token_ids for g in s.generate(prompts, temperature=0, max_tokens=8)]
           for s in (policy.sampler, hf)]
    assert ids[0] == ids[1], f"vLLM {ids[0]} != HF {ids[1]} after a sync"
    print("check: vLLM greedy == HF greedy after a perturbed sync", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/qwen3-0.6b-shape")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--layers", type=int, default=QWEN3_06B["num_hidden_layers"],
                    help="fewer decoder layers: the same per-layer shapes in less memory")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    if args.layers != QWEN3_06B["num_hidden_layers"]:
        out = out.with_name(f"{out.name}-{args.layers}l")
    path = build(out, args.layers)
    cfg = common.RunConfig(model=path, backend="vllm", max_model_len=1024, dtype="float32")
    t = time.perf_counter()
    policy = common.Policy.load(cfg)
    print(f"load (trainer + engine): {time.perf_counter() - t:.1f} s", flush=True)
    n_bytes = sum(v.numel() * v.element_size() for _, v in policy.iter_full_weights())
    print(f"weights: {n_bytes / 2**30:.2f} GiB; resident before the first sync: {rss_gb():.2f} GB",
          flush=True)
    for i in range(args.repeats):
        t, fresh = time.perf_counter(), fresh_gib()
        policy.sync()
        print(f"sync {i}: {time.perf_counter() - t:.2f} s, resident {rss_gb():.2f} GB, "
              f"{fresh_gib() - fresh:.2f} GiB fresh pages", flush=True)
    src = [v for _, v in policy.iter_full_weights()]
    dst = [torch.empty_like(v) for v in src]
    for buffers in ("fresh", "reused"):
        t = time.perf_counter()
        for a, b in zip(dst, src):
            a.copy_(b)
        print(f"plain copy of the same tensors into {buffers} buffers: "
              f"{time.perf_counter() - t:.2f} s", flush=True)
    del dst
    if args.profile:
        profile(policy)
    check_greedy(policy)
    policy.sampler.close()


if __name__ == "__main__":
    main()
