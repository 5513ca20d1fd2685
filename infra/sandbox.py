"""The Python sandbox, trusted side: PythonSandbox runs untrusted, model-written Python, a fresh
isolated process per program, and parse_literal reads what comes back.

A program costs ~2 ms of CPU (a fresh interpreter costs 25-40 ms: tests/bench_sandbox.py). A zygote
per worker (infra/zygote.py), a clean `python -s -S -P` with an allow-listed env, forks one child
per program: no state reaches the next one, and the trainer is never forked. Each child gets net,
mount, IPC, UTS and PID namespaces (inside a user namespace if not root), an allow-listed read-only
root with a fresh tmpfs and /proc per job, a uid per worker and a memory cgroup per job (root),
no_new_privs, seccomp (x86-64) and rlimits. A job's processes, sockets and memory are gone before
its call returns, its zygote's death included. The trainer never evals or unpickles output: it
gets a capped JSON frame {status, value, error} of strings, value a repr for parse_literal. What
the host lacks is said in .isolation, never made up for by Python-level guards. No new
dependency: bubblewrap would exec a fresh interpreter per program. forbidden_modules is a task
policy, not a boundary.

How the two sides talk (infra/zygote.py's docstring has the fields): over the zygote's stdin and
stdout, each message a 4-byte big-endian length and a payload. The trainer sends the config once
(JSON) and gets {"ready", "report"} back; then, per job, a JSON header of limits and lengths
followed by the program's and the expression's bytes, and gets one reply: a kind byte (b"P", b"S",
b"Z" or b"E": see PythonSandbox._result) and a JSON frame {status, value, error}, maybe after a
b"T" (replace this zygote after the reply: PythonSandbox._verdict_of).
"""
import ast
import collections
import contextlib
import json
import math
import os
import platform
import re
import selectors
import shutil
import signal
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


MAX_SAME_HASH = 16  # distinct keys of one set or dict display that may share a hash


def _check_key_hashes(display: ast.Set | ast.Dict):
    """ValueError if more than MAX_SAME_HASH distinct keys of a set or dict display share a hash:
    building it would take quadratic time (the integers k * (2**61 - 1) + c all hash alike)."""
    keys = display.elts if isinstance(display, ast.Set) else display.keys
    distinct_by_hash: dict[int, list] = {}
    for key_node in keys:
        if key_node is None:  # {**x}: literal_eval refuses it
            continue
        if isinstance(key_node, ast.Constant):  # most keys: no literal_eval call
            key = key_node.value
        else:
            key = ast.literal_eval(key_node)
        same_hash = distinct_by_hash.setdefault(hash(key), [])
        if key not in same_hash:  # compares with at most MAX_SAME_HASH keys
            same_hash.append(key)
        if len(same_hash) > MAX_SAME_HASH:
            raise ValueError(f"over {MAX_SAME_HASH} keys of one set or dict share a hash")


def _check_literal_tree(tree: ast.AST):
    """ValueError if tree is nested past 50, holds NaN or infinity, or a set or dict whose keys
    collide (_check_key_hashes). Breadth first: the depth is checked before ast.literal_eval
    recurses."""
    nodes = [(tree, 0)]
    for node, depth in nodes:
        if depth > 50:
            raise ValueError("nested deeper than 50")
        # literal_eval only adds a real to an imaginary constant: finite constants stay so
        if isinstance(node, ast.Constant) and isinstance(node.value, (float, complex)):
            number = node.value
            if not (math.isfinite(number.real) and math.isfinite(number.imag)):
                raise ValueError("NaN or infinity")
        for child in ast.iter_child_nodes(node):
            nodes.append((child, depth + 1))
    for node, _ in reversed(nodes):  # deepest first: a key is built once its own sets passed
        if isinstance(node, (ast.Set, ast.Dict)):
            _check_key_hashes(node)


