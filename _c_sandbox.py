# ----------------------------------------------------------------------------------------------------------------
# Python sandbox for model-written code (issue #5)
# ----------------------------------------------------------------------------------------------------------------
"""Run untrusted, model-written Python in fresh, isolated processes, fast.

Design (why each piece is there):

* Trust boundary. The trainer (this module) never evals, execs or unpickles anything untrusted code produced.
  Programs run in other processes; what comes back is a size-capped JSON object of strings
  ``{status, value, error}`` where ``value`` is the ``repr`` of the expression, cut off *inside the child*
  (a repr longer than ``max_output_chars`` is status ``output_limit``, never silently truncated). Values are
  compared in the trainer after :func:`parse_literal` (``ast.literal_eval`` with size/depth caps and a
  repr round-trip check, so an object whose ``__eq__`` always says True can never become a task value).

* One fresh process per program. Each worker is a *zygote* (fork server): a small interpreter started clean
  with ``subprocess`` (``python -s -S -P -c <source>``, an allow-listed environment, cwd ``/``), never forked
  from the multi-GB trainer and never importing ``common``/torch. Per job it forks a child that runs exactly
  one program and then exits, so monkeypatched builtins, threads or caches never reach the next task. A job
  costs 1.5-2 ms of CPU in all (trainer + zygote + child; most of it copy-on-write page faults, which are slow
  in a VM) against 25-40 ms for a fresh interpreter: see tests/bench_sandbox.py.

* Isolation, as far as the kernel lets us (the achieved level is reported by ``PythonSandbox.isolation``):
  - At start-up each zygote (root: directly; non-root Linux: inside a new user namespace) enters private
    network, mount, IPC and UTS namespaces. The network namespace has no interface up, so no socket reaches
    anything. In the mount namespace every filesystem is re-mounted read-only, and empty tmpfs mounts hide
    ``/root``, ``/home``, ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run`` and the trainer's working directory
    (tokens and caches in homes, other users' temp files, run folders and checkpoints). The directories Python
    itself needs (prefix, stdlib, site-packages) are bound back read-only where they sit under a hidden
    directory (pyenv under /root, a venv under /home). ``/etc/passwd``, ``/etc/shadow`` and friends are masked,
    and ``/proc`` is re-mounted with ``hidepid=2`` so a child cannot look at other users' processes.
  - Each child is PID 1 of its own new PID namespace. When it exits or is killed, the kernel kills every
    process inside it, which is what catches ``fork``+``setsid`` escapees and makes ``kill(-1, 9)`` harmless.
    (In a user namespace that is not allowed; there the worker is PID 1 of one namespace and empties it after
    every program.)
  - As root the child drops to an unprivileged uid/gid of its own (one per worker, from a block no account
    uses), so ``RLIMIT_NPROC`` really applies, file permissions protect the host, and workers cannot signal
    each other. ``PR_SET_NO_NEW_PRIVS`` blocks setuid binaries; on x86-64 a small hand-written seccomp filter
    (no library needed) refuses ptrace, mount, unshare/setns, new user namespaces, bpf, keyctl, io_uring,
    module loading and similar kernel attack surface.
  - rlimits with soft = hard: address space (``memory_mb``), CPU seconds, file size, open files, processes
    (``max_procs``, threads included), core = 0. The address-space limit is per process, so one program's
    processes together hold at most ``max_procs * memory_mb`` (its temp files at most ``tmpfs_mb``); a hard
    per-program bound would need a memory cgroup, which this sandbox does not create (on shared machines run
    the trainer in a container or cgroup with a memory limit).
  - The *zygote* enforces the wall-clock deadline with SIGKILL; the trainer keeps a second, looser deadline on
    the zygote itself, and a dead or silent zygote costs only its in-flight job (``sandbox_error``) before it
    is restarted. A program's frames are only believed for what a program may claim (it cannot report
    ``timeout``, ``crash`` or ``sandbox_error`` for itself).
  - Environment: an allow-list only (no tokens), ``PYTHONHASHSEED=hash_seed`` (default 0, the same in every
    child of one sandbox; two sandboxes with different seeds give a determinism check two independent runs),
    ``OMP_NUM_THREADS=1`` and friends, stdin/stdout/stderr on ``/dev/null``, cwd a private empty directory.
  Where something is unavailable (macOS, non-root without user namespaces, non-x86 seccomp) the sandbox still
  works with what it has and says so in ``.isolation``; Python-level guards are never relied upon.

* Few moving parts: nothing to install. bubblewrap would mean one exec of a fresh interpreter per program
  (tens of ms) and libseccomp bindings a compiled dependency; here the handful of syscalls (unshare, setns,
  mount, prctl, capset) go through ctypes and the seccomp filter is ~50 hand-assembled BPF instructions.

* ``forbidden`` status: optional ``forbidden_modules`` turn an import of those modules into status
  ``forbidden``. That is a task *policy* (Absolute Zero bans ``os``, ``random``...), not a security boundary.

Statuses: ok, error (exception, with its message), timeout (wall clock or CPU), memory (MemoryError or address-
space limit), output_limit (repr too long), crash (signal, or exit without a result), forbidden, sandbox_error
(the sandbox failed, not the program).
"""
import ast
import collections
import json
import math
import os
import platform
import selectors
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

EXEC_STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "crash", "forbidden", "sandbox_error")
_SB_PROGRAM_STATUSES = ("ok", "error", "memory", "output_limit", "forbidden")  # what a program's frame may claim


@dataclass(frozen=True)
class ExecResult:
    status: str                 # one of EXEC_STATUSES
    value: str | None = None    # repr of the expression's value (status "ok"), produced and capped in the child
    error: str | None = None    # exception type and message, signal name, or why the sandbox failed

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ---------------------------------------------------------------- trusted-side literal parsing (never eval)

_SB_LITERAL_NODES = (ast.Expression, ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.UnaryOp,
                     ast.BinOp, ast.USub, ast.UAdd, ast.Add, ast.Sub, ast.Load, ast.Call, ast.Name)


