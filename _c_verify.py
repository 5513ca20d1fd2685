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

from _c_core import *  # merge:drop

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
_VF_WORKER_MAX_PAIRS = 50_000  # a worker is replaced after this many pairs
_VF_HARD_GRACE_S = 1.0       # soft alarm at `timeout` CPU-seconds; killed at timeout + grace CPU-seconds
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
    for junk in ("\\$", "$", "\\left", "\\right", "\\!", "\\,"):
        s = s.replace(junk, "")
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


_VF_FRAC_RE = re.compile(r"^([+-]?)\\frac(?:\{([+-]?\d{1,30})\}|(\d))(?:\{(\d{1,30})\}|(\d))$")
_VF_SLASH_RE = re.compile(r"^([+-]?\d{1,30})/(\d{1,30})$")


def _vf_rational(c):
    """(Fraction, exact) for a canonical simple number: integer, decimal, a/b, \\frac{a}{b}, \\frac12; else None.
    `exact` is False for decimals, which math-verify compares after rounding to 6 places."""
    from fractions import Fraction
    d = _vf_number(c)
    if d is not None:
        return Fraction(d), d == d.to_integral_value() and "." not in c
    m = _VF_SLASH_RE.match(c)
    if m and int(m.group(2)):
        return Fraction(int(m.group(1)), int(m.group(2))), True
    m = _VF_FRAC_RE.match(c)
    if m:
        num, den = int(m.group(2) or m.group(3)), int(m.group(4) or m.group(5))
        if den:
            return Fraction(-num if m.group(1) == "-" else num, den), True
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
    rp, rg = _vf_rational(cp), _vf_rational(cg)
    if rp is not None and rg is not None:
        if rp[0] == rg[0]:
            return True, pred, gold
        if rp[1] and rg[1]:
            return False, pred, gold  # two exact rationals (integers, a/b): nothing math-verify could add
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
try:  # a LaTeX bomb that allocates gigabytes fails with MemoryError instead of taking the machine down
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
except Exception:
    pass
try:
    from math_verify import parse, verify
except Exception as e:
    sys.stdout.write(json.dumps({"fatal": repr(e)}) + "\n"); sys.stdout.flush(); sys.exit(3)
class Late(BaseException):
    pass
def on_alarm(signum, frame):
    raise Late()
signal.signal(signal.SIGPROF, on_alarm)
def wrap(s):
    return s if ("$" in s or "\\(" in s or "\\[" in s) else "$" + s + "$"
def surely_differ(g, p, raw):
    # Most unequal pairs are plain expressions with different values: evaluating both at one point proves it in
    # well under a millisecond, where verify() would try simplification for tens of milliseconds. Anything
    # verify() treats specially (%, degrees, sets, relations, matrices, floats rounded to 6 places) goes to verify.
    from sympy import Expr, Rational
    a, b = g[0], p[0]
    if not (isinstance(a, Expr) and isinstance(b, Expr)) or "%" in raw or "circ" in raw or "deg" in raw:
        return False
    syms = sorted(a.free_symbols | b.free_symbols, key=str)
    if len(syms) > 6:
        return False
    at = {s: Rational(13 + 7 * i, 10) for i, s in enumerate(syms)}
    try:
        va, vb = complex(a.evalf(30, subs=at)), complex(b.evalf(30, subs=at))
    except Exception:
        return False
    if not all(abs(v) < 1e300 for v in (va, vb)) or va != va or vb != vb:
        return False
    return abs(va - vb) > 1e-5 * max(1.0, abs(va), abs(vb))