def parse_literal(text: str, *, max_chars: int = 100_000, require_roundtrip: bool = True):
    """ast.literal_eval of an untrusted literal (a sandbox repr) -> ValueError, naming why, for a
    non-str, over max_chars, nested past 50, NaN/inf, colliding set or dict keys, or
    (require_roundtrip) a changed repr."""
    if not isinstance(text, str):
        raise ValueError(f"parse_literal needs a str, got {type(text).__name__}")
    if len(text) > max_chars:
        raise ValueError(f"literal is {len(text)} chars, over the cap of {max_chars}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
        _check_literal_tree(tree)
        value = ast.literal_eval(tree)
        # equal, not the same repr: set order may change on re-insertion
        again = ast.literal_eval(repr(value)) if require_roundtrip else value
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(f"not a Python literal: {type(e).__name__}: {e}") from None
    if type(again) is not type(value) or again != value:
        raise ValueError("literal does not round-trip through repr and ast.literal_eval")
    return value


ZYGOTE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")

# the zygote's whole environment: nothing of the trainer's (tokens, paths) reaches a program
ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
    # one thread per numeric library: a program keeps to one core
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "RAYON_NUM_THREADS": "1",
    "VECLIB_MAXIMUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# shown empty to a program: homes, temp dirs, runtime state
HIDDEN_DIRS = ("/root", "/home", "/tmp", "/var/tmp", "/dev/shm", "/run")

# the trainer's cwd is hidden too, unless it lies in one of these
SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/proc", "/sys",
               "/dev", "/var", "/opt", "/nix", "/snap", "/boot")

# which statuses each kind of reply may carry: the zygote's verdict any, a program's frame only
# its own outcomes, a frame from the child's setup (or the zygote's own failure) only sandbox_error
STATUSES_BY_KIND = {
    b"Z": EXEC_STATUSES,
    b"P": ("ok", "error", "memory", "output_limit", "forbidden"),
    b"S": ("sandbox_error",),
    b"E": ("sandbox_error",),
}

LONE_SURROGATE = re.compile("[\ud800-\udfff]")

_uids_in_use: set[int] = set()  # held by this process's live workers, one uid each
_uid_lock = threading.Lock()


def python_paths() -> list[str]:
    """Directories the child's interpreter reads (bound read-only; one inside another once)."""
    import site, sysconfig  # noqa: E401
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable))]
    paths += site.getsitepackages()
    install_paths = sysconfig.get_paths()
    for name in ("stdlib", "platstdlib", "purelib", "platlib"):
        paths.append(install_paths.get(name))
    real_dirs = set()
    for path in paths:
        if path and os.path.isdir(path):
            real_dirs.add(os.path.realpath(path))
    return sorted(real_dirs)


def _default_hidden_paths() -> list[str]:
    """HIDDEN_DIRS, and the trainer's cwd (runs, checkpoints) unless it is a system dir."""
    cwd = os.path.realpath(os.getcwd())
    known = any((cwd + "/").startswith(d + "/") for d in SYSTEM_DIRS + HIDDEN_DIRS)
    hidden = list(HIDDEN_DIRS)
    if cwd != "/" and not known:
        hidden.append(cwd)
    return hidden


def _claim_uids(n: int) -> list[int]:
    """n uids (each its gid too) of no account and no other live sandbox: 2048 per process."""
    base = 100_000_000 + (os.getpid() % 2_000_000) * 2048
    with _uid_lock:
        free = [uid for uid in range(base, base + 2048) if uid not in _uids_in_use]
        if len(free) < n:
            raise RuntimeError("PythonSandbox: more than 2048 workers alive in this process; "
                               "close some sandboxes first")
        claimed = free[:n]
        _uids_in_use.update(claimed)
    return claimed


def _isolation_level(report: dict) -> str:
    namespaces = report["namespaces"]
    # a read-only root has a mount namespace, a net one a uid of its own
    if namespaces["net"] and namespaces["pid"] and report["readonly_root"]:
        return "strong" if report["seccomp"] else "namespaces"
    if any(namespaces.values()) or report["uid_dropped"]:
        return "partial"
    return "rlimits-only"


