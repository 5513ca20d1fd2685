"""Benchmark of the verifier and the repetition penalty (prints figures; not a test).

    python tests/bench_verify.py [--n 4096] [--b 2048] [--workers W]

1. math_equal throughput on N mixed answers (all pairs distinct, so the result cache never hits):
   serial (math_equal in a loop, one worker process) vs parallel (math_equal_many over W worker processes).
   Also a "hard" batch where every pair needs math-verify (LaTeX fractions / expressions).
2. repetition_penalty wall time at B questions (R-Zero's rollout batch is 2,048).
"""
import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np  # noqa: E402

import common  # noqa: E402
import infra.verifier  # noqa: E402
import r_zero  # noqa: E402


def mixed_pairs(n, rng):
    """Roughly what a step of verification sees: many integers (GSM8K-like), fractions vs decimals, LaTeX
    expressions, MCQ letters, short strings, unboxed (None) answers, and the odd hostile answer."""
    out = []
    for i in range(n):
        r = rng.random()
        a, b = rng.randint(1, 10**6), rng.randint(2, 97)
        if r < 0.35:
            out.append((f"{a:,}" if rng.random() < 0.3 else str(a), str(a if rng.random() < 0.5 else a + 1)))
        elif r < 0.55:
            out.append((f"\\frac{{{a}}}{{{b}}}", f"{a / b:.6f}" if rng.random() < 0.5 else f"{a}/{b + 1}"))
        elif r < 0.70:
            out.append((f"{b}x^2 + {a % 50}x", f"{a % 50}x + {b}x^{{2}}" if rng.random() < 0.5 else f"{b}x^2-{i}"))
        elif r < 0.78:
            out.append((f"{'ABCD'[i % 4]}) {a} km", "ABCD"[(i + (rng.random() < 0.5)) % 4]))
        elif r < 0.84:
            out.append((f"word{i} answer", f"Word{i} answer." if rng.random() < 0.5 else f"other{i}"))
        elif r < 0.95:
            out.append((None, str(a)))
        else:
            out.append((f"\\sqrt{{{a}}}^{{{b}}} + \\frac{{1}}{{{i}}}", f"{a}^{{{b}/2}}+1/{i}"))
    return out


def hard_pairs(n, rng):
    out = []
    for i in range(n):
        a, b = rng.randint(1, 10**5), rng.randint(2, 997)
        out.append((f"\\frac{{{a}}}{{{b}}}", f"{a / b:.8f}") if i % 2 else (f"{b}y + {i}", f"{i} + y \\cdot {b}"))
    return out


def time_it(fn):
    t = time.perf_counter()
    r = fn()
    return r, time.perf_counter() - t


def questions(B, rng):
    words = ("what is the value of sum product integer real number triangle circle radius area prime find "
             "compute let be such that how many positive solutions equation satisfies given").split()
    base = [" ".join(rng.choice(words) for _ in range(rng.randint(12, 60))) + f" {k}" for k in range(B // 4)]
    qs = []
    for k in range(B):
        q = rng.choice(base)
        if rng.random() < 0.5:  # a near-duplicate: a few words changed
            w = q.split()
            for _ in range(3):
                w[rng.randrange(len(w))] = rng.choice(words)
            q = " ".join(w)
        qs.append(q)
    return qs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--b", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=0, help="0 = min(cpu_count, 8)")
    args = ap.parse_args()
    w = args.workers or None
    print(f"cpu_count={os.cpu_count()}  workers={w or min(os.cpu_count() or 1, 8)}")
    common.math_equal("1", "1.0")           # start one worker (not timed)
    common.math_equal_many([(f"{i}x", f"x*{i}") for i in range(64)], workers=w)   # start the pool (not timed)
    for name, gen, seed in (("mixed", mixed_pairs, 1), ("hard (all math-verify)", hard_pairs, 2)):
        pairs_s = gen(args.n, random.Random(seed))
        pairs_p = gen(args.n, random.Random(seed + 100))  # fresh pairs: no cache hits
        _, ts = time_it(lambda: [common.math_equal(p, g) for p, g in pairs_s])
        res, tp = time_it(lambda: common.math_equal_many(pairs_p, workers=w))
        print(f"math_equal {name:24s} N={args.n}: serial {args.n / ts:8.0f} answers/s ({ts:6.2f} s) | "
              f"parallel {args.n / tp:8.0f} answers/s ({tp:6.2f} s) | speed-up {ts / tp:4.2f}x | "
              f"{np.mean(res):.2f} equal")
    print("verifier failures:", common.math_equal_failures())
    qs = questions(args.b, random.Random(3))
    def repetition_penalty(texts):  # r_zero's r_rep (paper §3: |C_k| / B at lambda 1)
        return r_zero.challenger_rewards(texts, [0.5] * len(texts), r_zero.Config())["r_rep"]
    repetition_penalty(qs[:64])
    rp, t = time_it(lambda: repetition_penalty(qs))
    _, tb = time_it(lambda: common.bleu_distance_matrix(qs))
    print(f"repetition_penalty B={args.b}: {t:.2f} s total (BLEU matrix {tb:.2f} s), "
          f"{len(set(np.round(rp * args.b).astype(int)))} distinct cluster sizes, mean penalty {rp.mean():.4f}")
    infra.verifier.shutdown_verifier()


if __name__ == "__main__":
    main()
