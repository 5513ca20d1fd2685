"""The sandbox's fork server. infra/sandbox.py starts one per worker as `python -s -S -P zygote.py`:
a clean interpreter that imports only the standard library, isolates itself once (namespaces, an
allow-listed read-only root, memory cgroups, seccomp), then forks one child per program, and after
each makes sure that nothing of it is left: no process, no socket, no memory (release_job). Nothing
here runs in the trainer.

How the trainer and the zygote talk, over the zygote's stdin and stdout (blocking pipes):
- every message and reply starts with a 4-byte big-endian length of what follows;
- first the config, JSON: {keep_paths, hide_paths, site_dirs, namespaces, memory_mb, tmpfs_mb,
  hash_seed, uid}; the reply, JSON with no kind byte: {"ready": true, "report": REPORT}, or
  {"ready": false, "report": ..., "error": "..."};
- then per job a JSON header {memory_mb, fsize_mb, nproc, max_output, forbidden, timeout, plen,
  elen}, followed by plen + elen raw bytes: the program and the expression (UTF-8, surrogatepass);
- per job one reply: a kind byte and a JSON frame {"status", "value", "error"}. b"P": the child's
  frame, written after the child's setup, so it may claim program outcomes only; b"S": the child's
  frame from its setup; b"Z": the zygote's verdict on a child that left no frame (timeout, crash,
  memory, output_limit); b"E": the zygote itself failed on this job (the trainer replaces it).
  Before the reply may come b"T" and {"error"}: the job left something the zygote could not free
  (release_job); the trainer replaces the zygote after the reply.
The child writes its frame on fd 3: b"R" when its setup is over, then a length and the JSON frame.
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


# clone(2) and unshare(2) flags, linux/sched.h
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# mount(2) flags, linux/mount.h
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MS_RO = MS_REMOUNT | MS_BIND | MS_RDONLY  # a read-only remount
MNT_DETACH = 2  # umount2(2)

# flags a read-only remount must keep (they are locked in a user namespace)
MS_KEPT = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
}

# prctl(2) options
PR_SET_PDEATHSIG = 1
PR_SET_SECCOMP = 22
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
LINUX_CAPABILITY_VERSION_3 = 0x20080522  # capset(2)'s header
SYS_PIVOT_ROOT = 155  # x86-64; glibc has no wrapper

# the worker's memory cgroup holds the job's (memory_mb) and this much more: the zygote's own
# memory, and what a finished job may leave pinned (up to LEFTOVER_MB: kernel caches)
WORKER_MEMORY_MB = 64
LEFTOVER_MB = 16

# besides Python's own: system libraries (for C extensions) and time zones
SYSTEM_LIBRARY_DIRS = ("/lib", "/lib32", "/lib64", "/usr/lib", "/usr/lib32", "/usr/lib64",
                       "/usr/share/zoneinfo")
DEV_NODES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")  # no GPU
DEV_LINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
    "shm": "/tmp",  # POSIX shared memory: in the job's tmpfs
}

# x86-64 system calls a program gets EPERM for (the zygote's own setup is done by then)
DENIED_SYSCALLS = {
    "ptrace": 101, "pivot_root": 155, "chroot": 161, "swapon": 167, "swapoff": 168,
    "reboot": 169, "iopl": 172, "ioperm": 173, "init_module": 175, "delete_module": 176,
    "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250,
    "perf_event_open": 298, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "process_vm_readv": 310, "process_vm_writev": 311, "finit_module": 313,
    "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442,
    # another job's imports and the trainer's own file opens would show in inotify's events
    "inotify_init": 253, "inotify_add_watch": 254, "inotify_rm_watch": 255, "inotify_init1": 294,
    "fanotify_init": 300, "fanotify_mark": 301,
}
# x86-64 system calls that succeed doing nothing: a job's own files live in its tmpfs, which has
# nothing to flush, and the host's dirty pages (or its journal) are not a job's to flush
NO_OP_SYSCALLS = {"msync": 26, "fsync": 74, "fdatasync": 75, "sync": 162,
                  "sync_file_range": 277, "syncfs": 306}
SYS_SOCKET = 41
SYS_SOCKETPAIR = 53
SYS_CLONE = 56
SYS_UNSHARE = 272
SYS_SETNS = 308
SYS_CLONE3 = 435
AF_UNIX = 1
SOCK_STREAM = 1
AF_INET = 2
AF_INET6 = 10

# classic BPF, linux/filter.h: opcodes, and where a seccomp filter finds its inputs
BPF_LD_W_ABS = 0x20  # A = the 32-bit word at an offset into struct seccomp_data
BPF_JEQ = 0x15       # jump if A == k
BPF_JGE = 0x35       # jump if A >= k
BPF_JSET = 0x45      # jump if A & k
BPF_RET = 0x06       # return k
SECCOMP_DATA_NR = 0
SECCOMP_DATA_ARCH = 4
SECCOMP_DATA_ARG0 = 16
SECCOMP_DATA_ARG1 = 24
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_EPERM = 0x00050000 | 1          # SECCOMP_RET_ERRNO | EPERM
SECCOMP_RET_SUCCESS = 0x00050000            # ... with errno 0: the call returns 0
SECCOMP_RET_ENOSYS = 0x00050000 | 38        # ... | ENOSYS
SECCOMP_RET_EAFNOSUPPORT = 0x00050000 | 97  # ... | EAFNOSUPPORT

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
WARM_UP_EXPRESSION = "warm_example([1, 2, 3, 15, 4])"

# what the zygote found, shown in PythonSandbox.isolation; setup adds root, uid_dropped, uid and
# ipc_per_job
REPORT = {
    "namespaces": dict.fromkeys(("user", "net", "mount", "ipc", "uts", "pid"), False),
    "pid_namespace": None,
    "readonly_root": False,
    "filesystem": "host",
    "scratch": None,
    "hidden_paths": [],
    "given_up_paths": {},  # allow-listed paths a program does not see, and why
    "masked_files": [],
    "proc_hidepid": False,
    "proc_per_job": False,  # each job sees a /proc of its own PID namespace
    "seccomp": False,
    "rlimits": ["RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_NPROC",
                "RLIMIT_CORE"],
    "no_new_privs": True,
    "notes": [],
    "self_test": None,
    "memory_cgroup": None,
}

# what the zygote keeps between jobs
STATE = {
    "pidns_fd": None,     # our own PID namespace, to return to after each job's fork
    "pid1": False,        # this zygote is PID 1 of a namespace, emptied after every job
    "job_ns": 0,          # CLONE_NEWPID: a PID namespace unshared afresh before every job
    "oom_fd": None,       # the job's memory cgroup's events, read for its OOM kills
    "oom_kills": 0,       # its OOM kills so far
    "oom_exempt": False,  # this zygote is exempt from the OOM killer (its children are not)
    "cgroup": None,       # our memory cgroups' files (open_cgroup_files)
    "unix_fd": None,      # /proc/net/unix of our network namespace
    "job_proc": False,    # each child mounts a /proc of its own PID namespace over ours
    "proc_dev": None,     # st_dev of our own /proc
    "tmp_mark": None,     # the stat of the job tmpfs on /tmp; None: mount a fresh one
    "nproc_base": 0,      # processes of our real uid outside the job, added to RLIMIT_NPROC
    "ids": None,          # (uid, gid) of a job's files
    "jobdir": None,       # each job's working directory
    "tmp_binds": {},      # allow-listed path under /tmp -> {fd, is_dir}: bound on each tmpfs
    "tmp_names": [],      # what a fresh /tmp holds: the way down to those, and the jobdir
}

CFG = None    # the config message
LIBC = None   # the C library, errno kept
PRCTL = None  # LIBC.prctl, typed once: a cheap call in each child

RES_BUF = bytearray()  # the child's result frame (zeroed after each job)


# ----------------------------------------------------------------------------------- helpers

def note(msg):
    REPORT["notes"].append(msg)


def libc_call(name, *args):
    if getattr(LIBC, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, name + ": " + os.strerror(errno))


def c_string(text):
    if text is None:
        return None
    return text.encode()


def mount(source, target, fstype, flags, data=None):
    libc_call("mount", c_string(source), c_string(target), c_string(fstype),
              ctypes.c_ulong(flags), c_string(data))


def write_file(path, text):  # os.open: cheaper than open() in each child
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def unescape_octal(path):
    """mountinfo writes a space, tab, newline or backslash in a path as \\ooo (octal)."""
    return re.sub(r"\\([0-7]{3})", octal_char, path)


def octal_char(match):
    return chr(int(match[1], 8))


def mountinfo():
    """The rows of /proc/self/mountinfo (proc(5)), by name."""
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            end = fields.index("-")  # the optional fields end here
            mounts.append({
                "root": unescape_octal(fields[3]),
                "mount_point": unescape_octal(fields[4]),
                "options": fields[5].split(","),
                "fstype": fields[end + 1],
                "super_options": fields[end + 3].split(","),
            })
    return mounts


def try_in_child(fn):
    """Whether fn() succeeds in a throwaway child: a probe that must not change this one."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
            os._exit(0)
        finally:
            os._exit(1)
    _, wait_status = os.waitpid(pid, 0)
    return wait_status == 0


