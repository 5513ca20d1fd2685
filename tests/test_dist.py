"""torchrun tests (#10): 2 processes, gloo on CPU, the tiny model.

This file is both the pytest module and the worker that torchrun starts:
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/test_dist.py SCENARIO OUT_DIR
Each rank writes OUT_DIR/rank<r>.json (and tensors to .pt files); the pytest side compares them with a
single-process run of the same code.
"""
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("SELFPLAY_CACHE", str(ROOT / "tests" / ".cache"))

import pytest  # noqa: E402
import torch  # noqa: E402

AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "drgrpo"]
# PGConfig of each case; the last takes 3 optimizer steps (mini-batches of 2, 2 and 1 trajectories,
# the last leaving rank 1 a zero-weight stand-in), and its gradient is recorded at the third
CASES = {**{agg: {"aggregation": agg} for agg in AGGREGATIONS},
         "mini_batches": {"aggregation": "seq-mean-token-mean", "mini_batch": 2},
         # one trajectory per step: the third (A = 0) is skipped on every rank, the others computed
         "zero_adv_skip": {"aggregation": "token-mean", "mini_batch": 1}}
STEPS = {"mini_batches": 3, "zero_adv_skip": 5}
# pg_step stats that describe the whole batch, so under torchrun every rank must log the 1-process figure
LOGGED_OVER_BATCH = ["entropy", "nll_entropy", "entropy/solver", "entropy/proposer", "entropy_exact/solver",
                     "entropy_exact/proposer", "zero_adv_frac", "n_seqs", "n_tokens",
                     "optimizer_steps", "skipped_mini_batches"]
PROMPTS = ["What is 2+3?", [{"role": "user", "content": "Name a prime number."}], "def f(x):",
           "<question>7*8</question>", "Hello", "The answer is"]


def _trajectories(common, vocab: int) -> list:
    """A fixed, uneven batch (5 sequences of different lengths, mixed-sign advantages), same on every rank."""
    rng = random.Random(0)
    out = []
    for i in range(5):
        p = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))]
        c = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 12))]
        adv = rng.uniform(-1.5, 1.5) if i != 2 else 0.0
        out.append(common.Trajectory(prompt_ids=p, completion_ids=c, reward=float(i % 2), advantage=adv,
                                     role="solver" if i < 4 else "proposer"))
    return out


def scenario_grad(out: pathlib.Path) -> dict:
    """One pg_step per case from the same weights; record the full gradient before the last step."""
    import common
    cfg = common.RunConfig(model="tiny", backend="hf", lr=1e-3, grad_clip=1e9, micro_batch_tokens=24,
                           output_dir=str(out / "run"))
    common.seed_everything(0)
    policy = common.Policy.load(cfg)
    base = policy.get_weights()
    trajs = _trajectories(common, len(policy.tokenizer))
    grads = {}
    original = policy.clip_and_step

    def capture():
        g = {}
        for name, p in policy.model.named_parameters():
            if p.grad is not None:
                full = p.grad.full_tensor() if type(p.grad).__name__ == "DTensor" else p.grad
                g[name.replace("module.", "")] = full.detach().clone()
        grads[current] = g
        return original()

    policy.clip_and_step = capture
    stats = {}
    for current in CASES:
        policy.set_weights(base)
        # plain SGD: a step's update is continuous in the gradient (Adam's first step is about
        # lr * sign(g), which flips on round-off), so later steps compare across world sizes too
        trainable = [p for p in policy.model.parameters() if p.requires_grad]
        policy.optimizer = torch.optim.SGD(trainable, lr=0.01)
        st = common.pg_step(policy, trajs, common.PGConfig(max_len=16, **CASES[current]))
        stats[current] = float(st["loss"])
        stats[current + "/logged"] = {k: st[k] for k in LOGGED_OVER_BATCH}
    if policy.is_main:
        torch.save(grads, out / f"grads_ws{policy.world_size}.pt")
    return {"loss": stats, "world_size": policy.world_size}


UNEVEN_FIGURES = ["loss", "entropy", "nll_entropy", "entropy_exact/solver", "kl_ref", "optimizer_steps",
                  "n_tokens"]


