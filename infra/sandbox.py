"""The Python sandbox, trusted side: fork-server workers (infra/zygote.py) that run each program in a
fresh isolated process, and parse_literal for what comes back.

It runs untrusted, model-written Python, a fresh isolated process per program, at ~2 ms of CPU (a
fresh interpreter costs 25-40 ms: tests/bench_sandbox.py). A zygote per worker, a clean
`python -s -S -P` with an allow-listed env, forks one child per program: no state reaches the
next one, and the trainer is never forked. Each child gets net, mount, IPC, UTS and PID
namespaces (inside a user namespace if not root), an allow-listed read-only root with a fresh
tmpfs per job, a uid per worker and a memory cgroup (root), no_new_privs, seccomp (x86-64) and
rlimits. The trainer never evals or unpickles output: it gets a capped JSON frame {status, value,
error} of strings, value a repr for parse_literal. What the host lacks is said in .isolation,
never made up for by Python-level guards. No new dependency: bubblewrap would exec a fresh
interpreter per program. forbidden_modules is a task policy, not a boundary.
"""
import ast
import collections
import contextlib
import functools
import json
import math
import os
import platform
import re
import selectors
import shutil
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from infra.timing import timed


EXEC_STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "crash", "forbidden",
                 "sandbox_error")  # timeout: wall clock or CPU; crash: a signal, or no result


@dataclass(frozen=True)
class ExecResult:
    status: str                 # one of EXEC_STATUSES
    value: str | None = None    # repr of the expression's value (status "ok"), capped in the child
    error: str | None = None    # exception type and message, signal name, or why the sandbox failed

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def parse_literal(text: str, *, max_chars: int = 100_000, require_roundtrip: bool = True):
    """ast.literal_eval of an untrusted literal (a sandbox repr) -> ValueError, naming why, for a
    non-str, over max_chars, nested past 50, NaN/inf, or (require_roundtrip) a changed repr."""
    if not isinstance(text, str):
        raise ValueError(f"parse_literal needs a str, got {type(text).__name__}")
    if len(text) > max_chars:
        raise ValueError(f"literal is {len(text)} chars, over the cap of {max_chars}")
    try:
        nodes = [(ast.parse(text.strip(), mode="eval"), 0)]
        for node, depth in nodes:  # breadth first: depth is checked before literal_eval recurses
            if depth > 50:
                raise ValueError("nested deeper than 50")
            # literal_eval only adds a real to an imaginary constant: finite constants stay so
            v = node.value if isinstance(node, ast.Constant) else None
            if isinstance(v, (float, complex)) and not all(map(math.isfinite, (v.real, v.imag))):
                raise ValueError("NaN or infinity")
            nodes.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
        value = ast.literal_eval(nodes[0][0])
        # equal, not the same repr: set order may change on re-insertion
        again = ast.literal_eval(repr(value)) if require_roundtrip else value
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(f"not a Python literal: {type(e).__name__}: {e}") from None
    if type(again) is not type(value) or again != value:
        raise ValueError("literal does not round-trip through repr and ast.literal_eval")
    return value


ZYGOTE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
           **{k + "_NUM_THREADS": "1" for k in ("OMP", "OPENBLAS", "MKL", "NUMEXPR", "RAYON")},
           "VECLIB_MAXIMUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


HIDDEN_DIRS = ("/root", "/home", "/tmp", "/var/tmp", "/dev/shm", "/run")


SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/proc", "/sys",
                   "/dev", "/var", "/opt", "/nix", "/snap", "/boot")


_uids_in_use: set[int] = set()  # held by this process's live workers, one uid each


_uid_lock = threading.Lock()


def python_paths() -> list[str]:
    """Directories the child's interpreter reads (bound read-only; one inside another once)."""
    import site, sysconfig  # noqa: E401
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)), *site.getsitepackages(),
             *map(sysconfig.get_paths().get, ("stdlib", "platstdlib", "purelib", "platlib"))}
    return sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)})


