"""/v1/completions with a batch of prompts (OpenAI's array forms: texts, or token-id lists), through the official
openai client: each prompt answered as it would be alone, its n choices at indices prompt * n + j, streamed or
not, the usage of every prompt; a refused prompt refuses the batch, names its place and leaves nothing running."""
from __future__ import annotations

import asyncio

import httpx
import pytest

# The autouse fixture keeps this process at one torch thread, as for the other server tests.
from test_openai_server import GREEDY, PROMPTS, _one_torch_thread, client  # noqa: F401


def alone(server, prompts, **kw):
    """Each prompt's choice texts, finish reasons and usage, asked for one request at a time."""
    return [client(server).completions.create(model=server.model, prompt=p, **GREEDY, **kw) for p in prompts]


def test_a_batch_of_texts_answers_each_prompt_as_alone(plain_server):
    want = alone(plain_server, PROMPTS)
    r = client(plain_server).completions.create(model=plain_server.model, prompt=PROMPTS, n=2, **GREEDY)
    assert [c.index for c in r.choices] == list(range(2 * len(PROMPTS)))
    # Greedy: both choices of prompt i are prompt i's answer alone.
    assert [c.text for c in r.choices] == [w.choices[0].text for w in want for _ in range(2)]
    assert all(c.finish_reason == "length" for c in r.choices)
    # The prompt counts once per prompt (as for n alone), the completion tokens every choice's.
    assert r.usage.prompt_tokens == sum(w.usage.prompt_tokens for w in want)
    assert r.usage.completion_tokens == 2 * sum(w.usage.completion_tokens for w in want)
    plain_server.wait_idle()


def test_a_batch_of_token_id_lists_and_its_logprobs(plain_server):
    ids = [[5, 9, 17, 5, 9, 17, 5], [40, 41, 42, 43, 40, 41]]
    want = alone(plain_server, ids, logprobs=1)
    r = client(plain_server).completions.create(model=plain_server.model, prompt=ids, logprobs=1, **GREEDY)
    assert [c.text for c in r.choices] == [w.choices[0].text for w in want]
    assert [c.logprobs.tokens for c in r.choices] == [w.choices[0].logprobs.tokens for w in want]
    assert [len(c.logprobs.token_logprobs) for c in r.choices] == [GREEDY["max_tokens"]] * 2


@pytest.mark.parametrize("kind", ["texts", "token-ids"])
def test_echo_puts_each_prompt_before_its_choices(plain_server, tiny_llama, kind):
    """A text prompt's own text, token ids' decoding, before each of its n choices, streamed or not."""
    from transformers import AutoTokenizer

    prompts = PROMPTS[:2] if kind == "texts" else [[5, 9, 17, 5, 9, 17, 5], [40, 41, 42, 43, 40, 41]]
    tok = AutoTokenizer.from_pretrained(str(tiny_llama[0]))
    echoed = prompts if kind == "texts" else [tok.decode(ids) for ids in prompts]
    want = alone(plain_server, prompts)
    c = client(plain_server)
    r = c.completions.create(model=plain_server.model, prompt=prompts, n=2, echo=True, **GREEDY)
    assert [ch.text for ch in r.choices] == [e + w.choices[0].text for e, w in zip(echoed, want) for _ in range(2)]
    chunks = list(c.completions.create(model=plain_server.model, prompt=prompts, n=2, echo=True, stream=True,
                                       **GREEDY))
    texts = [""] * len(r.choices)
    for chunk in chunks:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == [ch.text for ch in r.choices]


