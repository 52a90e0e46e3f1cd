"""Stop token ids, max_tokens, sharded checkpoints, and the command line."""
from __future__ import annotations

import pytest
import torch

from conftest import make_hf_model
from specserve import LLM, SamplingParams
from specserve.errors import InvalidRequestError
from specserve.entrypoints.cli import main


def test_stop_token_id_and_max_tokens(tiny_llama):
    llm = LLM(str(tiny_llama[0]), max_model_len=128)
    free = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    assert len(tokens) == 10 and free[0].outputs[0].finish_reason == "length"
    stop_at = tokens[3]
    first = tokens.index(stop_at)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                   stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at


def test_sharded_safetensors_load_identically(tiny_llama, tmp_path, tokenizer_dir):
    path = tmp_path / "sharded"
    path.mkdir()
    hf = make_hf_model(path, tokenizer_dir, "llama")
    hf.save_pretrained(str(path), safe_serialization=True, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    for f in path.glob("model.safetensors"):
        f.unlink()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(path), max_model_len=128)
    got = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    x = torch.tensor([[5, 6, 7]])
    hf.generation_config.eos_token_id = None
    ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, 3:].tolist()
    assert got == ref


def test_cli_generate(tiny_llama, capsys):
    rc = main(["generate", "The quick brown fox", "Hi", "--model", str(tiny_llama[0]), "--max-tokens", "5",
               "--max-model-len", "128", "--stats",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("--- 5 tokens, finished: length") == 2 and "tokens/s" in out


def test_cli_generate_prints_each_sequence(tiny_llama, capsys):
    args = ["--model", str(tiny_llama[0]), "--max-tokens", "6", "--max-model-len", "128", "--temperature", "1",
            "--request-seed", "5"]
    assert main(["generate", "The quick brown fox", "--n", "3", "--stats", *args]) == 0
    out = capsys.readouterr().out
    expected = LLM(str(tiny_llama[0]), max_model_len=128).generate(
        "The quick brown fox", SamplingParams(n=3, temperature=1, max_tokens=6, seed=5), use_tqdm=False)[0]
    assert len({c.text for c in expected.outputs}) == 3
    for c in expected.outputs:
        assert f"--- sequence {c.index}\n{c.text}\n--- {len(c.token_ids)} tokens, finished: {c.finish_reason}" in out
    assert f"=== {expected.metrics.num_output_tokens} tokens in" in out
    assert main(["generate", "hi", "--n", "0", *args]) == 2
    assert "error: n: must be an integer in [1, 128]" in capsys.readouterr().err


def test_cli_chat_streams_the_reply(tiny_llama, capsys, monkeypatch):
    lines = iter(["Hi there"])

    def typed(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", typed)
    assert main(["chat", "--model", str(tiny_llama[0]), "--max-tokens", "8", "--max-model-len", "128"]) == 0
    llm = LLM(str(tiny_llama[0]), max_model_len=128)
    reply = llm.generate(llm.apply_chat_template([{"role": "user", "content": "Hi there"}]),
                         SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    assert reply and capsys.readouterr().out == reply + "\n"
    with pytest.raises(SystemExit):  # one reply a turn: chat has no --n
        main(["chat", "--n", "2"])


def test_cli_reports_bad_input_without_a_traceback(capsys):
    assert main(["generate", "hi", "--model", "/no/such/model"]) == 2
    assert "error: unknown model" in capsys.readouterr().err


def test_without_detokenization_the_tokens_are_the_same_and_the_text_empty(tiny_llama):
    llm = LLM(str(tiny_llama[0]), max_model_len=128)
    params = dict(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10]]
    with_text = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    bare = llm.generate(prompts, SamplingParams(**params, detokenize=False), use_tqdm=False)
    for a, b in zip(with_text, bare):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids and a.outputs[0].text
        assert b.outputs[0].text == "" and b.outputs[0].finish_reason == "length"
    with pytest.raises(InvalidRequestError, match="stop: stop strings are matched in the output text"):
        SamplingParams(stop=["\n"], detokenize=False)
