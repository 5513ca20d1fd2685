"""Benchmark: trivial programs per second, three ways, in one run (issue #5).

  1. PythonSandbox: one fresh, isolated process per program (fork server, namespaces, rlimits,
     seccomp);
  2. baseline: `subprocess.run([python, "-c", ...])` per program (a fresh interpreter, no
     isolation);
  3. the official Absolute Zero approach: a reused, unisolated worker pool that execs every program
     in the same long-lived interpreters (fast, and unsafe: state leaks, no limits, escapees
     survive).

All three use the same number of parallel workers. With --compare REF (a git revision, e.g. main)
the PythonSandbox of that revision (its infra/sandbox.py and infra/zygote.py, or its common.py
before they existed) runs too, in rounds interleaved with today's, so a busy machine slows both
alike; the ratio of their medians is the cost of what changed (issue #15: at most 25%). Usage:
    python tests/bench_sandbox.py [--workers 2] [--n 3000] [--n-subprocess 200]
                                  [--compare main --rounds 6]
Target (issue #5): >= 1,000 isolated programs/s on 2 cores and >= 4x the subprocess baseline.
"""
import argparse
import concurrent.futures as cf
import importlib.util
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROGRAM = "def f(x):\n    return [x + i for i in range(3)]"
EXPRESSION = "f(41)"
EXPECTED = "[41, 42, 43]"
JOB = (PROGRAM, EXPRESSION)


def _unisolated_worker(job):
    program, expression = job
    namespace = {}
    exec(program, namespace)  # noqa: S102 - this IS the unsafe approach being measured
    return repr(eval(expression, namespace))  # noqa: S307


