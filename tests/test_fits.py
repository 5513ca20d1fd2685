"""Issue 19 (fits at real size): no step spent on nothing, honest step figures, the trainer's threads
and vLLM's compile cache on CPU."""
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

import common
import infra.memory

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _trajs(advantages, seed=0):
    """Fixed trajectories (random token ids of the tiny vocabulary), one per advantage."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, a in enumerate(advantages):
        prompt = torch.randint(5, 200, (3 + i % 3,), generator=g).tolist()
        comp = torch.randint(5, 200, (4 + i % 4,), generator=g).tolist()
        out.append(common.Trajectory(prompt_ids=prompt, completion_ids=comp, advantage=a, role="solver"))
    return out


def _adam_state(policy):
    return [(k, v.clone() if torch.is_tensor(v) else v)
            for st in policy.optimizer.state.values() for k, v in sorted(st.items())]


def _count_forwards(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls, handle


# ------------------------------------------------------------------------------------------------
# Item 4: a mini-batch whose advantages are all zero costs no forward or backward
# ------------------------------------------------------------------------------------------------
def test_zero_advantage_mini_batch_skipped_with_the_same_weights_and_adam_state(tiny_policy_hf):
    """Mini-batches [A != 0], [A = 0], [A != 0]: the skipped middle step leaves weights and AdamW
    state (step count, both moments, weight decay) bit-identical to computing it."""
    policy = tiny_policy_hf
    policy.cfg.weight_decay = 0.1
    policy.cfg.grad_clip = 1.0
    start = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    trajs = _trajs([1.0, -1.0, 0.0, 0.0, 0.5, -0.5])
    results = []
    for skip in (True, False):
        policy.model.load_state_dict(start)
        policy.reset_optimizer()
        calls, handle = _count_forwards(policy.model)
        st = common.pg_step(policy, trajs, common.PGConfig(mini_batch=2, skip_zero_adv=skip))
        handle.remove()
        results.append((st, len(calls), {k: v.detach().clone() for k, v in policy.model.state_dict().items()},
                        _adam_state(policy)))
    (st_s, n_s, w_s, adam_s), (st_c, n_c, w_c, adam_c) = results
    assert st_s["skipped_mini_batches"] == 1 and st_c["skipped_mini_batches"] == 0
    assert st_s["optimizer_steps"] == st_c["optimizer_steps"] == 3
    assert n_s == n_c - 1  # one forward fewer (the whole batch fits one micro-batch)
    for k in w_c:
        assert torch.equal(w_s[k], w_c[k]), k
    assert len(adam_s) == len(adam_c) > 0
    for (ka, a), (kb, b) in zip(adam_s, adam_c):
        assert ka == kb and (torch.equal(a, b) if torch.is_tensor(a) else a == b), ka
    assert any(not torch.equal(w_c[k], start[k]) for k in w_c)


def test_all_zero_batch_steps_without_a_gradient_pass_but_keeps_its_diagnostics(tiny_policy_hf):
    """Every step skipped: weights move only by AdamW's decay of earlier moments (here: none, fresh
    optimizer, no weight decay, so not at all); the no-grad pass still gives the entropy."""
    policy = tiny_policy_hf
    before = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    calls, handle = _count_forwards(policy.model)
    st = common.pg_step(policy, _trajs([0.0] * 4), common.PGConfig(mini_batch=2, updates_per_batch=2))
    handle.remove()
    assert st["skipped_mini_batches"] == st["optimizer_steps"] == 4
    assert len(calls) == 1  # the no-grad pi_old / entropy pass only
    assert math.isfinite(st["entropy"]) and st["loss"] == 0 and st["grad_norm"] == 0
    assert math.isnan(st["approx_kl"])  # nothing computed: unknown, not 0
    assert all(s["step"] == 4 for s in policy.optimizer.state.values())
    for k, v in policy.model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("kw", [dict(entropy_coef=0.01), dict(skip_zero_adv=False)])
def test_zero_advantage_with_an_entropy_term_is_computed(tiny_policy_hf, kw):
    policy = tiny_policy_hf
    before = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    st = common.pg_step(policy, _trajs([0.0] * 4), common.PGConfig(**kw))
    assert st["skipped_mini_batches"] == 0
    if "entropy_coef" in kw:  # the entropy bonus has a gradient even with A = 0
        assert st["grad_norm"] > 0
        assert any(not torch.equal(v, before[k]) for k, v in policy.model.state_dict().items())


def test_custom_token_loss_is_never_skipped(tiny_policy_hf):
    """A fork's loss function may not vanish at A = 0: pg_step cannot know, so it computes."""
    def loss_with_a_floor(logp, old_logp, adv, cfg, **kw):
        loss, clipped = common.pg_token_loss(logp, old_logp, adv, cfg, **kw)
        return loss - 0.01 * logp, clipped
    st = common.pg_step(tiny_policy_hf, _trajs([0.0] * 4), common.PGConfig(), token_loss=loss_with_a_floor)
    assert st["skipped_mini_batches"] == 0 and st["grad_norm"] > 0