def parse_literal(text: str, *, max_chars: int = 100_000, max_depth: int = 50, require_roundtrip: bool = True,
                  allow_nonfinite: bool = False):
    """Parse an untrusted Python literal (e.g. a ``repr`` from the sandbox) without evaluating code.

    Raises ``ValueError`` naming the problem when ``text`` is not a str, longer than ``max_chars``, nested
    deeper than ``max_depth``, not a literal, holds NaN/inf (unless ``allow_nonfinite``), or, with
    ``require_roundtrip``, is a value that does not survive ``repr`` -> ``literal_eval`` unchanged.
    """
    if not isinstance(text, str):
        raise ValueError(f"parse_literal needs a str, got {type(text).__name__}")
    if len(text) > max_chars:
        raise ValueError(f"literal is {len(text)} chars, over the cap of {max_chars}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise ValueError(f"not a Python literal: {type(e).__name__}: {e}") from None
    stack = [(tree, 0)]
    while stack:  # iterative walk: depth and node-type checks before literal_eval recurses
        node, depth = stack.pop()
        if depth > max_depth:
            raise ValueError(f"literal nested deeper than {max_depth}")
        if not isinstance(node, _SB_LITERAL_NODES):
            raise ValueError(f"not a literal: contains {type(node).__name__}")
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id == "set"
                                               and not node.args and not node.keywords):
            raise ValueError("not a literal: contains a call other than set()")
        if isinstance(node, ast.Name) and node.id != "set":
            raise ValueError(f"not a literal: contains the name {node.id!r}")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    try:
        value = ast.literal_eval(tree)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError(f"not a Python literal: {type(e).__name__}: {e}") from None
    if not allow_nonfinite and not _sb_all_finite(value):
        raise ValueError("literal contains NaN or infinity")
    if require_roundtrip:
        try:
            again = ast.literal_eval(repr(value))
            # (not repr(again) == repr(value): set order may legitimately change on re-insertion)
            ok = type(again) is type(value) and again == value
        except Exception:  # noqa: BLE001 - any failure means "does not round-trip"
            ok = False
        if not ok:
            raise ValueError("literal does not round-trip through repr and ast.literal_eval")
    return value


def _sb_all_finite(value) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if isinstance(v, complex) and not (math.isfinite(v.real) and math.isfinite(v.imag)):
            return False
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
    return True


# ---------------------------------------------------------------- the zygote (runs in its own clean interpreter)
# Everything below up to the closing quotes runs in the zygote, NOT in the trainer. It only uses the stdlib.