def check(pred, gold, t):
    signal.setitimer(signal.ITIMER_PROF, t)  # CPU time: verdicts must not depend on machine load
    try:
        g = parse(wrap(gold), parsing_timeout=None)
        p = parse(wrap(pred), parsing_timeout=None)
        if not (g and p) or surely_differ(g, p, pred + gold):
            return 0
        return 1 if verify(g, p, timeout_seconds=None) else 0
    except Late:
        return 2
    except Exception:
        return 3
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
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
        self.done = 0           # pairs answered; the pool retires a worker after _VF_WORKER_MAX_PAIRS
        self.head_since = 0.0   # when the worker started on inflight[0] (approximately), wall clock
        self.head_cpu = 0.0     # and its CPU seconds at that moment

    def cpu(self):
        """CPU seconds (user + system) the worker has used, from /proc; None where /proc is unavailable."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _VF_CLK_TCK
        except (OSError, IndexError, ValueError):
            return None

    def start_head(self):
        self.head_since = time.monotonic()
        self.head_cpu = self.cpu() or 0.0

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
        if self.pid == os.getpid():  # a forked child must not kill its parent's workers
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
        # Budgets are CPU time, so a loaded machine does not turn right answers into timeouts. A worker that
        # uses no CPU yet never answers (stopped, blocked) is caught by the wall-clock cap.
        hard_cpu = float(timeout) + _VF_HARD_GRACE_S
        hard_wall = 3 * hard_cpu + 2.0
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
                    w.start_head()
                w.inflight.append((idx, len(payload[idx])))
                nbytes += len(payload[idx])

        try:
            while remaining:
                for w in workers:
                    feed(w)
                for key, _ in sel.select(timeout=0.05):
                    w = key.data
                    try:
                        lines = w.lines()
                    except EOFError:  # the worker died (e.g. out of memory): count its head as an error
                        if not w.ready:
                            raise RuntimeError(f"the math-verify worker ({sys.executable}) exited before it was "
                                               "ready; check that `python -c 'import math_verify'` works "
                                               "(fix: `pip install math-verify`)") from None
                        if w.inflight:
                            idx, _ = w.inflight.pop(0)
                            out[idx] = 3
                            remaining -= 1
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
                        w.done += 1
                        w.start_head()
                now = time.monotonic()
                for w in list(workers):
                    if w.inflight and now - w.head_since > hard_cpu:
                        cpu = w.cpu()
                        used = (cpu - w.head_cpu) if cpu is not None else now - w.head_since
                        stuck = used > hard_cpu or now - w.head_since > hard_wall
                    else:
                        stuck = False
                    if stuck:
                        idx, _ = w.inflight.pop(0)
                        out[idx] = 4
                        remaining -= 1
                        replace(w)
                    elif not w.ready and now - w.started > 120:
                        raise RuntimeError("math-verify worker did not start within 120 s")
        finally:
            sel.close()
        for w in list(self.workers):  # bound the memory of sympy's caches: retire old workers between batches
            if w.done > _VF_WORKER_MAX_PAIRS:
                w.kill()
                self.workers.remove(w)
        return out


_VF_POOL = None
_VF_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


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


def verifier_worker_pids():
    """Process ids of the running math-verify workers (diagnostics; the pool restarts killed ones)."""
    if _VF_POOL is None:
        return []
    return [w.proc.pid for w in _VF_POOL.workers if w.proc.poll() is None]


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
      4. Simple numbers compared as exact fractions: "1,000" == "1000", "3/4" == "\\frac{3}{4}" == "0.75"; two
         unequal exact rationals (integers, a/b) are decided here, decimals that differ go on to math-verify.
      5. Word answers (gold made of words): normalize_string equality (SPICE's String type).
      6. math-verify: `verify(parse(gold), parse(pred))`, gold first, raw strings wrapped in `$...$`, in a worker
         process (works from any thread). Budgets are CPU seconds of the worker, so verdicts do not change with
         machine load: a soft alarm at `timeout`, a kill at timeout + 1 s, and a kill after 3·(timeout + 1) + 2
         wall seconds for a worker that makes no progress at all.
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


# ------------------------------------------------------------------------------------------------------------
# R-Zero repetition penalty: pairwise sentence-BLEU-4 + average-linkage clustering, vectorised in numpy
# ------------------------------------------------------------------------------------------------------------
_VF_BLEU_EPS = 0.1        # Chen & Cherry smoothing "method 1" (NLTK SmoothingFunction().method1, epsilon 0.1)
_VF_DENSE_DF = 48         # n-grams shared by more texts than this are counted with a dense matrix product


def _vf_ngram_match_counts(seqs, n_max=4):
    """For each order n: (M_n, totals_n). M_n[i, j] = Σ_g min(count_i(g), count_j(g)) (clipped matches, which
    are symmetric), totals_n[i] = number of n-grams of text i. Only n-grams shared by >= 2 texts matter: rare
    ones go through an inverted index (pairs per posting list), frequent ones through (C >= t)(C >= t)^T."""
    B = len(seqs)
    lens = np.array([len(s) for s in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    toks = np.concatenate(seqs) if B and lens.sum() else np.zeros(0, dtype=np.int64)
    V = int(toks.max()) + 1 if toks.size else 1
    out = []
    prev_ids = toks.copy()      # id of the (n-1)-gram starting at each position (valid where it fits)
    for n in range(1, n_max + 1):
        cnt = np.maximum(lens - n + 1, 0)
        total = int(cnt.sum())
        M = np.zeros((B, B), dtype=np.float64)
        if total:
            text_of = np.repeat(np.arange(B), cnt)
            starts = np.repeat(offsets, cnt) + (np.arange(total) - np.repeat(np.cumsum(cnt) - cnt, cnt))
            if n == 1:
                gram = toks[starts]
            else:  # exact: (id of the (n-1)-gram at s) * V + token at s+n-1, re-densified with np.unique
                gram = prev_ids[starts] * V + toks[starts + n - 1]
            uniq_g, gid = np.unique(gram, return_inverse=True)
            ids_at = np.full(toks.shape[0], -1, dtype=np.int64)
            ids_at[starts] = gid
            prev_ids = ids_at
            G = len(uniq_g)
            key, c = np.unique(text_of * G + gid, return_counts=True)  # (text, gram) -> count
            t_i, g_i = key // G, key % G
            df = np.bincount(g_i, minlength=G)
            shared = df[g_i] >= 2
            dense = shared & (df[g_i] > _VF_DENSE_DF)
            rare = shared & ~dense
            if dense.any():
                gd, col = np.unique(g_i[dense], return_inverse=True)
                C = np.zeros((B, len(gd)), dtype=np.float32)
                C[t_i[dense], col] = c[dense]
                for t in range(1, int(C.max()) + 1):
                    I = (C >= t).astype(np.float32)
                    M += I @ I.T
            if rare.any():
                rt, rg, rc = t_i[rare], g_i[rare], c[rare].astype(np.float64)
                order = np.lexsort((rt, rg))
                rt, rg, rc = rt[order], rg[order], rc[order]
                bounds = np.flatnonzero(np.diff(rg)) + 1
                starts_g = np.concatenate([[0], bounds])
                sizes = np.diff(np.concatenate([starts_g, [len(rg)]]))
                idx_all, val_all = [], []
                for s in np.unique(sizes):
                    st = starts_g[sizes == s][:, None] + np.arange(s)[None, :]
                    ti, ci = rt[st], rc[st]
                    idx_all.append((ti[:, :, None] * B + ti[:, None, :]).ravel())
                    val_all.append(np.minimum(ci[:, :, None], ci[:, None, :]).ravel())
                idx, val = np.concatenate(idx_all), np.concatenate(val_all)
                M += np.bincount(idx, weights=val, minlength=B * B).reshape(B, B)
        np.fill_diagonal(M, np.maximum(lens - n + 1, 0))
        out.append((M, cnt.astype(np.float64)))
    return out, lens


def bleu_matrix(texts):
    """Sentence-BLEU-4 for every ordered pair: S[i, j] = BLEU(hypothesis = texts[i], reference = texts[j]).

    As NLTK's `sentence_bleu([ref.split()], hyp.split(), smoothing_function=SmoothingFunction().method1)`:
    whitespace tokens, uniform weights ¼, clipped n-gram precisions p_n = m_n / max(1, |hyp| − n + 1) where a
    zero m_n becomes ε / max(1, |hyp| − n + 1) with ε = 0.1 (Chen & Cherry method 1), BLEU = 0 when no
    unigram matches, brevity penalty exp(1 − |ref|/|hyp|) when |hyp| <= |ref| (1 when longer, 0 when empty)."""
    texts = [str(t) for t in texts]
    vocab = {}
    seqs = [np.array([vocab.setdefault(w, len(vocab)) for w in t.split()], dtype=np.int64) for t in texts]
    per_n, lens = _vf_ngram_match_counts(seqs)
    L = lens.astype(np.float64)
    logp = np.zeros((len(texts), len(texts)))
    for M, cnt in per_n:
        den = np.maximum(cnt, 1.0)[:, None]
        logp += 0.25 * np.log(np.where(M > 0, M, _VF_BLEU_EPS) / den)
    with np.errstate(divide="ignore", invalid="ignore"):
        bp = np.where(L[:, None] > L[None, :], 1.0, np.exp(1.0 - L[None, :] / np.maximum(L[:, None], 1.0)))
    bp[L == 0, :] = 0.0
    S = np.where(per_n[0][0] > 0, bp * np.exp(logp), 0.0)
    return S


def bleu_distance_matrix(texts):
    """R-Zero's distances: d_ij = 1 − BLEU(hyp = earlier text, ref = later text), mirrored; d_ii = 0.
    (R-Zero's code fills the upper triangle with hyp = q_i, ref = q_j for i < j and copies it down.)"""
    S = bleu_matrix(texts)
    D = 1.0 - np.triu(S, 1)
    D = np.triu(D, 1)
    D = D + D.T
    np.fill_diagonal(D, 0.0)
    return D


def average_linkage_clusters(dist, threshold=0.5):
    """Average-linkage agglomerative clustering of a precomputed symmetric distance matrix, cut at `threshold`
    (two clusters merge while their mean pairwise distance is < threshold, as sklearn's
    AgglomerativeClustering(linkage="average", distance_threshold=...)). Nearest-neighbour-chain algorithm:
    O(B²) time, the full dendrogram, then the merges below the threshold (average linkage is monotone, so this
    equals cutting the tree). Returns cluster ids numbered by first appearance (0, 1, ...)."""
    D = np.array(dist, dtype=np.float64, copy=True)
    B = D.shape[0]
    if D.shape != (B, B):
        raise ValueError(f"distance matrix must be square, got shape {D.shape}")
    if B == 0:
        return []
    np.fill_diagonal(D, np.inf)
    size = np.ones(B)
    active = np.ones(B, dtype=bool)
    parent = np.arange(B)

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    chain, n_active = [], B
    while n_active > 1:
        if not chain:
            chain.append(int(np.flatnonzero(active)[0]))
        a = chain[-1]
        row = D[a]
        b = int(np.argmin(row))
        if len(chain) > 1 and row[chain[-2]] <= row[b]:
            b = chain[-2]
        if len(chain) > 1 and b == chain[-2]:
            chain.pop()
            chain.pop()
            d = row[b]
            if d < threshold:
                parent[find(b)] = find(a)
            # Lance-Williams update for average linkage; the merged cluster keeps index a
            new = (size[a] * D[a] + size[b] * D[b]) / (size[a] + size[b])
            D[a, :] = new
            D[:, a] = new
            D[a, a] = np.inf
            D[b, :] = np.inf
            D[:, b] = np.inf
            size[a] += size[b]
            active[b] = False
            n_active -= 1
        else:
            chain.append(b)
    roots = [find(i) for i in range(B)]
    ids = {}
    return [ids.setdefault(r, len(ids)) for r in roots]


def bleu_clusters(texts, threshold=0.5):
    """Cluster id per text: R-Zero's BLEU distance + average linkage at `threshold` (ids by first appearance)."""
    texts = list(texts)
    if not texts:
        return []
    return average_linkage_clusters(bleu_distance_matrix(texts), threshold)


def repetition_penalty(texts, threshold=0.5):
    """R-Zero's batch repetition penalty: r_rep(x_i) = |C_k| / B for x_i in cluster C_k (λ = 1), clusters from
    1 − BLEU-4 distances with average linkage at τ_BLEU = 0.5. A singleton still pays 1/B (r_zero.md worked
    example 2). Returns a float array of length B."""
    texts = list(texts)
    if not texts:
        return np.zeros(0)
    ids = np.asarray(bleu_clusters(texts, threshold))
    sizes = np.bincount(ids)
    return sizes[ids] / len(texts)


# ------------------------------------------------------------------------------------------------------------
# Diversity metrics (analysis.md §7.2)
# ------------------------------------------------------------------------------------------------------------
def distinct_fraction(texts):
    """Share of distinct texts after normalize_string."""
    texts = list(texts)
    return len({normalize_string(t) for t in texts}) / len(texts) if texts else 0.0


def distinct_ngram_ratio(texts, n=4):
    """Distinct-n: unique n-grams / all n-grams over the batch (lower-cased whitespace tokens)."""
    grams, total = set(), 0
    for t in texts:
        w = str(t).lower().split()
        for i in range(len(w) - n + 1):
            grams.add(tuple(w[i:i + n]))
            total += 1
    return len(grams) / total if total else 0.0


def self_bleu(texts):
    """Mean pairwise sentence-BLEU-4 over the batch (same BLEU as the repetition penalty; hyp = earlier text)."""
    texts = list(texts)
    if len(texts) < 2:
        return 0.0
    S = bleu_matrix(texts)
    iu = np.triu_indices(len(texts), 1)
    return float(S[iu].mean())


def diversity_metrics(texts, threshold=0.5):
    """Per-batch diversity numbers for any proposer: distinct fraction, distinct-4, self-BLEU, cluster count."""
    texts = list(texts)
    return {"distinct_frac": distinct_fraction(texts), "distinct4": distinct_ngram_ratio(texts, 4),
            "self_bleu": self_bleu(texts), "bleu_clusters": len(set(bleu_clusters(texts, threshold)))}


# ------------------------------------------------------------------------------------------------------------
# pass@k
# ------------------------------------------------------------------------------------------------------------
def pass_at_k(n, c, k):
    """Unbiased pass@k for one problem (Chen et al. 2021): 1 − C(n − c, k) / C(n, k), in the stable product
    form 1 − Π_{i = n−c+1}^{n} (1 − k / i); 1 when n − c < k. (Not 1 − (1 − c/n)^k, which is biased.)"""
    n, c, k = int(n), int(c), int(k)
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def bootstrap_ci(values, n_boot=2000, alpha=0.05, seed=0):
    """Percentile bootstrap interval of the mean over problems (resampling problems with replacement)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, size=(n_boot, v.size))].mean(axis=1)
    return (float(np.quantile(means, alpha / 2)), float(np.quantile(means, 1 - alpha / 2)))


def pass_at_k_ci(ns, cs, k, n_boot=2000, alpha=0.05, seed=0):
    """Mean pass@k over problems with a bootstrap (1 − alpha) interval: (mean, low, high)."""
    per = [pass_at_k(n, c, k) for n, c in zip(ns, cs)]
    lo, hi = bootstrap_ci(per, n_boot, alpha, seed)
    return (float(np.mean(per)) if per else float("nan"), lo, hi)


# ------------------------------------------------------------------------------------------------------------
# Decontamination (analysis.md §7.3): any shared 13-gram of normalised words
# ------------------------------------------------------------------------------------------------------------
_VF_WORD_RE = re.compile(r"[^\W_]+")


def _vf_words(text):
    return _VF_WORD_RE.findall(_vf_unwrap_text(str(text)).lower())


class Decontaminator:
    """Index of the n-grams (default 13) of reference texts (benchmark questions, corpus documents).

    Text is normalised to lower-case alphanumeric words, so punctuation, LaTeX `\\text{}` and spacing do not
    hide a copy. A text shorter than n words is flagged only if it equals a reference after normalisation.
    Build once, query many: `d = Decontaminator(bench_questions); keep = [q for q in qs if not d.contaminated(q)]`.
    """

    def __init__(self, references, n=13):
        if n < 1:
            raise ValueError("n must be >= 1")
        self.n = n
        self.grams = set()
        self.short = set()
        for ref in references:
            w = _vf_words(ref)
            self.short.add(" ".join(w))
            for i in range(len(w) - n + 1):
                self.grams.add(hash(tuple(w[i:i + n])))

    def contaminated(self, text):
        w = _vf_words(text)
        if len(w) < self.n:
            return bool(w) and " ".join(w) in self.short
        g, n = self.grams, self.n
        return any(hash(tuple(w[i:i + n])) in g for i in range(len(w) - n + 1))

    def flags(self, texts):
        return [self.contaminated(t) for t in texts]


def ngram_overlap(text, references, n=13):
    """True if `text` shares a normalised n-gram with any reference. `references` may be a Decontaminator
    (fast, reused index) or an iterable of strings (indexed on the fly)."""
    d = references if isinstance(references, Decontaminator) else Decontaminator(references, n)
    return d.contaminated(text)


def decontaminate(questions, references, n=13):
    """Drop the questions that share an n-gram with the references. Returns (kept_questions, flagged_indices)."""
    d = references if isinstance(references, Decontaminator) else Decontaminator(references, n)
    flags = d.flags(questions)
    return [q for q, f in zip(questions, flags) if not f], [i for i, f in enumerate(flags) if f]


# ------------------------------------------------------------------------------------------------------------
# Benchmarks
# ------------------------------------------------------------------------------------------------------------
# name -> (hub id, config, split, question field, answer field). Override or extend this dict for other copies;
# any "hf:<id>[:<config>]:<split>:<question field>:<answer field>" string also works as a benchmark name.
BENCHMARKS = {
    "gsm8k": ("openai/gsm8k", "main", "test", "question", "answer"),          # answer after "####"
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem", "answer"),
    "aime24": ("HuggingFaceH4/aime_2024", None, "train", "problem", "answer"),
    "aime25": ("MathArena/aime_2025", None, "train", "problem", "answer"),
    "amc23": ("math-ai/amc23", None, "test", "question", "answer"),
}


def _vf_gsm8k_answer(a):
    a = str(a)
    return a.split("####")[-1].strip().replace(",", "") if "####" in a else a.strip()


def _vf_load_jsonl(path, limit):
    rows = []
    with open(path, encoding="utf-8") as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{ln}: not valid JSON ({e.msg}). Each line must be one object like "
                                 '{"question": "...", "answer": "..."}') from None
            if not isinstance(obj, dict) or "question" not in obj or "answer" not in obj:
                raise ValueError(f'{path}:{ln}: each line needs "question" and "answer" keys '
                                 f'(optional "choices": [..]); got {str(obj)[:120]}')
            row = {"question": str(obj["question"]), "answer": str(obj["answer"])}
            if obj.get("choices") is not None:
                if not isinstance(obj["choices"], list) or not obj["choices"]:
                    raise ValueError(f'{path}:{ln}: "choices" must be a non-empty list of strings')
                row["choices"] = [str(c) for c in obj["choices"]]
            rows.append(row)
            if limit and len(rows) >= limit:
                break
    if not rows:
        raise ValueError(f"{path}: no problems found (empty file?)")
    return rows


def load_benchmark(name_or_path, limit=0):
    """Problems as [{"question", "answer", "choices"?}]: a local JSONL file (one object per line), a name in
    BENCHMARKS (gsm8k, math500, aime24, aime25, amc23; loaded with `datasets`, imported lazily), or
    "hf:<id>[:<config>]:<split>:<question field>:<answer field>". `limit` > 0 keeps the first N problems."""
    name = str(name_or_path).strip()
    if os.path.isfile(name) or name.endswith((".jsonl", ".json")):
        if not os.path.isfile(name):
            raise FileNotFoundError(f"benchmark file {name} does not exist")
        return _vf_load_jsonl(name, limit)
    if name.startswith("hf:"):
        parts = name[3:].split(":")
        if len(parts) == 4:
            parts.insert(1, None)
        if len(parts) != 5:
            raise ValueError(f"{name}: expected hf:<id>[:<config>]:<split>:<question field>:<answer field>")
        spec = tuple(parts)
    elif name.lower() in BENCHMARKS:
        spec = BENCHMARKS[name.lower()]
    else:
        raise ValueError(f"unknown benchmark {name!r}: use one of {sorted(BENCHMARKS)}, a path to a local .jsonl "
                         'file of {"question", "answer"} lines, or hf:<id>[:<config>]:<split>:<q field>:<a field>')
    hub_id, config, split, qf, af = spec
    try:
        import datasets
    except ImportError:
        raise ImportError(f"benchmark {name!r} is loaded from the Hugging Face hub with the `datasets` package, "
                          "which is not installed. Fix: `pip install datasets`, or pass a local JSONL file "
                          '({"question", "answer"} per line).') from None
    try:
        ds = datasets.load_dataset(hub_id, config, split=split) if config else \
            datasets.load_dataset(hub_id, split=split)
    except Exception as e:
        raise RuntimeError(f"could not load benchmark {name!r} ({hub_id}, split {split}) from the Hugging Face hub: "
                           f"{type(e).__name__}: {str(e)[:300]}. Fix: check the network (or HF_HUB_OFFLINE=1 with a "
                           "populated cache), log in for gated sets, or pass a local JSONL file of "
                           '{"question", "answer"} lines.') from None
    rows = []
    for ex in ds:
        if qf not in ex or af not in ex:
            raise KeyError(f"{hub_id} has no field {qf!r}/{af!r}; its fields are {list(ex)}. Edit BENCHMARKS.")
        ans = _vf_gsm8k_answer(ex[af]) if hub_id == "openai/gsm8k" else str(ex[af]).strip()
        rows.append({"question": str(ex[qf]), "answer": ans})
        if limit and len(rows) >= limit:
            break
    return rows


# ------------------------------------------------------------------------------------------------------------
# Evaluation: greedy accuracy + pass@k per benchmark
# ------------------------------------------------------------------------------------------------------------
_VF_EVAL_INSTRUCTION = "Work through the problem step by step, then write the final answer as \\boxed{answer}."


def default_eval_prompt(problem, tokenizer=None):
    """Chat messages when the tokenizer has a chat template, else raw text. Options (if any) are listed as
    A) ... and the model is asked to box the letter."""
    q = problem["question"].strip()
    if problem.get("choices"):
        letters = "ABCDEFGHIJ"
        q += "\n\n" + "\n".join(f"{letters[i]}) {c}" for i, c in enumerate(problem["choices"]))
        q += "\n\nAnswer with the letter of the correct option."
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return [{"role": "user", "content": f"{q}\n\n{_VF_EVAL_INSTRUCTION}"}]
    return f"Problem:\n{q}\n\n{_VF_EVAL_INSTRUCTION}\n\nSolution:"


def _vf_verifier_name(timeout):
    try:
        from importlib.metadata import version
        mv = version("math-verify")
    except Exception:
        mv = "?"
    return (f"last \\boxed{{}} -> math_equal: string/MCQ-letter/integer fast paths, else math-verify {mv} "
            f"verify(parse(gold), parse(pred)), $-wrapped, timeout {timeout}s (timeout = wrong)")


def evaluate(sampler_or_policy, benchmarks, *, n=1, k=(1,), temperature=0.6, max_tokens=2048, prompt_fn=None,
             limit=0, top_p=0.95, seed=0, extract_fn=None, timeout=2.0, n_boot=1000):
    """Greedy accuracy and pass@k per benchmark.

    - Greedy: one completion per problem at temperature 0 -> "greedy_acc".
    - Sampling (only when n > 1): n completions at (temperature, top_p) -> unbiased pass@k for each k <= n, with
      a bootstrap 95% interval over problems; "mean@n" is the mean per-sample accuracy (= pass@1).
      With n == 1 no sampling is done and pass@1 is the greedy accuracy (marked "pass@k_source": "greedy").
    - The answer is extract_fn(completion text) (default: the last \\boxed{}), judged by math_equal_many.
    `benchmarks`: names or JSONL paths (see load_benchmark), a list or a comma-separated string. `prompt_fn
    (problem, tokenizer) -> prompt` overrides the default step-by-step / boxed-answer prompt. The settings (n,
    T, top-p, max tokens, verifier) are written into the result so base and trained runs can be compared."""
    if isinstance(benchmarks, str):
        benchmarks = benchmarks.split(",")
    benchmarks = list(dict.fromkeys(b.strip() for b in benchmarks if b.strip()))
    if isinstance(k, (int, str)):
        k = [int(x) for x in str(k).split(",") if str(x).strip()]
    ks = sorted({int(x) for x in k})
    n = int(n)
    if n < 1 or not ks or ks[0] < 1:
        raise ValueError(f"evaluate needs n >= 1 and k >= 1, got n={n}, k={ks}")
    skipped_k = [x for x in ks if x > n]
    ks = [x for x in ks if x <= n]
    tok = getattr(sampler_or_policy, "tokenizer", None)
    prompt_fn = prompt_fn or default_eval_prompt
    extract_fn = extract_fn or extract_boxed
    t0 = time.time()
    results = {}
    for bench in benchmarks:
        probs = load_benchmark(bench, limit)
        prompts = [prompt_fn(p, tok) for p in probs]
        golds = [p["answer"] for p in probs]
        greedy = sampler_or_policy.generate(prompts, n=1, temperature=0.0, max_tokens=max_tokens)
        g_preds = [extract_fn(g[0].text) for g in greedy]
        g_ok = math_equal_many(list(zip(g_preds, golds)), timeout=timeout)
        res = {"n_problems": len(probs), "greedy_acc": float(np.mean(g_ok)),
               "greedy_acc_ci": list(bootstrap_ci(np.asarray(g_ok, float), n_boot)),
               "greedy_no_answer_frac": float(np.mean([p is None for p in g_preds])),
               "greedy_truncated_frac": float(np.mean([g[0].finish_reason == "length" for g in greedy])),
               "greedy_mean_tokens": float(np.mean([len(g[0].token_ids) for g in greedy]))}
        per_problem = [{"answer": gold, "greedy_pred": p, "greedy_correct": bool(ok)}
                       for gold, p, ok in zip(golds, g_preds, g_ok)]
        if n > 1:
            samp = sampler_or_policy.generate(prompts, n=n, temperature=temperature, top_p=top_p,
                                              max_tokens=max_tokens, seed=seed)
            pairs, owner = [], []
            for j, group in enumerate(samp):
                for c in group:
                    pairs.append((extract_fn(c.text), golds[j]))
                    owner.append(j)
            ok = math_equal_many(pairs, timeout=timeout)
            cs = np.zeros(len(probs), dtype=int)
            for j, o in zip(owner, ok):
                cs[j] += int(o)
            ns = [len(g) for g in samp]
            res["pass@k"], res["pass@k_ci"] = {}, {}
            for kk in ks:
                m, lo, hi = pass_at_k_ci(ns, cs, kk, n_boot=n_boot, seed=seed)
                res["pass@k"][str(kk)] = m
                res["pass@k_ci"][str(kk)] = [lo, hi]
            res["mean@n"] = float(np.mean(cs / np.asarray(ns)))
            res["pass@k_source"] = "samples"
            res["sample_no_answer_frac"] = float(np.mean([p is None for p, _ in pairs]))
            res["sample_truncated_frac"] = float(np.mean([c.finish_reason == "length" for g in samp for c in g]))
            for rec, c in zip(per_problem, cs):
                rec["correct_samples"] = int(c)
        else:
            res["pass@k"] = {"1": res["greedy_acc"]}
            res["pass@k_ci"] = {"1": res["greedy_acc_ci"]}
            res["pass@k_source"] = "greedy"
        res["per_problem"] = per_problem
        results[bench] = res
    return {"benchmarks": results,
            "settings": {"n": n, "k": ks, "k_skipped_gt_n": skipped_k, "temperature": float(temperature),
                         "top_p": float(top_p), "greedy_for_acc": True, "max_tokens": int(max_tokens),
                         "limit": int(limit), "seed": seed, "verifier": _vf_verifier_name(timeout),
                         "prompt": "default" if prompt_fn is default_eval_prompt else getattr(
                             prompt_fn, "__name__", "custom"),
                         "bootstrap": f"{n_boot} resamples over problems, 95% percentile interval"},
            "verifier_failures": math_equal_failures(), "time_s": round(time.time() - t0, 2)}


def evaluate_config(policy, cfg, **kw):
    """evaluate() with a RunConfig's eval_* settings: the call each method's main() makes at the end (and every
    cfg.eval_every steps). Optional fields eval_temperature / eval_top_p are used when a Config declares them."""
    return evaluate(policy, cfg.eval_benchmarks, n=cfg.eval_n, k=cfg.eval_k, max_tokens=cfg.eval_max_tokens,
                    limit=cfg.eval_limit, temperature=getattr(cfg, "eval_temperature", 0.6),
                    top_p=getattr(cfg, "eval_top_p", 0.95), seed=cfg.seed, **kw)


# ------------------------------------------------------------------------------------------------------------
# Parameter update sparsity (understanding paper Eq. 2)
# ------------------------------------------------------------------------------------------------------------
class _VfTensors:
    """Uniform, streaming access to a model's parameters: nn.Module, state dict, or a checkpoint folder/file
    (safetensors read tensor by tensor; .bin/.pt via torch.load(mmap=True))."""

    def __init__(self, src):
        self.tied = False
        self.files = None
        self.sd = None
        self._bins = {}
        if not isinstance(src, (torch.nn.Module, dict, str, Path)) and isinstance(getattr(src, "model", None),
                                                                              torch.nn.Module):
            src = src.model  # a Policy
        if isinstance(src, str) and not Path(src).expanduser().exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", src):
            src = _vf_hub_snapshot(src)
        if isinstance(src, torch.nn.Module):
            self.tied = bool(getattr(getattr(src, "config", None), "tie_word_embeddings", False))
            self.sd = dict(src.named_parameters())  # remove_duplicate=True: tied weights appear once
        elif isinstance(src, dict):
            seen, sd = {}, {}
            for k, v in src.items():
                if not torch.is_tensor(v):
                    continue
                key = (v.data_ptr(), tuple(v.shape), v.dtype) if v.numel() else None
                if key is not None and key in seen:  # the same storage twice = tied
                    self.tied = True
                    continue
                if key is not None:
                    seen[key] = k
                sd[k] = v
            # copies (e.g. Policy.get_weights()) lose the shared storage: a head identical to the embedding is tied
            emb = next((k for k in sd if k.endswith("embed_tokens.weight")), None)
            head = next((k for k in sd if k.endswith("lm_head.weight")), None)
            if emb and head and sd[emb].shape == sd[head].shape and torch.equal(sd[emb], sd[head]):
                self.tied = True
            self.sd = sd
        else:
            p = Path(str(src)).expanduser()
            if p.is_dir():
                cfgf = p / "config.json"
                if cfgf.is_file():
                    try:
                        self.tied = bool(json.loads(cfgf.read_text()).get("tie_word_embeddings", False))
                    except Exception:
                        pass
                files = sorted(p.glob("*.safetensors")) or sorted(p.glob("*.bin")) + sorted(p.glob("*.pt"))
                files = [f for f in files if f.name not in ("optimizer.pt", "training_args.bin")]
            elif p.is_file():
                files = [p]
            else:
                raise FileNotFoundError(f"{src}: no such checkpoint folder or file (pass a folder written by "
                                        "save_pretrained, a .safetensors file, a model or a state dict)")
            if not files:
                raise FileNotFoundError(f"{src}: no *.safetensors / *.bin weights in this folder")
            self.files = {}
            for f in files:
                if f.suffix == ".safetensors":
                    from safetensors import safe_open
                    with safe_open(str(f), framework="pt") as h:
                        for k in h.keys():
                            self.files[k] = f
                else:
                    for k, v in torch.load(str(f), map_location="cpu", mmap=True, weights_only=True).items():
                        self.files[k] = f
        if self.sd is not None:
            self.sd = {self._strip(k): v for k, v in self.sd.items()}
        else:
            self.files = {self._strip(k): f for k, f in self.files.items()}
        self._handles = {}

    @staticmethod
    def _strip(k):
        for pre in ("module.", "_orig_mod.", "_fsdp_wrapped_module."):
            k = k.replace(pre, "")
        return k

    def keys(self):
        return list(self.sd) if self.sd is not None else list(self.files)

    def get(self, k):
        if self.sd is not None:
            return self.sd[k].detach()
        f = self.files[k]
        if f.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(f), framework="pt") as h:
                names = {self._strip(x): x for x in h.keys()}
                return h.get_tensor(names[k])
        if f not in self._bins:  # memory-mapped: loading the dict does not read the tensors
            sd = torch.load(str(f), map_location="cpu", mmap=True, weights_only=True)
            self._bins[f] = {self._strip(x): v for x, v in sd.items()}
        return self._bins[f][k]


def _vf_hub_snapshot(repo_id):
    """Local folder of a hub model's weights (downloaded into the HF cache if needed), for `sparsity BASE CKPT`."""
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(repo_id, allow_patterns=["*.safetensors", "*.json"])
    except Exception as e:
        raise FileNotFoundError(f"{repo_id}: not a local checkpoint folder, and the Hugging Face hub did not provide "
                                f"it ({type(e).__name__}: {str(e)[:200]}). Pass a local folder written by "
                                "save_pretrained, or check the id / network.") from None