# ------------------------------------------------------------------------------------------------
# Item 5: honest figures
# ------------------------------------------------------------------------------------------------
def test_tokens_per_s_counts_prompt_and_completion_and_excludes_the_sync(tiny_policy_hf, monkeypatch):
    policy = tiny_policy_hf
    trajs = _trajs([1.0, -1.0, 0.5, -0.5])
    real_sync = policy.sync

    def slow_sync():
        time.sleep(0.5)
        real_sync()
    monkeypatch.setattr(policy, "sync", slow_sync)
    st = common.pg_step(policy, trajs, common.PGConfig(updates_per_batch=2))
    assert st["sync_s"] >= 0.5 and st["time_s"] > st["sync_s"]
    seq_tokens = sum(len(t.prompt_ids) + len(t.completion_ids) for t in trajs)
    # two forward+backward passes (the first gives pi_old: no no-grad pass), over the time without the sync
    assert st["tokens_per_s"] * (st["time_s"] - st["sync_s"]) == pytest.approx(2 * seq_tokens, rel=1e-3)
    # two mini-batches: the no-grad pass over the second, then a forward+backward pass over each
    st = common.pg_step(policy, trajs, common.PGConfig(mini_batch=2))
    second_tokens = sum(len(t.prompt_ids) + len(t.completion_ids) for t in trajs[2:])
    assert st["tokens_per_s"] * (st["time_s"] - st["sync_s"]) == pytest.approx(seq_tokens + second_tokens,
                                                                                rel=1e-3)


def test_sft_tokens_per_s_counts_prompt_tokens(tiny_policy_hf):
    ex = [([5, 6, 7, 8], [9, 10]), ([11, 12], [13, 14, 15])]
    st = common.sft_step(tiny_policy_hf, ex)
    assert st["tokens_per_s"] * st["time_s"] == pytest.approx(11, rel=1e-3)