def _one_subprocess(_):
    source = f"{PROGRAM}\nprint(repr({EXPRESSION}))"
    command = [sys.executable, "-c", source]
    out = subprocess.run(command, capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process and of its reaped children (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    after_name = stat.rsplit(")", 1)[1]  # the command name may hold spaces
    fields = after_name.split()
    ticks = sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def _total_cpu_seconds(zygotes: list[int]) -> float:
    """This process's CPU seconds, and the zygotes' with their children's."""
    own = os.times()
    seconds = own.user + own.system
    for pid in zygotes:
        seconds += _cpu_seconds(pid)
    return seconds


def _measure(sb, n: int) -> dict:
    """Run n programs: programs/s, and CPU ms per program over trainer + zygotes + children."""
    zygotes = [w.proc.pid for w in sb._pool]
    cpu_before = _total_cpu_seconds(zygotes)
    t0 = time.perf_counter()
    jobs = [JOB] * n
    results = sb.run_many(jobs)
    seconds = time.perf_counter() - t0
    cpu_seconds = _total_cpu_seconds(zygotes) - cpu_before
    wrong = [r for r in results if r.status != "ok" or r.value != EXPECTED]
    assert not wrong, wrong[:3]
    cpu_ms = cpu_seconds / n * 1e3
    return {"rate": n / seconds, "cpu_ms": cpu_ms}


def bench_sandbox(workers: int, n: int) -> dict:
    from infra.sandbox import PythonSandbox
    warm_up = [JOB] * (4 * workers)
    with PythonSandbox(workers=workers, timeout_s=5) as sb:
        sb.run_many(warm_up)
        measured = _measure(sb, n)
        iso = sb.isolation
        namespaces = [k for k, v in iso["namespaces"].items() if v]
        print(f"  isolation level: {iso['level']}  (namespaces: {namespaces}, seccomp: "
              f"{iso['seccomp']}, uid dropped: {iso['uid_dropped']})")
    return measured


def _programs_per_second(ex, fn, jobs: list, **map_kwargs) -> float:
    """How fast ex.map(fn, jobs) runs; every output must be EXPECTED."""
    t0 = time.perf_counter()
    out = list(ex.map(fn, jobs, **map_kwargs))
    seconds = time.perf_counter() - t0
    assert all(o == EXPECTED for o in out), out[:3]
    return len(jobs) / seconds


def bench_subprocess(workers: int, n: int) -> float:
    with cf.ThreadPoolExecutor(workers) as ex:
        return _programs_per_second(ex, _one_subprocess, list(range(n)))


def bench_reused_pool(workers: int, n: int) -> float:
    jobs = [JOB] * n
    warm_up = jobs[:4 * workers]
    with cf.ProcessPoolExecutor(workers) as ex:
        list(ex.map(_unisolated_worker, warm_up))
        return _programs_per_second(ex, _unisolated_worker, jobs, chunksize=1)


def _git_show(ref: str, path: str) -> str | None:
    """The file at git revision ref, or None where it has none."""
    revision_path = f"{ref}:{path}"
    command = ["git", "-C", str(ROOT), "show", revision_path]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return out.stdout


def _sandbox_class_at(ref: str):
    """PythonSandbox as it is at git revision ref, imported under another name: from its
    infra/sandbox.py beside its own infra/zygote.py, or from its common.py (before infra/)."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="bench-sandbox-"))
    safe_ref = ref.replace("/", "_").replace("~", "_").replace("^", "_")
    sandbox = _git_show(ref, "infra/sandbox.py")
    if sandbox is not None:
        zygote = _git_show(ref, "infra/zygote.py")
        if zygote is not None:  # its ZYGOTE_SCRIPT: the zygote.py beside the module
            (folder / "zygote.py").write_text(zygote)
        path = folder / f"sandbox_{safe_ref}.py"
        path.write_text(sandbox)
    else:
        common = _git_show(ref, "common.py")
        if common is None:
            raise SystemExit(f"--compare {ref}: no infra/sandbox.py nor common.py there")
        path = folder / f"common_{safe_ref}.py"
        path.write_text(common)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module.PythonSandbox


def bench_compare(ref: str, workers: int, n: int, rounds: int) -> None:
    """Today's PythonSandbox and `ref`'s, `rounds` interleaved rounds of n programs each."""
    from infra.sandbox import PythonSandbox
    sandbox_at_ref = _sandbox_class_at(ref)
    boxes = {ref: sandbox_at_ref(workers=workers, timeout_s=5),
             "this checkout": PythonSandbox(workers=workers, timeout_s=5)}
    rates = {name: [] for name in boxes}
    cpus = {name: [] for name in boxes}
    warm_up = [JOB] * (4 * workers)
    try:
        for sb in boxes.values():
            sb.run_many(warm_up)
        for _ in range(rounds):
            for name, sb in boxes.items():
                measured = _measure(sb, n)
                rates[name].append(measured["rate"])
                cpus[name].append(measured["cpu_ms"])
    finally:
        for sb in boxes.values():
            sb.close()
    for name in boxes:
        rate = statistics.median(rates[name])
        cpu_ms = statistics.median(cpus[name])
        each = ", ".join(f"{x:.0f}" for x in rates[name])
        print(f"PythonSandbox at {name:14s} median {rate:6.0f} programs/s, "
              f"{cpu_ms:.2f} CPU ms/program  (rounds: {each})")
    ratio = statistics.median(rates["this checkout"]) / statistics.median(rates[ref])
    # CPU per program does not depend on what else the machine runs nearly as much
    before = statistics.median(cpus[ref])
    after = statistics.median(cpus["this checkout"])
    speedup = before / after
    print(f"this checkout / {ref}: throughput {ratio:.2f}, CPU per program {before:.2f} -> "
          f"{after:.2f} ms, i.e. throughput on idle cores x{speedup:.2f} "
          "(issue #15: per-job isolation may cost at most 25%, >= 0.75)")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--n", type=int, default=3000,
                    help="programs for the sandbox and the reused pool")
    ap.add_argument("--n-subprocess", type=int, default=200,
                    help="programs for the subprocess baseline")
    ap.add_argument("--compare", default="",
                    help="git revision whose PythonSandbox runs beside today's")
    ap.add_argument("--rounds", type=int, default=6,
                    help="interleaved rounds of --n / 3 programs each for --compare")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    python = sys.version.split()[0]
    print(f"{os.cpu_count()} CPUs, load average {load:.2f}, {args.workers} workers, "
          f"python {python}")
    if args.compare:
        bench_compare(args.compare, args.workers, args.n // 3, args.rounds)
    sandbox = bench_sandbox(args.workers, args.n)
    sandbox_rate = sandbox["rate"]
    cpu_ms = sandbox["cpu_ms"]
    print(f"PythonSandbox (fresh isolated process each): {sandbox_rate:8.0f} programs/s")
    print(f"  CPU per program (trainer + zygote + child): {cpu_ms:.2f} ms -> at most "
          f"{2000 / cpu_ms:.0f} programs/s on 2 otherwise idle cores")
    subprocess_rate = bench_subprocess(args.workers, args.n_subprocess)
    print(f"subprocess.run per program:                  {subprocess_rate:8.0f} programs/s")
    pool_rate = bench_reused_pool(args.workers, args.n)
    print(f"reused unisolated pool (official, unsafe):   {pool_rate:8.0f} programs/s")
    target = "met" if sandbox_rate >= 1000 else "NOT met"
    print(f"sandbox / subprocess = {sandbox_rate / subprocess_rate:.1f}x (target >= 4x);  "
          f"sandbox / reused pool = {sandbox_rate / pool_rate:.2f}x;  "
          f"target >= 1000/s: {target}")
    print(f"load average after: {os.getloadavg()[0]:.2f} "
          "(other users of the machine lower every figure)")


if __name__ == "__main__":
    main()
