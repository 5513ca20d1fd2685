# ============================================================================================================
# Verifiers, reward shapes, evaluation and the self-play analyses (issue #4).
#
# Everything a method needs to turn text into a reward or a score lives here:
#   extraction    extract_boxed, extract_tag, choice_letter, normalize_string
#   checking      math_equal / math_equal_many (math-verify in killable worker processes), majority_vote
#   reward shapes learnability_reward (AZR Eq. 4), uncertainty_reward (R-Zero; understanding paper Eq. 3),
#                 variance_reward (SPICE Eq. 1), threshold_reward, repetition_penalty (R-Zero BLEU clusters),
#                 the format constants of AZR (Eq. 6) and SPICE
#   evaluation    pass_at_k (+ bootstrap CI), load_benchmark, evaluate
#   analyses      update_sparsity (understanding paper Eq. 2), decontamination (13-gram overlap),
#                 diversity metrics (distinct-n, self-BLEU, cluster count), the `eval` / `sparsity` CLI
# ============================================================================================================
import atexit
import json
import math
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from collections import Counter
from decimal import Decimal, InvalidOperation
from pathlib import Path

import numpy as np
import torch

# ------------------------------------------------------------------------------------------------------------
# Answer extraction
# ------------------------------------------------------------------------------------------------------------
_VF_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")


def extract_boxed(text):
    """Content of the LAST `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces matched; None if there is none.

    `\\boxed {x}` (spaces before the brace) and `\\boxed 5` (a single token, TeX style) are accepted. Escaped
    braces `\\{ \\}` inside the box do not count for matching. If the last box is never closed (a truncated
    generation), the answer is None: the model did not finish writing it. Linear time in len(text).
    """
    if not isinstance(text, str) or not text:
        return None
    last = None
    for m in _VF_BOX_RE.finditer(text):
        last = m
    if last is None:
        return None
    i, n = last.end(), len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    if i >= n:
        return None
    if text[i] != "{":  # `\boxed 5`: up to whitespace or a math delimiter
        j = i
        while j < n and text[j] not in " \t\r\n$":
            j += 1
        tok = text[i:j].strip()
        return tok or None
    depth, j, start = 0, i, i + 1
    while j < n:
        ch = text[j]
        if ch == "\\":
            j += 2  # skip the escaped character (\{ \} \\)
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:j].strip()
        j += 1
    return None


def extract_tag(text, tag, last=True):
    """Content of a `<tag>...</tag>` block (stripped), the last complete one by default; None if absent.

    Uses str.find / rfind rather than a regex so that hostile text (thousands of unclosed `<tag>`) stays linear.
    """
    if not isinstance(text, str) or not text:
        return None
    op, cl = f"<{tag}>", f"</{tag}>"
    if last:
        e = text.rfind(cl)
        if e < 0:
            return None
        s = text.rfind(op, 0, e)
        if s < 0:
            return None
        return text[s + len(op):e].strip()
    s = text.find(op)
    if s < 0:
        return None
    e = text.find(cl, s + len(op))
    if e < 0:
        return None
    return text[s + len(op):e].strip()


_VF_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")


def _vf_unwrap_text(s):
    for _ in range(3):  # nested \text{\textbf{x}}; bounded so hostile input stays cheap
        t = _VF_TEXT_CMD_RE.sub(r"\1", s)
        if t == s:
            break
        s = t
    return s


def normalize_string(s):
    """Normalised form for string answers (SPICE's "String" type, §4): unwrap `\\text{}`-like commands,
    lowercase, and drop every character that is not a letter or a digit (spaces and punctuation included).
    `"The Krebs cycle."` -> `"thekrebscycle"`. Not for numbers: "1.5" and "15" normalise alike, which is why
    math_equal only uses this for answers made of words."""
    if s is None:
        return ""
    s = _vf_unwrap_text(str(s)).lower()
    return "".join(ch for ch in s if ch.isalnum())


_VF_CHOICE_RE = re.compile(r"^\s*(?:\\text\s*\{\s*)?\(?\s*([A-Ja-j])\s*(?:\)|\.|:|\}|\s|$)")


def choice_letter(s):
    """Option letter at the START of an answer, as SPICE's MCQ check wants (Fig. 6 boxes `B) 149,600,000 km`).

    Accepts "B", "B)", "B.", "B:", "(b)", "B) 149,600,000 km", "\\text{B}"; returns the upper-case letter, or None
    ("Because ..." is not a letter answer: the letter must be followed by a delimiter or the end)."""
    if not isinstance(s, str):
        return None
    m = _VF_CHOICE_RE.match(s[:200])
    return m.group(1).upper() if m else None


