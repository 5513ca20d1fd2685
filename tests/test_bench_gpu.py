"""The GPU benchmark (tests/bench_gpu.py) on the CPU. Its --dry-run goes through every code path at
the tiny model's sizes, so that the first call on a GPU machine cannot fail on a typo. Plus its pure
parts: the largest-fit search, the FLOP formula, the model configs, the README table it reads."""
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "bench_gpu.py"

_spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
bench_gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_gpu)

# what one model's dry run must have measured, every one with status "ok"
EXPECTED = ["build", "pg_step_gc", "nograd_pass", "pg_step_nogc", "plain_nogc", "generate",
            "agreement", "plain_gc", "largest_fit_gc", "largest_fit_nogc"]


def _run(tmp_path, *flags, timeout=600):
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_dry_run_goes_through_every_measurement(tmp_path):
    proc, res = _run(tmp_path)
    printed = json.loads(proc.stdout.splitlines()[0])  # the condensed JSON first, then the table
    assert printed["dry_run"] is True and printed["models"].keys() == res["models"].keys()
    assert "measurement" in proc.stdout and "target mfu_4b_at_least_40pct" in proc.stdout
    assert res["errors"] == [] and res["skipped"] == [] and "aborted" not in res
    assert res["elapsed_s"] < res["budget_s"]
    assert set(res["models"]) == set(bench_gpu.MODELS)
    for key, entry in res["models"].items():
        meas = entry["measurements"]
        names = EXPECTED + (["pg_step_kl"] if bench_gpu.MODELS[key]["shape"].kl_coef else [])
        assert [n for n in names if meas.get(n, {}).get("status") != "ok"] == [], (key, meas)
        # the GPU's precision path: fp32 master weights under bf16 autocast, as Policy.load set them
        assert meas["build"]["fp32_master_bf16_autocast"] is True
        for name in ("pg_step_gc", "pg_step_nogc"):
            m = meas[name]
            n_seqs = entry["shape"]["prompts"] * entry["shape"]["group"]
            assert m["completion_tokens"] == n_seqs * 10
            assert m["completion_tokens_per_s"] > 0 and math.isfinite(m["loss"])
            assert m["flops"] == pytest.approx(4 * bench_gpu.forward_flops(
                entry["params"], [(12, 10)] * (m["completion_tokens"] // 10)))
        assert meas["pg_step_gc"]["gradient_checkpointing"] is True
        assert meas["pg_step_nogc"]["gradient_checkpointing"] is False
        plain = meas["plain_nogc"]
        assert plain["time_s"] >= plain["forward_loss_s"] + plain["backward_s"] - 1e-3
        for mode in ("nogc", "gc"):
            c = entry[f"ours_vs_plain_{mode}"]
            assert c["time_ratio"] > 0 and c["ours_nograd_s"] == meas["nograd_pass"]["time_s"]
            assert (c["time_ratio"] > 1.05) == ("slower_phase" in c)
        # the simulated GPU holds 5 sequences per micro-batch: the search must find exactly that
        for mode in ("gc", "nogc"):
            fit = meas[f"largest_fit_{mode}"]
            assert (fit["largest_fit"], fit["first_oom"], fit["resolved"]) == (5, 6, True), fit
        # sampler and trainer score the same tokens: in bf16 they agree to well under 0.05 nats
        gen, agree = meas["generate"], meas["agreement"]
        assert agree["trainer_vs_sampler"]["tokens"] == gen["new_tokens"] > 0
        assert agree["trainer_vs_sampler"]["mean"] < 0.05
        if entry["precision"] == "fp32-master":  # bf16 weights have no fp32 pass to compare with
            fp32 = agree["trainer_bf16_vs_fp32"]
            assert fp32["tokens"] > 0 and fp32["mean"] < 0.05
        assert entry["memory_vs_readme"]["rule_gb"] is not None
    # the 7B architecture is made to run out of memory with fp32 master weights: measured in bf16
    coder = res["models"]["qwen2.5-coder-7b"]
    assert coder["precision"] == "bf16" and coder["fp32_master"]["status"] == "oom"
    assert coder["measurements"]["pg_step_gc_fp32_master"]["status"] == "oom"
    assert coder["measurements"]["build_bf16"]["param_dtype"] == "torch.bfloat16"
    assert res["models"]["qwen3-4b"]["memory_vs_readme"]["readme_row"]["gpus"] == 1
    assert res["targets"]["mfu_4b_at_least_40pct"]["met"] is None  # no GPU peak on a CPU
    assert "bfloat16" in " ".join(res["summary"])


def test_no_budget_skips_every_measurement_and_still_reports(tmp_path):
    proc, res = _run(tmp_path, "--budget-s", "0", "--models", "qwen3-4b")
    meas = res["models"]["qwen3-4b"]["measurements"]
    assert meas["build"]["status"] == "skipped" and "budget" in meas["build"]["reason"]
    assert res["matmul_bf16"]["status"] == "skipped"
    assert len(res["skipped"]) == 2 and res["errors"] == []
    assert all(t["met"] is None for t in res["targets"].values())
    assert "skipped" in proc.stdout and json.loads(proc.stdout.splitlines()[0])["budget_s"] == 0


def test_unknown_model_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench_gpu.main(["--dry-run", "--models", "qwen3-4b,gpt5", "--out", ""])
    assert e.value.code == 2 and "unknown gpt5" in capsys.readouterr().err


LIMITS = (0, 1, 2, 3, 5, 7, 8, 13, 40, 64, 100, 128, 500)


@pytest.mark.parametrize("true_fit,known", [(t, k) for t in LIMITS for k in (0, 1, 4) if k <= t])
def test_largest_fit_search_brackets_the_limit(true_fit, known):
    calls = []

    def probe(m):
        calls.append(m)
        return m <= true_fit

    r = bench_gpu.largest_fit(probe, known, cap=128, max_probes=20)
    assert len(calls) == len(set(calls)) == len(r["probes"])  # no size is probed twice
    assert r["largest_fit"] == max([known] + [m for m in calls if m <= true_fit])
    if true_fit >= 128:
        assert r["capped"] and r["largest_fit"] == 128 and r["first_oom"] is None
    else:
        assert r["resolved"] and r["largest_fit"] <= true_fit < r["first_oom"]
        assert r["first_oom"] - r["largest_fit"] <= max(1, r["largest_fit"] // 8)


def test_largest_fit_search_stops_when_the_budget_runs_out():
    r = bench_gpu.largest_fit(lambda m: None if m > 16 else True, 4, cap=128, max_probes=20)
    assert r == {"largest_fit": 16, "first_oom": None, "capped": False, "resolved": False,
                 "probes": [[8, True], [16, True]]}
    r = bench_gpu.largest_fit(lambda m: m <= 50, 1, cap=128, max_probes=3)
    assert r["probes"] == [[2, True], [4, True], [8, True]] and not r["resolved"]


def test_flop_formula():
    counts = {"body": 10, "head": 3, "layers": 2, "attn_width": 4}
    # 2*N_body*S + 2*N_head*H + 2*layers*width*S^2 with S = 2 + 3
    assert bench_gpu.forward_flops(counts, [(2, 3)]) == 2 * 10 * 5 + 2 * 3 * 3 + 2 * 2 * 4 * 25
    assert bench_gpu.forward_flops(counts, [(2, 3)], full_logits=True) == 100 + 2 * 3 * 5 + 400
    assert bench_gpu.forward_flops(counts, [(2, 3), (1, 1)]) == 518 + (40 + 6 + 64)


@pytest.mark.parametrize("key", list(bench_gpu.MODELS))
def test_model_configs_have_the_published_sizes(key):
    """The config dicts give the model cards' parameter counts (the cards round to 2-3 digits)."""
    spec = bench_gpu.MODELS[key]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**spec["config"]))
    counts = bench_gpu.param_counts(model)
    total, non_embedding = spec["card"]
    assert counts["total"] == pytest.approx(total, rel=0.03)
    assert counts["body"] == pytest.approx(non_embedding, rel=0.03)
    assert counts["tied"] == spec["config"]["tie_word_embeddings"]
    assert type(model).__name__ == {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[
        spec["config"]["model_type"]]


def test_readme_memory_table_is_found():
    table = bench_gpu.readme_memory(ROOT / "README.md")
    assert table["bytes_per_param"] == 16.0
    one_gpu = [r for r in table["rows"] if r["gpus"] == 1 and r["model_b"] == 4.0]
    assert one_gpu and one_gpu[0]["state_gb"] > 0 and one_gpu[0]["gpu_gb"] >= 80


def test_watchdog_report_marks_and_writes_the_json(tmp_path):
    args = types.SimpleNamespace(out=str(tmp_path / "b.json"), budget_s=10.0, hard_grace_s=5.0,
                                 dry_run=True)
    bench = bench_gpu.Bench(args)
    bench.current = "qwen3-4b/pg_step_gc"
    bench.model("qwen3-4b")["measurements"]["build"] = {"status": "ok", "time_s": 1.0}
    printed = json.loads(bench.abort_report())
    written = json.loads((tmp_path / "b.json").read_text())
    assert "during qwen3-4b/pg_step_gc" in printed["aborted"]
    assert written["aborted"] == printed["aborted"]
    assert printed["models"]["qwen3-4b"]["measurements"]["build"]["status"] == "ok"