def test_a_streamed_batch_sends_each_choice_under_its_index(plain_server):
    whole = client(plain_server).completions.create(model=plain_server.model, prompt=PROMPTS, n=2, **GREEDY)
    chunks = list(client(plain_server).completions.create(model=plain_server.model, prompt=PROMPTS, n=2, stream=True,
                                                          stream_options={"include_usage": True}, **GREEDY))
    texts, finished = [""] * len(whole.choices), [None] * len(whole.choices)
    for chunk in chunks[:-1]:
        (c,) = chunk.choices
        texts[c.index] += c.text
        finished[c.index] = c.finish_reason or finished[c.index]
    assert texts == [c.text for c in whole.choices] and finished == ["length"] * len(whole.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    plain_server.wait_idle()


@pytest.mark.parametrize("prompt, param, words", [
    (["a fine prompt", ""], "prompt[1]", ["empty"]),
    ([[5, 6], [10**9]], "prompt[1]", ["vocabulary"]),
    ([[5, 6], [7] * 600], "prompt[1]", ["600 tokens", "512 tokens"]),
    (["a text", 5], "prompt", ["mixes a text (prompt[0]) with a token id (prompt[1])"]),
    (["x"] * 300 + [{"n": 2}], "prompt", ["holds 300 prompts of 2 sequences each, 600 requests", "at most 512"]),
    ([[5], "a text"], "prompt", ["mixes a list of token ids (prompt[0]) with a text (prompt[1])"]),
], ids=["empty-text", "unknown-token", "too-long", "text-then-id", "too-many", "ids-then-text"])
def test_a_refused_prompt_refuses_the_batch_and_aborts_the_rest(plain_server, prompt, param, words):
    before = plain_server.metrics()
    fields = prompt[-1] if isinstance(prompt[-1], dict) else {}  # the request's other fields, last
    prompt = prompt[:-1] if fields else prompt
    r = httpx.post(plain_server.url + "/v1/completions", timeout=30, json={
        "model": plain_server.model, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and all(w in error["message"] for w in words), error["message"]
    # Nothing of the batch runs on: a prompt admitted before another was refused is aborted, not finished.
    after = plain_server.wait_idle()
    assert after.get("specserve:requests_total{finish_reason=length}", 0) == before.get(
        "specserve:requests_total{finish_reason=length}", 0)
    ok = client(plain_server).completions.create(model=plain_server.model, prompt=["ok", "fine"], max_tokens=2)
    assert [c.index for c in ok.choices] == [0, 1]


# ---- the helpers a batch runs on (entrypoints/openai/serving.py), with stand-in requests ----------------------

def test_all_or_none_undoes_the_finished_and_cancels_the_running_once_one_fails():
    from specserve.entrypoints.openai.serving import all_or_none

    events = []

    async def admitted():
        await asyncio.sleep(0.01)
        return "admitted"

    async def refused():
        await asyncio.sleep(0.05)
        raise ValueError("refused")

    async def slow():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            events.append("slow cancelled")
            raise

    async def undo(result):
        events.append(f"undo {result}")

    async def run():
        with pytest.raises(ValueError, match="refused"):
            await all_or_none([admitted(), refused(), slow()], undo)
        assert await all_or_none([admitted(), admitted()], undo) == ["admitted", "admitted"]

    asyncio.run(run())
    assert sorted(events) == ["slow cancelled", "undo admitted"]


def _stream(name: str, delays: list[float], closed: list[str], fail_at: int | None = None):
    async def outputs():
        try:
            for i, delay in enumerate(delays):
                await asyncio.sleep(delay)
                if i == fail_at:
                    raise RuntimeError(f"{name} failed")
                yield f"{name}{i}"
        finally:
            closed.append(name)

    return outputs()


def test_merged_interleaves_streams_and_closes_them_all():
    from specserve.entrypoints.openai.serving import StartedOutputs, merged

    async def run():
        closed = []
        got = [x async for x in merged([_stream("a", [0.0, 0.03, 0.03], closed),
                                        _stream("b", [0.01, 0.03], closed)])]
        assert got == [(0, "a0"), (1, "b0"), (0, "a1"), (1, "b1"), (0, "a2")] and sorted(closed) == ["a", "b"]
        # A reader that leaves early (a client gone) closes every stream, read or not.
        closed = []
        outputs = merged([_stream("a", [0.0, 5.0], closed), _stream("b", [5.0], closed)])
        assert await anext(outputs) == (0, "a0")
        await outputs.aclose()
        assert sorted(closed) == ["a", "b"]
        # One stream's failure is raised, and closes the others.
        closed = []
        with pytest.raises(RuntimeError, match="b failed"):
            async for _ in merged([_stream("a", [0.0, 5.0], closed), _stream("b", [0.01], closed, fail_at=0)]):
                pass
        assert sorted(closed) == ["a", "b"]
        # A request start() admitted (its first output read) that nobody read on is aborted: its own outputs
        # are closed.
        closed = []
        own = _stream("rest", [0.0, 5.0], closed)
        await StartedOutputs(await anext(own), own).aclose()
        assert closed == ["rest"]

    asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_leaving_a_batch_aborts_every_prompt(plain_server, stream):
    before = plain_server.metrics().get("specserve:requests_total{finish_reason=abort}", 0)
    body = {"model": plain_server.model, "prompt": PROMPTS, "max_tokens": 480, "ignore_eos": True, "stream": stream}
    with httpx.Client(base_url=plain_server.url, timeout=30) as http:
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i == 6:
                        break  # leaving the block closes the connection mid-stream
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=body, timeout=0.5)
    m = plain_server.wait_idle()
    assert m["specserve:requests_total{finish_reason=abort}"] == before + len(PROMPTS)