def _socket_families(report: dict) -> str:
    if not report["seccomp"]:
        return "any"
    if not report["namespaces"]["net"]:
        return "AF_UNIX"
    return "AF_UNIX, AF_INET/AF_INET6 in the empty network namespace"


def _remove_cgroup(path: str, timeout: float = 1.0):
    """rmdir a cgroup and those below it once they are empty (their processes reaped); give up
    after timeout seconds."""
    stop = time.monotonic() + timeout
    while os.path.exists(path) and time.monotonic() < stop:
        for folder, _, _ in os.walk(path, topdown=False):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        if os.path.exists(path):
            time.sleep(0.02)


def _process_status(pid: int) -> dict | None:
    """{"uids": [real, effective, saved, fs], "zombie": bool} of a process, None once it is gone."""
    status = {"uids": [], "zombie": False}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    status["uids"] = [int(uid) for uid in line.split()[1:]]
                elif line.startswith("State:"):
                    status["zombie"] = line.split()[1] == "Z"
    except (OSError, ValueError):
        return None
    return status


def _kill_if_uid(pid: int, uid: int):
    """SIGKILL pid if it runs as uid. The pidfd names the process checked: never one that took
    its pid meanwhile."""
    with contextlib.suppress(OSError):  # gone meanwhile
        pidfd = os.pidfd_open(pid)
        try:
            status = _process_status(pid)
            if status and uid in status["uids"]:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        finally:
            os.close(pidfd)


