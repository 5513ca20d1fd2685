"""The sandbox's fork server. infra/sandbox.py starts it as `python -s -S -P zygote.py`: a clean
interpreter that imports only the standard library, isolates itself once, then forks one child per
program. Nothing here runs in the trainer.

Each message is a 4-byte big-endian length + payload: the config (JSON) gets {"ready", "report"};
each job is a JSON header of limits and lengths, then the program and expression bytes; each reply
a kind byte (see PythonSandbox._result in infra/sandbox.py) and a JSON frame.
"""
import contextlib
import ctypes
import gc
import json
import os
import re
import resource
import select
import signal
import struct
import sys
import time


CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000


CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32


MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 4096, 16384, 1 << 18, 2


MS_RO = MS_REMOUNT | MS_BIND | MS_RDONLY  # a read-only remount


# flags a read-only remount must keep (they are locked in a user namespace)
MS_KEPT = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
               "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}


PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38


DEV_NODES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")  # no GPU


DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
                 "stderr": "/proc/self/fd/2", "shm": "/tmp"}  # POSIX shm: in the job's tmpfs


# what the zygote found (root, uid_dropped and uid set first), shown in PythonSandbox.isolation
REPORT = {"namespaces": dict.fromkeys(("user", "net", "mount", "ipc", "uts", "pid"), False),
              "pid_namespace": None, "readonly_root": False, "filesystem": "host", "scratch": None,
              "hidden_paths": [], "masked_files": [], "proc_hidepid": False, "seccomp": False,
              "rlimits": ["RLIMIT_" + n for n in ("AS", "CPU", "FSIZE", "NOFILE", "NPROC", "CORE")],
              "no_new_privs": True, "notes": [], "self_test": None, "memory_cgroup": None}


STATE = {"pidns_fd": None, "pid1": False, "oom_fd": None, "oom_kills": 0,
             "oom_exempt": False, "tmp_mark": None, "nproc_base": 0, "job_ns": 0}


CFG = LIBC = PRCTL = None


RES_BUF = bytearray()  # the child's result frame (zeroed after each job)


# A typical model-written program: main compiles and runs it before the first fork, so that each
# child starts with the parser, the compiler and the allocator warm.
WARM_UP_PROGRAM = '''\
def warm_example(xs: list, k=2) -> dict:
    """A typical model-written function, run to warm up."""
    out = {}
    for i, x in enumerate(sorted(xs)):
        out[str(i)] = [x * j for j in range(k)] + list({x, -x}) if x % k else (x, f"{x:03d}")
    return out
'''




def note(msg):
    REPORT["notes"].append(msg)


def libc_call(name, *args):
    if getattr(LIBC, name)(*args) != 0:
        raise OSError(e := ctypes.get_errno(), name + ": " + os.strerror(e))


def mount(src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    libc_call("mount", enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))


def write_file(path, text):  # os.open: cheaper than open() in each child
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def mountinfo():
    """/proc/self/mountinfo's rows, split, with mount root and target unescaped (octal)."""
    unescape = lambda p: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), p)
    with open("/proc/self/mountinfo") as f:
        return [m[:3] + [unescape(m[3]), unescape(m[4])] + m[5:] for m in map(str.split, f)]


def try_in_child(fn):
    """Whether fn() succeeds in a throwaway child: a probe that must not change this one."""
    if (pid := os.fork()) == 0:
        try:
            fn()
            os._exit(0)
        finally:
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0


def leave():
    """Leave and remove our memory cgroup (the trainer has gone or closed us), then exit."""
    with contextlib.suppress(KeyError, OSError):
        parent, procs, name = STATE["cgroup"]
        os.write(procs, b"0")
        os.rmdir(name, dir_fd=parent)
    os._exit(0)


def read_message(n=None):
    """n bytes from the trainer, in a bytearray (a job's is zeroed after it); else a message."""
    buf, got = bytearray(4 if n is None else n), 0
    while got < len(buf):
        k = os.readv(0, [memoryview(buf)[got:]])
        if not k:
            leave()  # the trainer went away
        got += k
    return json.loads(read_message(struct.unpack(">I", buf)[0])) if n is None else buf