@pytest.mark.skipif(not pathlib.Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")
def test_cpu_peak_memory_is_the_steps_own(tiny_policy_hf):
    """A 1 GiB allocation before the step raises the process's peak but not the step's; 256 MiB
    touched inside the step (a fork's loss function) shows in it."""
    big = torch.ones(2**28)  # 1 GiB, touched
    del big
    st = common.pg_step(tiny_policy_hf, _trajs([1.0, -1.0]), common.PGConfig())
    assert st["peak_mem_gb"] < 0.5

    def loss_allocating(logp, old_logp, adv, cfg, **kw):
        scratch = torch.ones(2**26)  # 256 MiB, touched
        loss, clipped = common.pg_token_loss(logp, old_logp, adv, cfg, **kw)
        return loss + 0 * scratch[0], clipped
    st = common.pg_step(tiny_policy_hf, _trajs([1.0, -1.0]), common.PGConfig(), token_loss=loss_allocating)
    assert 0.24 <= st["peak_mem_gb"] < 0.75


# ------------------------------------------------------------------------------------------------
# Item 6: the trainer's threads after vLLM starts, and vLLM's compile cache on CPU
# ------------------------------------------------------------------------------------------------
_ENGINE_START = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch, common
before = torch.get_num_threads()
path = common.resolve_model_path("tiny")
cfg = common.RunConfig(model=path, backend="vllm", max_model_len=256)
t = time.perf_counter()
s = common.VLLMSampler(path, common.load_tokenizer(path), cfg)
start_s = time.perf_counter() - t
after = torch.get_num_threads()
torch.set_num_threads(1)  # must act: the trainer owns torch's threads
settable = torch.get_num_threads() == 1
s.generate(["hi"], max_tokens=2, temperature=0)
from torch._dynamo.utils import counters
print(json.dumps(dict(before=before, after=after, settable=settable, start_s=start_s,
                      fx_hit=counters["inductor"]["fxgraph_cache_hit"],
                      fx_miss=counters["inductor"]["fxgraph_cache_miss"])))
s.close()
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU engine's threads and compile cache")
def test_vllm_cpu_keeps_trainer_threads_and_reuses_its_compile_cache(tmp_path):
    """Two engine starts in fresh processes sharing fresh compile caches: the trainer keeps its
    thread count and can still set it; the second start loads every compiled graph."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # vLLM's own choice
    env.update(VLLM_CACHE_ROOT=str(tmp_path / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_LOGGING_LEVEL="INFO", VLLM_CONFIGURE_LOGGING="1")
    runs, logs = [], []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _ENGINE_START, str(ROOT)], env=env, capture_output=True,
                           text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads([x for x in p.stdout.splitlines() if x.startswith("{")][-1]))
        logs.append(p.stdout + p.stderr)  # vLLM logs to stdout
    first, second = runs
    for r in runs:
        assert r["after"] == r["before"] and r["settable"], r
    # the second start finds every graph in the compile cache (vllm/compilation/decorators.py logs
    # "Compiling model again due to a load failure" where it cannot)
    assert first["fx_miss"] > 0, first
    assert second["fx_hit"] > 0 and second["fx_miss"] == 0, second
    assert "load failure" not in logs[1]


# ------------------------------------------------------------------------------------------------
# Item 3: a weight swap (R-Zero's KL reference pass) holds no full backup copy
# ------------------------------------------------------------------------------------------------
def _reset_peak() -> float:
    """Reset the resident peak; returns the resident GiB now. Large blocks are mmap-ed and unmapped
    on free (glibc mallopt M_MMAP_THRESHOLD = 64 KiB), so resident memory follows live tensors
    rather than what the heap kept from earlier frees."""
    import ctypes
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    return infra.memory.proc_status_kb("VmRSS") / 2**20


def _mid_policy(tmp_path):
    """A Policy on a ~100 MB random Qwen3 (many small tensors), no sampler needed."""
    import transformers
    conf = transformers.Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1536,
                                    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                    head_dim=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(conf)
    cfg = common.RunConfig(model="tiny", output_dir=str(tmp_path), backend="hf")
    return common.Policy(cfg, model, None, None, "tiny")


@pytest.mark.skipif(not pathlib.Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")
def test_swapped_weights_exchanges_without_a_full_backup(tmp_path):
    policy = _mid_policy(tmp_path)
    start = {k: v.clone() for k, v in policy.get_weights().items()}
    ref = {k: v + 1.0 for k, v in policy.get_weights().items()}
    ref["lm_head.weight"] = ref["model.embed_tokens.weight"]  # tied, as get_weights gives
    ref_copy = {k: v.clone() for k, v in ref.items()}
    full_gb = sum(v.numel() * 4 for k, v in start.items() if k != "lm_head.weight") / 2**30
    rss0 = _reset_peak()
    with policy.swapped_weights(ref):
        grown = infra.memory.peak_memory_gb(torch.device("cpu"), rss0)
        for k, v in policy.get_weights().items():
            assert torch.equal(v, ref_copy[k]), k
    assert grown < 0.2 * full_gb, (grown, full_gb)  # the old backup held a full copy
    for k, v in policy.get_weights().items():
        assert torch.equal(v, start[k]), k
    for k, v in ref.items():
        assert torch.equal(v, ref_copy[k]), k


def test_swapped_weights_of_another_dtype_still_restores(tmp_path):
    policy = _mid_policy(tmp_path)
    start = {k: v.clone() for k, v in policy.get_weights().items()}
    ref = {k: v.to(torch.bfloat16) for k, v in policy.get_weights().items()}
    with policy.swapped_weights(ref):
        pass
    for k, v in policy.get_weights().items():
        assert torch.equal(v, start[k]), k


@pytest.mark.skipif(not pathlib.Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")
def test_r_zero_role_switch_holds_no_third_copy(tmp_path):
    """Roles.activate parks the trained role in the other role's dict: the set leaves, the trained
    one takes its storage; no full copy is made on the way."""
    import r_zero

    class _Engine:  # stands for the sampler: it records what sync pushes
        def load_weights(self, named):
            self.n = sum(1 for _ in named)
    policy = _mid_policy(tmp_path)
    policy.sampler = _Engine()
    trained = {k: v.clone() for k, v in policy.get_weights().items()}
    other = {k: v + 1.0 for k, v in policy.get_weights().items()}
    other["lm_head.weight"] = other["model.embed_tokens.weight"]
    other_copy = {k: v.clone() for k, v in other.items()}
    roles = r_zero.Roles(policy, r_zero.CHALLENGER, other)
    full_gb = sum(v.numel() * 4 for k, v in trained.items() if k != "lm_head.weight") / 2**30
    rss0 = _reset_peak()
    roles.activate(r_zero.SOLVER)
    grown = infra.memory.peak_memory_gb(torch.device("cpu"), rss0)
    assert grown < 0.2 * full_gb, (grown, full_gb)  # at most one tensor (8 MiB of 104)
    assert roles.active == r_zero.SOLVER and policy.sampler.n > 0
    for k, v in policy.get_weights().items():
        assert torch.equal(v, other_copy[k]), k
    for k, v in roles.parked[r_zero.CHALLENGER].items():
        assert torch.equal(v, trained[k]), k