def _vf_layer_type(name):
    n = name.lower()
    if "norm" in n:
        return "norm"
    if "embed" in n or "wte" in n or "wpe" in n:
        return "embedding"
    if "lm_head" in n:
        return "lm_head"
    if any(s in n for s in ("attn", "attention", "q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention"
    if any(s in n for s in ("mlp", "gate_proj", "up_proj", "down_proj", "ffn", "experts")):
        return "mlp"
    return "other"


def _vf_unchanged(a, b):
    """Exactly-equal entries (bitwise in the stored dtype, so NaN == NaN); float32 if the dtypes differ."""
    if a.dtype == b.dtype and a.is_floating_point():
        int_t = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
        if int_t is not None:
            return int((a.contiguous().view(int_t) == b.contiguous().view(int_t)).sum())
    if a.dtype != b.dtype:
        a, b = a.float(), b.float()
    return int((a == b).sum())


def update_sparsity(a, b):
    """Understanding paper Eq. 2:  S(θ⁰, θ¹) = 1 − ‖θ¹ − θ⁰‖₀ / n  = share of parameters exactly unchanged.

    `a`, `b`: models, state dicts, or checkpoint folders/files. Compared tensor by tensor (streaming, CPU), with
    exact equality and no tolerance, in the stored dtype (reported: bf16 storage rounds small updates away, so
    the number depends on it). Tied embeddings are counted once. Returns {"sparsity", "n_params",
    "n_unchanged", "dtype", "per_type": {embedding|attention|mlp|norm|lm_head|other: {sparsity, n_params}},
    "n_tensors", "tied"}."""
    ta, tb = _VfTensors(a), _VfTensors(b)
    ka, kb = ta.keys(), set(tb.keys())
    tied = ta.tied or tb.tied
    if tied:  # a tied head is the embedding: count it once, whichever side stored it
        ka = [k for k in ka if k != "lm_head.weight"]
        kb.discard("lm_head.weight")
    only_a, only_b = sorted(set(ka) - kb), sorted(kb - set(ka))
    if only_a or only_b:
        raise ValueError(f"update_sparsity: the two checkpoints hold different parameters: only in A "
                         f"{only_a[:5]}{'...' if len(only_a) > 5 else ''}, only in B {only_b[:5]}. Compare "
                         "checkpoints of the same architecture.")
    tot = unchanged = 0
    per, dtypes = {}, set()
    for k in ka:
        x, y = ta.get(k).cpu(), tb.get(k).cpu()
        if x.shape != y.shape:
            raise ValueError(f"update_sparsity: {k} has shape {tuple(x.shape)} in A but {tuple(y.shape)} in B")
        dtypes.add(str(x.dtype).replace("torch.", "") + ("" if x.dtype == y.dtype else
                                                          "/" + str(y.dtype).replace("torch.", "")))
        u, m = _vf_unchanged(x, y), x.numel()
        tot += m
        unchanged += u
        d = per.setdefault(_vf_layer_type(k), [0, 0])
        d[0] += m
        d[1] += u
        del x, y
    if tot == 0:
        raise ValueError("update_sparsity: no parameters to compare")
    return {"sparsity": unchanged / tot, "n_params": tot, "n_unchanged": unchanged,
            "dtype": ",".join(sorted(dtypes)), "n_tensors": len(ka), "tied": tied,
            "per_type": {t: {"sparsity": u / m, "n_params": m} for t, (m, u) in sorted(per.items())}}


# ------------------------------------------------------------------------------------------------------------
# CLI: `python common.py eval ...` / `python common.py sparsity A B`
# ------------------------------------------------------------------------------------------------------------
def _vf_eval_model(args, model):
    cfg = RunConfig(model=model, backend=args.backend, seed=args.seed, dtype=args.dtype,
                    max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization)
    path = resolve_model_path(model)
    tok = load_tokenizer(path)
    sampler = make_sampler(path, tok, cfg)
    try:
        out = evaluate(sampler, args.benchmarks, n=args.n, k=args.k, temperature=args.temperature,
                       top_p=args.top_p, max_tokens=args.max_tokens, limit=args.limit, seed=args.seed)
    finally:
        sampler.close()
    out["model"] = model
    return out


def plot_pass_at_k(results, labels, path):
    """PNG of pass@k vs k per benchmark for several evaluate() results (the understanding paper's Fig. 1).
    Returns the path, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no pass@k plot (pip install matplotlib)", file=sys.stderr)
        return None
    benches = list(results[0]["benchmarks"])
    fig, axes = plt.subplots(1, len(benches), figsize=(4.2 * len(benches), 3.4), squeeze=False)
    for ax, b in zip(axes[0], benches):
        for res, lab in zip(results, labels):
            pk = res["benchmarks"][b]["pass@k"]
            ci = res["benchmarks"][b]["pass@k_ci"]
            ks = sorted(int(x) for x in pk)
            ys = [pk[str(x)] for x in ks]
            ax.plot(ks, ys, marker="o", label=lab)
            ax.fill_between(ks, [ci[str(x)][0] for x in ks], [ci[str(x)][1] for x in ks], alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k")
        ax.set_title(b)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def cli_main(argv=None):
    """`python common.py eval --model M --benchmarks gsm8k,math500 --n 16 --k 1,4,16 [--compare BASE]
    [--out file.json]` and `python common.py sparsity CKPT_A CKPT_B [--out file.json]`."""
    import argparse
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="common.py", description="Evaluation and analysis tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ev = sub.add_parser("eval", help="greedy accuracy and pass@k of a model on benchmarks")
    ev.add_argument("--model", required=True, help="hub id, local folder (e.g. a checkpoint), or 'tiny'")
    ev.add_argument("--benchmarks", default="gsm8k,math500",
                    help=f"comma-separated: {', '.join(BENCHMARKS)} or paths to JSONL files")
    ev.add_argument("--n", type=int, default=1, help="samples per problem for pass@k (1 = greedy only)")
    ev.add_argument("--k", default="1", help="comma-separated k values, each <= n")
    ev.add_argument("--temperature", type=float, default=0.6)
    ev.add_argument("--top-p", type=float, default=0.95)
    ev.add_argument("--max-tokens", type=int, default=2048)
    ev.add_argument("--limit", type=int, default=0, help="first N problems per benchmark (0 = all)")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    ev.add_argument("--dtype", default="auto")
    ev.add_argument("--max-model-len", type=int, default=8192)
    ev.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ev.add_argument("--compare", default="", help="also evaluate this base model and plot pass@k curves")
    ev.add_argument("--out", default="", help="output JSON (default eval_<model>.json)")
    sp = sub.add_parser("sparsity", help="update sparsity (Eq. 2) between two checkpoints")
    sp.add_argument("a")
    sp.add_argument("b")
    sp.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.cmd == "sparsity":
        res = update_sparsity(args.a, args.b)
        res.update(a=args.a, b=args.b)
        text = json.dumps(res, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0
    out = args.out or "eval_" + re.sub(r"[^\w.-]+", "_", args.model.strip("/")) + ".json"
    res = _vf_eval_model(args, args.model)
    report = res
    if args.compare:
        base = _vf_eval_model(args, args.compare)
        report = {"trained": res, "base": base}
        png = plot_pass_at_k([base, res], [f"base: {args.compare}", f"trained: {args.model}"],
                             str(Path(out).with_suffix(".png")))
        if png:
            report["plot"] = png
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    for label, r in ([("trained", res), ("base", report["base"])] if args.compare else [("", res)]):
        for b, v in r["benchmarks"].items():
            pk = ", ".join(f"pass@{x}={y:.3f}" for x, y in v["pass@k"].items())
            print(f"{label + ' ' if label else ''}{r['model']} {b}: greedy={v['greedy_acc']:.3f} {pk}")
    print(f"wrote {out}")
    return 0