# ------------------------------------------------------------------------------------------------------------
# math_equal: fast paths in-process, math-verify in killable worker processes
# ------------------------------------------------------------------------------------------------------------
VF_MAX_ANSWER_CHARS = 1000   # longer answers skip math-verify (exact string compare only) and count as failures
VF_MAX_BRACE_DEPTH = 50      # deeper nesting is a LaTeX bomb, not an answer
_VF_HARD_GRACE_S = 1.0       # the worker's own soft alarm fires at `timeout`; it is killed at timeout + grace
_VF_FAILS = Counter()        # timeouts / errors / skipped inputs; read with math_equal_failures()
_VF_CACHE = {}               # (pred, gold) -> bool for math-verify results (majority votes repeat pairs a lot)
_VF_CACHE_MAX = 200_000


def math_equal_failures(reset=False):
    """Counts of verifier failures since start (or the last reset): 'timeout' (soft alarm in the worker),
    'killed' (hard timeout: the worker was killed and restarted), 'error' (exception inside math-verify),
    'too_long' / 'too_deep' (inputs that skipped math-verify), 'total'. Every failure means "not equal"."""
    d = dict(_VF_FAILS)
    d["total"] = sum(v for k, v in _VF_FAILS.items())
    if reset:
        _VF_FAILS.clear()
    return d


def _vf_fail(kind, n=1):
    _VF_FAILS[kind] += n


_VF_NUM_RE = re.compile(r"^[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?$")
_VF_WORDY_RE = re.compile(r"^[^\W\d_]+(?:[\s\-'’.,/&]+[^\W\d_]+)*[.]?$")


def _vf_canon(s):
    """Light canonical form for math answers: no $, no spaces, no \\left/\\right, no trailing period."""
    s = _vf_unwrap_text(s)
    s = s.replace("$", "").replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = "".join(s.split())
    return s.rstrip(".")


def _vf_number(s):
    """Decimal of a plain number ("1,234", "-3.50", "\\$12", "45\\%"), or None. Commas only as thousands groups,
    so "1,2" (a pair) is not a number."""
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").strip()
    if len(s) > 60 or not _VF_NUM_RE.match(s):
        return None
    try:
        return Decimal(s.replace(",", ""))
    except InvalidOperation:
        return None


def _vf_max_depth(s):
    d = m = 0
    for ch in s:
        if ch == "{" or ch == "(" or ch == "[":
            d += 1
            if d > m:
                m = d
        elif ch == "}" or ch == ")" or ch == "]":
            d -= 1
    return m


def _vf_prepare(pred, gold):
    """Decide a pair in-process when that is safe. Returns (decision, pred_str, gold_str): decision is True /
    False, or None when math-verify must decide."""
    if pred is None or gold is None:
        return False, None, None
    pred, gold = str(pred).strip(), str(gold).strip()
    if not pred or not gold:
        return False, pred, gold
    if len(pred) > VF_MAX_ANSWER_CHARS * 20 or len(gold) > VF_MAX_ANSWER_CHARS * 20:
        _vf_fail("too_long")
        return pred == gold, pred, gold
    if "\\boxed" in pred or "\\fbox" in pred:  # a whole response was passed: judge its final answer
        pred = extract_boxed(pred) or ""
    if "\\boxed" in gold or "\\fbox" in gold:
        gold = extract_boxed(gold) or ""
    if not pred or not gold:
        return False, pred, gold
    if len(pred) > VF_MAX_ANSWER_CHARS or len(gold) > VF_MAX_ANSWER_CHARS:
        _vf_fail("too_long")
        return pred == gold, pred, gold
    cp, cg = _vf_canon(pred), _vf_canon(gold)
    if cp == cg and cp:
        return True, pred, gold
    # multiple choice: an upper-case gold letter ("B", "(B)", "B)") or a parenthesised lower-case one ("(b)")
    g_letter = choice_letter(gold) if re.fullmatch(r"\(?[A-J][).:]?|\([a-j]\)", cg) else None
    if g_letter is not None:
        return choice_letter(pred) == g_letter, pred, gold
    np_, ng = _vf_number(cp), _vf_number(cg)
    if np_ is not None and ng is not None:
        if np_ == ng:
            return True, pred, gold
        if np_ == np_.to_integral_value() and ng == ng.to_integral_value():
            return False, pred, gold  # two integers: nothing math-verify could add
    if _VF_WORDY_RE.match(_vf_unwrap_text(gold).strip()) and len(normalize_string(gold)) >= 2:
        return normalize_string(pred) == normalize_string(gold), pred, gold
    if max(_vf_max_depth(pred), _vf_max_depth(gold)) > VF_MAX_BRACE_DEPTH:
        _vf_fail("too_deep")
        return False, pred, gold
    return None, pred, gold


