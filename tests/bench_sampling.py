"""Sampling throughput, vLLM vs Hugging Face generate, and the cost of one weight sync.

    python tests/bench_sampling.py                       # tiny model on CPU: 64 prompts x 8 samples x 128 tokens
    python tests/bench_sampling.py --model Qwen/Qwen3-4B-Base --max-model-len 4096   # on a GPU

Prints completion tokens/s for both backends, measured in the same process on the same prompts, and the
seconds of Policy.sync() (trainer weights -> vLLM engine, in place) and of set_weights (swap to a stored set).
Not a test: figures only.
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import common  # noqa: E402


def _prompts(k: int) -> list:
    topics = ["the sum of two numbers", "a prime", "a list in python", "a triangle", "a fraction", "speed"]
    return [[{"role": "user", "content": f"Question {i}: explain {topics[i % len(topics)]} with {i} steps."}]
            for i in range(k)]


def _measure(sampler, prompts, n, max_tokens, label):
    sampler.generate(prompts[:2], n=2, temperature=1.0, max_tokens=8)  # warm-up (kernels, caches)
    t0, c0 = time.perf_counter(), time.process_time()
    out = sampler.generate(prompts, n=n, temperature=1.0, max_tokens=max_tokens)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    toks = sum(len(c.token_ids) for g in out for c in g)
    seqs = sum(len(g) for g in out)
    # CPU seconds (all threads of this process) make the figure comparable on a machine shared with others
    print(f"{label:>5}: {seqs} completions, {toks} completion tokens in {dt:.2f} s = {toks / dt:,.0f} tokens/s "
          f"(process CPU {cpu:.1f} s = {toks / max(cpu, 1e-9):,.0f} tokens per CPU-second)", flush=True)
    return {"completions": seqs, "tokens": toks, "seconds": dt, "tokens_per_s": toks / dt, "cpu_seconds": cpu}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--hf-batch", type=int, default=64, help="sequences per HF generate call")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--syncs", type=int, default=5)
    args = ap.parse_args()

    cfg = common.RunConfig(model=args.model, backend="vllm", max_model_len=args.max_model_len)
    common.seed_everything(0)
    t0 = time.perf_counter()
    policy = common.Policy.load(cfg)
    print(f"policy + vLLM engine loaded in {time.perf_counter() - t0:.1f} s "
          f"({sum(p.numel() for p in policy.model.parameters()) / 1e6:.2f}M params, device {policy.device}, "
          f"threads {torch.get_num_threads()})", flush=True)
    prompts = _prompts(args.prompts)
    res = {"config": vars(args)}
    res["vllm"] = _measure(policy.sampler, prompts, args.n, args.max_tokens, "vllm")
    if not args.skip_hf:
        hf = common.HFSampler(policy.model_path, policy.tokenizer, cfg, model=policy.model, batch_size=args.hf_batch)
        res["hf"] = _measure(hf, prompts, args.n, args.max_tokens, "hf")
        print(f"vLLM / HF speed-up: {res['vllm']['tokens_per_s'] / res['hf']['tokens_per_s']:.1f}x")

    times = []
    for _ in range(args.syncs):
        with torch.no_grad():
            for p in policy.model.parameters():
                p.mul_(1.0 + 1e-3)
        t0 = time.perf_counter()
        policy.sync()
        times.append(time.perf_counter() - t0)
    base = policy.get_weights()
    t0 = time.perf_counter()
    policy.set_weights(base)
    swap = time.perf_counter() - t0
    res["sync_s"] = {"median": statistics.median(times), "min": min(times), "max": max(times)}
    res["set_weights_s"] = swap
    print(f"weight sync (Policy.sync, {args.syncs}x): median {statistics.median(times) * 1e3:.1f} ms, "
          f"min {min(times) * 1e3:.1f} ms; set_weights (swap to stored set): {swap * 1e3:.1f} ms")
    print(json.dumps(res))
    policy.sampler.close()


if __name__ == "__main__":
    main()