# ------------------------------------------------------------------ messages with the trainer

def remove_cgroups():
    """Remove our memory cgroups, retried while the last processes of a job exit (for 1 s)."""
    cgroup = STATE["cgroup"]
    deadline = time.monotonic() + 1.0
    while True:
        kill_job_cgroup(deadline)
        for name in ("job", "zygote"):  # "zygote": v2 alone
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=cgroup["worker_fd"])
        try:
            return os.rmdir(cgroup["name"], dir_fd=cgroup["parent_fd"])
        except OSError:
            if time.monotonic() > deadline:
                return None
        time.sleep(0.01)


def leave():
    """Leave and remove our memory cgroups (the trainer has gone or closed us), then exit. Under
    v2 the parent shares memory out, so it may hold no process: the trainer removes them."""
    cgroup = STATE["cgroup"]
    if cgroup is not None and cgroup["version"] == 1:
        with contextlib.suppress(OSError):
            os.write(cgroup["parent_procs_fd"], b"0")
        remove_cgroups()
    os._exit(0)


def read_exactly(n):
    """n bytes from the trainer, in a bytearray (a job's is zeroed after it)."""
    buf = bytearray(n)
    got = 0
    while got < n:
        k = os.readv(0, [memoryview(buf)[got:]])
        if not k:
            leave()  # the trainer went away
        got += k
    return buf


def read_message():
    """One JSON message from the trainer."""
    length = struct.unpack(">I", read_exactly(4))[0]
    return json.loads(read_exactly(length))


def reply(kind, data):
    """Send kind + data, a dict (as JSON) or a child's frame (uncopied), to the trainer."""
    if type(data) is dict:
        data = json.dumps(data).encode()
    header = struct.pack(">I", len(kind) + len(data)) + kind
    os.writev(1, [header, data])  # a blocking pipe: written whole


# ------------------------------------------------------- one-time isolation of the zygote itself

def enter_namespaces():
    """Net, mount, IPC and UTS namespaces; not root: inside a user namespace of our uid alone."""
    namespaces = REPORT["namespaces"]
    if not CFG["namespaces"]:
        return note("namespaces turned off by the caller")
    if os.geteuid() != 0 or CFG["namespaces"] == "user":
        uid = os.getuid()
        gid = os.getgid()
        try:
            libc_call("unshare", CLONE_NEWUSER)
            write_file("/proc/self/setgroups", "deny")
            write_file("/proc/self/uid_map", "%d %d 1" % (uid, uid))
            write_file("/proc/self/gid_map", "%d %d 1" % (gid, gid))
            namespaces["user"] = True
        except OSError as e:
            return note("no user namespace (%s): running without namespaces" % e)
    for key, flag in (("net", CLONE_NEWNET), ("mount", CLONE_NEWNS),
                      ("ipc", CLONE_NEWIPC), ("uts", CLONE_NEWUTS)):
        namespaces[key] = LIBC.unshare(flag) == 0
        if not namespaces[key]:
            note("no %s namespace: %s" % (key, os.strerror(ctypes.get_errno())))
    if namespaces["uts"]:
        LIBC.sethostname(b"sandbox", 7)


def setup_pid_namespace():
    """A PID namespace per job (root), else (setns refused) one per worker with this as PID 1."""
    own_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY)

    def new_namespace_per_job():  # in a throwaway child: a failure would spoil pid_for_children
        failed = (LIBC.unshare(CLONE_NEWPID) or LIBC.setns(own_namespace, CLONE_NEWPID)
                  or LIBC.unshare(CLONE_NEWPID))
        if failed:
            raise OSError("refused")
        if os.fork() == 0:
            os._exit(0)
        os.wait()

    if try_in_child(new_namespace_per_job):
        STATE["pidns_fd"] = own_namespace
        STATE["job_ns"] = CLONE_NEWPID
        REPORT["pid_namespace"] = "one per program"
    else:
        os.close(own_namespace)
        if LIBC.unshare(CLONE_NEWPID) != 0:
            return note("no pid namespace (errno %d): escaped processes are found by uid"
                        % ctypes.get_errno())
        if os.fork() != 0:  # the outer process only waits; the worker goes on as the new PID 1
            os.wait()
            os._exit(1)
        PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        STATE["pid1"] = True
        REPORT["pid_namespace"] = "one per worker, emptied after every program"
    REPORT["namespaces"]["pid"] = True