class _Worker:
    """One zygote process and its control pipes (trainer side)."""

    def __init__(self, cfg: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-s", "-S", "-P", ZYGOTE_SCRIPT], cwd="/",
            start_new_session=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=dict(ENV, PYTHONHASHSEED=str(cfg["hash_seed"])))
        self.rfd, self.wfd = self.proc.stdout.fileno(), self.proc.stdin.fileno()
        self.buf, self.report, self.deadline = b"", {}, 0.0
        os.set_blocking(self.rfd, False)
        try:
            self.send(cfg)
            with selectors.DefaultSelector() as sel:  # not select(): a trainer may hold 1024+ fds
                sel.register(self.rfd, selectors.EVENT_READ)
                while (msg := self.poll()) is None:
                    if not sel.select(30.0):
                        raise RuntimeError("sandbox zygote did not answer in 30 s")
            msg = json.loads(msg)
            self.report = msg["report"]
            if not msg["ready"]:
                raise RuntimeError(f"sandbox zygote failed to start: {msg['error']}")
        except BaseException:
            self.kill()
            raise

    def send(self, head: dict, payload: bytes = b""):
        head = json.dumps(head).encode()
        data = memoryview(struct.pack(">I", len(head)) + head + payload)
        while data:
            data = data[os.write(self.wfd, data):]

    def poll(self) -> bytes | None:
        """Read what is there; return one whole frame or None. EOFError if the zygote died."""
        with contextlib.suppress(BlockingIOError):
            chunk = os.read(self.rfd, 1 << 20)
            if not chunk:
                raise EOFError("sandbox zygote exited")
            self.buf += chunk
        n = struct.unpack(">I", self.buf[:4])[0] if len(self.buf) >= 4 else 0
        if n > 64 << 20:  # far over any reply
            raise EOFError("sandbox zygote sent an oversized frame")
        if len(self.buf) < 4 + n:
            return None
        data, self.buf = self.buf[4:4 + n], self.buf[4 + n:]
        return data

    def kill(self):
        """Close the pipes (the zygote leaves its cgroup, exits), kill it if it lingers, tidy up."""
        self.proc.stdin.close()
        self.proc.stdout.close()
        for wait in (0.5, 10):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait)
            self.proc.kill()  # a no-op once it has exited
        if (self.report.get("scratch") or "").startswith("/"):  # no mount namespace: on the host
            shutil.rmtree(self.report["scratch"], ignore_errors=True)
        cgroup, stop = (self.report.get("memory_cgroup") or {}).get("path"), time.monotonic() + 1
        while cgroup and os.path.exists(cgroup) and time.monotonic() < stop:  # empty once reaped
            with contextlib.suppress(OSError):
                os.rmdir(cgroup)
            time.sleep(0.02)