def scenario_uneven(out: pathlib.Path) -> dict:
    """Issue #39's hang: at a 24-token budget each of rank 0's rows needs a forward of its own while
    rank 1's whole share fits in one, so no-grad passes cut per rank ran 4 FSDP2 forwards on rank 0
    and 1 on rank 1. One pg_step of two mini-batches of 4, without and with the KL reference pass."""
    import common
    cfg = common.RunConfig(model="tiny", backend="hf", lr=1e-3, micro_batch_tokens=24,
                           output_dir=str(out / "run"))
    common.seed_everything(0)
    policy = common.Policy.load(cfg)
    base = policy.get_weights()
    g = torch.Generator().manual_seed(7)
    reference = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    reference["lm_head.weight"] = reference["model.embed_tokens.weight"]  # tied
    rng = random.Random(1)
    trajs = []
    for i in range(8):
        n_prompt, n_completion = (6, 10) if i % 4 < 2 else (3, 3)  # rank 0 shares: rows 0, 1, 4, 5
        trajs.append(common.Trajectory(prompt_ids=[rng.randrange(3, 1000) for _ in range(n_prompt)],
                                       completion_ids=[rng.randrange(3, 1000) for _ in range(n_completion)],
                                       advantage=rng.uniform(-1, 1), role="solver"))
    figures = {}
    for name, kl_coef in (("no_kl", 0.0), ("kl", 0.1)):
        policy.set_weights(base)
        st = common.pg_step(policy, trajs, common.PGConfig(mini_batch=4, kl_coef=kl_coef), ref_weights=reference)
        figures[name] = {k: st[k] for k in UNEVEN_FIGURES if k in st}
    return {"world_size": policy.world_size, "figures": figures}


def scenario_sync(out: pathlib.Path) -> dict:
    """Each rank's own vLLM engine (external_launcher) must produce the greedy output of the updated
    weights after sync; then a checkpoint is saved and resumed under torchrun."""
    import common
    import transformers
    rank = int(os.environ.get("RANK", 0))
    cfg = common.RunConfig(model="tiny", backend="vllm", lr=1e-3, max_model_len=512, output_dir=str(out / "run"))
    common.seed_everything(0)
    run = common.Run(cfg, "dist")
    policy = common.Policy.load(cfg)
    assert isinstance(policy.sampler, common.VLLMSampler)
    base = policy.get_weights()
    g = torch.Generator().manual_seed(7)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]
    # a reference full (unsharded) HF copy with the new weights, on this rank
    ref = transformers.AutoModelForCausalLM.from_pretrained(policy.model_path, dtype=torch.float32)
    ref.load_state_dict(new)
    hf = common.HFSampler(policy.model_path, policy.tokenizer, cfg, model=ref)
    before = [g[0].token_ids for g in policy.sampler.generate(PROMPTS, temperature=0, max_tokens=16)]
    policy.load_trainer_weights(new)
    policy.sync()
    mine = [g[0].token_ids for g in policy.sampler.generate(PROMPTS, temperature=0, max_tokens=16)]
    expected = [g[0].token_ids for g in hf.generate(PROMPTS, temperature=0, max_tokens=16)]
    gathered = policy.generate(PROMPTS, temperature=0, max_tokens=16)
    # one AdamW step so the optimizer has state, then checkpoint, disturb, resume
    batch = [common.Trajectory(prompt_ids=c.prompt_ids, completion_ids=c.token_ids, advantage=1.0 - i % 2)
             for i, grp in enumerate(gathered) for c in grp]
    common.pg_step(policy, batch, common.PGConfig(aggregation="token-mean"))
    saved = policy.get_weights()
    ck = run.save_checkpoint(1, policy, {"rank0_only_state": [1, 2]})
    run.log(1, {"loss": 0.5})
    after_step = [g[0].token_ids for g in policy.sampler.generate(PROMPTS[:2], temperature=0, max_tokens=8)]
    policy.set_weights(base)
    resumed = common.Run(common.RunConfig(**{**cfg.__dict__, "resume": str(out / "run")}), "dist")
    step, state = resumed.load_checkpoint(policy)
    restored = policy.get_weights()
    same = all(torch.equal(restored[k], saved[k]) for k in saved)
    after_resume = [g[0].token_ids for g in policy.sampler.generate(PROMPTS[:2], temperature=0, max_tokens=8)]
    n_state = sum(len(s) for s in policy.optimizer.state.values())
    policy.generate(PROMPTS, n=2, temperature=1.0, max_tokens=4)  # sampled, different shards per rank
    return {"rank": rank, "world_size": policy.world_size, "before": before, "mine": mine,
            "expected": expected, "gathered": [[c.token_ids for c in grp] for grp in gathered],
            "ckpt": str(ck), "step": step, "state": state, "weights_restored": same,
            "after_step": after_step, "after_resume": after_resume, "optimizer_entries": n_state,
            "run_dir_files": sorted(p.name for p in (out / "run").iterdir()),
            "python_rng": random.random(), "numpy_rng": float(__import__("numpy").random.rand())}