def reply(kind, data):
    """Send kind + data, a dict (as JSON) or a child's frame (uncopied), to the trainer."""
    data = json.dumps(data).encode() if type(data) is dict else data
    os.writev(1, [struct.pack(">I", len(kind) + len(data)) + kind, data])  # a blocking pipe: whole


def enter_namespaces():
    """Net, mount, IPC and UTS namespaces; not root: inside a user namespace of our uid alone."""
    ns = REPORT["namespaces"]
    if not CFG["namespaces"]:
        return note("namespaces turned off by the caller")
    if os.geteuid() != 0 or CFG["namespaces"] == "user":
        uid, gid = os.getuid(), os.getgid()
        try:
            libc_call("unshare", CLONE_NEWUSER)
            write_file("/proc/self/setgroups", "deny")
            write_file("/proc/self/uid_map", "%d %d 1" % (uid, uid))
            write_file("/proc/self/gid_map", "%d %d 1" % (gid, gid))
            ns["user"] = True
        except OSError as e:
            return note("no user namespace (%s): running without namespaces" % e)
    for key, flag in (("net", CLONE_NEWNET), ("mount", CLONE_NEWNS),
                      ("ipc", CLONE_NEWIPC), ("uts", CLONE_NEWUTS)):
        ns[key] = LIBC.unshare(flag) == 0
        if not ns[key]:
            note("no %s namespace: %s" % (key, os.strerror(ctypes.get_errno())))
    if ns["uts"]:
        LIBC.sethostname(b"sandbox", 7)


def setup_pid_namespace():
    """A PID namespace per job (root), else (setns refused) one per worker with this as PID 1."""
    libc, fd, ns = LIBC, os.open("/proc/self/ns/pid", os.O_RDONLY), CLONE_NEWPID

    def per_job():  # in a throwaway child: a failed attempt would spoil pid_for_children
        if libc.unshare(ns) or libc.setns(fd, ns) or libc.unshare(ns):
            raise OSError("refused")
        if os.fork() == 0:
            os._exit(0)
        os.wait()
    if try_in_child(per_job):
        STATE["pidns_fd"], STATE["job_ns"] = fd, CLONE_NEWPID
        REPORT["pid_namespace"] = "one per program"
    else:
        os.close(fd)
        if libc.unshare(ns) != 0:
            return note("no pid namespace (errno %d): escaped processes are found by uid"
                            % ctypes.get_errno())
        if os.fork() != 0:  # the outer process only waits; the worker goes on as the new PID 1
            os.wait()
            os._exit(1)
        PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        STATE["pid1"] = True
        REPORT["pid_namespace"] = "one per worker, emptied after every program"
    REPORT["namespaces"]["pid"] = True