_SB_ZYGOTE_SOURCE = r'''
# The zygote. Protocol on stdin/stdout: 4-byte big-endian length + payload. First the trainer sends its config
# (JSON) and gets {"ready", "report"}; then, one at a time, a job (JSON) -> a reply (see reply_bytes).
# Per job: fork a child (PID 1 of a fresh PID namespace), which sets itself up, writes b"R", runs the program
# and writes one length-prefixed JSON frame on fd 3; enforce the deadline; kill what is left; reply.
import ctypes, gc, json, os, resource, select, signal, struct, sys, time

CFG = None
LIBC = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_NOATIME, MS_NODIRATIME, MS_REMOUNT, MS_BIND, MS_REC = 1024, 2048, 32, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 38, 22
PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # typed once here: a cheap call in each child
PRCTL.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
PRCTL.restype = ctypes.c_int
REPORT = {"namespaces": {}, "notes": []}

def note(msg):
    REPORT["notes"].append(msg)

def libc_call(name, *args):
    if getattr(LIBC, name)(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, name + ": " + os.strerror(e))

def mount(src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    libc_call("mount", enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))

def recv_exact(n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(0, n - len(buf))
        if not chunk:
            os._exit(0)  # trainer went away: nothing more to do
        buf += chunk
    return buf

def recv():
    (n,) = struct.unpack(">I", recv_exact(4))
    return json.loads(recv_exact(n))

def send_bytes(data):
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(1, data):]

def send(obj):
    send_bytes(json.dumps(obj).encode())

def reply_bytes(res):
    """A job's reply: b"Z" + JSON made here, or the child's own frame passed through undecoded, tagged
    b"P" (written after setup, by the program's process) or b"S" (written during setup). The trainer decodes
    and checks it: parsing there instead of here saves copy-on-write faults in this forking process."""
    if type(res) is tuple:
        return res[0] + res[1]
    return b"Z" + json.dumps(res).encode()

def decode_reply(data):
    """Only for the start-up self-tests (the trainer decodes every other reply)."""
    try:
        return json.loads(data[1:])
    except ValueError:
        return {"status": "crash", "value": None, "error": "malformed"}

# ------------------------------------------------------------- one-time isolation of the zygote itself

def write_file(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)

def enter_namespaces():
    ns = REPORT["namespaces"]
    for k in ("user", "net", "mount", "ipc", "uts", "pid"):
        ns[k] = False
    if not sys.platform.startswith("linux"):
        note("not Linux: no namespaces")
        return
    if not CFG["namespaces"]:
        note("namespaces turned off by the caller")
        return
    if os.geteuid() != 0 or CFG["namespaces"] == "user":
        uid, gid = os.getuid(), os.getgid()
        try:
            libc_call("unshare", CLONE_NEWUSER)
            write_file("/proc/self/setgroups", "deny")
            write_file("/proc/self/uid_map", "%d %d 1" % (uid, uid))
            write_file("/proc/self/gid_map", "%d %d 1" % (gid, gid))
            ns["user"] = True
        except OSError as e:
            note("no user namespace (%s): running without namespaces" % e)
            return
    for key, flag in (("net", CLONE_NEWNET), ("mount", CLONE_NEWNS), ("ipc", CLONE_NEWIPC), ("uts", CLONE_NEWUTS)):
        try:
            libc_call("unshare", flag)
            ns[key] = True
        except OSError as e:
            note("no %s namespace: %s" % (key, e))
    if ns["uts"]:
        try:
            LIBC.sethostname(b"sandbox", 7)
        except Exception:
            pass

def setup_pid_namespace():
    """Per job, a fresh PID namespace whose PID 1 is the child (root: setns back to our own namespace, then
    unshare again). Where that is not allowed (inside a user namespace we hold no rights over our original PID
    namespace), one PID namespace for the whole worker: this process becomes its PID 1 and after every job
    kills every other process in it. Either way nothing a program starts outlives it."""
    if not sys.platform.startswith("linux") or not CFG["namespaces"]:
        return
    fd = os.open("/proc/self/ns/pid", os.O_RDONLY)
    pid = os.fork()  # probe in a throwaway child: a failed attempt would spoil our own pid_for_children
    if pid == 0:
        ok = LIBC.unshare(CLONE_NEWPID) == 0 and LIBC.setns(fd, CLONE_NEWPID) == 0 and LIBC.unshare(CLONE_NEWPID) == 0
        if ok:
            try:
                p = os.fork()
                if p == 0:
                    os._exit(0)
                os.waitpid(p, 0)
            except OSError:
                ok = False
        os._exit(0 if ok else 1)
    if os.waitpid(pid, 0)[1] == 0:
        STATE["pidns_fd"] = fd
        REPORT["namespaces"]["pid"] = True
        REPORT["pid_namespace"] = "one per program"
        return
    os.close(fd)
    if LIBC.unshare(CLONE_NEWPID) != 0:
        note("no pid namespace (errno %d): escaped processes are found by uid instead" % ctypes.get_errno())
        return
    pid = os.fork()
    if pid != 0:  # the outer process only waits; the worker goes on as PID 1 of the new namespace
        while True:
            try:
                os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        os._exit(1)
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    STATE["pid1"] = True
    REPORT["namespaces"]["pid"] = True
    REPORT["pid_namespace"] = "one per worker, emptied after every program"

def mount_flags(opts):
    flags = 0
    for o, f in (("nosuid", MS_NOSUID), ("nodev", MS_NODEV), ("noexec", MS_NOEXEC), ("noatime", MS_NOATIME),
                 ("nodiratime", MS_NODIRATIME), ("relatime", MS_RELATIME)):
        if o in opts:
            flags |= f
    return flags

def unescape(p):
    return p.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")

def isolate_filesystem():
    REPORT["readonly_root"] = False
    REPORT["hidden"] = []
    if not REPORT["namespaces"].get("mount"):
        return
    try:
        mount(None, "/", None, MS_REC | MS_PRIVATE)
    except OSError as e:
        note("mount propagation: %s" % e)
        return
    keep_fds = []
    for p in CFG["keep_paths"]:
        try:
            keep_fds.append((p, os.open(p, os.O_PATH | os.O_DIRECTORY)))
        except OSError:
            pass
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    failures = 0
    for fields in mounts:
        target, opts = unescape(fields[4]), fields[5].split(",")
        if target == "/proc" or target.startswith("/proc/"):
            continue
        try:
            mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | mount_flags(opts))
        except OSError:
            failures += 1
    REPORT["readonly_root"] = failures == 0
    if failures:
        note("%d mounts could not be made read-only" % failures)
    for d in CFG["hide_paths"]:
        if not os.path.isdir(d) or os.path.islink(d):
            continue
        size = "%dm" % CFG["tmpfs_mb"] if d == "/tmp" else "4m"
        try:
            mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=%s,mode=0755" % size)
            REPORT["hidden"].append(d)
        except OSError as e:
            note("could not hide %s: %s" % (d, e))
    if "/tmp" in REPORT["hidden"]:  # account databases: only the accounts a child can meet
        os.makedirs("/tmp/.masks", 0o755)
        uid, gid = CFG["uid"], CFG["gid"]
        masks = {"/etc/passwd": "root:x:0:0:root:/root:/usr/sbin/nologin\n"
                                "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
                                "sandbox:x:%d:%d:sandbox:/tmp:/usr/sbin/nologin\n" % (uid, gid),
                 "/etc/group": "root:x:0:\nnogroup:x:65534:\nsandbox:x:%d:\n" % gid,
                 "/etc/shadow": "", "/etc/gshadow": ""}
        REPORT["masked"] = []
        for target, text in masks.items():
            if not os.path.isfile(target):
                continue
            src = "/tmp/.masks/" + os.path.basename(target)
            with open(src, "w") as f:
                f.write(text)
            try:
                mount(src, target, None, MS_BIND)
                mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
                REPORT["masked"].append(target)
            except OSError as e:
                note("could not mask %s: %s" % (target, e))
    for p, fd in keep_fds:  # bring back what Python needs from under a hidden directory, read-only
        if not any(p == h or p.startswith(h.rstrip("/") + "/") for h in REPORT["hidden"]):
            os.close(fd)
            continue
        try:
            os.makedirs(p, exist_ok=True)
            mount("/proc/self/fd/%d" % fd, p, None, MS_BIND | MS_REC)
            mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        except OSError as e:
            note("could not keep %s: %s" % (p, e))
        os.close(fd)
    try:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
        REPORT["proc_hidepid"] = True
    except OSError as e:
        REPORT["proc_hidepid"] = False
        note("proc hidepid: %s" % e)

# ------------------------------------------------------------- seccomp: a tiny deny-list filter, x86-64 only

def build_seccomp():
    import platform
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        note("seccomp filter only written for x86-64: not installed")
        return None
    deny = [101, 155, 161, 165, 166, 167, 168, 169, 172, 173, 175, 176, 246, 248, 249, 250, 298, 303,
            304, 310, 311, 313, 320, 321, 323, 425, 426, 427, 428, 429, 430, 431, 432, 433, 442]
    # ptrace pivot_root chroot mount umount2 swapon swapoff reboot iopl ioperm init_module delete_module
    # kexec_load add_key request_key keyctl perf_event_open name_to_handle_at open_by_handle_at
    # process_vm_readv/writev finit_module kexec_file_load bpf userfaultfd io_uring_* open_tree move_mount
    # fsopen fsconfig fsmount fspick mount_setattr.  clone/unshare/setns: only what the zygote itself needs
    # (a new PID namespace per job), which needs CAP_SYS_ADMIN that the children do not have anyway.
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, KILL, EPERM, ENOSYS = 0x7FFF0000, 0x80000000, 0x00050000 | 1, 0x00050000 | 38
    ns_flags = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | 0x02000000
    src = [("", LD, 0, 0, 4), ("", JEQ, 1, 0, 0xC000003E), ("", RET, 0, 0, KILL),   # x86-64 ABI only
           ("", LD, 0, 0, 0), ("", JGE, "eperm", 0, 0x40000000),                   # x32 syscall numbers
           ("", JEQ, "enosys", 0, 435)]              # clone3 -> ENOSYS: glibc falls back to clone
    src += [("", JEQ, "eperm", 0, nr) for nr in deny]
    src += [("", JEQ, "clone", 0, 56), ("", JEQ, "unshare", 0, 272), ("", JEQ, "setns", 0, 308),
            ("", RET, 0, 0, ALLOW),
            ("clone", LD, 0, 0, 16), ("", JSET, "eperm", 0, ns_flags), ("", RET, 0, 0, ALLOW),
            ("unshare", LD, 0, 0, 16), ("", JEQ, "allow", "eperm", CLONE_NEWPID),
            ("setns", LD, 0, 0, 24), ("", JEQ, "allow", "eperm", CLONE_NEWPID),
            ("allow", RET, 0, 0, ALLOW), ("eperm", RET, 0, 0, EPERM), ("enosys", RET, 0, 0, ENOSYS)]
    where = {lab: i for i, (lab, *_rest) in enumerate(src) if lab}
    jump = lambda target, i: where[target] - i - 1 if isinstance(target, str) else target
    fixed = [(code, jump(jt, i), jump(jf, i), k) for i, (_, code, jt, jf, k) in enumerate(src)]
    raw = b"".join(struct.pack("HBBI", *ins) for ins in fixed)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class FProg(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = FProg(len(fixed), ctypes.cast(buf, ctypes.c_void_p))
    return (buf, fprog)

# ------------------------------------------------------------- per job: the child

STATE = {}

def child_main(job, wfd):
    """Runs in the fresh child. Never returns. Everything the reporting path needs is bound to locals before the
    program runs, so a program that monkeypatches builtins, json or os cannot garble its own result frame."""
    _write, _exit, _enc, _pack = os.write, os._exit, json.encoder.encode_basestring_ascii, struct.pack
    _len, _isinstance, _type, _str, _repr = len, isinstance, type, str, repr
    _BaseException, _Exception, _MemoryError, _SyntaxError = BaseException, Exception, MemoryError, SyntaxError

    def report(status, value=None, error=None):
        try:
            data = '{"status": %s, "value": %s, "error": %s}' % (
                _enc(status), "null" if value is None else _enc(value), "null" if error is None else _enc(error))
            data = data.encode()
            _write(wfd, _pack(">I", _len(data)) + data)
        except _BaseException:
            pass
        _exit(0)

    try:
        os.setsid()
        if wfd != 3:
            os.dup2(wfd, 3)
            wfd = 3
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(4, STATE["maxfd"])
        os.chdir(job["dir"])
        if STATE["drop_uid"]:
            os.setgroups([])
            set_ids(CFG["uid"], CFG["gid"])
        elif STATE.get("userns"):
            drop_caps()
        if sys.platform.startswith("linux"):
            PRCTL(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # SIGKILL when the zygote dies
            if STATE["seccomp"] is None:  # otherwise already set in the zygote and inherited
                PRCTL(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        mem = job["memory_mb"] << 20
        cpu = int(job["timeout"]) + 1
        for name, lim in (("RLIMIT_AS", mem), ("RLIMIT_CPU", cpu), ("RLIMIT_FSIZE", job["fsize_mb"] << 20),
                          ("RLIMIT_NOFILE", 64), ("RLIMIT_NPROC", job["nproc"] + STATE["nproc_base"]),
                          ("RLIMIT_CORE", 0)):
            if name in STATE["rlimits"]:
                resource.setrlimit(getattr(resource, name), (lim, lim))
    except BaseException as e:
        report("sandbox_error", None, "child setup failed: %s: %s" % (type(e).__name__, e))

    forbidden = set(job.get("forbidden") or ())
    if forbidden:
        import builtins
        real_import = builtins.__import__

        class ForbiddenImport(ImportError):
            pass
        STATE["forbidden_exc"] = ForbiddenImport

        def guarded_import(name, *a, **k):
            if name.split(".")[0] in forbidden:
                raise ForbiddenImport("import of %r is not allowed" % name)
            return real_import(name, *a, **k)
        builtins.__import__ = guarded_import
        for m in list(sys.modules):  # modules the zygote already holds must also go through the guard
            if m.split(".")[0] in forbidden:
                sys.modules.pop(m, None)

    cap = job["max_output"]
    try:  # "R": setup is over. Frames after it come from the program's process, so they cannot claim
        _write(wfd, b"R")  # sandbox_error, timeout or crash: the zygote turns such claims into "crash"
    except _BaseException:
        _exit(71)
    try:
        code = compile(job["program"], "<program>", "exec")
        expr = compile(job["expression"], "<expression>", "eval")
        ns = {"__name__": "__main__", "__builtins__": __builtins__}
        del job
        exec(code, ns)
        value = eval(expr, ns)
        if _isinstance(value, (_str, bytes)) and _len(value) > cap:
            report("output_limit", None, "value of length %d exceeds the output cap of %d" % (_len(value), cap))
        text = _repr(value)
        if _type(text) is not _str:
            report("error", None, "repr returned a non-str")
        if _len(text) > cap:
            report("output_limit", None, "repr of %d chars exceeds the output cap of %d" % (_len(text), cap))
        report("ok", text, None)
    except _BaseException as e:
        try:
            fexc = STATE.get("forbidden_exc")
            status = "memory" if _isinstance(e, _MemoryError) else \
                "forbidden" if fexc and _isinstance(e, fexc) else "error"
            name, msg = _type(e).__name__, _str(e)
            if _type(name) is not _str or _type(msg) is not _str:
                raise TypeError
            line = ""
            tb = e.__traceback__
            while tb is not None:
                if tb.tb_frame.f_code.co_filename == "<program>":
                    line = " (program line %d)" % tb.tb_lineno
                tb = tb.tb_next
            if _isinstance(e, _SyntaxError) and _type(e.lineno) is int:
                line = " (line %d)" % e.lineno
            report(status, None, ("%s: %s%s" % (name, msg, line))[:2000])
        except _BaseException:
            report("error", None, "an exception that could not be described")


def drop_caps():
    class Hdr(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    hdr, data = Hdr(0x20080522, 0), (Data * 2)()
    for cap in range(64):
        LIBC.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
    libc_call("capset", ctypes.byref(hdr), ctypes.byref(data))

def set_ids(uid, gid):
    if hasattr(os, "setresuid"):
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    else:  # macOS
        os.setgid(gid)
        os.setuid(uid)

def count_processes(uid):
    n = 0
    try:
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    n += os.stat("/proc/" + d).st_uid == uid
                except OSError:
                    pass
    except OSError:
        return 4096  # no /proc (macOS): a loose cap
    return n

def sweep_uid():
    """Without a PID namespace: kill every process of the job uid (a root-only trick)."""
    pid = os.fork()
    if pid == 0:
        try:
            set_ids(CFG["uid"], CFG["gid"])
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)

def remove_tree(path):
    try:
        os.rmdir(path)
        return
    except OSError:
        pass
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files + dirs:
            p = os.path.join(root, name)
            try:
                if os.path.isdir(p) and not os.path.islink(p):
                    os.rmdir(p)
                else:
                    os.unlink(p)
            except OSError:
                pass
    try:
        os.rmdir(path)
    except OSError:
        pass

SIGNAMES = {getattr(signal, n): n for n in dir(signal) if n.startswith("SIG") and not n.startswith("SIG_")}

def run_job(job):
    jobdir = os.path.join(CFG["scratch"], "job")  # the same path for every program: outputs can't differ by it
    if os.path.lexists(jobdir):
        remove_tree(jobdir)
    os.mkdir(jobdir, 0o700)
    if STATE["drop_uid"]:
        os.chown(jobdir, CFG["uid"], CFG["gid"])
    job["dir"] = jobdir
    r, w = os.pipe()
    if STATE.get("pidns_fd") is not None:
        LIBC.setns(STATE["pidns_fd"], CLONE_NEWPID)  # back to our own namespace for children...
        if LIBC.unshare(CLONE_NEWPID) != 0:          # ...then a fresh one: the child is its PID 1
            return {"status": "sandbox_error", "value": None, "error": "pid namespace: errno %d" % ctypes.get_errno()}
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            child_main(job, w)
        finally:
            os._exit(70)
    os.close(w)
    deadline = t0 + job["timeout"]
    cap = 12 * job["max_output"] + 65536
    buf = b""
    timed_out = False
    need = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([r, 0], [], [], left)
        if 0 in ready:  # trainer closed our control pipe: take the child down and go
            os.kill(pid, signal.SIGKILL)
            os._exit(0)
        if not ready:
            continue
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        buf += chunk
        off = 1 if buf[:1] == b"R" else 0
        if need is None and len(buf) >= off + 4:
            need = off + 4 + struct.unpack(">I", buf[off:off + 4])[0]
        if len(buf) > cap or (need is not None and need > cap):
            buf = None
            break
        if need is not None and len(buf) >= need:
            break
    os.close(r)
    try:
        os.kill(pid, signal.SIGKILL)  # kills its whole PID namespace; the pid is ours until waited for
    except ProcessLookupError:
        pass
    if STATE.get("pidns_fd") is None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    _, wstatus, rusage = os.wait4(pid, 0)
    if STATE.get("pid1"):  # we are PID 1 of the worker's namespace: everything else in it goes
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
    elif STATE.get("pidns_fd") is None and STATE["drop_uid"]:
        sweep_uid()
    remove_tree(jobdir)
    if buf is None:
        return {"status": "output_limit", "value": None, "error": "child wrote more than %d bytes" % cap}
    if need is not None and len(buf) >= need:
        started = buf[:1] == b"R"
        return (b"P" if started else b"S", buf[int(started) + 4:need])
    if timed_out:
        return {"status": "timeout", "value": None, "error": "wall-clock limit of %gs exceeded" % job["timeout"]}
    cpu = rusage.ru_utime + rusage.ru_stime
    if os.WIFSIGNALED(wstatus):
        sig = os.WTERMSIG(wstatus)
        if sig in (signal.SIGXCPU, signal.SIGKILL) and cpu >= int(job["timeout"]) + 0.5:
            return {"status": "timeout", "value": None, "error": "CPU limit exceeded (%.1fs)" % cpu}
        return {"status": "crash", "value": None, "error": "killed by %s" % SIGNAMES.get(sig, sig)}
    return {"status": "crash", "value": None,
            "error": "exited with code %d before producing a result" % os.WEXITSTATUS(wstatus)}

WARM_PROGRAM = """
import math
class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y
def f(xs: list, k=2) -> dict:
    out = {}
    for i, x in enumerate(sorted(xs)):
        if x % k == 0 and not isinstance(x, str):
            out[str(i)] = [x * j for j in range(3)] + list({x, -x})
        elif x > 10:
            out[i] = (x, f"{x:03d}", math.sqrt(abs(x)))
        else:
            try:
                out[i] = 1 / (x - x)
            except ZeroDivisionError as e:
                out[i] = repr(e)
    return out
"""

def warm_up():
    """Compile and run a typical program once, so each child starts with the parser, the compiler and the
    allocator already warm: measured ~1 ms less CPU per job (fewer page faults after fork)."""
    for _ in range(3):
        ns = {"__name__": "__main__"}
        exec(compile(WARM_PROGRAM, "<program>", "exec"), ns)
        json.dumps({"status": "ok", "value": repr(eval(compile("f([1, 2, 3, 15, 4])", "<expression>", "eval"), ns)),
                    "error": None})
        try:
            compile("def f(:", "<program>", "exec")
        except SyntaxError as e:
            str(e)

def main():
    global CFG
    CFG = recv()
    sys.path[:] = [p for p in sys.path if p] + CFG["site_dirs"]
    try:
        STATE["rlimits"] = []
        for name in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_CORE"):
            if hasattr(resource, name):
                try:  # probe in a throwaway child: some platforms refuse some limits (macOS: RLIMIT_AS)
                    pid = os.fork()
                    if pid == 0:
                        try:
                            soft, hard = resource.getrlimit(getattr(resource, name))
                            v = min(hard, 1 << 34) if hard != resource.RLIM_INFINITY else 1 << 34
                            resource.setrlimit(getattr(resource, name), (v, v))
                            os._exit(0)
                        except BaseException:
                            os._exit(1)
                    if os.waitpid(pid, 0)[1] == 0:
                        STATE["rlimits"].append(name)
                except OSError:
                    pass
        REPORT["root"] = os.geteuid() == 0
        # Linux closes the rest with one close_range(); elsewhere closerange loops, so bound it by the fd limit
        STATE["maxfd"] = 1 << 16 if sys.platform.startswith("linux") else \
            max(64, min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 1 << 16))
        enter_namespaces()
        STATE["userns"] = REPORT["namespaces"].get("user", False)
        STATE["drop_uid"] = os.geteuid() == 0 and CFG["drop_uid"] and not STATE["userns"]
        # RLIMIT_NPROC counts every process of the real uid: exact for our own unprivileged uid, otherwise
        # (non-root) it has to sit on top of what the user already runs
        STATE["nproc_base"] = 0 if STATE["drop_uid"] else count_processes(os.getuid()) + 64
        isolate_filesystem()
        setup_pid_namespace()
        STATE["seccomp"] = build_seccomp()
        if STATE["seccomp"] is not None:  # installed once here, inherited by every child (cheaper than per job)
            libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            libc_call("prctl", PR_SET_SECCOMP, 2, ctypes.byref(STATE["seccomp"][1]), 0, 0)
        if "/tmp" in REPORT["hidden"]:
            CFG["scratch"] = "/tmp/sandbox"   # on our private tmpfs
            os.makedirs(CFG["scratch"], mode=0o711, exist_ok=True)
        else:
            import tempfile
            CFG["scratch"] = tempfile.mkdtemp(prefix="pysandbox-")
        os.chmod(CFG["scratch"], 0o711)
        REPORT["scratch"] = CFG["scratch"]
        # the job directory has one fixed path: it is also HOME and TMPDIR (so tempfile finds a writable place)
        os.environ["HOME"] = os.environ["TMPDIR"] = os.path.join(CFG["scratch"], "job")
        PRCTL(PR_SET_PDEATHSIG, 0, 0, 0, 0)  # warms ctypes' argument conversion before the children need it
        REPORT["rlimits"] = STATE["rlimits"]
        REPORT["uid_dropped"] = STATE["drop_uid"]
        REPORT["uid"] = CFG["uid"] if REPORT["uid_dropped"] else os.geteuid()
        REPORT["no_new_privs"] = sys.platform.startswith("linux")
        REPORT["seccomp"] = STATE["seccomp"] is not None
        if STATE["seccomp"] is not None:
            probe = run_job({"program": "import ctypes, os\nlibc = ctypes.CDLL(None)",
                             "expression": "os.getpid() == 1, libc.unshare(%d), libc.unshare(%d)"
                                           % (CLONE_NEWUSER, CLONE_NEWNET),
                             "timeout": 5.0, "memory_mb": 512, "fsize_mb": 1, "nproc": 8, "max_output": 100})
            probe = decode_reply(reply_bytes(probe))
            if probe.get("value") != "(%s, -1, -1)" % (STATE.get("pidns_fd") is not None):
                note("self-test failed: %r" % (probe,))
                REPORT["self_test"] = False
            else:
                REPORT["self_test"] = True
        probe = run_job({"program": "import statistics, decimal", "expression": "1", "timeout": 5.0,
                         "memory_mb": 512, "fsize_mb": 1, "nproc": 8, "max_output": 100})
        probe = decode_reply(reply_bytes(probe))
        if probe.get("value") != "1":
            REPORT["self_test"] = False
            note("children cannot import the standard library (%s): on this host Python's files are not "
                 "readable by the unprivileged uid without a mount namespace" % (probe.get("error"),))
    except BaseException as e:
        send({"ready": False, "error": "%s: %s" % (type(e).__name__, e), "report": REPORT})
        return
    warm_up()
    gc.collect()
    gc.freeze()  # keep the collector away from inherited objects: fewer copy-on-write faults per child
    send({"ready": True, "report": REPORT})
    while True:
        job = recv()
        try:
            res = run_job(job)
        except BaseException as e:
            res = {"status": "sandbox_error", "value": None, "error": "zygote: %s: %s" % (type(e).__name__, e)}
        send_bytes(reply_bytes(res))

main()
'''