# The worker runs only math-verify: launched as `python -I -c SOURCE`, it never imports torch or this module
# (spawn-safe, cheap), and a pair that hangs inside C code (huge integer powers) is handled by killing it.
_VF_WORKER_SRC = r'''
import sys, json, signal, logging
logging.disable(logging.CRITICAL)
try:
    from math_verify import parse, verify
except Exception as e:
    sys.stdout.write(json.dumps({"fatal": repr(e)}) + "\n"); sys.stdout.flush(); sys.exit(3)
class Late(BaseException):
    pass
def on_alarm(signum, frame):
    raise Late()
signal.signal(signal.SIGALRM, on_alarm)
def wrap(s):
    return s if ("$" in s or "\\(" in s or "\\[" in s) else "$" + s + "$"
def check(pred, gold, t):
    signal.setitimer(signal.ITIMER_REAL, t)
    try:
        g = parse(wrap(gold), parsing_timeout=None)
        p = parse(wrap(pred), parsing_timeout=None)
        return 1 if (g and p and verify(g, p, timeout_seconds=None)) else 0
    except Late:
        return 2
    except Exception:
        return 3
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
sys.stdout.write('{"ready": 1}\n'); sys.stdout.flush()
for line in sys.stdin:
    try:
        pred, gold, t = json.loads(line)
        r = check(pred, gold, t)
    except Late:
        r = 2
    except Exception:
        r = 3
    sys.stdout.write("%d\n" % r); sys.stdout.flush()
'''


class _VfWorker:
    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", _VF_WORKER_SRC], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, bufsize=0)
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buf = b""
        self.ready = False
        self.started = time.monotonic()
        self.inflight = []      # [(index, n_bytes)] in send order
        self.head_since = 0.0   # when the worker started on inflight[0] (approximately)

    def lines(self):
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return []
        if not chunk:
            raise EOFError
        self.buf += chunk
        *done, self.buf = self.buf.split(b"\n")
        return done

    def kill(self):
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:
                pass