def isolate_filesystem():
    """Pivot into a tmpfs root: allow-listed dirs and files read-only, fake accounts, /proc."""
    R, C = REPORT, CFG
    if not R["namespaces"]["mount"]:
        return
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below reaches the host
    failed = 0
    for m in mountinfo():  # every mount read-only first, so the binds below are throughout
        kept = sum(f for o, f in MS_KEPT.items() if o in m[5].split(","))
        failed += not (m[4] + "/").startswith("/proc/") and LIBC.mount(
            None, m[4].encode(), None, ctypes.c_ulong(MS_RO | kept), None) != 0
    if failed:
        note("%d mounts could not be made read-only" % failed)
    # besides Python's own: system libraries (for C extensions), the loader cache, time zones
    libs = [d + n for d in ("/lib", "/usr/lib") for n in ("", "32", "64")] + ["/usr/share/zoneinfo"]
    dirs = sorted({*C["keep_paths"], *map(os.path.realpath, filter(os.path.isdir, libs))}, key=len)
    files = [*DEV_NODES, "/etc/ld.so.cache", "/etc/localtime"]
    fds = {}  # opened before the new root covers /tmp, where Python itself may live
    for p in dirs + files:  # shortest dirs first: one inside an opened one comes with it
        if not any(p.startswith(q.rstrip("/") + "/") for q in fds):
            with contextlib.suppress(OSError):
                fds[p] = os.open(p, os.O_PATH | (os.O_DIRECTORY if p in dirs else 0))
    new = "/tmp" if os.path.isdir("/tmp") else "/mnt"
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    for link in filter(os.path.islink, libs):  # merged /usr: /lib -> usr/lib and friends
        os.symlink(os.readlink(link), new + link)
    for p, fd in fds.items():  # read-only and nosuid; nodev too, except for the /dev nodes
        try:
            os.makedirs(new + p if p in dirs else os.path.dirname(new + p), exist_ok=True)
            if p not in dirs:
                open(new + p, "w").close()
            mount("/proc/self/fd/%d" % fd, new + p, None, MS_BIND | MS_REC)
            mount(None, new + p, None, MS_RO | MS_NOSUID
                      | (0 if p in DEV_NODES else MS_NODEV))
        except OSError as e:
            note("could not bind %s: %s" % (p, e))
        os.close(fd)
    os.makedirs(new + "/dev", exist_ok=True)
    for name, target in DEV_LINKS.items():  # before the hidden /dev/shm: that one is a link
        os.symlink(target, new + "/dev/" + name)
    R["hidden_paths"] = [d for d in C["hide_paths"] if os.path.isdir(d) and not os.path.islink(d)]
    for d in ["/etc", "/tmp", "/proc"] + R["hidden_paths"]:  # hidden ones: empty, or absent
        with contextlib.suppress(OSError):  # where no directory can be made
            os.makedirs(new + d, exist_ok=True)
    etc = {"/etc/passwd": "root:x:0:0:root:/root:/usr/sbin/nologin\n"  # the uid is its gid too
                          "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
                          "sandbox:x:{0}:{0}:sandbox:/tmp:/usr/sbin/nologin\n".format(C["uid"]),
           "/etc/group": "root:x:0:\nnogroup:x:65534:\nsandbox:x:%d:\n" % C["uid"],
           "/etc/shadow": "", "/etc/gshadow": "", "/etc/hostname": "sandbox\n",
           "/etc/hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n"}
    for p, text in etc.items():
        write_file(new + p, text)
    R["masked_files"] = list(etc)
    try:
        mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  "hidepid=2")
        R["proc_hidepid"] = True
    except OSError as e:
        note("proc hidepid: %s (the host's /proc is bound instead)" % e)
        mount("/proc", new + "/proc", None, MS_BIND | MS_REC)
    try:
        os.chdir(new)
        libc_call("syscall", 155, b".", b".")  # pivot_root(".", "."): the old root on top ...
        libc_call("umount2", b".", MNT_DETACH)  # ... is detached whole
        os.chdir("/")
        mount(None, "/", None, MS_RO | MS_NOSUID | MS_NODEV)
    except OSError as e:
        os.chdir("/")
        return note("could not switch to the allow-list root: %s" % e)
    R["readonly_root"], R["filesystem"] = True, "allow-list"