def remount_all_readonly():
    """Every mount read-only, so that the bind mounts made later are read-only throughout."""
    failed = 0
    for m in mountinfo():
        if (m["mount_point"] + "/").startswith("/proc/"):
            continue  # /proc stays writable: a child writes /proc/self/oom_score_adj
        kept = 0
        for option, flag in MS_KEPT.items():
            if option in m["options"]:
                kept |= flag
        target = m["mount_point"].encode()
        if LIBC.mount(None, target, None, ctypes.c_ulong(MS_RO | kept), None) != 0:
            failed += 1
    if failed:
        note("%d mounts could not be made read-only" % failed)


def is_inside(path, directory):
    return path.startswith(directory.rstrip("/") + "/")


def open_allowed_paths(dirs, files):
    """O_PATH fds of the allow-listed dirs and files, opened before the new root covers /tmp
    (where Python itself may live); a path inside an opened dir comes with it."""
    fds = {}
    for path in dirs + files:  # shortest dirs first
        if any(is_inside(path, opened) for opened in fds):
            continue
        flags = os.O_PATH
        if path in dirs:
            flags |= os.O_DIRECTORY
        with contextlib.suppress(OSError):
            fds[path] = os.open(path, flags)
    return fds


def bind_readonly(fd, path, target, is_dir):
    """Bind what fd opened on target: read-only and nosuid; nodev too, except for the /dev nodes."""
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()  # a file to bind over
    flags = MS_RO | MS_NOSUID
    if path not in DEV_NODES:
        flags |= MS_NODEV
    mount("/proc/self/fd/%d" % fd, target, None, MS_BIND | MS_REC)
    mount(None, target, None, flags)


def fake_accounts(uid):
    """/etc files a program may read: root, nobody, and the job's uid (its gid too) alone."""
    passwd = ("root:x:0:0:root:/root:/usr/sbin/nologin\n"
              "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
              "sandbox:x:%d:%d:sandbox:/tmp:/usr/sbin/nologin\n" % (uid, uid))
    return {
        "/etc/passwd": passwd,
        "/etc/group": "root:x:0:\nnogroup:x:65534:\nsandbox:x:%d:\n" % uid,
        "/etc/shadow": "",
        "/etc/gshadow": "",
        "/etc/hostname": "sandbox\n",
        "/etc/hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
    }


def mount_proc(root):
    """A /proc that shows only our own processes; else the host's, bound."""
    try:
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
        REPORT["proc_hidepid"] = True
    except OSError as e:
        note("proc hidepid: %s (the host's /proc is bound instead)" % e)
        mount("/proc", root + "/proc", None, MS_BIND | MS_REC)


def switch_root(root):
    """pivot_root into root; -> whether it worked (else we stay, read-only, on the host's)."""
    try:
        os.chdir(root)
        libc_call("syscall", SYS_PIVOT_ROOT, b".", b".")  # the old root lands on top ...
        libc_call("umount2", b".", MNT_DETACH)  # ... and is detached whole
        os.chdir("/")
        mount(None, "/", None, MS_RO | MS_NOSUID | MS_NODEV)
    except OSError as e:
        os.chdir("/")
        note("could not switch to the allow-list root: %s" % e)
        return False
    return True


def bind_allowed_paths(fds, dirs, root):
    """Bind each allow-listed path under root, after every other mount there: nothing covers it.
    One under /proc (each job mounts its own there) is given up; -> those under /tmp, which each
    job's fresh tmpfs covers, to be bound over it again."""
    under_tmp = []
    for path, fd in fds.items():
        try:
            if is_inside(path, "/proc"):
                raise OSError("under /proc, which each job's own /proc covers")
            bind_readonly(fd, path, root + path, path in dirs)
            if is_inside(path, "/tmp"):
                under_tmp.append(path)
        except OSError as e:
            REPORT["given_up_paths"][path] = str(e)
            note("could not bind %s: %s" % (path, e))
        os.close(fd)
    return under_tmp


def keep_tmp_binds(paths):
    """O_PATH fds of the binds under /tmp: what prepare_jobdir binds over each fresh tmpfs. The
    job's working directory is then a directory of its own there, its listing empty."""
    for path in paths:
        STATE["tmp_binds"][path] = {"fd": os.open(path, os.O_PATH), "is_dir": os.path.isdir(path)}
    top_names = set()
    for path in paths:
        top_names.add(path.split("/")[2])
    STATE["jobdir"] = "/tmp"
    if top_names:
        name = "job"
        while name in top_names:
            name += "_"
        STATE["jobdir"] = "/tmp/" + name
        top_names.add(name)
    STATE["tmp_names"] = sorted(top_names)


def isolate_filesystem():
    """Pivot into a tmpfs root: fake accounts, /proc, then the allow-listed dirs and files,
    read-only."""
    if not REPORT["namespaces"]["mount"]:
        return
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below reaches the host
    remount_all_readonly()
    dirs = set(CFG["keep_paths"])
    for path in SYSTEM_LIBRARY_DIRS:
        if os.path.isdir(path):
            dirs.add(os.path.realpath(path))
    dirs = sorted(dirs, key=len)
    files = [*DEV_NODES, "/etc/ld.so.cache", "/etc/localtime"]  # and the loader cache, time zone
    fds = open_allowed_paths(dirs, files)

    new_root = "/tmp" if os.path.isdir("/tmp") else "/mnt"
    mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    for path in SYSTEM_LIBRARY_DIRS:
        if os.path.islink(path):  # merged /usr: /lib -> usr/lib and friends
            os.symlink(os.readlink(path), new_root + path)
    os.makedirs(new_root + "/dev", exist_ok=True)
    for name, target in DEV_LINKS.items():  # before the hidden /dev/shm: that one is a link
        os.symlink(target, new_root + "/dev/" + name)

    hidden = []
    for path in CFG["hide_paths"]:
        if os.path.isdir(path) and not os.path.islink(path):
            hidden.append(path)
    REPORT["hidden_paths"] = hidden
    # hidden ones: empty, or absent where no directory can be made
    for path in ["/etc", "/tmp", "/proc"] + hidden:
        with contextlib.suppress(OSError):
            os.makedirs(new_root + path, exist_ok=True)
    etc = fake_accounts(CFG["uid"])
    for path, text in etc.items():
        write_file(new_root + path, text)
    REPORT["masked_files"] = list(etc)
    mount_proc(new_root)
    under_tmp = bind_allowed_paths(fds, dirs, new_root)
    if switch_root(new_root):
        REPORT["readonly_root"] = True
        REPORT["filesystem"] = "allow-list"
        keep_tmp_binds(under_tmp)