def scenario_rzero_shards(out: pathlib.Path) -> dict:
    """R-Zero's parked role and KL reference under FSDP2: each rank keeps only its shards; a KL
    pass, a role switch and a resume from a saved folder are exact, bit for bit."""
    import common
    import r_zero
    cfg = common.RunConfig(model="tiny", backend="hf", output_dir=str(out / "run"))
    common.seed_everything(0)
    policy = common.Policy.load(cfg)
    (out / "run").mkdir(parents=True, exist_ok=True)
    base = policy.get_weights()
    g = torch.Generator().manual_seed(7)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]
    roles = r_zero.Roles(policy, r_zero.CHALLENGER, folder=out / "run")
    ref = roles.park()

    def same(a, b):
        return all(torch.equal(v, b[k]) for k, v in dict(a).items())
    res = {"share": sum(v.numel() for v in ref.values()) / sum(
        v.numel() for k, v in base.items() if k != "lm_head.weight")}
    policy.load_trainer_weights(new)  # stands for training
    with policy.swapped_weights(ref):
        res["kl_pass_sees_ref"] = same(policy.get_weights(), base)
    res["kl_pass_restores"] = same(policy.get_weights(), new)
    res["ref_kept"] = same(r_zero.full_weights(policy, ref), base)
    roles.activate(r_zero.SOLVER)
    res["switch_in"] = same(policy.get_weights(), base)
    res["switch_out"] = same(r_zero.full_weights(policy, roles.parked[r_zero.CHALLENGER]), new)
    saved = {k: v.cpu() for k, v in r_zero.full_weights(policy, roles.parked[r_zero.CHALLENGER])}
    if common.is_main_process():
        policy.model.save_pretrained(str(out / "saved"), state_dict=saved)
    policy.barrier()
    res["resumed"] = same(r_zero.full_weights(policy, roles.park(out / "saved")), new)
    return res


def _worker(scenario: str, out: str) -> None:
    out = pathlib.Path(out)
    res = {"grad": scenario_grad, "sync": scenario_sync, "rzero_shards": scenario_rzero_shards,
           "uneven": scenario_uneven}[scenario](out)
    rank = int(os.environ.get("RANK", 0))
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # (the process group is left to vLLM's exit handler, which destroys it)


# ----------------------------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------------------------

def _kill_marked(marker: str) -> None:
    """SIGKILL every process whose environment holds ``marker``: the launcher and its ranks, which
    torchrun starts in sessions of their own."""
    for proc in pathlib.Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker.encode() in (proc / "environ").read_bytes():
                    os.kill(int(proc.name), signal.SIGKILL)
            except OSError:
                pass  # gone already, or not ours


def _torchrun_script(args: list, timeout: int = 900) -> subprocess.CompletedProcess:
    """torchrun of 2 ranks. A rank that hangs in a collective is killed with the launcher after
    ``timeout`` seconds, and the test fails (the output goes to files: a hung rank holds no pipe)."""
    marker = f"selfplay-torchrun-{os.getpid()}-{random.random()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", SELFPLAY_TEST_MARKER=marker)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *map(str, args)]
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        p = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=stdout, stderr=stderr, text=True)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_marked(marker)
            p.wait()
        stdout.seek(0)
        stderr.seek(0)
        out, err = stdout.read(), stderr.read()
    if p.returncode == -signal.SIGKILL:
        pytest.fail(f"torchrun hung for {timeout} s:\n{out[-4000:]}\n{err[-8000:]}")
    assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n{out[-4000:]}\n{err[-8000:]}"
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _torchrun(scenario: str, out: pathlib.Path, timeout: int = 900) -> list:
    _torchrun_script([pathlib.Path(__file__).resolve(), scenario, out], timeout)
    return [json.loads((out / f"rank{k}.json").read_text()) for k in range(2)]