def setup_cgroup():
    """Root: this zygote, and so each job, in a memory cgroup of memory_mb + 32 MB (v2, else v1)."""
    S, limit = STATE, (CFG["memory_mb"] + 32) << 20
    why = "a job's processes together may hold max_procs x memory_mb, its tmpfs tmpfs_mb more"
    if not REPORT["uid_dropped"]:
        return note("no memory cgroup (needs root): " + why)
    try:
        write_file("/proc/self/oom_score_adj", "-1000")
        S["oom_exempt"] = True
    except OSError as e:  # no CAP_SYS_RESOURCE: the zygote may be an OOM victim (then it restarts)
        note("zygote not exempt from the OOM killer: %s" % e)
    with open("/proc/self/cgroup") as f:
        groups = [ln.rstrip("\n").split(":", 2) for ln in f]
    found, mounts, errors = [], mountinfo(), []  # (version, our memory cgroup's directory)
    for _, ctrl, rel in groups:
        for m in mounts:
            fstype, opts = m[m.index("-") + 1], m[m.index("-") + 3].split(",")
            v1 = "memory" in ctrl.split(",") and fstype == "cgroup" and "memory" in opts
            if rel.startswith(m[3]) and ((ctrl == "" and fstype == "cgroup2") or v1):
                found.append((2 if ctrl == "" else 1, m[4] + "/" + rel[len(m[3]):].strip("/")))
    for version, parent in sorted(found, reverse=True):
        d = parent.rstrip("/") + "/pysandbox-%d" % os.getpid()
        # v2's memory.oom.group: an OOM kill takes the whole job, not the (exempt) zygote
        settings = {"memory.max": limit, "memory.swap.max": 0, "memory.oom.group":
                    int(S["oom_exempt"])} if version == 2 else {"memory.limit_in_bytes": limit}
        try:
            if version == 2:  # a no-op where it is on; ENOENT where the parent has no memory
                write_file(parent + "/cgroup.subtree_control", "+memory")
            os.mkdir(d)
            if os.path.exists(d + "/memory.memsw.limit_in_bytes"):  # v1 with swap accounting
                settings["memory.memsw.limit_in_bytes"] = limit
            for name, value in dict(settings, **{"cgroup.procs": os.getpid()}).items():
                write_file(d + "/" + name, str(value))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.rmdir(d)
            errors.append("v%d %s: %s" % (version, parent, e))
            continue
        S["oom_fd"] = os.open(d + ("/memory.events" if version == 2 else "/memory.oom_control"),
                              os.O_RDONLY)  # a new cgroup: no OOM kill yet
        # kept open for leave, which runs after the pivot, where /sys is not visible
        S["cgroup"] = (os.open(parent, os.O_RDONLY | os.O_DIRECTORY),
                       os.open(parent + "/cgroup.procs", os.O_WRONLY), os.path.basename(d))
        REPORT["memory_cgroup"] = {"version": version, "path": d, "limit_mb": limit >> 20}
        return
    note("no memory cgroup (%s): %s" % ("; ".join(errors) or "no cgroup filesystem with a "
                                            "memory controller", why))