def memory_cgroup_parents():
    """[(version, directory)] of our memory cgroup, in each mounted hierarchy that has one."""
    with open("/proc/self/cgroup") as f:
        groups = [line.rstrip("\n").split(":", 2) for line in f]  # id:controllers:path
    mounts = mountinfo()
    found = []
    for _, controllers, path in groups:
        for m in mounts:
            if not path.startswith(m["root"]):
                continue
            v2 = controllers == "" and m["fstype"] == "cgroup2"
            v1 = ("memory" in controllers.split(",") and m["fstype"] == "cgroup"
                  and "memory" in m["super_options"])
            if v2 or v1:
                directory = m["mount_point"] + "/" + path[len(m["root"]):].strip("/")
                found.append((2 if v2 else 1, directory))
    return found


def memory_settings(version, limit):
    """A memory cgroup's files for a limit of `limit` bytes and no swap."""
    if version == 2:
        return {"memory.max": limit, "memory.swap.max": 0}
    return {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes": limit}


def write_settings(cgroup, settings):
    for name, value in settings.items():
        if name.startswith("memory.memsw.") and not os.path.exists(cgroup + "/" + name):
            continue  # v1 without swap accounting
        write_file(cgroup + "/" + name, str(value))


def make_memory_cgroups(version, parent, job_limit):
    """The worker's cgroup under parent, of job_limit + WORKER_MEMORY_MB, with this zygote in it
    (v2: in its child "zygote": a v2 cgroup that shares memory out holds no process), and the
    job's cgroup, "job", of job_limit (v2: an OOM kill there takes the whole job); -> the worker's.
    The zygote is outside the job's cgroup: the OOM killer ends the job, never the zygote."""
    worker = parent.rstrip("/") + "/pysandbox-%d" % os.getpid()
    home = worker
    job = worker + "/job"
    job_settings = memory_settings(version, job_limit)
    if version == 2:
        home = worker + "/zygote"
        job_settings["memory.oom.group"] = 1
    made = []
    try:
        if version == 2:  # a no-op where it is on; ENOENT where the parent has no memory
            write_file(parent + "/cgroup.subtree_control", "+memory")
        for path in (worker, home):
            if path not in made:
                os.mkdir(path)
                made.append(path)
        write_settings(worker, memory_settings(version, job_limit + (WORKER_MEMORY_MB << 20)))
        write_file(home + "/cgroup.procs", str(os.getpid()))
        if version == 2:
            write_file(worker + "/cgroup.subtree_control", "+memory")
        os.mkdir(job)
        made.append(job)
        write_settings(job, job_settings)
    except OSError:
        with contextlib.suppress(OSError):
            write_file(parent + "/cgroup.procs", str(os.getpid()))
        for path in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(path)
        raise
    return worker


def open_cgroup_files(version, parent, worker):
    """What the zygote and its children use of the cgroups, opened before the pivot hides /sys."""
    job = worker + "/job"
    names = {"events": "memory.events", "usage": "memory.current"}
    if version == 1:
        names = {"events": "memory.oom_control", "usage": "memory.usage_in_bytes"}
    STATE["oom_fd"] = os.open(job + "/" + names["events"], os.O_RDONLY)  # no OOM kill yet
    STATE["cgroup"] = {
        "version": version,
        "parent_fd": os.open(parent, os.O_RDONLY | os.O_DIRECTORY),
        "parent_procs_fd": os.open(parent + "/cgroup.procs", os.O_WRONLY),
        "worker_fd": os.open(worker, os.O_RDONLY | os.O_DIRECTORY),
        "name": os.path.basename(worker),
        "job_enter_fd": os.open(job + "/cgroup.procs", os.O_WRONLY),  # each child writes "0"
        "job_procs_fd": os.open(job + "/cgroup.procs", os.O_RDONLY),
        "job_usage_fd": os.open(job + "/" + names["usage"], os.O_RDONLY),
        "job_stat_fd": os.open(job + "/memory.stat", os.O_RDONLY),
    }


def setup_cgroup():
    """Root: a memory cgroup of memory_mb for each job, under the worker's (v2, else v1)."""
    job_limit = CFG["memory_mb"] << 20
    why = "a job's processes together may hold max_procs x memory_mb, its tmpfs tmpfs_mb more"
    if not REPORT["uid_dropped"]:
        return note("no memory cgroup (needs root): " + why)
    try:
        write_file("/proc/self/oom_score_adj", "-1000")
        STATE["oom_exempt"] = True
    except OSError as e:  # no CAP_SYS_RESOURCE: still outside the job's cgroup, which OOMs first
        note("zygote not exempt from the OOM killer: %s" % e)
    errors = []
    for version, parent in sorted(memory_cgroup_parents(), reverse=True):  # v2 first
        try:
            worker = make_memory_cgroups(version, parent, job_limit)
        except OSError as e:
            errors.append("v%d %s: %s" % (version, parent, e))
            continue
        open_cgroup_files(version, parent, worker)
        REPORT["memory_cgroup"] = {"version": version, "path": worker, "job": worker + "/job",
                                   "limit_mb": job_limit >> 20,
                                   "worker_limit_mb": (job_limit >> 20) + WORKER_MEMORY_MB}
        rlimits = REPORT["rlimits"]
        rlimits[rlimits.index("RLIMIT_AS")] = "RLIMIT_DATA"  # memory in use, not address space
        return
    reasons = "; ".join(errors) or "no cgroup filesystem with a memory controller"
    note("no memory cgroup (%s): %s" % (reasons, why))


def bpf(code, k, if_true=0, if_false=0, label=None):
    """One BPF instruction; a jump target is a label further on, or a count of those to skip."""
    return {"label": label, "code": code, "k": k, "if_true": if_true, "if_false": if_false}


def assemble(program):
    """struct sock_filter bytes of program, its labels resolved to jump offsets."""
    where = {}
    for index, instruction in enumerate(program):
        if instruction["label"]:
            where[instruction["label"]] = index

    def offset(target, index):
        if isinstance(target, str):
            return where[target] - index - 1
        return target

    raw = b""
    for index, instruction in enumerate(program):
        if_true = offset(instruction["if_true"], index)
        if_false = offset(instruction["if_false"], index)
        raw += struct.pack("HBBI", instruction["code"], if_true, if_false, instruction["k"])
    return raw


def seccomp_filter(allow_inet):
    """The filter's program: x86-64 calls alone, DENIED_SYSCALLS refused, NO_OP_SYSCALLS made
    no-ops, no new namespaces but PID and IPC ones (the zygote's and the child's, per job),
    sockets: AF_UNIX, AF_INET/6 where allow_inet."""
    namespaces = (CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID
                  | CLONE_NEWNET | CLONE_NEWCGROUP)
    program = [
        bpf(BPF_LD_W_ABS, SECCOMP_DATA_ARCH),
        bpf(BPF_JEQ, AUDIT_ARCH_X86_64, if_true=1),
        bpf(BPF_RET, SECCOMP_RET_KILL_PROCESS),
        bpf(BPF_LD_W_ABS, SECCOMP_DATA_NR),
        bpf(BPF_JGE, X32_SYSCALL_BIT, if_true="eperm"),
        bpf(BPF_JEQ, SYS_CLONE3, if_true="enosys"),  # glibc falls back to clone
    ]
    for number in DENIED_SYSCALLS.values():
        program.append(bpf(BPF_JEQ, number, if_true="eperm"))
    for number in NO_OP_SYSCALLS.values():
        program.append(bpf(BPF_JEQ, number, if_true="no_op"))
    program += [
        bpf(BPF_JEQ, SYS_CLONE, if_true="clone"),
        bpf(BPF_JEQ, SYS_UNSHARE, if_true="unshare"),
        bpf(BPF_JEQ, SYS_SETNS, if_true="setns"),
        bpf(BPF_JEQ, SYS_SOCKET, if_true="socket"),
        bpf(BPF_JEQ, SYS_SOCKETPAIR, if_true="socket"),
        bpf(BPF_RET, SECCOMP_RET_ALLOW),

        bpf(BPF_LD_W_ABS, SECCOMP_DATA_ARG0, label="clone"),  # its flags
        bpf(BPF_JSET, namespaces, if_true="eperm"),
        bpf(BPF_RET, SECCOMP_RET_ALLOW),

        bpf(BPF_LD_W_ABS, SECCOMP_DATA_ARG0, label="unshare"),
        bpf(BPF_JSET, namespaces & ~(CLONE_NEWPID | CLONE_NEWIPC), if_true="eperm"),
        bpf(BPF_RET, SECCOMP_RET_ALLOW),

        bpf(BPF_LD_W_ABS, SECCOMP_DATA_ARG1, label="setns"),  # the namespace type
        bpf(BPF_JEQ, CLONE_NEWPID, if_true="allow", if_false="eperm"),

        bpf(BPF_LD_W_ABS, SECCOMP_DATA_ARG0, label="socket"),  # the address family
        bpf(BPF_JEQ, AF_UNIX, if_true="allow"),
    ]
    if allow_inet:
        program.append(bpf(BPF_JEQ, AF_INET, if_true="allow"))
        program.append(bpf(BPF_JEQ, AF_INET6, if_true="allow"))
    program += [
        bpf(BPF_RET, SECCOMP_RET_EAFNOSUPPORT),
        bpf(BPF_RET, SECCOMP_RET_ALLOW, label="allow"),
        bpf(BPF_RET, SECCOMP_RET_EPERM, label="eperm"),
        bpf(BPF_RET, SECCOMP_RET_ENOSYS, label="enosys"),
        bpf(BPF_RET, SECCOMP_RET_SUCCESS, label="no_op"),
    ]
    return program


def install_seccomp():
    """Installed once here, inherited (one per child costs ~10% of throughput). The zygote keeps
    mount and PID unshare/setns, and a child its IPC unshare and /proc mount (a program lacks
    CAP_SYS_ADMIN; CLONE_NEWUSER, to regain it, is refused). Sockets: AF_UNIX, and AF_INET/6 only
    in the empty network namespace."""
    if os.uname().machine != "x86_64":
        return note("seccomp filter only written for x86-64: not installed")
    program = seccomp_filter(allow_inet=REPORT["namespaces"]["net"])
    raw = assemble(program)
    buf = ctypes.create_string_buffer(raw, len(raw))
    sock_fprog = (ctypes.c_ulong * 2)(len(program), ctypes.addressof(buf))
    libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc_call("prctl", PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(sock_fprog), 0, 0)
    REPORT["seccomp"] = True


# ----------------------------------------------------------------------------------- per job

def mount_job_proc():
    """In a job's child: a /proc of its PID namespace over the zygote's (unmount_job_proc)."""
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")


def unmount_job_proc():
    """Unmount what a child mounted over our /proc (its processes are gone by then)."""
    while os.stat("/proc").st_dev != STATE["proc_dev"]:
        libc_call("umount2", b"/proc", MNT_DETACH)


def confine_child(job):
    """The child's own limits: the job's memory cgroup, its own IPC namespace and /proc, no
    inherited fds, the job's uid or no capabilities, rlimits."""
    if STATE["cgroup"] is not None:  # first: what the job allocates is charged there
        os.write(STATE["cgroup"]["job_enter_fd"], b"0")
    if REPORT["ipc_per_job"]:  # the child's alone: the zygote never holds it (nor its memory)
        libc_call("unshare", CLONE_NEWIPC)
    if STATE["job_proc"]:
        mount_job_proc()
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(4, 1 << 16)
    os.chdir(STATE["jobdir"])
    if STATE["oom_exempt"]:  # the zygote is exempt from the OOM killer, its children are not
        write_file("/proc/self/oom_score_adj", "0")
    if REPORT["uid_dropped"]:  # setgid/setuid as root set the real, effective and saved ids
        os.setgroups([])
        os.setgid(CFG["uid"])
        os.setuid(CFG["uid"])
    elif REPORT["namespaces"]["user"]:  # drop every capability, from the bounding set too
        for cap in range(64):
            PRCTL(PR_CAPBSET_DROP, cap, 0, 0, 0)
        # capset({version 3, pid 0}, all 2 x 3 capability sets empty)
        header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
        libc_call("capset", header, (ctypes.c_uint32 * 6)())
    PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # when the zygote dies
    PRCTL(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # inherited already where seccomp is on
    # With a cgroup capping what the job's processes use, the rlimit counts private writable
    # memory (RLIMIT_DATA), not the address space that threads' stacks and malloc arenas reserve:
    # threaded programs run, and one oversized allocation still raises MemoryError.
    memory_limit = resource.RLIMIT_AS
    if STATE["cgroup"] is not None:
        memory_limit = resource.RLIMIT_DATA
    limits = {
        memory_limit: job["memory_mb"] << 20,
        resource.RLIMIT_CPU: int(job["timeout"]) + 1,
        resource.RLIMIT_FSIZE: job["fsize_mb"] << 20,
        resource.RLIMIT_NOFILE: 64,
        resource.RLIMIT_NPROC: job["nproc"] + STATE["nproc_base"],
        resource.RLIMIT_CORE: 0,
    }
    for which, limit in limits.items():
        resource.setrlimit(which, (limit, limit))


def guard_imports(forbidden):
    """Make an import of a forbidden module fail; -> the exception class it raises."""
    import builtins
    real_import = builtins.__import__
    forbidden_import = type("ForbiddenImport", (ImportError,), {})

    def guarded_import(name, *args, **kwargs):
        if name.split(".")[0] in forbidden:
            raise forbidden_import("import of %r is not allowed" % name)
        return real_import(name, *args, **kwargs)

    builtins.__import__ = guarded_import
    for module in [m for m in sys.modules if m.split(".")[0] in forbidden]:
        del sys.modules[module]  # what the zygote imported goes through the guard too
    return forbidden_import


def child_main(job, src, wfd):
    """The job's child: set up, write b"R", run the program, write one frame on fd 3, exit. What
    reporting needs is bound first: a program that patches builtins, json or os cannot garble it."""
    _write, _exit, _pack = os.write, os._exit, struct.pack
    _enc = json.encoder.encode_basestring_ascii
    _len, _isinstance, _type, _str, _repr = len, isinstance, type, str, repr
    _BaseException, _MemoryError, _SyntaxError = BaseException, MemoryError, SyntaxError

    def report(status, value=None, error=None):
        try:
            value_json = "null" if value is None else _enc(value)
            error_json = "null" if error is None else _enc(error)
            frame = '{"status": %s, "value": %s, "error": %s}' % (_enc(status), value_json,
                                                                   error_json)
            data = frame.encode()
            _write(wfd, _pack(">I", _len(data)) + data)
        finally:
            _exit(0)

    try:
        os.setsid()
        wfd = os.dup2(wfd, 3)
        confine_child(job)
    except BaseException as e:
        report("sandbox_error", None, "child setup failed: %s: %s" % (type(e).__name__, e))

    forbidden_exc = ()  # isinstance(e, ()) is False
    if job["forbidden"]:
        forbidden_exc = guard_imports(set(job["forbidden"]))

    cap = job["max_output"]
    _write(wfd, b"R")  # setup is over: the zygote lets later frames claim program outcomes only
    try:
        plen = job["plen"]
        program = compile(src[:plen].decode("utf-8", "surrogatepass"), "<program>", "exec")
        expression = compile(src[plen:].decode("utf-8", "surrogatepass"), "<expression>", "eval")
        namespace = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(program, namespace)
        value = eval(expression, namespace)
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
            if _isinstance(e, _MemoryError):
                status = "memory"
            elif _isinstance(e, forbidden_exc):
                status = "forbidden"
            else:
                status = "error"
            where = ""
            tb = e.__traceback__
            while tb is not None:  # the innermost line of the program itself
                if tb.tb_frame.f_code.co_filename == "<program>":
                    where = " (program line %d)" % tb.tb_lineno
                tb = tb.tb_next
            if _isinstance(e, _SyntaxError) and _type(e.lineno) is int:
                where = " (line %d)" % e.lineno
            message = "%s: %s%s" % (_type(e).__name__, _str(e), where)
            report(status, None, message[:2000])
        except _BaseException:
            report("error", None, "an exception that could not be described")


def tmp_mark():
    """What a job could change about its empty /tmp and working directory: inode, mode, owner,
    times... (None: it removed one)."""
    mark = []
    try:
        for path in dict.fromkeys(["/tmp", STATE["jobdir"]]):  # once where the jobdir is /tmp
            st = os.stat(path)
            mark.append(st[:7] + (st.st_mtime_ns, st.st_ctime_ns))
    except OSError:
        return None
    return mark


def tmp_untouched():
    """Whether /tmp is as prepare_jobdir left it."""
    if tmp_mark() != STATE["tmp_mark"] or sorted(os.listdir("/tmp")) != STATE["tmp_names"]:
        return False
    jobdir = STATE["jobdir"]
    if jobdir != "/tmp" and os.listdir(jobdir):
        return False
    return not (os.listxattr("/tmp") or os.listxattr(jobdir))


def mount_job_tmpfs():
    """A capped tmpfs on /tmp, the allow-listed paths under /tmp bound over it again, and the
    job's working directory."""
    size_mb = CFG["tmpfs_mb"]
    inodes = max(1024, 64 * size_mb)
    uid, gid = STATE["ids"]
    options = "size=%dm,nr_inodes=%d,mode=0700,uid=%d,gid=%d" % (size_mb, inodes, uid, gid)
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, options)
    for path, bind in STATE["tmp_binds"].items():
        bind_readonly(bind["fd"], path, path, bind["is_dir"])
    if STATE["jobdir"] != "/tmp":
        os.mkdir(STATE["jobdir"], 0o700)
        os.chown(STATE["jobdir"], uid, gid)
    STATE["tmp_mark"] = tmp_mark()


def prepare_jobdir():
    """A fresh host directory; with the allow-list root, a capped tmpfs on /tmp, kept while jobs
    leave it untouched."""
    if REPORT["filesystem"] != "allow-list":
        os.mkdir(STATE["jobdir"], 0o700)
        os.chown(STATE["jobdir"], *STATE["ids"])
    elif STATE["tmp_mark"] is None:
        mount_job_tmpfs()


def clean_jobdir():
    if REPORT["filesystem"] != "allow-list":
        import shutil
        shutil.rmtree(STATE["jobdir"], ignore_errors=True)
    elif not tmp_untouched():
        libc_call("umount2", b"/tmp", MNT_DETACH)  # the job's files go in one step
        STATE["tmp_mark"] = None


def enter_job_namespaces():
    """A fresh PID namespace for the next child: it is PID 1 of its own."""
    if STATE["job_ns"] and LIBC.unshare(STATE["job_ns"]) != 0:
        raise OSError(ctypes.get_errno(), "pid namespace")


def leave_job_namespaces():
    """Back to our own PID namespace once the child is forked."""
    if STATE["pidns_fd"] is not None:
        LIBC.setns(STATE["pidns_fd"], CLONE_NEWPID)


def kill_as_job_uid():  # in a throwaway child of the job's uid: it may signal all the job runs
    os.setgid(CFG["uid"])
    os.setuid(CFG["uid"])
    os.kill(-1, signal.SIGKILL)


def kill_escapees():
    """Kill what the job's child left running: the PID namespace's rest, or its uid's processes."""
    if STATE["pid1"]:  # PID 1 of the worker's namespace: everything else in it goes
        with contextlib.suppress(OSError):  # ESRCH: none left; ECHILD: all reaped
            os.kill(-1, signal.SIGKILL)
            while True:
                os.waitpid(-1, 0)
    elif STATE["pidns_fd"] is None and REPORT["uid_dropped"]:
        try_in_child(kill_as_job_uid)


def job_cgroup_pids():
    """The processes in the job's memory cgroup (none without one)."""
    if STATE["cgroup"] is None:
        return []
    listing = os.pread(STATE["cgroup"]["job_procs_fd"], 1 << 16, 0)
    return [int(pid) for pid in listing.split()]


def kill_job_cgroup(deadline):
    """SIGKILL what is left in the job's cgroup, again until it is empty or the deadline; -> the
    pids still there. A program cannot leave its cgroup (cgroup.procs is root's)."""
    pids = job_cgroup_pids()
    while pids and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(OSError):  # it exited meanwhile
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.001)
        pids = job_cgroup_pids()
    return pids