class _VfPool:
    """Lazily started, reused math-verify worker processes. One batch at a time (a lock), any thread."""

    def __init__(self):
        self.workers = []
        self.lock = threading.Lock()
        self.pid = os.getpid()

    def close(self):
        for w in self.workers:
            w.kill()
        self.workers = []

    def run(self, items, timeout, n_workers):
        """items: list of (pred, gold). Returns list of codes 1 equal / 0 not / 2 timeout / 3 error / 4 killed."""
        with self.lock:
            if self.pid != os.getpid():  # forked child: the workers belong to the parent
                self.workers, self.pid = [], os.getpid()
            return self._run(items, timeout, n_workers)

    def _run(self, items, timeout, n_workers):
        n_workers = max(1, min(n_workers, len(items)))
        self.workers = [w for w in self.workers if w.proc.poll() is None]
        while len(self.workers) < n_workers:
            self.workers.append(_VfWorker())
        workers = self.workers[:n_workers]
        payload = [(json.dumps([p, g, float(timeout)]) + "\n").encode() for p, g in items]
        queue = list(range(len(items)))[::-1]     # pop() from the end = in order
        out = [None] * len(items)
        remaining = len(items)
        hard = float(timeout) + _VF_HARD_GRACE_S
        sel = selectors.DefaultSelector()
        for w in workers:
            sel.register(w.fd, selectors.EVENT_READ, w)

        def replace(w):
            sel.unregister(w.fd)
            w.kill()
            for idx, _ in w.inflight:  # the rest of its window goes back to the queue
                queue.append(idx)
            nw = _VfWorker()
            self.workers[self.workers.index(w)] = nw
            workers[workers.index(w)] = nw
            sel.register(nw.fd, selectors.EVENT_READ, nw)

        def feed(w):
            if not w.ready:
                return
            nbytes = sum(b for _, b in w.inflight)
            while queue and (not w.inflight or nbytes + len(payload[queue[-1]]) < 32768):
                idx = queue.pop()
                try:
                    w.proc.stdin.write(payload[idx])
                except (BrokenPipeError, OSError):
                    queue.append(idx)
                    return
                if not w.inflight:
                    w.head_since = time.monotonic()
                w.inflight.append((idx, len(payload[idx])))
                nbytes += len(payload[idx])

        try:
            while remaining:
                for key, _ in sel.select(timeout=0.05):
                    w = key.data
                    try:
                        lines = w.lines()
                    except EOFError:  # the worker died (e.g. out of memory): count its head as an error
                        if w.inflight:
                            idx, _ = w.inflight.pop(0)
                            out[idx] = 3
                            remaining -= 1
                        if not w.ready and w.proc.poll() not in (None, 0):
                            raise RuntimeError("math-verify worker failed to start; install it with "
                                               "`pip install math-verify` in the interpreter running this code")
                        replace(w)
                        continue
                    for ln in lines:
                        if not w.ready:
                            if b"fatal" in ln:
                                raise RuntimeError("math-verify is not importable (" + ln.decode(errors="replace")
                                                   + "); fix: `pip install math-verify`")
                            w.ready = True
                            continue
                        idx, _ = w.inflight.pop(0)
                        out[idx] = int(ln)
                        remaining -= 1
                        w.head_since = time.monotonic()
                now = time.monotonic()
                for w in list(workers):
                    if w.inflight and now - w.head_since > hard:
                        idx, _ = w.inflight.pop(0)
                        out[idx] = 4
                        remaining -= 1
                        replace(w)
                    elif not w.ready and now - w.started > 120:
                        raise RuntimeError("math-verify worker did not start within 120 s")
                for w in workers:
                    feed(w)
        finally:
            sel.close()
        return out


_VF_POOL = None


def _vf_pool():
    global _VF_POOL
    if _VF_POOL is None:
        _VF_POOL = _VfPool()
        atexit.register(_VF_POOL.close)
    return _VF_POOL


def shutdown_verifier():
    """Kill the math-verify worker processes (they restart lazily on the next call)."""
    if _VF_POOL is not None:
        with _VF_POOL.lock:
            _VF_POOL.close()


def _vf_default_workers():
    return max(1, min(os.cpu_count() or 1, 8))


def math_equal_many(pairs, workers=None, timeout=2.0):
    """math_equal over many (pred, gold) pairs, math-verify calls spread over `workers` processes (default:
    min(cpu_count, 8); 1 for small batches). Same semantics as math_equal, same order as `pairs`."""
    res = [False] * len(pairs)
    todo, keys = [], []
    for i, (pred, gold) in enumerate(pairs):
        dec, p, g = _vf_prepare(pred, gold)
        if dec is not None:
            res[i] = bool(dec)
            continue
        hit = _VF_CACHE.get((p, g))
        if hit is not None:
            res[i] = hit
            continue
        todo.append(i)
        keys.append((p, g))
    if todo:
        uniq = list(dict.fromkeys(keys))
        w = workers if workers else _vf_default_workers()
        w = max(1, min(w, math.ceil(len(uniq) / 32)))
        codes = _vf_pool().run(uniq, timeout, w)
        if len(_VF_CACHE) > _VF_CACHE_MAX:
            _VF_CACHE.clear()
        verdict = {}
        for key, code in zip(uniq, codes):
            verdict[key] = code == 1
            if code == 2:
                _vf_fail("timeout")
            elif code == 3:
                _vf_fail("error")
            elif code == 4:
                _vf_fail("killed")
            if code in (0, 1):  # failures are not cached: a retry under less load may succeed
                _VF_CACHE[key] = code == 1
        for i, key in zip(todo, keys):
            res[i] = verdict[key]
    return res