def install_seccomp():
    """Installed once here, inherited (one per child costs ~10% of throughput). The zygote keeps
    mount and PID/IPC unshare/setns (a child lacks CAP_SYS_ADMIN; CLONE_NEWUSER, to regain it, is
    refused). Sockets: AF_UNIX, and AF_INET/6 only in the empty network namespace."""
    if os.uname().machine != "x86_64":
        return note("seccomp filter only written for x86-64: not installed")
    # ptrace pivot_root chroot swapon swapoff reboot iopl ioperm init_module delete_module
    # kexec_load add_key request_key keyctl perf_event_open name_to_handle_at open_by_handle_at
    # process_vm_readv/writev finit_module kexec_file_load bpf userfaultfd io_uring_setup/enter/
    # register open_tree move_mount fsopen fsconfig fsmount fspick mount_setattr
    deny = [101, 155, 161, 167, 168, 169, 172, 173, 175, 176, 246, 248, 249, 250, 298, 303,
            304, 310, 311, 313, 320, 321, 323, 425, 426, 427, 428, 429, 430, 431, 432, 433, 442]
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, KILL, EPERM, ENOSYS = 0x7FFF0000, 0x80000000, 0x00050000 | 1, 0x00050000 | 38
    ns_flags = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | \
        CLONE_NEWPID | CLONE_NEWNET | 0x02000000  # CLONE_NEWCGROUP
    src = [("", LD, 0, 0, 4), ("", JEQ, 1, 0, 0xC000003E), ("", RET, 0, 0, KILL),  # x86-64 ABI
           ("", LD, 0, 0, 0), ("", JGE, "eperm", 0, 0x40000000),                  # x32 syscalls
           ("", JEQ, "enosys", 0, 435)]              # clone3 -> ENOSYS: glibc falls back to clone
    src += [("", JEQ, "eperm", 0, nr) for nr in deny]
    src += [("", JEQ, "clone", 0, 56), ("", JEQ, "unshare", 0, 272), ("", JEQ, "setns", 0, 308),
            ("", JEQ, "socket", 0, 41), ("", JEQ, "socket", 0, 53), ("", RET, 0, 0, ALLOW),
            ("clone", LD, 0, 0, 16), ("", JSET, "eperm", 0, ns_flags), ("", RET, 0, 0, ALLOW),
            ("unshare", LD, 0, 0, 16),
            ("", JSET, "eperm", 0, ns_flags & ~(CLONE_NEWPID | CLONE_NEWIPC)),
            ("", RET, 0, 0, ALLOW),
            ("setns", LD, 0, 0, 24), ("", JEQ, "allow", "eperm", CLONE_NEWPID),
            ("socket", LD, 0, 0, 16), ("", JEQ, "allow", 0, 1)]               # AF_UNIX
    if REPORT["namespaces"]["net"]:
        src += [("", JEQ, "allow", 0, 2), ("", JEQ, "allow", 0, 10)]          # AF_INET, AF_INET6
    src += [("", RET, 0, 0, 0x00050000 | 97),                                 # EAFNOSUPPORT
            ("allow", RET, 0, 0, ALLOW), ("eperm", RET, 0, 0, EPERM), ("enosys", RET, 0, 0, ENOSYS)]
    where = {lab: i for i, (lab, *_rest) in enumerate(src) if lab}
    jump = lambda target, i: where[target] - i - 1 if isinstance(target, str) else target
    raw = b"".join(struct.pack("HBBI", code, jump(jt, i), jump(jf, i), k)
                   for i, (_, code, jt, jf, k) in enumerate(src))
    buf = ctypes.create_string_buffer(raw, len(raw))
    prog = (ctypes.c_ulong * 2)(len(src), ctypes.addressof(buf))  # struct sock_fprog
    libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc_call("prctl", 22, 2, ctypes.addressof(prog), 0, 0)  # PR_SET_SECCOMP, a filter
    REPORT["seccomp"] = True