def _end_uid_processes(uid: int, timeout: float = 2.0) -> list[int]:
    """SIGKILL every process that runs as uid, again until none is alive or timeout seconds have
    passed; -> the pids left, zombies included (they count against the uid's RLIMIT_NPROC until
    whoever adopted them reaps them). A job's processes keep its worker's uid: they are found
    even where its zygote died and no PID namespace took them along."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        alive = False
        for name in os.listdir("/proc"):
            status = _process_status(int(name)) if name.isdigit() else None
            if status is None or uid not in status["uids"]:
                continue
            left.append(int(name))
            if not status["zombie"]:
                alive = True
                _kill_if_uid(int(name), uid)
        if not alive or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


def _sandbox_error(error: str) -> ExecResult:
    return ExecResult("sandbox_error", None, error)


def _parse_frame(data: bytes) -> dict | None:
    """A JSON frame {status: str, value: str | None, error: str | None}, or None if malformed."""
    try:
        frame = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError, MemoryError):  # bad UTF-8 too
        return None
    if type(frame) is not dict or set(frame) != {"status", "value", "error"}:
        return None
    if type(frame["status"]) is not str:
        return None
    for key in ("value", "error"):
        if frame[key] is not None and type(frame[key]) is not str:
            return None
    return frame


class _Worker:
    """One zygote process and its control pipes (trainer side)."""

    def __init__(self, cfg: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-s", "-S", "-P", ZYGOTE_SCRIPT], cwd="/",
            start_new_session=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=dict(ENV, PYTHONHASHSEED=str(cfg["hash_seed"])))
        self.rfd = self.proc.stdout.fileno()
        self.wfd = self.proc.stdin.fileno()
        self.buf = b""          # what has come of the next reply
        self.report = {}        # the zygote's REPORT
        self.deadline = 0.0     # when a busy worker counts as stuck
        self.retire = None      # why the zygote asked to be replaced after its job (b"T")
        os.set_blocking(self.rfd, False)
        try:
            self.send(cfg)
            ready = json.loads(self._first_reply())
            self.report = ready["report"]
            if not ready["ready"]:
                raise RuntimeError(f"sandbox zygote failed to start: {ready['error']}")
        except BaseException:
            self.kill()
            raise

    def _first_reply(self) -> bytes:
        with selectors.DefaultSelector() as sel:  # not select(): a trainer may hold 1024+ fds
            sel.register(self.rfd, selectors.EVENT_READ)
            while True:
                reply = self.poll()
                if reply is not None:
                    return reply
                if not sel.select(30.0):
                    raise RuntimeError("sandbox zygote did not answer in 30 s")

    def send(self, head: dict, payload: bytes = b""):
        """One message: the JSON head with its length, then payload's bytes as they are."""
        head = json.dumps(head).encode()
        data = memoryview(struct.pack(">I", len(head)) + head + payload)
        while data:
            written = os.write(self.wfd, data)
            data = data[written:]

    def poll(self) -> bytes | None:
        """Read what is there; return one whole reply or None. EOFError if the zygote died."""
        with contextlib.suppress(BlockingIOError):
            chunk = os.read(self.rfd, 1 << 20)
            if not chunk:
                raise EOFError("sandbox zygote exited")
            self.buf += chunk
        if len(self.buf) < 4:
            return None
        n = struct.unpack(">I", self.buf[:4])[0]
        if n > 64 << 20:  # far over any reply
            raise EOFError("sandbox zygote sent an oversized frame")
        if len(self.buf) < 4 + n:
            return None
        reply = self.buf[4:4 + n]
        self.buf = self.buf[4 + n:]
        return reply

    def kill(self) -> list[int]:
        """Close the pipes (the zygote leaves its cgroups, exits), kill it if it lingers, end every
        process of its uid (a job whose zygote died), tidy up; -> the pids that would not die."""
        self.proc.stdin.close()
        self.proc.stdout.close()
        for wait in (0.5, 10):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait)
            self.proc.kill()  # a no-op once it has exited
        left = []
        if self.report.get("uid_dropped"):  # a uid of the sandbox's own: nothing else runs as it
            left = _end_uid_processes(self.report["uid"])
        scratch = self.report.get("scratch") or ""
        if scratch.startswith("/"):  # no mount namespace: on the host
            shutil.rmtree(scratch, ignore_errors=True)
        memory_cgroup = self.report.get("memory_cgroup") or {}
        if memory_cgroup.get("path"):
            _remove_cgroup(memory_cgroup["path"])
        return left


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
        invalid = (timeout_s <= 0 or memory_mb < 64 or max_output_chars < 1
                   or not 0 <= seed < 2**32
                   or namespaces not in (True, False, "user"))  # "user": the unprivileged setup
        if invalid:
            raise ValueError("needs timeout_s > 0, memory_mb >= 64, max_output_chars >= 1, "
                             "hash_seed in [0, 2**32 - 1], namespaces True, False or 'user'")
        default_workers = max(2, min(8, 2 * (os.cpu_count() or 1)))
        self.workers = int(workers or default_workers)
        self.timeout_s = float(timeout_s)
        self.max_program_chars = max_program_chars
        self.limits = {  # sent with every job
            "memory_mb": int(memory_mb),
            "fsize_mb": int(max_file_mb),
            "nproc": int(max_procs),
            "max_output": int(max_output_chars),
            "forbidden": sorted(set(forbidden_modules)),
        }
        # one uid (and gid) per worker; one whose processes would not die is replaced, and kept
        self.uids = self.uids_held = _claim_uids(self.workers)
        hidden = _default_hidden_paths()
        self._cfg = {
            "keep_paths": python_paths(),
            "hash_seed": seed,
            "namespaces": namespaces,
            "site_dirs": [os.path.realpath(p) for p in sys.path if p and "-packages" in p],
            "hide_paths": hidden if hide_paths is None else list(hide_paths),
            "memory_mb": int(memory_mb),
            "tmpfs_mb": int(tmpfs_mb),
        }
        self._lock = threading.Lock()
        self._owner = os.getpid()  # a fork must not use our workers
        self._pool: list[_Worker | None] = [None] * self.workers
        self.restarts = 0
        self._closed = False
        self._retry_after: dict[int, float] = {}  # worker index -> when it may be started again
        self._start_errors: dict[int, Exception] = {}  # worker index -> why its last start failed
        self._start_all()
        report = self._pool[0].report
        self.isolation = {"level": _isolation_level(report), "hash_seed": self.hash_seed,
                          "platform": f"{platform.system()} {platform.release()}", **report,
                          "socket_families": _socket_families(report)}

    def _start_all(self):
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(self.workers) as ex:  # in parallel
            list(ex.map(self._start, range(self.workers)))
        if not all(self._pool):
            self.close()
            errors = [f"worker {i}: {e}" for i, e in self._start_errors.items()]
            raise RuntimeError("PythonSandbox: workers failed to start: " + "; ".join(errors))

    def _start(self, i: int) -> _Worker | None:
        """Start worker i, unless its last start failed less than a second ago; -> it or None."""
        if time.monotonic() < self._retry_after.get(i, 0.0):
            return self._pool[i]
        try:
            self._pool[i] = _Worker(dict(self._cfg, uid=self.uids[i]))
        except Exception as e:  # noqa: BLE001 - reported by the caller
            self._retry_after[i] = time.monotonic() + 1.0
            self._start_errors[i] = e
        return self._pool[i]

    def _job_msg(self, timeout: float) -> dict:
        return dict(self.limits, timeout=timeout)

    def _send_job(self, worker: _Worker, job: tuple[str, str], timeout: float):
        program_text, expression_text = job
        program = program_text.encode("utf-8", "surrogatepass")
        expression = expression_text.encode("utf-8", "surrogatepass")
        head = dict(self._job_msg(timeout), plen=len(program), elen=len(expression))
        with contextlib.suppress(OSError):  # a dead zygote: its poll() says so
            worker.send(head, program + expression)

    def run(self, program: str, expression: str, *, timeout_s: float | None = None) -> ExecResult:
        """Exec program in a fresh isolated process, then evaluate expression there."""
        return self.run_many([(program, expression)], timeout_s=timeout_s)[0]

    def _check_jobs(self, jobs: list) -> list[ExecResult | None]:
        """TypeError for a job that is not a pair of str; an error result for one over the cap."""
        results: list[ExecResult | None] = [None] * len(jobs)
        for k, job in enumerate(jobs):
            is_pair = isinstance(job, (tuple, list)) and len(job) == 2
            if not (is_pair and all(isinstance(s, str) for s in job)):
                raise TypeError(f"run_many: job {k} must be a (program: str, expression: str) "
                                f"pair, got {type(job).__name__}")
            program, expression = job
            n = len(program) + len(expression)
            if n > self.max_program_chars:
                results[k] = ExecResult("error", None, f"program is {n} chars, over the cap of "
                                                       f"{self.max_program_chars}")
        return results

    @timed("verify")
    def run_many(self, jobs, *, timeout_s: float | None = None) -> list[ExecResult]:
        """Run (program, expression) pairs in parallel over the workers; results in input order."""
        jobs = list(jobs)
        timeout = float(timeout_s or self.timeout_s)
        results = self._check_jobs(jobs)
        if self._closed or os.getpid() != self._owner:
            raise RuntimeError(f"PythonSandbox is closed, or belongs to pid {self._owner}, not "
                               "to this forked process: create a new one")
        pending = collections.deque(k for k, result in enumerate(results) if result is None)
        busy: dict[int, int] = {}  # worker index -> job index
        sel = selectors.DefaultSelector()  # the busy workers' reply pipes

        # a restarted worker's successor starts when a job needs one
        def finish(i, result, restart):
            results[busy.pop(i)] = result
            sel.unregister(self._pool[i].rfd)
            if restart or self._pool[i].retire:
                self._stop_worker(i)

        with self._lock:
            try:
                while pending or busy:
                    for i in range(self.workers):
                        if i in busy or not pending:
                            continue
                        worker = self._pool[i] or self._start(i)
                        if worker is None:
                            continue
                        k = pending.popleft()
                        self._send_job(worker, jobs[k], timeout)
                        sel.register(worker.rfd, selectors.EVENT_READ, i)
                        # the zygote enforces timeout: this only catches a stuck zygote
                        worker.deadline = time.monotonic() + 5.0 + timeout
                        busy[i] = k
                    if not busy:  # then no worker could be started
                        for k in pending:
                            results[k] = _sandbox_error("no sandbox worker could be started")
                        break
                    wait = min(self._pool[i].deadline for i in busy) - time.monotonic()
                    for key, _ in sel.select(wait):
                        i = key.data
                        try:
                            reply = self._verdict_of(self._pool[i])
                            if reply is not None:  # b"E": the zygote failed on its own, replace it
                                finish(i, self._result(reply), reply[:1] == b"E")
                        except (EOFError, OSError, ValueError) as e:
                            finish(i, _sandbox_error(f"sandbox worker died: {e}"), True)
                    stuck = [i for i in busy if self._pool[i].deadline < time.monotonic()]
                    for i in stuck:
                        finish(i, _sandbox_error("sandbox worker stopped answering"), True)
            finally:
                for i in list(busy):  # interrupted (KeyboardInterrupt): in-flight ones are unknown
                    finish(i, None, True)
                sel.close()
        return results  # type: ignore[return-value]

    @staticmethod
    def _verdict_of(worker: _Worker) -> bytes | None:
        """The worker's reply on its job, once it is whole; a b"T" before it (the job left
        something behind, see the zygote's release_job) marks the worker for replacement."""
        reply = worker.poll()
        while reply is not None and reply[:1] == b"T":
            worker.retire = reply[1:]
            reply = worker.poll()
        return reply

    def _stop_worker(self, i: int):
        """Stop worker i for a successor. Where processes of its uid would not die, that uid stays
        claimed (they would count against a successor's RLIMIT_NPROC): the next gets a fresh one."""
        left = self._pool[i].kill()
        self._pool[i] = None
        self.restarts += 1
        if left:
            self.uids[i] = _claim_uids(1)[0]

    def _result(self, reply: bytes) -> ExecResult:
        """Check a reply: b"Z" the zygote's (b"E": it failed), b"P" the program's (its outcomes
        only), b"S" the child's in setup; a child's malformed frame is a crash of its job alone."""
        kind = reply[:1]
        frame = _parse_frame(reply[1:])
        if frame is None:
            if kind in (b"P", b"S"):
                return ExecResult("crash", None, "the program wrote a malformed result")
            raise ValueError("malformed reply from the sandbox zygote")
        status = frame["status"]
        value = frame["value"]
        error = frame["error"]
        if status not in STATUSES_BY_KIND.get(kind, ("sandbox_error",)):
            return ExecResult("crash", None,
                              f"the program claimed status {status[:40]!r}, which it may not")
        # a value comes with status ok alone, and a repr escapes lone surrogates
        forged = (value is not None) != (status == "ok")
        if value and LONE_SURROGATE.search(value):
            forged = True
        if forged:
            return ExecResult("crash", None, "the program forged a result (a value without "
                                             "status ok, or no repr)")
        if value is not None and len(value) > self.limits["max_output"]:
            return ExecResult("output_limit", None, "result over the output cap")
        if error:  # an exception message may carry lone surrogates: escaped, logs are UTF-8
            error = error[:2000].encode("utf-8", "backslashreplace").decode("utf-8")
        return ExecResult(status, value, error)

    def close(self):
        self._closed = True
        if os.getpid() != getattr(self, "_owner", None):
            return  # a forked copy of the trainer: the workers are not ours to stop
        kept = set()  # uids whose processes would not die: never reused
        for i, worker in enumerate(self._pool):
            if worker is not None and worker.kill():
                kept.add(self.uids[i])
        self._pool = [None] * self.workers
        with _uid_lock:
            _uids_in_use.difference_update(set(self.__dict__.pop("uids_held", ())) - kept)

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter shutdown
            self.close()
