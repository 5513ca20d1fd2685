"""A pool of math-verify worker processes (infra/math_verify_worker.py), killable when a pair hangs
inside C code, replaced when sympy's caches grow."""
import atexit
import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time


WORKER_MAX_PAIRS = 50_000  # a worker is replaced after this many pairs (sympy's caches grow)


WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_verify_worker.py")
HARD_GRACE_S = 1.0  # soft alarm at `timeout` CPU seconds; killed at timeout + grace


CLK_TCK = os.sysconf("SC_CLK_TCK")


class _Worker:
    """One math-verify process with at most one pair in flight: a JSON line down its stdin, a
    verdict line back (a pair costs milliseconds, the round trip microseconds)."""

    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-I", WORKER_SCRIPT],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, bufsize=0)
        self.ready = False  # it has written its ready line
        self.job = None  # the index of the pair in flight
        self.done = 0  # pairs answered
        self.since = time.monotonic()  # when the job (or the start) began
        self.cpu0 = 0.0  # its CPU seconds then

    def cpu(self):
        """User + system CPU seconds of the process; None without /proc."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                stat = f.read()
            fields = stat.rsplit(b")", 1)[1].split()  # after the command name (it may hold spaces)
            return (int(fields[11]) + int(fields[12])) / CLK_TCK
        except (OSError, IndexError, ValueError):
            return None

    def send(self, i, lines):
        self.job = i
        self.since = time.monotonic()
        self.cpu0 = self.cpu() or 0.0
        with contextlib.suppress(OSError):  # it died: select sees the end of its output
            self.proc.stdin.write(lines[i])

    def read(self):
        """A verdict line, None for the ready line, b"" once the process has died."""
        line = self.proc.stdout.readline()
        if self.ready:
            return line
        if line != b'{"ready": 1}\n':  # {"fatal": ...}, or it exited
            raise RuntimeError(f"the math-verify worker ({sys.executable}) did not start: "
                               f"{line.decode(errors='replace').strip() or 'it exited'}; fix: "
                               "`pip install math-verify`")
        self.ready = True
        return None

    def stuck(self, hard_cpu):
        """Over `hard_cpu` CPU seconds on one pair (load does not turn answers into kills), or
        over 3 * hard_cpu + 2 wall-clock seconds (stopped, blocked)."""
        waited = time.monotonic() - self.since
        if not self.ready and waited > 120:
            raise RuntimeError("math-verify worker did not start within 120 s")
        if self.job is None or waited <= hard_cpu:
            return False
        cpu = self.cpu()
        if cpu is None:
            used = waited
        else:
            used = cpu - self.cpu0
        return used > hard_cpu or waited > 3 * hard_cpu + 2.0

    def kill(self):
        self.proc.kill()  # nothing once it has exited
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.proc.stdin.close()
        self.proc.stdout.close()


class VerifierPool:
    """Lazily started, reused math-verify workers. One batch at a time (a lock), from any thread."""

    def __init__(self):
        self.workers = []
        self.lock = threading.Lock()
        self.pid = os.getpid()  # the process whose workers they are

    def close(self):
        if self.pid == os.getpid():  # a forked child must not kill its parent's workers
            for w in self.workers:
                w.kill()
        self.workers = []
        self.pid = os.getpid()

    def run(self, items, timeout, n_workers):
        """items: [(pred, gold, expression)] -> 1 equal / 0 not / 2 timeout / 3 error / 4 killed."""
        lines = []
        for pred, gold, expression in items:
            request = [pred, gold, timeout, bool(expression)]
            lines.append((json.dumps(request) + "\n").encode())
        with self.lock:
            self._start_workers(n_workers)
            try:
                return self._answer(lines, timeout)
            except BaseException:  # no half-answered pair survives into the next batch
                self.close()
                raise

    def _start_workers(self, n_workers):
        """n_workers running workers; the ones past WORKER_MAX_PAIRS are replaced (sympy's caches
        grow), and in a forked child the parent's are left alone."""
        if self.pid != os.getpid():
            self.close()
        for w in self.workers:
            if w.done > WORKER_MAX_PAIRS:
                w.kill()
        self.workers = [w for w in self.workers if w.proc.poll() is None]
        while len(self.workers) < n_workers:
            self.workers.append(_Worker())

    def _answer(self, lines, timeout):
        """The verdict of each request line, the workers each answering one at a time; a worker
        that dies or is stuck is replaced, its pair judged 3 (died) or 4 (killed)."""
        queue = list(range(len(lines)))[::-1]  # pop() takes them in order
        out = [None] * len(lines)
        while queue or any(w.job is not None for w in self.workers):
            for w in self.workers:
                if w.ready and w.job is None and queue:
                    w.send(queue.pop(), lines)
            pipes = [w.proc.stdout for w in self.workers]
            readable, _, _ = select.select(pipes, [], [], 0.05)
            for i, w in enumerate(self.workers):
                line = None
                if w.proc.stdout in readable:
                    line = w.read()
                if line:
                    out[w.job] = int(line)
                    w.job = None
                    w.done += 1
                elif line == b"" or w.stuck(timeout + HARD_GRACE_S):
                    if w.job is not None:  # its pair is the culprit
                        out[w.job] = 4 if line is None else 3  # killed, or it died
                    w.kill()
                    self.workers[i] = _Worker()
        return out


POOL = VerifierPool()  # no process starts before the first pair that needs one


atexit.register(POOL.close)


def shutdown_verifier():
    """Kill the math-verify workers (they restart lazily on the next call)."""
    with POOL.lock:
        POOL.close()


def verifier_worker_pids():
    """Process ids of the running math-verify workers (diagnostics)."""
    return [w.proc.pid for w in POOL.workers if w.proc.poll() is None]
