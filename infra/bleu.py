"""Sentence-BLEU-4 of every pair of a batch at once (R-Zero scores B = 2,048 questions a step).
common.sentence_bleu is the readable definition this kernel must equal (tests/test_verify.py)."""
import numpy as np


SMOOTHING_EPS = 0.1  # Chen & Cherry smoothing method 1 (NLTK SmoothingFunction().method1)


DENSE_DF = 48  # n-grams shared by more texts than this are counted by a matrix product


def ngram_match_counts(seqs, n_max=4):
    """Per order n: (M_n[i, j] = Σ_g min(count_i(g), count_j(g)), n-grams of each text)."""
    B = len(seqs)
    lens = np.array([len(s) for s in seqs], dtype=np.int64)
    offsets = np.cumsum(lens) - lens
    toks = np.concatenate(seqs) if B and lens.sum() else np.zeros(0, dtype=np.int64)
    V = int(toks.max()) + 1 if toks.size else 1
    out = []
    prev_ids = toks.copy()  # id of the (n-1)-gram starting at each position (where it fits)
    for n in range(1, n_max + 1):
        cnt = np.maximum(lens - n + 1, 0)
        total = int(cnt.sum())
        M = np.zeros((B, B), dtype=np.float64)
        if total:
            text_of = np.repeat(np.arange(B), cnt)
            first = np.repeat(np.cumsum(cnt) - cnt, cnt)  # each text's first n-gram, repeated
            starts = np.repeat(offsets, cnt) + np.arange(total) - first
            # exact ids: (id of the (n-1)-gram at s) * V + token at s+n-1, re-densified by np.unique
            gram = toks[starts] if n == 1 else prev_ids[starts] * V + toks[starts + n - 1]
            uniq_g, gid = np.unique(gram, return_inverse=True)
            prev_ids = np.full(toks.shape[0], -1, dtype=np.int64)
            prev_ids[starts] = gid
            G = len(uniq_g)
            key, c = np.unique(text_of * G + gid, return_counts=True)  # (text, gram) -> count
            t_i, g_i = key // G, key % G
            df = np.bincount(g_i, minlength=G)
            shared = df[g_i] >= 2
            dense = shared & (df[g_i] > DENSE_DF)
            rare = shared & ~dense
            if dense.any():
                gd, col = np.unique(g_i[dense], return_inverse=True)
                C = np.zeros((B, len(gd)), dtype=np.float32)
                C[t_i[dense], col] = c[dense]
                for t in range(1, int(C.max()) + 1):
                    at_least = (C >= t).astype(np.float32)
                    M += at_least @ at_least.T
            if rare.any():  # every pair of texts sharing a rare n-gram, groups of one size at once
                rt, rg, rc = t_i[rare], g_i[rare], c[rare].astype(np.float64)
                order = np.lexsort((rt, rg))
                rt, rg, rc = rt[order], rg[order], rc[order]
                starts_g = np.concatenate([[0], np.flatnonzero(np.diff(rg)) + 1])
                sizes = np.diff(np.concatenate([starts_g, [len(rg)]]))
                idx_all, val_all = [], []
                for s in np.unique(sizes):
                    st = starts_g[sizes == s][:, None] + np.arange(s)[None, :]
                    ti, ci = rt[st], rc[st]
                    idx_all.append((ti[:, :, None] * B + ti[:, None, :]).ravel())
                    val_all.append(np.minimum(ci[:, :, None], ci[:, None, :]).ravel())
                idx, val = np.concatenate(idx_all), np.concatenate(val_all)
                M += np.bincount(idx, weights=val, minlength=B * B).reshape(B, B)
        np.fill_diagonal(M, cnt)
        out.append((M, cnt.astype(np.float64)))
    return out, lens


def bleu_matrix(texts):
    """S[i, j] = sentence-BLEU-4(hypothesis texts[i], reference texts[j]), as NLTK's sentence_bleu
    with SmoothingFunction().method1: whitespace tokens, weights ¼, zero matches -> ε = 0.1,
    0 without a unigram match, brevity penalty exp(1 − |ref|/|hyp|) when |hyp| <= |ref|."""
    vocab = {}
    seqs = [np.array([vocab.setdefault(w, len(vocab)) for w in str(t).split()], dtype=np.int64)
            for t in texts]
    per_n, lens = ngram_match_counts(seqs)
    L = lens.astype(np.float64)
    logp = sum(0.25 * np.log(np.where(M > 0, M, SMOOTHING_EPS) / np.maximum(cnt, 1.0)[:, None])
               for M, cnt in per_n)
    bp = np.where(L[:, None] > L[None, :], 1.0, np.exp(1 - L[None, :] / np.maximum(L[:, None], 1)))
    bp[L == 0, :] = 0.0
    return np.where(per_n[0][0] > 0, bp * np.exp(logp), 0.0)