def collect_unix_sockets():
    """Schedule the kernel's Unix-socket garbage collector: closing a Unix socket does. It frees
    sockets that only reference each other through file descriptors in flight (SCM_RIGHTS), and
    what those hold: in-memory files, an IPC namespace and its shared memory, a tmpfs. A job that
    left no socket in our network namespace has nothing in flight: then it is not needed."""
    pair = (ctypes.c_int * 2)()
    libc_call("socketpair", AF_UNIX, SOCK_STREAM, 0, pair)  # not the socket module: the
    os.close(pair[0])                                        # zygote's heap stays small, and
    os.close(pair[1])                                        # so each fork


def pinned_job_memory():
    """Bytes charged to the job's cgroup that the kernel cannot reclaim: all but page cache (the
    files a job read stay cached for the next one, and go under memory pressure)."""
    usage = int(os.pread(STATE["cgroup"]["job_usage_fd"], 64, 0))
    if usage <= LEFTOVER_MB << 20:  # the common case: one read
        return usage
    stat = os.pread(STATE["cgroup"]["job_stat_fd"], 1 << 14, 0).decode()
    for line in stat.splitlines():
        name, value = line.split()
        if name in ("active_file", "inactive_file"):
            usage -= int(value)
    return usage


def job_leftovers():
    """What a finished job still holds: processes in its cgroup, Unix sockets in our network
    namespace (only jobs make any there), memory pinned in its cgroup over LEFTOVER_MB."""
    left = []
    # a job's PID namespace dies with its PID 1 (or ours empties it): then no process is left
    if not (STATE["job_ns"] or STATE["pid1"]) and job_cgroup_pids():
        left.append("processes")
    if STATE["unix_fd"] is not None and os.pread(STATE["unix_fd"], 4096, 0).count(b"\n") > 1:
        left.append("Unix sockets")  # more than the header line
    if STATE["cgroup"] is not None:
        pinned = pinned_job_memory()
        if pinned > LEFTOVER_MB << 20:
            left.append("%d MB of memory" % (pinned >> 20))
    return left