@pytest.mark.slow
def test_ranks_with_uneven_shares_run_the_same_forwards(tmp_path):
    """Every no-grad pass (pi_old of the second mini-batch, the KL reference) runs as many forwards on
    every rank: the old per-rank cut hung here. The figures are the one-process ones."""
    single = scenario_uneven(tmp_path)
    ranks = _torchrun("uneven", tmp_path, timeout=300)
    for r in ranks:
        assert r["world_size"] == 2
        for name, figures in single["figures"].items():
            assert r["figures"][name] == pytest.approx(figures, rel=1e-4), name
    assert single["figures"]["kl"]["kl_ref"] > 1e-4 and "kl_ref" not in single["figures"]["no_kl"]


@pytest.mark.slow
def test_two_process_gradient_equals_single_process(tmp_path):
    single = scenario_grad(tmp_path)  # this pytest process: world size 1, no wrapping
    assert single["world_size"] == 1
    ranks = _torchrun("grad", tmp_path)
    assert [r["world_size"] for r in ranks] == [2, 2]
    g1 = torch.load(tmp_path / "grads_ws1.pt")
    g2 = torch.load(tmp_path / "grads_ws2.pt")
    for agg in CASES:
        assert g1[agg].keys() == g2[agg].keys() and len(g1[agg]) > 10
        for name in g1[agg]:
            # fp32 round-off grows with the gradient's scale, which one- and two-trajectory
            # mini-batches make ~10x larger (max |g| ~1.7 measured): a tolerance relative to it
            scale = float(g1[agg][name].abs().max()) if agg in STEPS else 0.0
            atol = 1e-6 + 1e-5 * scale
            torch.testing.assert_close(g2[agg][name], g1[agg][name], rtol=1e-4, atol=atol,
                                       msg=lambda m: f"{agg} {name}: {m}")
        assert ranks[0]["loss"][agg] == ranks[1]["loss"][agg]
        logged = single["loss"][agg + "/logged"]
        assert logged["zero_adv_frac"] == 0.2 and logged["n_seqs"] == 5
        assert logged["optimizer_steps"] == STEPS.get(agg, 1)
        assert logged["skipped_mini_batches"] == (agg == "zero_adv_skip")
        for r in ranks:
            assert r["loss"][agg + "/logged"] == pytest.approx(logged, rel=1e-5)
    # the three aggregations really are different gradients (the comparison above can fail)
    a, b = g1["token-mean"], g1["drgrpo"]
    assert any(not torch.allclose(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sync_reaches_every_rank_and_resume_under_torchrun(tmp_path):
    ranks = _torchrun("sync", tmp_path)
    for r in ranks:
        assert r["world_size"] == 2
        assert r["mine"] == r["expected"], f"rank {r['rank']}: engine does not follow the synced weights"
        assert r["mine"] != r["before"]
        assert r["gathered"] == [[ids] for ids in r["expected"]]  # full list, in prompt order, on every rank
        assert r["step"] == 1 and r["state"] == {"rank0_only_state": [1, 2]}
        assert r["weights_restored"] and r["optimizer_entries"] > 0
        assert r["after_resume"] == r["after_step"]
    assert ranks[0]["gathered"] == ranks[1]["gathered"]
    # python/numpy RNG streams stay identical across ranks (engine start-up and sampling do not touch them)
    assert ranks[0]["python_rng"] == ranks[1]["python_rng"] and ranks[0]["numpy_rng"] == ranks[1]["numpy_rng"]
    assert ranks[0]["ckpt"] == ranks[1]["ckpt"]
    files = ranks[0]["run_dir_files"]
    assert {"config.json", "metrics.jsonl", "checkpoints"} <= set(files)
    ck = pathlib.Path(ranks[0]["ckpt"])
    ts = json.loads((ck / "trainer_state.json").read_text())
    assert ts["world_size"] == 2 and len(ts["rng_per_rank"]) == 2
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1  # only rank 0 logs


@pytest.mark.slow
def test_r_zero_keeps_only_its_shards_of_the_other_role_and_the_reference(tmp_path):
    for r in _torchrun("rzero_shards", tmp_path):
        assert r.pop("share") < 0.6  # about half of a set per rank: one set per node
        assert all(r.values()), r


@pytest.mark.slow
def test_a_method_runs_and_resumes_under_torchrun(tmp_path):
    """spice.py end to end under torchrun (2 ranks, one vLLM-cpu engine each), then --resume, in one folder."""
    data = ROOT / "tests" / "data"
    run = tmp_path / "run"
    small = ["--model", "tiny", "--corpus", data / "spice_corpus.jsonl", "--docs-per-step", "2", "--group-size", "2",
             "--reasoner-k", "2", "--max-attempts", "2", "--max-tokens", "24", "--max-model-len", "1024",
             "--eval-benchmarks", data / "spice_eval.jsonl", "--eval-max-tokens", "8", "--save-every", "1",
             "--log-samples", "1"]
    _torchrun_script([ROOT / "spice.py", *small, "--steps", "2", "--output-dir", run])
    _torchrun_script([ROOT / "spice.py", "--resume", run, "--steps", "3"])
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [m["step"] for m in metrics if "challenger/valid_rate" in m]
    assert train_steps == [1, 2, 3]  # each step logged once (rank 0), the resumed run continued at 3
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_3"
    assert (run / "eval.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


_DATA = ROOT / "tests" / "data"
_OTHER_METHODS = {
    # script: (small flags for a first run, flags for the resumed run, the last step the resumed run must log)
    "star.py": (["--data", _DATA / "star_copy_train.jsonl", "--test-data", _DATA / "star_copy_test.jsonl",
                 "--exemplars", _DATA / "star_copy_exemplars.jsonl", "--lr", "1e-3", "--warmup", "short",
                 "--steps-scale", "0.05", "--batch-tokens", "64", "--max-new-tokens", "8", "--max-model-len", "512",
                 "--patience", "0", "--rounds", "1"], ["--rounds", "2"], 2),
    "absolute_zero.py": (["--batch-size", "2", "--references", "2", "--induction-inputs", "2",
                          "--learnability-samples", "2", "--max-response-tokens", "16", "--max-prompt-tokens", "1500",
                          "--max-model-len", "2048", "--seed-max-rounds", "1", "--sandbox-workers", "1",
                          "--executor-timeout", "2", "--eval-benchmarks", _DATA / "azr_eval.jsonl",
                          "--eval-max-tokens", "8", "--no-eval-code", "--save-every", "1", "--steps", "1"],
                         ["--steps", "2"], 2),
    "r_zero.py": (["--iterations", "1", "--challenger-steps", "1", "--solver-steps", "1", "--challenger-batch", "2",
                   "--challenger-group", "2", "--solver-batch", "2", "--solver-group", "2", "--votes", "4",
                   "--question-pool", "4", "--max-tokens", "12", "--vote-max-tokens", "8", "--max-model-len", "1024",
                   "--max-prompt-tokens", "400", "--eval-benchmarks", _DATA / "rzero_eval.jsonl",
                   "--eval-max-tokens", "8"], ["--iterations", "2"], None),
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(_OTHER_METHODS))
def test_other_methods_run_and_resume_under_torchrun(script, tmp_path):
    """star.py, absolute_zero.py and r_zero.py end to end under torchrun (2 ranks, a vLLM-cpu engine each), then
    --resume for one more round / step / iteration; one run folder, metrics logged once (rank 0)."""
    first, more, last_step = _OTHER_METHODS[script]
    run = tmp_path / "run"
    _torchrun_script([ROOT / script, "--model", "tiny", *first, "--output-dir", run])
    n_before = len((run / "metrics.jsonl").read_text().splitlines())
    _torchrun_script([ROOT / script, "--resume", run, *more])
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) > n_before  # the resumed run continued and logged more
    steps = [m["step"] for m in metrics]
    assert len(steps) == len(set(steps)), steps  # every step logged once: only rank 0 writes
    if last_step is not None:
        assert steps[-1] == last_step
    else:  # R-Zero logs per phase step; the resumed run reached iteration 2
        assert max(m.get("iteration", 0) for m in metrics) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