# ---------------------------------------------------------------- trusted side: workers and the pool

_SB_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1",
           "VECLIB_MAXIMUM_THREADS": "1", "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HOME": "/tmp", "TMPDIR": "/tmp"}
_SB_HIDE = ("/root", "/home", "/tmp", "/var/tmp", "/dev/shm", "/run")
_SB_SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/proc", "/sys", "/dev", "/var", "/opt",
                   "/nix", "/snap", "/boot")


def _sb_hidden_paths() -> list[str]:
    """Default directories to cover with an empty tmpfs: homes, temp dirs, and the trainer's working directory
    (its run folders, checkpoints and data), unless that is a system directory. Python's own directories are
    bound back read-only wherever they sit under one of these."""
    hidden = list(_SB_HIDE)
    cwd = os.path.realpath(os.getcwd())
    if cwd != "/" and not any(cwd == d or cwd.startswith(d + "/") for d in _SB_SYSTEM_DIRS + _SB_HIDE):
        hidden.append(cwd)
    return hidden
_SB_MAX_FRAME = 64 << 20
_sb_instances = iter(range(1 << 30))


def _sb_python_paths() -> list[str]:
    """Directories the child's interpreter reads (so they can be bound back under hidden directories)."""
    import site
    import sysconfig
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable))}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            paths.add(p)
    paths.update(getattr(site, "getsitepackages", lambda: [])())
    real = sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)})
    return [p for p in real if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in real)]


