"""Time Policy.sync() (trainer weights -> the colocated vLLM engine) on a model with Qwen3-0.6B's exact
architecture and random weights, built locally (no hub), against a plain copy of the same bytes.

    python tests/bench_sync.py [--out DIR] [--repeats 3] [--profile]

Needs about 7 GB resident before the first sync (trainer and engine weights in fp32, 1 GB of KV
cache); each sync raised it by about 0.5-0.9 GB here (9.9 GB after three), so keep --repeats low.
Prints the seconds of each sync, the memory-copy time of the same bytes, and with --profile the top
functions of one sync by cumulative time.
"""
import argparse
import cProfile
import os
import pathlib
import pstats
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
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                 torch_dtype="bfloat16")


def build(out: pathlib.Path) -> str:
    """Random-weight Qwen3-0.6B-shaped model in ``out`` with the tiny test model's tokenizer."""
    if (out / "model.safetensors").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    tiny = pathlib.Path(common.resolve_model_path("tiny"))
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json",
                                                        "merges.txt", "generation_config.json"):
            shutil.copy(f, out / f.name)
    conf = transformers.Qwen3Config(**QWEN3_06B)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(conf).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/qwen3-0.6b-shape")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    path = build(pathlib.Path(args.out))
    cfg = common.RunConfig(model=path, backend="vllm", max_model_len=1024, dtype="float32")
    t = time.perf_counter()
    policy = common.Policy.load(cfg)
    print(f"load (trainer + engine): {time.perf_counter() - t:.1f} s", flush=True)
    n_bytes = sum(v.numel() * v.element_size() for _, v in policy.iter_full_weights())
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        policy.sync()
        times.append(time.perf_counter() - t)
    print(f"sync of {n_bytes / 2**30:.2f} GiB: " + ", ".join(f"{x:.2f}" for x in times) + " s", flush=True)
    src = [v for _, v in policy.iter_full_weights()]
    dst = [torch.empty_like(v) for v in src]
    t = time.perf_counter()
    for a, b in zip(dst, src):
        a.copy_(b)
    print(f"plain copy of the same tensors: {time.perf_counter() - t:.2f} s", flush=True)
    del dst
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        policy.sync()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    policy.sampler.close()


if __name__ == "__main__":
    main()