class PythonSandbox(contextlib.AbstractContextManager):
    """Fork-server workers that run each (program, expression) in a fresh isolated process:
    sb.run("def f(x):\\n    return x * 2", "f(21)") == ExecResult("ok", "42", None)."""

    def __init__(self, workers: int | None = None, timeout_s: float = 5.0, memory_mb: int = 1024,
                 max_output_chars: int = 100_000, *, max_procs: int = 16, max_file_mb: int = 64,
                 tmpfs_mb: int = 256, forbidden_modules=(), hide_paths=None, hash_seed: int = 0,
                 max_program_chars: int = 1_000_000, namespaces: bool | str = True):
        if not sys.platform.startswith("linux"):
            raise RuntimeError(f"PythonSandbox needs Linux (namespaces, seccomp, /proc), not "
                               f"{sys.platform}: run it in a Linux VM or container")
        # one PYTHONHASHSEED (and memory layout) per sandbox: independent runs need two sandboxes
        seed = self.hash_seed = int(hash_seed)
        if timeout_s <= 0 or memory_mb < 64 or max_output_chars < 1 or not 0 <= seed < 2**32 \
                or namespaces not in (True, False, "user"):  # "user": the unprivileged setup
            raise ValueError("needs timeout_s > 0, memory_mb >= 64, max_output_chars >= 1, "
                             "hash_seed in [0, 2**32 - 1], namespaces True, False or 'user'")
        self.workers = int(workers or max(2, min(8, 2 * (os.cpu_count() or 1))))
        self.timeout_s, self.max_program_chars = float(timeout_s), max_program_chars
        self.limits = {"memory_mb": int(memory_mb), "fsize_mb": int(max_file_mb),
                       "nproc": int(max_procs), "max_output": int(max_output_chars),
                       "forbidden": sorted(set(forbidden_modules))}
        # one uid (and gid) per worker, no account's nor another live sandbox's: 2048 per process
        base = 100_000_000 + (os.getpid() % 2_000_000) * 2048
        with _uid_lock:
            self.uids = [u for u in range(base, base + 2048) if u not in _uids_in_use]
            if len(self.uids) < self.workers:
                raise RuntimeError("PythonSandbox: more than 2048 workers alive in this process; "
                                   "close some sandboxes first")
            self.uids = self.uids_held = self.uids[:self.workers]
            _uids_in_use.update(self.uids)
        # shown empty: homes, temp dirs, the trainer's cwd (runs, checkpoints) unless a system dir
        cwd = os.path.realpath(os.getcwd())
        inside = any((cwd + "/").startswith(d + "/") for d in SYSTEM_DIRS + HIDDEN_DIRS)
        hidden = list(HIDDEN_DIRS) + ([cwd] if cwd != "/" and not inside else [])
        self._cfg = {"keep_paths": python_paths(), "hash_seed": seed, "namespaces": namespaces,
                     "site_dirs": [os.path.realpath(p) for p in sys.path if p and "-packages" in p],
                     "hide_paths": hidden if hide_paths is None else list(hide_paths),
                     "memory_mb": int(memory_mb), "tmpfs_mb": int(tmpfs_mb)}
        self._lock, self._owner = threading.Lock(), os.getpid()  # a fork must not use our workers
        self._pool: list[_Worker | None] = [None] * self.workers
        self.restarts, self._closed, self._retry_at = 0, False, {}  # i -> (time, last error)
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(self.workers) as ex:  # start them in parallel
            list(ex.map(self._start, range(self.workers)))
        if not all(self._pool):
            self.close()
            raise RuntimeError("PythonSandbox: workers failed to start: " + "; ".join(
                f"worker {i}: {e}" for i, (_, e) in self._retry_at.items()))
        rep = self._pool[0].report
        ns = rep["namespaces"]  # a read-only root has a mount namespace, a net one a uid of its own
        level = "partial" if any(ns.values()) or rep["uid_dropped"] else "rlimits-only"
        if ns["net"] and ns["pid"] and rep["readonly_root"]:
            level = "strong" if rep["seccomp"] else "namespaces"
        families = "any" if not rep["seccomp"] else "AF_UNIX" if not ns["net"] else \
            "AF_UNIX, AF_INET/AF_INET6 in the empty network namespace"
        self.isolation = {"level": level, "hash_seed": self.hash_seed,
                          "platform": f"{platform.system()} {platform.release()}", **rep,
                          "socket_families": families}

    def _start(self, i: int) -> _Worker | None:
        if time.monotonic() >= self._retry_at.get(i, (0.0,))[0]:  # a failed one waits 1 s
            try:
                self._pool[i] = _Worker(dict(self._cfg, uid=self.uids[i]))
            except Exception as e:  # noqa: BLE001 - reported by the caller
                self._retry_at[i] = (time.monotonic() + 1.0, e)
        return self._pool[i]

    def _job_msg(self, timeout: float) -> dict:
        return dict(self.limits, timeout=timeout)

    def run(self, program: str, expression: str, *, timeout_s: float | None = None) -> ExecResult:
        """Exec program in a fresh isolated process, then evaluate expression there."""
        return self.run_many([(program, expression)], timeout_s=timeout_s)[0]

    @timed("verify")
    def run_many(self, jobs, *, timeout_s: float | None = None) -> list[ExecResult]:
        """Run (program, expression) pairs in parallel over the workers; results in input order."""
        jobs, timeout = list(jobs), float(timeout_s or self.timeout_s)
        results: list[ExecResult | None] = [None] * len(jobs)
        for k, job in enumerate(jobs):
            if not (isinstance(job, (tuple, list)) and len(job) == 2
                    and all(isinstance(s, str) for s in job)):
                raise TypeError(f"run_many: job {k} must be a (program: str, expression: str) "
                                f"pair, got {type(job).__name__}")
            if (n := len(job[0]) + len(job[1])) > self.max_program_chars:
                results[k] = ExecResult("error", None, f"program is {n} chars, over the cap of "
                                                       f"{self.max_program_chars}")
        if self._closed or os.getpid() != self._owner:
            raise RuntimeError(f"PythonSandbox is closed, or belongs to pid {self._owner}, not "
                               "to this forked process: create a new one")
        pending = collections.deque(k for k, r in enumerate(results) if r is None)
        busy: dict[int, int] = {}  # worker index -> job index
        sel, err = selectors.DefaultSelector(), functools.partial(ExecResult, "sandbox_error", None)

        def finish(i, res, restart):  # a restarted worker's successor starts when a job needs one
            results[busy.pop(i)] = res
            sel.unregister(self._pool[i].rfd)
            if restart:
                self._pool[i].kill()
                self._pool[i], self.restarts = None, self.restarts + 1
        with self._lock:
            try:
                while pending or busy:
                    for i in [i for i in range(self.workers) if i not in busy]:
                        if not pending or not (w := self._pool[i] or self._start(i)):
                            continue
                        k = pending.popleft()
                        p, e = (s.encode("utf-8", "surrogatepass") for s in jobs[k])
                        with contextlib.suppress(OSError):  # a dead zygote: poll() says so below
                            w.send(dict(self._job_msg(timeout), plen=len(p), elen=len(e)), p + e)
                        sel.register(w.rfd, selectors.EVENT_READ, i)  # busy ones: registered
                        # the zygote enforces timeout: this only catches a stuck zygote
                        w.deadline, busy[i] = time.monotonic() + 5.0 + timeout, k
                    if not busy:  # then no worker could be started
                        for k in pending:
                            results[k] = err("no sandbox worker could be started")
                        break
                    wait = min(self._pool[i].deadline for i in busy) - time.monotonic()
                    for key, _ in sel.select(wait):
                        try:
                            msg = self._pool[key.data].poll()
                            if msg is not None:  # b"E": the zygote failed on its own, replace it
                                finish(key.data, self._result(msg), msg[:1] == b"E")
                        except (EOFError, OSError, ValueError) as e:
                            finish(key.data, err(f"sandbox worker died: {e}"), True)
                    for i in [i for i in busy if self._pool[i].deadline < time.monotonic()]:
                        finish(i, err("sandbox worker stopped answering"), True)
            finally:
                for i in list(busy):  # interrupted (KeyboardInterrupt): in-flight ones are unknown
                    finish(i, None, True)
                sel.close()
        return results  # type: ignore[return-value]

    def _result(self, reply: bytes) -> ExecResult:
        """Check a reply: b"Z" the zygote's (b"E": it failed), b"P" the program's (its outcomes
        only), b"S" the child's in setup; a child's malformed frame is a crash of its job alone."""
        kind, msg, crash = reply[:1], None, functools.partial(ExecResult, "crash", None)
        with contextlib.suppress(ValueError, RecursionError, MemoryError):  # bad UTF-8 too
            msg = json.loads(reply[1:].decode("utf-8"))
        if not (type(msg) is dict and set(msg) == {"status", "value", "error"} and all(
                type(v) is str or v is None and k != "status" for k, v in msg.items())):
            if kind in (b"P", b"S"):
                return crash("the program wrote a malformed result")
            raise ValueError("malformed reply from the sandbox zygote")
        status, value, error = msg["status"], msg["value"], msg["error"]
        allowed = {b"Z": EXEC_STATUSES, b"P": ("ok", "error", "memory", "output_limit",
                                              "forbidden")}.get(kind, ("sandbox_error",))
        if status not in allowed:
            return crash(f"the program claimed status {status[:40]!r}, which it may not")
        # a value comes with status ok alone, and a repr escapes lone surrogates
        if (value is None) != (status != "ok") or value and re.search("[\ud800-\udfff]", value):
            return crash("the program forged a result (a value without status ok, or no repr)")
        if value is not None and len(value) > self.limits["max_output"]:
            return ExecResult("output_limit", None, "result over the output cap")
        if error:  # an exception message may carry lone surrogates: escaped, logs are UTF-8
            error = error[:2000].encode("utf-8", "backslashreplace").decode("utf-8")
        return ExecResult(status, value, error)

    def close(self):
        self._closed = True
        if os.getpid() != getattr(self, "_owner", None):
            return  # a forked copy of the trainer: the workers are not ours to stop
        for w in filter(None, self._pool):
            w.kill()
        self._pool = [None] * self.workers
        with _uid_lock:
            _uids_in_use.difference_update(self.__dict__.pop("uids_held", ()))

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter shutdown
            self.close()