def release_job():
    """Wait until nothing of the job is left (job_leftovers), for at most a second: whatever is,
    is killed, and the garbage collector run; it, and the freeing of an IPC namespace, run in
    kernel workers. -> what is left, [] if nothing."""
    deadline = time.monotonic() + 1.0
    left = job_leftovers()
    while left and time.monotonic() < deadline:
        kill_job_cgroup(deadline)
        collect_unix_sockets()
        time.sleep(0.002)
        left = job_leftovers()
    return left


def count_new_oom_kills():
    """Whether the memory cgroup killed something since the last call."""
    if STATE["oom_fd"] is None:
        return False
    before = STATE["oom_kills"]
    events = os.pread(STATE["oom_fd"], 4096, 0).decode()
    match = re.search(r"^oom_kill (\d+)", events, re.M)
    STATE["oom_kills"] = int(match[1]) if match else 0
    return STATE["oom_kills"] != before


def run_job(job, src, send):
    """Run a job in a child: send(kind, frame) its frame or why it has none; zero its bytes."""
    global RES_BUF
    prepare_jobdir()
    enter_job_namespaces()
    deadline = time.monotonic() + job["timeout"]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # r goes with the child's closerange
        try:
            child_main(job, src, w)
        finally:
            os._exit(70)
    leave_job_namespaces()
    os.close(w)

    cap = 12 * job["max_output"] + 65536
    if len(RES_BUF) < cap:
        RES_BUF = bytearray(cap)
    view = memoryview(RES_BUF)
    got = 0
    need = None  # the frame's end, once its length has come
    start = 0    # 1 after the child's b"R"
    while need is None or got < need <= cap:
        left = deadline - time.monotonic()
        if left <= 0:
            break
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
        start = 1 if RES_BUF[0] == ord("R") else 0
        if need is None and got >= start + 4:
            need = start + 4 + struct.unpack(">I", RES_BUF[start:start + 4])[0]
    os.close(r)

    for kill in (os.kill, os.killpg):  # its PID namespace dies with it, else its group
        with contextlib.suppress(OSError):
            kill(pid, signal.SIGKILL)
    _, wait_status, rusage = os.wait4(pid, 0)
    kill_escapees()
    if STATE["job_proc"]:
        unmount_job_proc()
    oom_killed = count_new_oom_kills()
    src[:] = bytes(len(src))
    clean_jobdir()
    leftovers = release_job()
    if leftovers:  # before the verdict: the trainer replaces this worker after it
        send(b"T", {"error": "the job left %s behind" % ", ".join(leftovers)})

    sig = os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else None
    cpu = rusage.ru_utime + rusage.ru_stime
    status = None
    if need is not None and got >= need:  # then need <= cap
        send(b"P" if start else b"S", view[start + 4:need])
    elif need is not None and need > cap:
        status, error = "output_limit", "child wrote more than %d bytes" % cap
    elif left <= 0:
        status, error = "timeout", "wall-clock limit of %gs exceeded" % job["timeout"]
    elif sig == signal.SIGKILL and oom_killed:
        status, error = "memory", "the job's processes together exceeded memory_mb (memory cgroup)"
    elif sig in (signal.SIGXCPU, signal.SIGKILL) and cpu >= int(job["timeout"]) + 0.5:
        status, error = "timeout", "CPU limit exceeded (%.1fs)" % cpu
    elif sig is not None:
        signal_names = {s.value: s.name for s in signal.Signals}  # not every number has a name
        status, error = "crash", "killed by %s" % signal_names.get(sig, sig)
    else:
        exit_code = os.WEXITSTATUS(wait_status)
        status, error = "crash", "exited with code %d before producing a result" % exit_code
    if status:
        send(b"Z", {"status": status, "value": None, "error": error})
    RES_BUF[:got] = bytes(got)
    if cap > 1 << 22:  # a huge buffer would stay in every later child
        RES_BUF = bytearray()