class _SbWorker:
    """One zygote process and its control pipes (trainer side)."""

    def __init__(self, cfg: dict, start_timeout: float = 30.0):
        self.proc = subprocess.Popen(
            [sys.executable, "-s", "-S"] + (["-P"] if sys.version_info >= (3, 11) else []) + ["-c", _SB_ZYGOTE_SOURCE],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=dict(_SB_ENV, PYTHONHASHSEED=str(cfg["hash_seed"])),
            cwd="/", close_fds=True, start_new_session=True)
        self.rfd, self.wfd = self.proc.stdout.fileno(), self.proc.stdin.fileno()
        self.buf = b""
        self.job = None   # (index, deadline) of the job in flight
        self._send(cfg)
        msg = self._recv_blocking(time.monotonic() + start_timeout)
        if not msg.get("ready"):
            self.kill()
            raise RuntimeError(f"sandbox zygote failed to start: {msg.get('error')}")
        self.report = msg["report"]
        os.set_blocking(self.rfd, False)

    def _send(self, obj):
        self._send_all(json.dumps(obj).encode())

    def _send_all(self, data):
        data = struct.pack(">I", len(data)) + data
        blocking = os.get_blocking(self.wfd)
        os.set_blocking(self.wfd, True)
        try:
            while data:
                data = data[os.write(self.wfd, data):]
        finally:
            os.set_blocking(self.wfd, blocking)

    def send_job(self, job: dict):
        data = json.dumps(job).encode()
        self._send_all(data)

    def _recv_blocking(self, deadline):
        while True:
            msg = self.poll()
            if msg is not None:
                return json.loads(msg)
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError("sandbox zygote did not answer in time")
            sel = selectors.DefaultSelector()
            sel.register(self.rfd, selectors.EVENT_READ)
            sel.select(left)
            sel.close()

    def poll(self) -> bytes | None:
        """Read what is available; return one whole frame or None. Raises EOFError if the zygote died."""
        try:
            chunk = os.read(self.rfd, 1 << 20)
            if not chunk:
                raise EOFError("sandbox zygote exited")
            self.buf += chunk
        except BlockingIOError:
            pass
        if len(self.buf) < 4:
            return None
        (n,) = struct.unpack(">I", self.buf[:4])
        if n > _SB_MAX_FRAME:
            raise EOFError("sandbox zygote sent an oversized frame")
        if len(self.buf) < 4 + n:
            return None
        data, self.buf = self.buf[4:4 + n], self.buf[4 + n:]
        return data

    def kill(self):
        scratch = self.__dict__.get("report", {}).get("scratch", "")
        try:
            self.proc.kill()
        except OSError:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if scratch and not scratch.startswith("/tmp/sandbox"):  # no private /tmp: remove our scratch dir
            import shutil
            shutil.rmtree(scratch, ignore_errors=True)


