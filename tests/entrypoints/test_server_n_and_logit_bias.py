"""n and logit_bias through the official openai client: n choices with their indices, streamed chunks carrying
their choice's index and each choice's end, usage counting the prompt once and every choice's tokens, the
prompt-token metrics counting every sequence's prompt and its cache hits, a disconnect aborting every sequence,
best_of only equal to n, a bias that forces a token, and 400s naming what is wrong."""
from __future__ import annotations

import httpx
import openai
import pytest

from live_server import LiveServer, one_torch_thread
from specserve import LLM, SamplingParams

ENGINE = dict(max_model_len=512, num_kv_blocks=128, max_num_seqs=16)
PROMPT = "the cat sat on the mat, the cat sat on the mat, the cat"
MESSAGES = [{"role": "user", "content": "Tell me about the cat."}]
SAMPLED = dict(temperature=1.0, max_tokens=12, seed=5)


@pytest.fixture(scope="module")
def server(tiny_llama):
    with one_torch_thread(), LiveServer(str(tiny_llama[0]), max_waiting=8, **ENGINE) as s:
        yield s


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def joined(chunks, n: int, text) -> tuple[list[str], list[str | None]]:
    """Each choice's streamed text and finish reason."""
    texts, reasons = [""] * n, [None] * n
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += text(choice) or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    return texts, reasons


def test_completions_n_streamed_and_not(server, tiny_llama):
    c = client(server)
    r = c.completions.create(model=server.model, prompt=PROMPT, n=4, **SAMPLED)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3] and len({ch.text for ch in r.choices}) == 4
    # The engine's own sequences for the same seed, and the usage: the prompt once, every choice's tokens.
    with one_torch_thread():
        llm = LLM(str(tiny_llama[0]), **ENGINE)
    expected = llm.generate(PROMPT, SamplingParams(n=4, **SAMPLED), use_tqdm=False)[0]
    assert [ch.text for ch in r.choices] == [o.text for o in expected.outputs]
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in expected.outputs)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(c.completions.create(model=server.model, prompt=PROMPT, n=4, stream=True,
                                       stream_options={"include_usage": True}, **SAMPLED))
    assert all(len(ch.choices) == 1 for ch in chunks[:-1]) and chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (r.usage.prompt_tokens, r.usage.completion_tokens)
    assert joined(chunks, 4, lambda ch: ch.text) == ([ch.text for ch in r.choices],
                                                      [ch.finish_reason for ch in r.choices])


def test_chat_n_streamed_and_not_with_logprobs(server):
    c = client(server)
    r = c.chat.completions.create(model=server.model, messages=MESSAGES, n=3, logprobs=True, top_logprobs=2,
                                  stop=["e"], **SAMPLED)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    for ch in r.choices:
        assert "e" not in ch.message.content and ch.finish_reason in ("stop", "length")
        assert ch.logprobs.content and all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)
    chunks = list(c.chat.completions.create(model=server.model, messages=MESSAGES, n=3, stream=True, stop=["e"],
                                            **SAMPLED))
    # Each choice opens with the role, then its content.
    assert [(ch.choices[0].index, ch.choices[0].delta.role) for ch in chunks[:3]] == [(i, "assistant") for i in range(3)]
    assert joined(chunks, 3, lambda ch: ch.delta.content) == ([ch.message.content for ch in r.choices],
                                                              [ch.finish_reason for ch in r.choices])


def test_chat_stream_ends_each_choice_once_and_counts_usage_over_choices(server):
    c = client(server)
    r = c.chat.completions.create(model=server.model, messages=MESSAGES, n=3, **SAMPLED)
    chunks = list(c.chat.completions.create(model=server.model, messages=MESSAGES, n=3, stream=True,
                                            stream_options={"include_usage": True}, **SAMPLED))
    *body, last = chunks
    assert last.choices == [] and all(len(ch.choices) == 1 and ch.usage is None for ch in body)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (r.usage.prompt_tokens,
                                                                        r.usage.completion_tokens)
    ended = set()
    for ch in body:
        choice = ch.choices[0]
        assert choice.index not in ended, f"choice {choice.index} sent a chunk after its finish_reason"
        if choice.finish_reason is not None:
            ended.add(choice.index)
    assert ended == {0, 1, 2}
    texts, reasons = joined(body, 3, lambda ch: ch.delta.content)
    assert all(texts) and (texts, reasons) == ([ch.message.content for ch in r.choices],
                                               [ch.finish_reason for ch in r.choices])


