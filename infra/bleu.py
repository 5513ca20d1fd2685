"""Sentence-BLEU-4 of every pair of a batch at once (R-Zero scores B = 2,048 questions a step).
common.sentence_bleu is the readable definition this kernel must equal (tests/test_verify.py).

The clipped match counts M_n[i, j] = Σ_g min(count_i(g), count_j(g)) of all pairs come from one
pass over the batch's n-grams per order n: an n-gram that few texts share adds to each pair of
them, one that many share adds by matrix products."""
import numpy as np


SMOOTHING_EPS = 0.1  # Chen & Cherry smoothing method 1 (NLTK SmoothingFunction().method1)


NGRAM_WEIGHT = 0.25  # BLEU-4: the log-precisions of n = 1..4 weigh alike


DENSE_DF = 48  # n-grams shared by more texts than this are counted by a matrix product


def bleu_matrix(texts):
    """S[i, j] = sentence-BLEU-4(hypothesis texts[i], reference texts[j]), as NLTK's sentence_bleu
    with SmoothingFunction().method1: whitespace tokens, weights ¼, zero matches -> ε = 0.1,
    0 without a unigram match, brevity penalty exp(1 − |ref|/|hyp|) when |hyp| <= |ref|; that is,
    common.sentence_bleu(texts[i], texts[j])."""
    tokens, lens = token_ids(texts)
    per_order = ngram_match_counts(tokens, lens)
    B = len(lens)
    log_precision = np.zeros((B, B))  # Σ_n w_n log p_n
    for n, matches in enumerate(per_order, start=1):
        smoothed = np.where(matches > 0, matches, SMOOTHING_EPS)  # a zero count becomes ε
        hyp_ngrams = np.maximum(lens - n + 1, 1)[:, None]  # row i: hypothesis i's n-grams
        precision = smoothed / hyp_ngrams
        log_precision += NGRAM_WEIGHT * np.log(precision)
    geometric_mean = np.exp(log_precision)  # of p_1 .. p_4
    bleu = brevity_penalty(lens) * geometric_mean
    has_unigram_match = per_order[0] > 0
    return np.where(has_unigram_match, bleu, 0.0)


def brevity_penalty(lens):
    """BP[i, j] = 1 when |hypothesis i| > |reference j|, else exp(1 − |ref|/|hyp|) (an empty
    hypothesis scores 0 anyway: it matches no unigram)."""
    hyp_len = lens[:, None]  # a column: hypothesis i
    ref_len = lens[None, :]  # a row: reference j
    length_ratio = ref_len / np.maximum(hyp_len, 1)
    shorter_penalty = np.exp(1 - length_ratio)
    longer = hyp_len > ref_len  # no penalty
    return np.where(longer, 1.0, shorter_penalty)


def token_ids(texts):
    """(the whitespace tokens of all texts end to end, as ids of one vocabulary; each text's
    number of tokens)."""
    vocab = {}  # word -> id
    tokens, lens = [], []
    for text in texts:
        words = str(text).split()
        for word in words:
            if word not in vocab:
                vocab[word] = len(vocab)
            tokens.append(vocab[word])
        lens.append(len(words))
    return np.array(tokens, dtype=np.int64), np.array(lens, dtype=np.int64)


def ngram_match_counts(tokens, lens, n_max=4):
    """[M_1, ..., M_n_max] of a batch (token_ids): M_n[i, j] = Σ_g min(count_i(g), count_j(g))
    over the n-grams g, and M_n[i, i] the number of n-grams of text i."""
    B = len(lens)
    vocab_size = 1
    if tokens.size:
        vocab_size = int(tokens.max()) + 1
    text_of = np.repeat(np.arange(B), lens)  # the text of each token
    text_ends = np.cumsum(lens)
    token_text_end = text_ends[text_of]  # where the token's text ends
    gram_at = tokens  # the id of the n-gram starting at each position
    per_order = []
    for n in range(1, n_max + 1):
        # an n-gram is its (n-1)-gram and one more token; the ids are exact and made dense again
        # by np.unique, so they never overflow
        if n == 1:
            key = tokens
        else:
            prefix = gram_at[:-1]  # the (n-1)-gram at each position where an n-gram can start
            last_token = tokens[n - 1:]
            key = prefix * vocab_size + last_token
        distinct, gram_at = np.unique(key, return_inverse=True)
        start = np.arange(len(gram_at))
        end = start + n
        inside = end <= token_text_end[start]  # n-grams running past their text are left out
        text_of_gram = text_of[start][inside]
        gram_id = gram_at[inside]
        M = shared_matches(text_of_gram, gram_id, len(distinct), B)
        ngrams = np.maximum(lens - n + 1, 0)
        np.fill_diagonal(M, ngrams)
        per_order.append(M)
    return per_order


def shared_matches(text_of, gram_id, n_distinct, B):
    """M[i, j] = Σ_g min(count_i(g), count_j(g)) over the n-grams that two texts or more hold
    (the diagonal is the caller's). text_of, gram_id: the text and n-gram of each position."""
    position_key = text_of * n_distinct + gram_id
    key, count = np.unique(position_key, return_counts=True)
    text = key // n_distinct  # one entry per (text, n-gram) held, with its count
    gram = key % n_distinct
    holders = np.bincount(gram, minlength=n_distinct)  # how many texts hold each n-gram
    texts_holding = holders[gram]
    shared = texts_holding >= 2
    dense = texts_holding > DENSE_DF
    rare = shared & ~dense
    M = np.zeros((B, B))
    if dense.any():
        M += dense_matches(text[dense], gram[dense], count[dense], B)
    if rare.any():
        M += rare_matches(text[rare], gram[rare], count[rare], B)
    return M


def dense_matches(text, gram, count, B):
    """The part of M of the n-grams many texts share, by matrix products over count levels:
    min(c_i, c_j) = Σ_{t >= 1} [c_i >= t]·[c_j >= t]. (text, gram, count): one entry per text
    and n-gram it holds, with how often it holds it."""
    grams, column = np.unique(gram, return_inverse=True)
    counts = np.zeros((B, len(grams)), dtype=np.float32)  # counts[text, gram]
    counts[text, column] = count
    M = np.zeros((B, B))
    highest_count = int(counts.max())
    for level in range(1, highest_count + 1):
        at_least = (counts >= level).astype(np.float32)
        M += at_least @ at_least.T
    return M


def rare_matches(text, gram, count, B):
    """The part of M of the n-grams few texts share, pair by pair. Sorted by n-gram, the texts
    holding one n-gram are adjacent: entries `offset` apart pair up where their n-gram is the same.
    (text, gram, count): as dense_matches."""
    order = np.argsort(gram)
    text = text[order]
    gram = gram[order]
    count = count[order]
    cells, mins = [], []  # M's flat index i * B + j and min(c_i, c_j) of each pair, both ways
    for offset in range(1, DENSE_DF):
        same_gram = gram[offset:] == gram[:-offset]  # entry k against entry k + offset
        first = np.flatnonzero(same_gram)
        if first.size == 0:  # no n-gram is held by more than `offset` texts
            break
        second = first + offset
        text_i = text[first]
        text_j = text[second]
        pair_min = np.minimum(count[first], count[second])
        cells += [text_i * B + text_j, text_j * B + text_i]
        mins += [pair_min, pair_min]
    cells = np.concatenate(cells)
    mins = np.concatenate(mins)
    summed = np.bincount(cells, weights=mins, minlength=B * B)
    return summed.reshape(B, B)