def math_equal(pred, gold, timeout=2.0):
    """Is the predicted answer equal to the gold answer? Never raises, never hangs.

    Order of checks (the cheap, safe ones decide in-process):
      1. None / empty -> False. A full response containing `\\boxed{}` is reduced to its last box.
      2. Identical after light canonicalisation (no `$`, spaces, `\\left`/`\\right`, trailing period).
      3. Multiple choice: a gold letter ("B", "(B)", "(b)") matches the pred's leading letter ("B) 149,600,000 km").
      4. Plain numbers with thousands commas: "1,000" == "1000"; two integers are decided here.
      5. Word answers (gold made of words): normalize_string equality (SPICE's String type).
      6. math-verify: `verify(parse(gold), parse(pred))`, gold first, raw strings wrapped in `$...$`, in a worker
         process with a soft alarm at `timeout` s and a hard kill at timeout + 1 s (works from any thread).
    Inputs over VF_MAX_ANSWER_CHARS or nested deeper than VF_MAX_BRACE_DEPTH skip math-verify. Timeouts, errors
    and skipped inputs return False and are counted (math_equal_failures()).
    """
    try:
        return math_equal_many([(pred, gold)], workers=1, timeout=timeout)[0]
    except RuntimeError:
        raise  # math-verify missing: a setup error, not a hostile input
    except Exception:
        _vf_fail("error")
        return False


# ------------------------------------------------------------------------------------------------------------
# Majority vote (R-Zero pseudo-labels)
# ------------------------------------------------------------------------------------------------------------
def majority_vote_many(groups, timeout=2.0):
    """majority_vote for many groups at once; the math-verify comparisons of all groups go in one parallel batch
    per round (round r compares each group's r-th distinct answer with that group's current class heads)."""
    states = []
    for answers in groups:
        strs = [None if a is None or not str(a).strip() else str(a).strip() for a in answers]
        distinct = list(dict.fromkeys(s for s in strs if s is not None))
        states.append({"strs": strs, "distinct": distinct, "classes": []})  # classes: lists of distinct strings
    rnd = 0
    while True:
        jobs = []  # (state, candidate, head_index)
        for st in states:
            if rnd < len(st["distinct"]):
                cand = st["distinct"][rnd]
                if not st["classes"]:
                    st["classes"].append([cand])
                    continue
                jobs.extend((st, cand, h) for h in range(len(st["classes"])))
        if not jobs and all(rnd >= len(st["distinct"]) for st in states):
            break
        if jobs:
            fwd = math_equal_many([(c, st["classes"][h][0]) for st, c, h in jobs], timeout=timeout)
            back_idx = [i for i, ok in enumerate(fwd) if not ok]
            back = math_equal_many([(jobs[i][0]["classes"][jobs[i][2]][0], jobs[i][1]) for i in back_idx],
                                   timeout=timeout)
            eq = list(fwd)
            for i, ok in zip(back_idx, back):
                eq[i] = ok
            by_state = {}
            for (st, c, h), ok in zip(jobs, eq):
                by_state.setdefault(id(st), (st, c, []))[2].append((h, ok))
            for st, c, hs in by_state.values():
                first = next((h for h, ok in sorted(hs) if ok), None)  # join the OLDEST matching class
                if first is None:
                    st["classes"].append([c])
                else:
                    st["classes"][first].append(c)
        rnd += 1
    out = []
    for st in states:
        strs, m = st["strs"], len(st["strs"])
        if not st["classes"] or m == 0:
            out.append((None, 0.0))
            continue
        counts = Counter(s for s in strs if s is not None)
        best, best_n = None, -1
        for cls in st["classes"]:  # classes are in first-seen order: strict > keeps the earliest on ties
            n_cls = sum(counts[s] for s in cls)
            if n_cls > best_n:
                best, best_n = cls, n_cls
        label = max(best, key=lambda s: (counts[s], -best.index(s)))  # most common spelling, then first seen
        out.append((label, best_n / m))
    return out


def majority_vote(answers, timeout=2.0):
    """R-Zero's pseudo-label: the largest class of mutually equivalent answers and its share of ALL votes.

    - Equivalence is math_equal in either direction ("1/2" and "0.5" vote together), not string equality.
      Each distinct answer joins the oldest class whose first answer it matches (classes are formed greedily in
      order of first appearance, so a non-transitive verifier still gives one deterministic partition).
    - None / empty answers (no `\\boxed{}`) never form a class and never win, but they count in the denominator
      (r_zero.md worked example 1: 4x"12", 1x"7", 5xNone -> ("12", 0.4), not "None" with 0.5).
    - Ties: the class whose first member appears earliest in `answers` wins. The returned label is that class's
      most frequent spelling (earliest on ties).
    Returns (label, share); (None, 0.0) if nothing parses.
    """
    return majority_vote_many([list(answers)], timeout=timeout)[0]


