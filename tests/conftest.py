"""Shared fixtures: tiny random Hugging Face models saved as safetensors directories."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest_plugins = ["entrypoints.shared_servers"]

# pytest-xdist's workers (pytest_xdist_auto_num_workers) split the cores between them: a thread more than its
# share spins against the other worker's at every torch op, several times slower than one thread each.
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
# Without a GPU, Triton kernels run in Triton's interpreter, which is chosen when a kernel is defined (when
# its module is first imported): switched on here, before any test module imports one.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    from triton_interpreter import speed_up_patching

    speed_up_patching()


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (addopts): two workers on the CPU, where most tests are one thread of host Python (Triton's
    interpreter, tiny models); none with a GPU, whose tests share one device and time it."""
    return 0 if torch.cuda.is_available() else min(2, os.cpu_count() or 1)


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching admits new requests every step.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Symbols: (){}[]<>!?;:",
    "Héllo wörld, ça va? Ελληνικά, русский, 中文, 日本語 and emoji 🚀🙂.",
] * 20


def _train_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    fast.save_pretrained(str(path))


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


def make_hf_model(path: Path, tokenizer_dir: Path, arch: str = "llama", tie: bool = False, seed: int = 0, **overrides):
    """Save a random Hugging Face model of `arch` with the test tokenizer; returns the transformers model."""
    import shutil

    import transformers

    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    kw = dict(TINY, vocab_size=vocab, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, **overrides)
    cls, cfg_cls = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
    }[arch]
    if arch == "qwen3":
        kw.setdefault("head_dim", 16)
    torch.manual_seed(seed)
    model = cls(cfg_cls(**kw)).eval()
    with torch.no_grad():
        # Larger-than-default weights give peaked distributions, so greedy paths are not knife-edge ties.
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0, 0.02)
    model.save_pretrained(str(path), safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return model


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    _train_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_dir):
    """(directory, transformers model) of a tiny random Llama."""
    path = tmp_path_factory.mktemp("tiny_llama")
    return path, make_hf_model(path, tokenizer_dir, "llama")


def repetitive_prompts(vocab: int, n: int = 6, seed: int = 0) -> list[list[int]]:
    """n prompts of 5 to 100 token ids, each a short random run repeated, so that n-gram drafts find
    matches and a model has something to continue."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))]
        out.append((base * 12)[: rng.randint(5, 100)])
    return out


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of exactly n tokens, with EOS neither stopping nor suppressed."""
    hf.generation_config.eos_token_id = None
    x = torch.tensor([ids])
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def cuda_float32():
    """For GPU tests: a CUDA device, with float32 matmuls exact (TF32 off) so they match the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="session")
def smollm2_shape(tmp_path_factory):
    """For GPU tests: (SmolLM2's shape with random weights as a BenchModel, a random EAGLE-3 head's directory),
    in bfloat16: a real model's size and kernels without its weights."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from specserve.bench.models import prepare_model, write_random_eagle3_head

    root = tmp_path_factory.mktemp("smollm2_shape")
    model = prepare_model("smollm2-shape", root, torch.bfloat16)
    return model, write_random_eagle3_head(root / "head", model.hf_config, torch.bfloat16, "cuda")