# ------------------------------------------------------------------------------ setup and main

def count_own_processes(uid):
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):  # it exited meanwhile
                count += os.stat("/proc/" + name).st_uid == uid
    return count


def probe_job_proc():
    """Whether a child may mount a /proc of its own PID namespace over the allow-list root's."""
    if REPORT["filesystem"] != "allow-list" or not REPORT["namespaces"]["pid"]:
        return note("no /proc per job: jobs see the zygote's")
    STATE["proc_dev"] = os.stat("/proc").st_dev
    STATE["job_proc"] = REPORT["proc_per_job"] = try_in_child(mount_job_proc)
    unmount_job_proc()
    if not STATE["job_proc"]:
        note("no /proc per job (its mount was refused): jobs see the zygote's")
    return None


def self_test():
    """Run one program as every job runs: it must import the stdlib and get no new namespaces."""
    program = b"import ctypes, decimal, os, statistics\nlibc = ctypes.CDLL(None)"
    # PID 1 of its own namespace where there is one per job; CLONE_NEWUSER, CLONE_NEWNET refused
    expression = b"os.getpid() == 1, libc.unshare(0x10000000), libc.unshare(0x40000000)"
    job = {"timeout": 5.0, "memory_mb": 512, "fsize_mb": 1, "nproc": 8, "max_output": 100,
           "forbidden": [], "plen": len(program)}
    replies = []

    def keep(kind, frame):
        if kind == b"T":
            return note("self-test: " + frame["error"])
        if type(frame) is not dict:
            frame = json.loads(bytes(frame))
        replies.append(frame)

    run_job(job, bytearray(program + expression), keep)
    result = replies[0]
    # without seccomp, unshare may work: then only a failure to run says something
    if result["status"] != "ok" or REPORT["seccomp"]:
        expected = "(%s, -1, -1)" % (STATE["pidns_fd"] is not None)
        REPORT["self_test"] = result["value"] == expected
        if not REPORT["self_test"]:
            note("self-test failed (%s): without a mount namespace, Python's files may not be "
                 "readable by the unprivileged uid" % (result["error"] or result["value"]))