def child_main(job, src, wfd):
    """The job's child: set up, write b"R", run the program, write one frame on fd 3, exit. What
    reporting needs is bound first: a program that patches builtins, json or os cannot garble it."""
    _write, _exit, _pack = os.write, os._exit, struct.pack
    _enc = json.encoder.encode_basestring_ascii
    _len, _isinstance, _type, _str, _repr = len, isinstance, type, str, repr
    _BaseException, _MemoryError, _SyntaxError = BaseException, MemoryError, SyntaxError

    def report(status, value=None, error=None):
        try:
            data = ('{"status": %s, "value": %s, "error": %s}' % (
                _enc(status), "null" if value is None else _enc(value),
                "null" if error is None else _enc(error))).encode()
            _write(wfd, _pack(">I", _len(data)) + data)
        finally:
            _exit(0)

    R, S, forbidden_exc = REPORT, STATE, ()  # isinstance(e, ()) is False
    try:
        os.setsid()
        wfd = os.dup2(wfd, 3)
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(4, 1 << 16)
        os.chdir(S["jobdir"])
        if S["oom_exempt"]:  # the zygote is exempt from the OOM killer, its children are not
            write_file("/proc/self/oom_score_adj", "0")
        if R["uid_dropped"]:  # setgid/setuid as root set the real, effective and saved ids
            os.setgroups([])
            os.setgid(CFG["uid"])
            os.setuid(CFG["uid"])
        elif R["namespaces"]["user"]:  # drop every capability, from the bounding set too
            for cap in range(64):
                PRCTL(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
            # capset({_LINUX_CAPABILITY_VERSION_3, pid 0}, all 2 x 3 capability sets empty)
            libc_call("capset", (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)())
        PRCTL(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # SIGKILL when the zygote dies
        PRCTL(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # inherited already where seccomp is on
        for name, n in (("AS", job["memory_mb"] << 20), ("CPU", int(job["timeout"]) + 1),
                        ("FSIZE", job["fsize_mb"] << 20), ("NOFILE", 64),
                        ("NPROC", job["nproc"] + S["nproc_base"]), ("CORE", 0)):
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (n, n))
    except BaseException as e:
        report("sandbox_error", None, "child setup failed: %s: %s" % (type(e).__name__, e))

    forbidden = set(job["forbidden"])
    if forbidden:
        import builtins
        real_import = builtins.__import__
        forbidden_exc = type("ForbiddenImport", (ImportError,), {})

        def guarded_import(name, *a, **k):
            if name.split(".")[0] in forbidden:
                raise forbidden_exc("import of %r is not allowed" % name)
            return real_import(name, *a, **k)
        builtins.__import__ = guarded_import
        for m in [m for m in sys.modules if m.split(".")[0] in forbidden]:
            del sys.modules[m]  # what the zygote imported goes through the guard too

    cap = job["max_output"]
    _write(wfd, b"R")  # setup is over: the zygote lets later frames claim program outcomes only
    try:
        code = compile(src[:job["plen"]].decode("utf-8", "surrogatepass"), "<program>", "exec")
        expr = compile(src[job["plen"]:].decode("utf-8", "surrogatepass"), "<expression>", "eval")
        ns = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(code, ns)
        value = eval(expr, ns)
        if _isinstance(value, (_str, bytes)) and _len(value) > cap:
            report("output_limit", None, "value length %d over the cap of %d" % (_len(value), cap))
        text = _repr(value)
        if _type(text) is not _str:
            report("error", None, "repr returned a non-str")
        if _len(text) > cap:
            report("output_limit", None, "repr of %d chars over the cap of %d" % (_len(text), cap))
        report("ok", text, None)
    except _BaseException as e:
        try:
            status = "memory" if _isinstance(e, _MemoryError) else \
                "forbidden" if _isinstance(e, forbidden_exc) else "error"
            line, tb = "", e.__traceback__
            while tb is not None:
                if tb.tb_frame.f_code.co_filename == "<program>":
                    line = " (program line %d)" % tb.tb_lineno
                tb = tb.tb_next
            if _isinstance(e, _SyntaxError) and _type(e.lineno) is int:
                line = " (line %d)" % e.lineno
            report(status, None, ("%s: %s%s" % (_type(e).__name__, _str(e), line))[:2000])
        except _BaseException:
            report("error", None, "an exception that could not be described")


def tmp_mark():  # what a job could change about an empty /tmp: inode, mode, owner, times...
    st = os.stat("/tmp")
    return st[:7] + (st.st_mtime_ns, st.st_ctime_ns)


def run_job(job, src, send):
    """Run a job in a child: send(kind, frame) its frame or why it has none; zero its bytes."""
    global RES_BUF
    R, S, C = REPORT, STATE, CFG
    if R["filesystem"] != "allow-list":  # a fresh host directory
        os.mkdir(S["jobdir"], 0o700)
        os.chown(S["jobdir"], *S["ids"])
    elif S["tmp_mark"] is None:  # a capped tmpfs on /tmp, kept while jobs leave it untouched
        size = (C["tmpfs_mb"], max(1024, 64 * C["tmpfs_mb"]))  # MB, inodes
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
                  "size=%dm,nr_inodes=%d,mode=0700,uid=%d,gid=%d" % (size + S["ids"]))
        S["tmp_mark"] = tmp_mark()
    if S["pidns_fd"] is not None:  # back to our own, then a fresh one: the child its PID 1
        LIBC.setns(S["pidns_fd"], CLONE_NEWPID)
    if S["job_ns"] and LIBC.unshare(S["job_ns"]) != 0:  # and a fresh IPC namespace
        raise OSError(ctypes.get_errno(), "pid/ipc namespace")
    deadline = time.monotonic() + job["timeout"]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # r goes with the child's closerange
        try:
            child_main(job, src, w)
        finally:
            os._exit(70)
    os.close(w)
    cap = 12 * job["max_output"] + 65536
    if len(RES_BUF) < cap:
        RES_BUF = bytearray(cap)
    view, got, need = memoryview(RES_BUF), 0, None
    while (need is None or got < need <= cap) and (left := deadline - time.monotonic()) > 0:
        ready = select.select([r, 0], [], [], left)[0]
        if 0 in ready:  # the trainer closed our control pipe: take the child down and go
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            leave()
        if not ready:
            continue
        k = os.readv(r, [view[got:cap]])
        if not k:
            break
        got += k
        off = 1 if RES_BUF[0] == 82 else 0  # after b"R"
        if need is None and got >= off + 4:
            need = off + 4 + struct.unpack(">I", RES_BUF[off:off + 4])[0]
    os.close(r)
    for kill in (os.kill, os.killpg):  # its PID namespace dies with it, else its group
        with contextlib.suppress(OSError):
            kill(pid, signal.SIGKILL)
    _, wstatus, rusage = os.wait4(pid, 0)
    if S["pid1"]:  # PID 1 of the worker's namespace: everything else in it goes
        with contextlib.suppress(OSError):  # ESRCH: none left; ECHILD: all reaped
            os.kill(-1, signal.SIGKILL)
            while True:
                os.waitpid(-1, 0)
    elif S["pidns_fd"] is None and R["uid_dropped"]:
        u = C["uid"]  # no PID namespace: a child of the job's uid kills all it runs
        try_in_child(lambda: (os.setgid(u), os.setuid(u), os.kill(-1, signal.SIGKILL)))
    oom_kills = S["oom_kills"]
    if S["oom_fd"] is not None:  # the memory cgroup's OOM kills so far
        m = re.search(r"^oom_kill (\d+)", os.pread(S["oom_fd"], 4096, 0).decode(), re.M)
        S["oom_kills"] = int(m[1]) if m else 0
    src[:] = bytes(len(src))
    if R["filesystem"] != "allow-list":
        import shutil
        shutil.rmtree(S["jobdir"], ignore_errors=True)
    elif tmp_mark() != S["tmp_mark"] or os.listdir("/tmp") or os.listxattr("/tmp"):
        libc_call("umount2", b"/tmp", MNT_DETACH)  # the job's files go in one step
        S["tmp_mark"] = None
    sig = os.WTERMSIG(wstatus) if os.WIFSIGNALED(wstatus) else None
    cpu, status = rusage.ru_utime + rusage.ru_stime, None
    if need is not None and got >= need:  # then need <= cap
        send(b"P" if off else b"S", view[off + 4:need])
    elif need is not None and need > cap:
        status, error = "output_limit", "child wrote more than %d bytes" % cap
    elif left <= 0:
        status, error = "timeout", "wall-clock limit of %gs exceeded" % job["timeout"]
    elif sig == signal.SIGKILL and S["oom_kills"] != oom_kills:
        status, error = "memory", "the job's processes together exceeded memory_mb (memory cgroup)"
    elif sig in (signal.SIGXCPU, signal.SIGKILL) and cpu >= int(job["timeout"]) + 0.5:
        status, error = "timeout", "CPU limit exceeded (%.1fs)" % cpu
    elif sig is not None:
        names = {s.value: s.name for s in signal.Signals}  # not every number has a name
        status, error = "crash", "killed by %s" % names.get(sig, sig)
    else:
        status, error = "crash", "exited with code %d before producing a result" % \
            os.WEXITSTATUS(wstatus)
    if status:
        send(b"Z", {"status": status, "value": None, "error": error})
    RES_BUF[:got] = bytes(got)
    if cap > 1 << 22:  # a huge buffer would stay in every later child
        RES_BUF = bytearray()


def setup():
    """Isolate this zygote once (see the section's head), then check that a child works."""
    S, R, C = STATE, REPORT, CFG
    R["root"] = os.geteuid() == 0
    enter_namespaces()
    R["uid_dropped"] = R["root"] and not R["namespaces"]["user"]
    R["uid"] = C["uid"] if R["uid_dropped"] else os.geteuid()
    S["ids"] = (C["uid"], C["uid"]) if R["uid_dropped"] else (os.getuid(), os.getgid())
    if not R["uid_dropped"]:  # RLIMIT_NPROC counts all of the real uid's processes: add them
        S["nproc_base"] = 64
        for d in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):  # it exited meanwhile
                S["nproc_base"] += os.stat("/proc/" + d).st_uid == os.getuid()
    setup_cgroup()
    isolate_filesystem()
    if C["namespaces"]:
        setup_pid_namespace()
    R["ipc_per_job"] = R["namespaces"]["ipc"]
    S["job_ns"] |= CLONE_NEWIPC * R["ipc_per_job"]
    if not R["ipc_per_job"]:
        note("no IPC namespace: SysV IPC and message queues a job leaves reach later jobs")
    install_seccomp()
    if R["filesystem"] == "allow-list":
        S["jobdir"], R["scratch"] = "/tmp", "tmpfs per job"
    else:
        import tempfile
        R["scratch"] = tempfile.mkdtemp(prefix="pysandbox-")
        os.chmod(R["scratch"], 0o711)
        S["jobdir"] = R["scratch"] + "/job"  # one fixed path: outputs cannot differ
        note("no mount namespace: each job gets a fresh directory in " + R["scratch"])
    os.environ["HOME"] = os.environ["TMPDIR"] = S["jobdir"]  # tempfile writes there too
    out, p = [], b"import ctypes, decimal, os, statistics\nlibc = ctypes.CDLL(None)"
    e = b"os.getpid() == 1, libc.unshare(0x10000000), libc.unshare(0x40000000)"  # user, net
    run_job({"timeout": 5.0, "memory_mb": 512, "fsize_mb": 1, "nproc": 8, "max_output": 100,
                 "forbidden": [], "plen": len(p)}, bytearray(p + e), lambda kind, frame: out.append(
                     frame if type(frame) is dict else json.loads(bytes(frame))))
    if out[0]["status"] != "ok" or R["seccomp"]:  # it imports the stdlib, makes no namespaces
        R["self_test"] = out[0]["value"] == "(%s, -1, -1)" % (S["pidns_fd"] is not None)
        if not R["self_test"]:
            note("self-test failed (%s): without a mount namespace, Python's files may not be "
                     "readable by the unprivileged uid" % (out[0]["error"] or out[0]["value"]))


