"""Benchmark of the RL core (prints figures; not a test).

    python tests/bench_rl.py                 # both parts
    python tests/bench_rl.py logprobs        # chunked vs naive log-probs at Qwen's vocabulary
    python tests/bench_rl.py train           # pg_step / sft_step tokens/s on the tiny model

1. Peak memory and time of ``common.token_logprobs`` (row-chunked LM head, checkpointed under grad) against the
   naive ``log_softmax(model(ids).logits.float() / T)`` at vocabulary 151,936 x 2,048 completion tokens, with
   and without backward. The model is a 1-layer Qwen3 with hidden size 64 (the LM head is what matters here:
   151,936 x 64). Each measurement runs in a fresh subprocess; peak memory = the process's peak RSS minus
   its RSS just before the call.
2. Train-step throughput on the tiny model (HF backend, so the number is the trainer's alone).
"""
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("SELFPLAY_CACHE", str(ROOT / "tests" / ".cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, PROMPT, COMPLETION, HIDDEN = 151_936, 64, 2_048, 64


def _rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def _one_logprob_run(kind: str, grad: bool) -> dict:
    import resource
    import torch
    import transformers
    import common
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=1, num_key_value_heads=1, head_dim=64,
                                   tie_word_embeddings=False, max_position_embeddings=4096)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=g).tolist()
    comp = torch.randint(0, VOCAB, (COMPLETION,), generator=g).tolist()
    T = 0.7

    def run():
        with torch.set_grad_enabled(grad):
            if kind == "chunked":
                lp, ent = common.token_logprobs(model, [prompt], [comp], temperature=T, with_entropy=True)
                lp, ent = lp[0], ent[0]
            else:
                logits = model(input_ids=torch.tensor([prompt + comp]), use_cache=False).logits[0].float() / T
                logp = torch.log_softmax(logits[PROMPT - 1:-1], -1)
                lp = logp.gather(-1, torch.tensor(comp)[:, None]).squeeze(-1)
                ent = -(logp.exp() * logp).sum(-1)
            if grad:
                (lp.sum() + ent.sum()).backward()
                model.zero_grad(set_to_none=True)
        return lp.detach()

    base = _rss_gb()
    run()  # first call: memory (large tensors are mmap'ed, so the RSS peak is the call's own transient peak)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    t0 = time.perf_counter()
    lp = run()  # second call: time, without first-call allocator/kernel warm-up
    dt = time.perf_counter() - t0
    return {"kind": kind, "grad": grad, "time_s": round(dt, 3), "peak_extra_gb": round(peak - base, 3),
            "sum_logp": float(lp.sum())}


def bench_logprobs() -> None:
    print(f"# log-probs of {COMPLETION} completion tokens after a {PROMPT}-token prompt, vocab {VOCAB}, "
          f"hidden {HIDDEN}, fp32 on CPU (torch threads: {os.environ.get('OMP_NUM_THREADS', 'default')})")
    print(f"# full fp32 logits of these tokens alone: {COMPLETION * VOCAB * 4 / 2**30:.2f} GiB")
    for grad in (False, True):
        for kind in ("naive", "chunked"):
            # fresh process per measurement: ru_maxrss is a process-lifetime peak
            out = subprocess.run([sys.executable, __file__, "_one", kind, str(int(grad))], capture_output=True,
                                 text=True, check=True).stdout.strip().splitlines()[-1]
            r = json.loads(out)
            print(f"{kind:8s} {'fwd+bwd' if grad else 'fwd    '}  time {r['time_s']:7.3f} s   "
                  f"peak extra memory {r['peak_extra_gb']:6.3f} GiB   sum logp {r['sum_logp']:.2f}")


def bench_train() -> None:
    import torch
    import common
    path = common.resolve_model_path("tiny")
    cfg = common.RunConfig(model=path, backend="hf", lr=1e-4, micro_batch_tokens=8192)
    policy = common.Policy.load(cfg)
    g = torch.Generator().manual_seed(0)
    V = policy.model.config.vocab_size
    n_seq, p_len, c_len = 64, 64, 128
    trajs = [common.Trajectory(prompt_ids=torch.randint(0, V, (p_len,), generator=g).tolist(),
                               completion_ids=torch.randint(0, V, (c_len,), generator=g).tolist(),
                               advantage=float(i % 3 - 1), role="solver") for i in range(n_seq)]
    pg = common.PGConfig(aggregation="seq-mean-token-mean")
    common.pg_step(policy, trajs[:8], pg)  # warm-up
    print(f"# tiny model ({sum(p.numel() for p in policy.model.parameters()) / 1e6:.2f}M params), {n_seq} seqs x "
          f"({p_len} prompt + {c_len} completion) tokens, micro-batch budget {cfg.micro_batch_tokens} tokens")
    for upd in (1, 4):
        st = common.pg_step(policy, trajs, common.PGConfig(aggregation="seq-mean-token-mean", updates_per_batch=upd))
        print(f"pg_step updates_per_batch={upd}: {st['time_s']:.2f} s, {st['tokens_per_s']:.0f} completion tokens/s "
              f"(forward+backward passes incl. the no-grad old-log-prob pass), peak RSS {st['peak_mem_gb']:.2f} GiB")
    st = common.sft_step(policy, [(t.prompt_ids, t.completion_ids) for t in trajs])
    print(f"sft_step: {st['time_s']:.2f} s, {st['tokens_per_s']:.0f} target tokens/s")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_one":
        print(json.dumps(_one_logprob_run(sys.argv[2], bool(int(sys.argv[3])))))
        sys.exit(0)
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what in ("all", "logprobs"):
        bench_logprobs()
    if what in ("all", "train"):
        bench_train()