class PythonSandbox:
    """A pool of fork-server workers that run each (program, expression) in a fresh, isolated process.

    >>> with PythonSandbox(workers=2, timeout_s=2) as sb:
    ...     sb.run("def f(x):\\n    return x * 2", "f(21)")
    ExecResult(status='ok', value='42', error=None)
    """

    def __init__(self, workers: int | None = None, timeout_s: float = 5.0, memory_mb: int = 1024,
                 max_output_chars: int = 100_000, *, max_procs: int = 16, max_file_mb: int = 64,
                 tmpfs_mb: int = 256, forbidden_modules=(), hide_paths=None, max_program_chars: int = 1_000_000,
                 hash_seed: int = 0, namespaces: bool | str = True):
        if os.name != "posix":
            raise RuntimeError("PythonSandbox needs a POSIX system (Linux or macOS); use WSL on Windows")
        if namespaces not in (True, False, "user"):
            raise ValueError(f"namespaces must be True, False or 'user' (force the unprivileged user-namespace "
                             f"setup), got {namespaces!r}")
        if timeout_s <= 0 or memory_mb < 64 or max_output_chars < 1:
            raise ValueError("PythonSandbox needs timeout_s > 0, memory_mb >= 64 and max_output_chars >= 1")
        self.workers = int(workers or max(2, min(8, 2 * (os.cpu_count() or 1))))
        self.timeout_s, self.memory_mb, self.max_output_chars = float(timeout_s), int(memory_mb), int(max_output_chars)
        self.max_procs, self.max_file_mb, self.max_program_chars = int(max_procs), int(max_file_mb), max_program_chars
        self.forbidden_modules = sorted(set(forbidden_modules))
        # Every child of one sandbox shares this PYTHONHASHSEED (and its zygote's memory layout); a determinism
        # check that wants independent runs uses two sandboxes with different hash_seed values.
        self.hash_seed = int(hash_seed)
        if not 0 <= self.hash_seed <= 4294967295:
            raise ValueError(f"hash_seed must be in [0, 2**32 - 1], got {hash_seed}")
        # one unprivileged uid per worker, from a block keyed by our pid so concurrent sandboxes never share uids
        base = 100_000_000 + (os.getpid() % 2_000_000) * 512 + (next(_sb_instances) % 8) * 64
        self._cfgs = [{"hash_seed": self.hash_seed, "namespaces": namespaces, "drop_uid": True,
                       "uid": base + i % 64, "gid": base + i % 64,
                       "site_dirs": [p for p in sys.path if p and "-packages" in p],
                       "keep_paths": _sb_python_paths(), "tmpfs_mb": int(tmpfs_mb),
                       "hide_paths": list(_sb_hidden_paths() if hide_paths is None else hide_paths),
                       "scratch": None}
                      for i in range(self.workers)]
        self.uids = sorted({c["uid"] for c in self._cfgs})
        self._lock = threading.Lock()
        self._owner = os.getpid()  # a fork of the trainer (DataLoader, multiprocessing) must not touch our workers
        self._pool: list[_SbWorker | None] = [None] * self.workers
        self.restarts = 0
        self._closed = False
        self._errors: list[str] = []
        self._retry_at: dict[int, float] = {}
        starters = [threading.Thread(target=self._start, args=(i,)) for i in range(self.workers)]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        if not all(self._pool):
            self.close()
            raise RuntimeError("PythonSandbox: workers failed to start: " + "; ".join(self._errors))
        self.isolation = self._summarise(self._pool[0].report)

    def _start(self, i: int):
        if time.monotonic() < self._retry_at.get(i, 0.0):
            return  # it failed a moment ago: do not spawn in a tight loop
        try:
            self._pool[i] = _SbWorker(self._cfgs[i])
        except Exception as e:  # noqa: BLE001 - reported by the caller
            self._errors.append(f"worker {i}: {e}")
            self._pool[i] = None
            self._retry_at[i] = time.monotonic() + 1.0

    def _summarise(self, rep: dict) -> dict:
        ns = rep.get("namespaces", {})
        strong = all(ns.get(k) for k in ("net", "mount", "pid")) and rep.get("readonly_root") and \
            (rep.get("uid_dropped") or ns.get("user"))
        level = "strong" if strong and rep.get("seccomp") else "namespaces" if strong else \
            "partial" if any(ns.values()) or rep.get("uid_dropped") else "rlimits-only"
        return {"level": level, "hash_seed": self.hash_seed, "platform": f"{platform.system()} {platform.release()}",
                "root": rep.get("root"), "uid": rep.get("uid"), "uid_dropped": rep.get("uid_dropped"),
                "namespaces": ns, "pid_namespace": rep.get("pid_namespace"), "readonly_root": rep.get("readonly_root"),
                "hidden_paths": rep.get("hidden", []), "masked_files": rep.get("masked", []),
                "proc_hidepid": rep.get("proc_hidepid", False), "rlimits": rep.get("rlimits", []),
                "no_new_privs": rep.get("no_new_privs"), "seccomp": rep.get("seccomp"),
                "self_test": rep.get("self_test"), "notes": rep.get("notes", [])}

    # ------------------------------------------------------------------ public API
    def run(self, program: str, expression: str, *, timeout_s: float | None = None) -> ExecResult:
        """Exec ``program`` in a fresh isolated process, then evaluate ``expression`` there."""
        return self.run_many([(program, expression)], timeout_s=timeout_s)[0]

    def run_many(self, jobs, *, timeout_s: float | None = None) -> list[ExecResult]:
        """Run (program, expression) pairs in parallel over the workers; results in input order."""
        jobs = list(jobs)
        for k, job in enumerate(jobs):
            if not (isinstance(job, (tuple, list)) and len(job) == 2 and all(isinstance(s, str) for s in job)):
                raise TypeError(f"run_many: job {k} must be a (program: str, expression: str) pair, "
                                f"got {type(job).__name__}")
        if self._closed:
            raise RuntimeError("PythonSandbox is closed; create a new one")
        if os.getpid() != self._owner:
            raise RuntimeError("this PythonSandbox belongs to the process that created it (pid "
                               f"{self._owner}); create a new one in this forked process")
        timeout = float(timeout_s or self.timeout_s)
        results: list[ExecResult | None] = [None] * len(jobs)
        with self._lock:
            self._dispatch(jobs, timeout, results)
        return results  # type: ignore[return-value]

    def close(self):
        self._closed = True
        if os.getpid() != getattr(self, "_owner", None):
            return  # a forked copy of the trainer: the workers are not ours to stop
        for i, w in enumerate(self._pool):
            if w is not None:
                w.kill()
                self._pool[i] = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ------------------------------------------------------------------ the event loop
    def _job_msg(self, program: str, expression: str, timeout: float) -> dict:
        return {"program": program, "expression": expression, "timeout": timeout, "memory_mb": self.memory_mb,
                "fsize_mb": self.max_file_mb, "nproc": self.max_procs, "max_output": self.max_output_chars,
                "forbidden": self.forbidden_modules}

    def _restart(self, i: int):
        w = self._pool[i]
        if w is not None:
            w.kill()
        self.restarts += 1
        self._pool[i] = None
        self._start(i)

    def _dispatch(self, jobs, timeout, results):
        pending = collections.deque(range(len(jobs)))
        for k in list(pending):
            p, e = jobs[k]
            if len(p) + len(e) > self.max_program_chars:
                results[k] = ExecResult("error", None, f"program is {len(p) + len(e)} chars, over the cap of "
                                                       f"{self.max_program_chars}")
        pending = collections.deque(k for k in pending if results[k] is None)
        sel = selectors.DefaultSelector()
        busy: dict[int, int] = {}  # worker index -> job index
        slack = 5.0 + timeout      # the zygote enforces `timeout`; this only catches a stuck zygote
        try:
            while pending or busy:
                for i in range(self.workers):
                    if not pending:
                        break
                    if i in busy:
                        continue
                    if self._pool[i] is None:
                        self._start(i)
                        if self._pool[i] is None:
                            continue
                    k = pending.popleft()
                    w = self._pool[i]
                    try:
                        w.send_job(self._job_msg(jobs[k][0], jobs[k][1], timeout))
                    except OSError as e:
                        results[k] = ExecResult("sandbox_error", None, f"worker died before the job: {e}")
                        self._restart(i)
                        continue
                    w.job = (k, time.monotonic() + slack)
                    busy[i] = k
                    sel.register(w.rfd, selectors.EVENT_READ, i)
                if not busy:
                    if pending and all(w is None for w in self._pool):
                        for k in pending:
                            results[k] = ExecResult("sandbox_error", None, "no sandbox worker could be started")
                        pending.clear()
                    continue
                now = time.monotonic()
                wait = max(0.0, min(self._pool[i].job[1] for i in busy) - now)
                for key, _ in sel.select(wait):
                    i = key.data
                    w = self._pool[i]
                    try:
                        msg = w.poll()
                        if msg is not None:
                            results[busy.pop(i)] = self._result(msg)
                            sel.unregister(w.rfd)
                            w.job = None
                    except (EOFError, OSError, ValueError) as e:
                        results[busy.pop(i)] = ExecResult("sandbox_error", None, f"sandbox worker died: {e}")
                        sel.unregister(w.rfd)
                        self._restart(i)
                now = time.monotonic()
                for i in [i for i in busy if self._pool[i].job[1] < now]:
                    results[busy.pop(i)] = ExecResult("sandbox_error", None, "sandbox worker stopped answering")
                    sel.unregister(self._pool[i].rfd)
                    self._restart(i)
        finally:
            for i in list(busy):  # interrupted (KeyboardInterrupt): in-flight workers are in an unknown state
                try:
                    sel.unregister(self._pool[i].rfd)
                except (KeyError, ValueError, AttributeError):
                    pass
                self._restart(i)
            sel.close()

    def _result(self, reply: bytes) -> ExecResult:
        """Decode and check one reply. b"Z": made by the zygote. b"P": the child's frame after setup, i.e. from
        the program's process, which may only claim program outcomes. b"S": the child's frame from setup."""
        kind = reply[:1]
        allowed = {b"Z": EXEC_STATUSES, b"P": _SB_PROGRAM_STATUSES, b"S": ("sandbox_error",)}.get(kind)
        if allowed is None:
            raise ValueError("malformed reply from the sandbox zygote")
        try:
            msg = json.loads(reply[1:])
        except ValueError:
            msg = None
        if not isinstance(msg, dict) or set(msg) != {"status", "value", "error"}:
            if kind == b"Z":
                raise ValueError("malformed reply from the sandbox zygote")
            return ExecResult("crash", None, "the program wrote a malformed result")
        status, value, error = msg["status"], msg["value"], msg["error"]
        if status not in allowed:
            return ExecResult("crash", None, f"the program claimed status {str(status)[:40]!r}, which it may not")
        if not isinstance(value, (str, type(None))) or not isinstance(error, (str, type(None))):
            return ExecResult("crash", None, "the program forged a malformed result")
        if (value is None) != (status != "ok"):
            return ExecResult("crash", None, "the program forged a result (a value must come with status ok)")
        if value is not None and len(value) > self.max_output_chars:
            return ExecResult("output_limit", None, "result over the output cap")
        return ExecResult(status, value, error[:2000] if error else error)
