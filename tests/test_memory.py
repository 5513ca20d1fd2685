"""The trainer is sized to the memory that is free before the first step (common.fit_memory): the
activation cost is measured, and the plan keeps, shrinks or checkpoints so that a step fits."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import common
import infra.memory


def _qwen3(layers, hidden=256, inter=768):
    cfg = transformers.Qwen3Config(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=512,
    )
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg).train()


def test_activation_cost_is_per_token_per_layer_and_excludes_weights():
    two, four = infra.memory.activation_costs(_qwen3(2)), infra.memory.activation_costs(_qwen3(4))
    # linear in depth: a layer adds the same bytes per token; weights (MBs here) never enter
    per_layer = (four["off"] - two["off"]) / 2
    assert 0.3 < per_layer / (two["off"] / 2) <= 1.05
    assert two["fixed"] < 2**20 and four["fixed"] < 2**20
    # checkpointing keeps only the layers' inputs (plus one layer recomputed in backward)
    assert four["on"] < 0.6 * four["off"]
    # one saved fp32 hidden state per layer and token is the floor of either mode
    assert four["on"] >= 4 * 256 * 4


def test_autocast_weight_copies_are_a_fixed_cost_not_per_token():
    model = _qwen3(2)
    model.selfplay_autocast = (
        torch.bfloat16
    )  # read by common's forward context, as Policy.load sets it
    cost = infra.memory.activation_costs(model)
    linear = sum(p.numel() for n, p in model.named_parameters() if "proj" in n)
    assert 0.8 * 2 * linear <= cost["fixed"] <= 1.5 * 2 * linear + 2**20


@pytest.fixture
def policy(tiny_cfg):
    tiny_cfg.backend = "hf"
    tiny_cfg.fit_memory = False
    tiny_cfg.micro_batch_tokens = 16384
    tiny_cfg.max_model_len = 2048
    return common.Policy.load(tiny_cfg)


def _need(policy, tokens, ckpt):
    return 1.1 * infra.memory.step_memory(policy, tokens, ckpt, infra.memory.activation_costs(policy.model))


def test_a_step_that_fits_changes_nothing(policy):
    assert common.fit_memory(policy, free=int(_need(policy, 16384, False)) + 1) == ""
    assert policy.cfg.micro_batch_tokens == 16384 and not policy.model.is_gradient_checkpointing


def test_too_little_memory_shrinks_the_micro_batch_first(policy):
    note = common.fit_memory(policy, free=int(_need(policy, 8192, False)))
    assert 2048 <= policy.cfg.micro_batch_tokens < 16384
    assert policy.cfg.micro_batch_tokens % 256 == 0
    assert not policy.model.is_gradient_checkpointing
    assert "--micro-batch-tokens 16384" in note and f"{policy.cfg.micro_batch_tokens}" in note


def test_when_one_sequence_does_not_fit_it_checkpoints(policy):
    note = common.fit_memory(policy, free=int(_need(policy, 2048, True)) + 2**20)
    assert policy.cfg.gradient_checkpointing and policy.model.is_gradient_checkpointing
    assert policy.cfg.micro_batch_tokens >= 2048
    assert "gradient checkpointing" in note


def test_a_model_that_cannot_fit_is_one_line_naming_the_fixes(policy):
    with pytest.raises(common.InputError) as e:
        common.fit_memory(policy, free=int(_need(policy, 1024, True)))
    msg = str(e.value)
    assert "\n" not in msg and "--max-model-len" in msg and "2048-token" in msg


def test_the_plan_runs_on_load_and_a_fitting_tiny_model_is_left_alone(tiny_cfg):
    tiny_cfg.backend = "hf"
    policy = common.Policy.load(tiny_cfg)
    assert policy.cfg.micro_batch_tokens == common.RunConfig.micro_batch_tokens
    assert not policy.model.is_gradient_checkpointing


def test_the_lm_head_stays_in_one_piece_where_its_logits_fit(policy):
    """At 65,536 tokens the tiny model's logits take two 128 MiB chunks: in one piece the step
    needs 4 x 128 MiB more, and the plan keeps it so only where that fits."""
    policy.cfg.micro_batch_tokens = 65536
    cost = infra.memory.activation_costs(policy.model)
    whole = 1.1 * infra.memory.step_memory(policy, 65536, False, cost, whole_head=True)
    chunks = 1.1 * infra.memory.step_memory(policy, 65536, False, cost)
    assert whole - chunks == pytest.approx(1.1 * 4 * 2**27, rel=0.01)
    assert common.fit_memory(policy, free=int(whole) + 1) == ""
    assert policy.model.selfplay_head_rows == 65536
    assert common.fit_memory(policy, free=int(whole) - 1) == ""
    assert policy.model.selfplay_head_rows is None  # chunks, the micro-batch kept
    assert policy.cfg.micro_batch_tokens == 65536 and not policy.model.is_gradient_checkpointing


_FAULTS_AFTER_LOAD = """
import resource, sys, torch
sys.path.insert(0, sys.argv[1])
import common
cfg = common.RunConfig(model="tiny", backend="hf", fit_memory=False, output_dir=sys.argv[2])
policy = common.Policy.load(cfg)
batch = [common.Trajectory(prompt_ids=[5, 6, 7], completion_ids=[8, 9, 10, 11], advantage=a)
         for a in (1.0, -1.0)]
common.pg_step(policy, batch, common.PGConfig())
faults = []
for _ in range(10):  # a tensor of 4 MiB, filled and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(2**20)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator")
def test_a_process_that_trained_reuses_freed_tensor_memory(tmp_path):
    """Policy.load and pg_step leave glibc's allocator as they found it: a freed 4 MiB tensor's
    pages are reused, not handed back and faulted in again at each allocation (1,024 faults each,
    as under the process-wide mmap threshold of 128 KiB that made everything 1.3x slower)."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-c", _FAULTS_AFTER_LOAD, str(root), str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    faults = int(out.split()[-1])
    assert faults < 9 * 1024 / 4, out  # a quarter of the pages of nine tensors, at most


@pytest.mark.slow
def test_the_plan_covers_the_measured_peak_of_a_step():
    """tests/bench_memory.py runs two AdamW steps of two micro-batches in a fresh process and
    prints the resident peak they added beside step_memory's plan. At one layer of Qwen3-0.6B's
    shape the LM head holds 156M of the 171M parameters, so its two full gradients during the
    backward (and glibc's retained heap, which pg_step hands back) decide the fit."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "tests/bench_memory.py", "--layers", "1", "--tokens", "256", "--quick",
           "--allocators", "trim"]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=True).stdout
    lines = [line.split() for line in out.splitlines()]
    header = next(line for line in lines if line[:1] == ["tokens"])
    rows = [dict(zip(header, line)) for line in lines if line[:1] == ["256"]]
    assert len(rows) == 2, out
    for row in rows:
        assert float(row["measured"]) <= 1.1 * float(row["predicted"]), out  # fit_memory's margin
        assert float(row["measured"]) >= 0.8 * float(row["predicted"]), out  # not a blanket guess