def main():
    global CFG, LIBC, PRCTL
    LIBC = ctypes.CDLL(None, use_errno=True)
    PRCTL = LIBC.prctl  # typed once: a cheap call in each child
    PRCTL.argtypes, PRCTL.restype = [ctypes.c_int] + [ctypes.c_ulong] * 4, ctypes.c_int
    CFG = read_message()
    sys.path[:] = [p for p in sys.path if p] + CFG["site_dirs"]
    try:
        setup()
    except BaseException as e:
        import traceback
        where = traceback.extract_tb(e.__traceback__)[-1]
        return reply(b"", {"ready": False, "report": REPORT, "error": "%s: %s (in %s, "
                               "zygote line %d)" % (type(e).__name__, e, where.name, where.lineno)})
    PRCTL(PR_SET_PDEATHSIG, 0, 0, 0, 0)  # warms ctypes' argument conversion
    for _ in range(3):  # each child starts with parser, compiler and allocator warm: 1 ms less CPU
        ns = {"__name__": "__main__"}
        exec(compile(WARM_UP_PROGRAM, "<program>", "exec"), ns)
        repr(eval(compile("warm_example([1, 2, 3, 15, 4])", "<expression>", "eval"), ns))
        try:
            compile("def f(:", "<program>", "exec")
        except SyntaxError as e:
            str(e)  # and the error path a failing program takes
    gc.collect()
    gc.freeze()  # keep the collector off inherited objects: fewer copy-on-write faults per child
    reply(b"", {"ready": True, "report": REPORT})
    while True:
        job = read_message()
        try:
            run_job(job, read_message(job["plen"] + job["elen"]), reply)
        except BaseException as e:  # this zygote may be in a bad state: the trainer replaces it
            reply(b"E", {"status": "sandbox_error", "value": None,
                             "error": "zygote: %s: %s" % (type(e).__name__, e)})


if __name__ == "__main__":
    main()