def test_prompt_tokens_metrics_count_each_sequence_and_its_cache_hits(server):
    """As vLLM counts them: prompt_tokens_total the prefill tokens of every sequence, prompt_tokens_cached_total
    those the prefix cache served; usage counts the prompt once. The prompt is new to the server, so the first
    sequence computes it and each later one finds every full block of it but the last token's."""
    block = 16
    prompt = "a prompt no other test sends: " + "violet harbor lantern " * 12
    before = server.wait_idle()
    r = client(server).completions.create(model=server.model, prompt=prompt, n=4, max_tokens=3, temperature=1.0)
    m = server.wait_idle()
    length = r.usage.prompt_tokens
    assert length == len(server.engine.tokenizer(prompt).input_ids) > 2 * block
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    counted = m["specserve:prompt_tokens_total"] - before["specserve:prompt_tokens_total"]
    cached = m["specserve:prompt_tokens_cached_total"] - before["specserve:prompt_tokens_cached_total"]
    assert (counted, cached) == (4 * length, 3 * ((length - 1) // block * block))
    length_ended = "specserve:requests_total{finish_reason=length}"
    assert m[length_ended] - before.get(length_ended, 0) == 4  # each sequence, by its own finish reason


def test_greedy_choices_are_equal(server):
    r = client(server).completions.create(model=server.model, prompt=PROMPT, n=3, temperature=0, max_tokens=8)
    single = client(server).completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=8)
    assert [ch.text for ch in r.choices] == [single.choices[0].text] * 3


def test_a_disconnect_aborts_every_sequence(server):
    before = server.metrics().get("specserve:requests_total{finish_reason=abort}", 0)
    body = {"model": server.model, "prompt": PROMPT, "n": 4, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 6:
                    break  # leaving the block closes the connection mid-stream
    m = server.wait_idle()
    assert m["specserve:requests_total{finish_reason=abort}"] == before + 4  # each sequence, as vLLM counts
    assert m["specserve:generation_tokens_total"] < 4 * 400


def test_logit_bias_forces_a_token(server):
    c = client(server)
    forced = 7
    r = c.completions.create(model=server.model, prompt=PROMPT, n=2, max_tokens=5, logit_bias={str(forced): 100},
                             temperature=1.0, logprobs=1)
    token = server.engine.tokenizer.decode([forced])
    for ch in r.choices:
        assert ch.logprobs.tokens == [token] * 5 and ch.text == token * 5
    chat = c.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=5, temperature=0,
                                     logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == r.choices[0].text


@pytest.mark.parametrize("fields, param, words", [
    ({"n": 0}, "n", "must be an integer in [1, 128]"),
    ({"n": 9}, "n", "--max-waiting"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "key 99999 is not a token id of this model"),
    ({"logit_bias": {"5": -101}}, "logit_bias", "the bias of token 5 must be a number in [-100, 100]"),
    ({"logit_bias": {"five": 1}}, "logit_bias", "key 'five' is not a token id"),
    ({"best_of": 2}, "best_of", "use n, which returns every sequence it generates; best_of equal to n is "
                                "accepted, got best_of=2 and n=1"),
    ({"best_of": 3, "n": 2}, "best_of", "got best_of=3 and n=2"),
])
def test_refusals_name_the_field(server, fields, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(model=server.model, prompt=PROMPT, max_tokens=2, extra_body=fields)
    assert e.value.status_code == 400 and e.value.body["param"] == param and words in e.value.body["message"]
    assert client(server).completions.create(model=server.model, prompt="ok", max_tokens=2).choices[0].finish_reason


def test_best_of_equal_to_n_is_n(server):
    c = client(server)
    plain = c.completions.create(model=server.model, prompt=PROMPT, n=2, **SAMPLED)
    same = c.completions.create(model=server.model, prompt=PROMPT, n=2, best_of=2, **SAMPLED)
    one = c.completions.create(model=server.model, prompt=PROMPT, best_of=1, **SAMPLED)
    assert [ch.text for ch in same.choices] == [ch.text for ch in plain.choices]
    assert [ch.text for ch in one.choices] == [plain.choices[0].text]
    with pytest.raises(openai.BadRequestError) as e:  # a chat request has no best_of (OpenAI's API)
        c.chat.completions.create(model=server.model, messages=MESSAGES, n=2, max_tokens=2,
                                  extra_body={"best_of": 2})
    assert e.value.body["param"] == "best_of" and "use n" in e.value.body["message"]