def setup():
    """Isolate this zygote once, then check that a child works."""
    R = REPORT
    R["root"] = os.geteuid() == 0
    enter_namespaces()
    R["uid_dropped"] = R["root"] and not R["namespaces"]["user"]
    if R["uid_dropped"]:
        R["uid"] = CFG["uid"]
        STATE["ids"] = (CFG["uid"], CFG["uid"])
    else:
        R["uid"] = os.geteuid()
        STATE["ids"] = (os.getuid(), os.getgid())
        # RLIMIT_NPROC counts all of the real uid's processes: add them
        STATE["nproc_base"] = 64 + count_own_processes(os.getuid())
    setup_cgroup()
    isolate_filesystem()
    if CFG["namespaces"]:
        setup_pid_namespace()
    R["ipc_per_job"] = R["namespaces"]["ipc"]  # the child unshares it (confine_child)
    if not R["ipc_per_job"]:
        note("no IPC namespace: SysV IPC and message queues a job leaves reach later jobs")
    install_seccomp()
    probe_job_proc()
    if R["namespaces"]["net"]:  # only jobs make sockets there: any left is a job's
        STATE["unix_fd"] = os.open("/proc/net/unix", os.O_RDONLY)
    if R["filesystem"] == "allow-list":  # keep_tmp_binds chose the jobdir
        R["scratch"] = "tmpfs per job"
    else:
        import tempfile
        R["scratch"] = tempfile.mkdtemp(prefix="pysandbox-")
        os.chmod(R["scratch"], 0o711)
        STATE["jobdir"] = R["scratch"] + "/job"  # one fixed path: outputs cannot differ
        note("no mount namespace: each job gets a fresh directory in " + R["scratch"])
    os.environ["HOME"] = os.environ["TMPDIR"] = STATE["jobdir"]  # tempfile writes there too
    self_test()


def warm_up():
    """Each child starts with the parser, compiler and allocator warm: 1 ms less CPU each."""
    PRCTL(PR_SET_PDEATHSIG, 0, 0, 0, 0)  # and ctypes' argument conversion
    for _ in range(3):
        namespace = {"__name__": "__main__"}
        exec(compile(WARM_UP_PROGRAM, "<program>", "exec"), namespace)
        repr(eval(compile(WARM_UP_EXPRESSION, "<expression>", "eval"), namespace))
        try:
            compile("def f(:", "<program>", "exec")
        except SyntaxError as e:
            str(e)  # and the error path a failing program takes


def main():
    global CFG, LIBC, PRCTL
    LIBC = ctypes.CDLL(None, use_errno=True)
    PRCTL = LIBC.prctl
    PRCTL.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    PRCTL.restype = ctypes.c_int
    CFG = read_message()
    os.umask(0o022)  # what the zygote makes in a job's tmpfs is not the job's to change
    sys.path[:] = [p for p in sys.path if p] + CFG["site_dirs"]
    try:
        setup()
    except BaseException as e:
        import traceback
        where = traceback.extract_tb(e.__traceback__)[-1]
        error = "%s: %s (in %s, zygote line %d)" % (type(e).__name__, e, where.name, where.lineno)
        return reply(b"", {"ready": False, "report": REPORT, "error": error})
    warm_up()
    gc.collect()
    gc.freeze()  # keep the collector off inherited objects: fewer copy-on-write faults per child
    reply(b"", {"ready": True, "report": REPORT})
    while True:
        job = read_message()
        try:
            run_job(job, read_exactly(job["plen"] + job["elen"]), reply)
        except BaseException as e:  # this zygote may be in a bad state: the trainer replaces it
            error = "zygote: %s: %s" % (type(e).__name__, e)
            reply(b"E", {"status": "sandbox_error", "value": None, "error": error})


if __name__ == "__main__":
    main()