# ------------------------------------------------------------------------------------------------------------
# Reward shapes (pure functions of the solve rate p; scalars or numpy arrays)
# ------------------------------------------------------------------------------------------------------------
# Format rewards. AZR Eq. 6: R = r_role if the response is passable, -0.5 if it is well formatted but wrong,
# -1 on a format error (for the proposer: any invalid proposal). SPICE §2 / Alg. 1: an invalid Challenger
# question gets rho = -0.1.
FORMAT_ERROR = -1.0       # AZR Eq. 6
WRONG_FORMATTED = -0.5    # AZR Eq. 6
INVALID_QUESTION = -0.1   # SPICE rho (§3.1)


def _vf_p(p):
    a = np.asarray(p, dtype=np.float64)
    if np.any(~np.isfinite(a)) or np.any((a < 0) | (a > 1)):
        raise ValueError(f"solve rate must lie in [0, 1], got {p!r}")
    return a


def _vf_out(a, p):
    return float(a) if np.ndim(p) == 0 else a


def learnability_reward(p):
    """Absolute Zero, Eq. 4:  r_propose = 0 if r̄ ∈ {0, 1}, else 1 − r̄   (r̄ = mean of n = 8 solver rollouts).

    Monotone decreasing on (0, 1): it peaks at the hardest still-solvable task (0.875 at 1/8), not at 50%."""
    a = _vf_p(p)
    return _vf_out(np.where((a == 0) | (a == 1), 0.0, 1.0 - a), p)


def uncertainty_reward(p):
    """R-Zero (§3, r_unc) = the understanding paper's Eq. 3:  r = 1 − 2·|p − ½|.

    Edge case p ∈ {0, 1}: the formula itself gives 0 there, and Eq. 3 also defines r = 0 at r̄ ∈ {0, 1}, so
    both definitions agree everywhere (peak 1 at p = ½). In R-Zero p is the majority share p̂, so p̂ ≥ 1/m once
    any answer parses; p̂ = 0 only when nothing parses. (R-Zero's code uses min(p, 1 − p), half this scale.)"""
    a = _vf_p(p)
    return _vf_out(np.where((a == 0) | (a == 1), 0.0, 1.0 - 2.0 * np.abs(a - 0.5)), p)


def variance_reward(p, tau=0.01):
    """SPICE, Eq. 1 (App. D, Eq. 5):  r_C = exp(−(σ² − ¼)² / (2τ)),  σ² = p(1 − p),  τ = 0.01.

    σ² is the POPULATION variance of the K correctness bits, i.e. exactly p(1 − p). Using the unbiased
    estimator (torch.var's default, ×K/(K−1)) moves the peak off 50%: 3/8 would beat 4/8 (spice.md).
    Values for K = 8: 0.044 (0 or 8 right), 0.372, 0.823, 0.988, 1.0 (4 right)."""
    a = _vf_p(p)
    var = a * (1.0 - a)
    return _vf_out(np.exp(-((var - 0.25) ** 2) / (2.0 * tau)), p)


def variance_reward_from_bits(correct, tau=0.01):
    """SPICE Eq. 1 from the K correctness bits of the Reasoner's answers: population variance via p = mean."""
    bits = np.asarray(correct, dtype=np.float64).ravel()
    if bits.size == 0:
        raise ValueError("variance_reward_from_bits needs at least one correctness bit")
    return variance_reward(float(bits.mean()), tau)


def threshold_reward(p):
    """SPICE's "threshold" ablation (Table 4):  r = 1[0 < p < 1]."""
    a = _vf_p(p)
    return _vf_out(((a > 0) & (a < 1)).astype(np.float64), p)


def proposer_reward(rbar, kind="learnability", tau=0.01):
    """Dispatch by name: learnability (AZR Eq. 4) | uncertainty (R-Zero; Eq. 3) | variance (SPICE) | threshold."""
    shapes = {"learnability": learnability_reward, "uncertainty": uncertainty_reward,
              "variance": lambda p: variance_reward(p, tau), "threshold": threshold_reward}
    if kind not in shapes:
        raise ValueError(f"unknown proposer reward {kind!r}; choose one of {sorted(shapes)}")
    return shapes[kind](rbar)


def azr_composite_reward(r_role, *, formatted, passable):
    """AZR Eq. 6: r_role if passable; −0.5 if well formatted but wrong; −1 on a format error."""
    if not formatted:
        return FORMAT_ERROR
    return float(r_role) if passable else WRONG_FORMATTED
