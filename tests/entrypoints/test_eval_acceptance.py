"""eval-acceptance: its figures are the engine's own acceptance statistics, per (k, temperature)."""
from __future__ import annotations

import json

import pytest

from heads import save_eagle_head
from single_thread import one_thread  # noqa: F401  (autouse)
from specserve import LLM, SamplingParams
from specserve.entrypoints.cli import main
from specserve.entrypoints.eval_acceptance import evaluate, stats_between, stats_sum
from specserve.prompt_files import load_prompt_file, prompt_token_ids
from specserve.spec_decode.metrics import SpecDecodeStats

# A KV pool sized for these tests rather than the default 2 GB, which takes seconds to allocate (the commands'
# engines: by bytes).
ENGINE = {"max_model_len": 256, "num_kv_blocks": 128}
KV_CACHE = "4MiB"


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    path, hf = tiny_llama
    root = tmp_path_factory.mktemp("eval")
    head = save_eagle_head(root / "head", hf.config, "eagle3", seed=5)
    prompts = root / "mt_bench.jsonl"
    rows = [{"question_id": i, "category": "writing", "turns": [t, "Shorter."]}
            for i, t in enumerate(["The quick brown fox", "Paged attention stores keys", "Numbers: 0 1 2 3"])]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path), {"method": "eagle3", "model": str(head)}, str(prompts)


def test_figures_are_the_engines_own_statistics(setup):
    model, spec, prompts = setup
    report = evaluate(model, spec, prompts, [0.0], [2], max_tokens=16, num_prompts=None, baseline=True,
                      engine_kwargs=ENGINE)
    (result,) = report["results"]
    llm = LLM(model, **ENGINE, speculative_config={**spec, "num_speculative_tokens": 2})
    ids = [prompt_token_ids(llm, c) for c in load_prompt_file(prompts)]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    want = llm.engine.spec_stats.as_dict()
    for key in ("num_steps", "num_drafted", "num_accepted", "mean_acceptance_length", "acceptance_per_position"):
        assert result[key] == want[key], key
    assert result["output_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs)
    assert result["num_drafted"] > 0 and result["k"] == 2 and result["temperature"] == 0.0
    (base,) = report["baseline"]
    assert base["output_tokens"] == result["output_tokens"], "greedy output is the same without speculation"
    assert result["speedup"] == pytest.approx(result["tokens_per_s"] / base["tokens_per_s"], rel=1e-2)


def test_repeats_time_each_run_and_count_every_repeat(setup):
    model, spec, prompts = setup
    once = evaluate(model, spec, prompts, [0.0], [2], max_tokens=16, num_prompts=None, baseline=True,
                    engine_kwargs=ENGINE)
    thrice = evaluate(model, spec, prompts, [0.0], [2], max_tokens=16, num_prompts=None, baseline=True,
                      engine_kwargs=ENGINE, repeats=3)
    assert thrice["repeats"] == 3
    for one, three in ((once["results"][0], thrice["results"][0]), (once["baseline"][0], thrice["baseline"][0])):
        # Greedy: every repeat generates what the single run did.
        assert three["output_tokens"] == 3 * one["output_tokens"]
        assert len(three["repeat_tokens_per_s"]) == 3
        assert three["tokens_per_s"] == pytest.approx(sorted(three["repeat_tokens_per_s"])[1], rel=1e-3)
        assert "repeat_tokens_per_s" not in one
    r1, r3 = once["results"][0], thrice["results"][0]
    assert (r3["num_steps"], r3["num_drafted"], r3["num_accepted"]) == (
        3 * r1["num_steps"], 3 * r1["num_drafted"], 3 * r1["num_accepted"])
    assert r3["mean_acceptance_length"] == pytest.approx(r1["mean_acceptance_length"])


def test_interleave_builds_every_engine_first_then_times_them_round_robin(setup, monkeypatch):
    import specserve.entrypoints.eval_acceptance as ev
    import specserve.llm

    model, spec, prompts = setup
    events = []

    class Recorded(specserve.llm.LLM):
        def __init__(self, *args, speculative_config=None, **kwargs):
            events.append(("build", None if speculative_config is None else speculative_config["num_speculative_tokens"]))
            super().__init__(*args, speculative_config=speculative_config, **kwargs)

    def recorded_run(llm, prompts, temperature, max_tokens, speculative):
        events.append(("run", llm.engine.config.speculative_config is not None, temperature))
        return timed_run(llm, prompts, temperature, max_tokens, speculative)

    timed_run = ev.timed_run
    monkeypatch.setattr(specserve.llm, "LLM", Recorded)
    monkeypatch.setattr(ev, "timed_run", recorded_run)
    both = evaluate(model, spec, prompts, [0.0], [2], max_tokens=16, num_prompts=None, baseline=True,
                    engine_kwargs=ENGINE, repeats=2, interleave=True)
    assert events == [("build", None), ("build", 2)] + [("run", False, 0.0), ("run", True, 0.0)] * 2
    monkeypatch.undo()
    apart = evaluate(model, spec, prompts, [0.0], [2], max_tokens=16, num_prompts=None, baseline=True,
                     engine_kwargs=ENGINE, repeats=2)
    assert both["interleaved"] and not apart["interleaved"]
    (r,), (b,) = both["results"], both["baseline"]
    # Greedy: the same tokens and acceptance whichever order the runs take.
    for key in ("output_tokens", "num_steps", "num_drafted", "num_accepted", "acceptance_per_position"):
        assert r[key] == apart["results"][0][key], key
    assert b["output_tokens"] == apart["baseline"][0]["output_tokens"]
    rounds = [x / y for x, y in zip(r["repeat_tokens_per_s"], b["repeat_tokens_per_s"])]
    assert r["round_speedups"] == pytest.approx(rounds, rel=1e-2)
    assert r["paired_speedup"] == pytest.approx(sorted(rounds)[0] / 2 + sorted(rounds)[1] / 2, rel=1e-2)
    assert "round_speedups" not in apart["results"][0], "rounds pair up only when interleaved"


def test_stats_sum_adds_runs_of_different_depths():
    short, deep = SpecDecodeStats(), SpecDecodeStats()
    short.record(2, 1)
    deep.record(4, 3)
    deep.record(4, 0)
    total = stats_sum([short, deep])
    assert (total.num_steps, total.num_drafted, total.num_accepted, total.num_emitted) == (3, 10, 4, 7)
    assert total.drafted_per_position == [3, 3, 2, 2] and total.accepted_per_position == [2, 1, 1, 0]


def test_stats_between_two_snapshots():
    before, after = SpecDecodeStats(), SpecDecodeStats()
    before.record(3, 1)
    after.record(3, 1)
    after.record(4, 4)
    after.record(2, 0)
    d = stats_between(before, after)
    assert (d.num_steps, d.num_drafted, d.num_accepted, d.num_emitted) == (2, 6, 4, 6)
    assert d.drafted_per_position == [2, 2, 1, 1] and d.accepted_per_position == [1, 1, 1, 1]


def test_command_prints_a_table_and_writes_json(setup, tmp_path, capsys):
    model, spec, prompts = setup
    out = tmp_path / "report.json"
    rc = main(["eval-acceptance", "--model", model, "--speculative-config", json.dumps(spec), "--prompts", prompts,
               "--k", "1", "3", "--temperature", "0", "1", "--max-tokens", "8", "--num-prompts", "2",
               "--max-model-len", "256", "--kv-cache-memory", KV_CACHE, "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "accept len" in table and "(no speculation)" in table
    report = json.loads(out.read_text())
    assert report["num_prompts"] == 2
    assert [(r["k"], r["temperature"]) for r in report["results"]] == [(1, 0.0), (1, 1.0), (3, 0.0), (3, 1.0)]
    for r in report["results"]:
        assert len(r["acceptance_per_position"]) == r["k"]
        assert r["mean_acceptance_length"] == pytest.approx(1 + r["num_accepted"] / r["num_steps"])


def test_interleaved_command_prints_each_rounds_speedup(setup, capsys):
    model, spec, prompts = setup
    rc = main(["eval-acceptance", "--model", model, "--speculative-config", json.dumps(spec), "--prompts", prompts,
               "--k", "2", "--temperature", "0", "--max-tokens", "8", "--num-prompts", "2", "--max-model-len", "256",
               "--kv-cache-memory", KV_CACHE, "--repeats", "3", "--interleave", "--json", "-"])
    assert rc == 0
    out = capsys.readouterr().out
    table, report = out.split("\n{", 1)
    (r,) = json.loads("{" + report)["results"]
    assert len(r["round_speedups"]) == 3
    assert f"speedup in each round {' '.join(f'{x:.2f}' for x in r['round_speedups'])}" in table


@pytest.mark.parametrize("args,message", [
    ([], "speculative_config: is required"),
    (["--speculative-config", "{oops"], "speculative_config: is not valid JSON"),
    (["--speculative-config", '{"method": "eagle3", "model": "/no/head"}'], "speculative_config.model"),
    (["--speculative-config", '{"method": "ngram"}', "--k", "0"], "speculative_config.num_speculative_tokens"),
    (["--speculative-config", '{"method": "ngram"}', "--temperature", "-1"], "temperature: got [-1.0]"),
    (["--speculative-config", '{"method": "ngram"}', "--repeats", "0"], "repeats: must be >= 1, got 0"),
])
def test_bad_arguments_fail_before_loading_anything(setup, capsys, args, message):
    model, _, prompts = setup
    assert main(["eval-acceptance", "--model", model, "--prompts", prompts] + args) == 2
    assert message in capsys.readouterr().err


def test_bad_prompt_file_names_the_line(setup, tmp_path, capsys):
    model, spec, _ = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt field"}\n')
    assert main(["eval-acceptance", "--model", model, "--speculative-config", json.dumps(spec),
                 "--prompts", str(bad)]) == 2
    assert "bad.jsonl:2: has fields ['text']" in capsys.readouterr().err


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("suite")
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"turns": ["The quick brown fox", "Again, slower.", "Once more."]},
        {"messages": [{"role": "user", "content": "Paged attention"}, {"role": "assistant", "content": "ignored"},
                      {"role": "user", "content": "Keys and values"}]}]))
    (root / "code.jsonl").write_text(json.dumps({"prompt": "def add(a, b):", "source": "written"}) + "\n")
    (root / "notes.txt").write_text("not a category")
    return str(root)


def played_by_hand(llm, dialogue, max_tokens):
    """Output tokens of a dialogue played turn by turn, each later turn after the model's own answer."""
    messages, tokens = list(dialogue.opening), 0
    for turn in (*dialogue.later_turns, None):
        (out,) = llm.generate([prompt_token_ids(llm, messages)], SamplingParams(temperature=0, max_tokens=max_tokens),
                              use_tqdm=False)
        tokens += len(out.outputs[0].token_ids)
        if turn is not None:
            messages += [{"role": "assistant", "content": out.outputs[0].text}, {"role": "user", "content": turn}]
    return tokens


def test_suite_reports_each_category_with_every_turn_played(setup, suite):
    from specserve.entrypoints.acceptance_suite import evaluate_suite
    from specserve.prompt_files import load_dialogues

    model, spec, _ = setup
    report = evaluate_suite(model, spec, suite, [0.0], [2], max_tokens=8, num_prompts=None, baseline=False,
                            engine_kwargs=ENGINE)
    assert [c["category"] for c in report["categories"]] == ["chat", "code"]
    chat, code = report["categories"]
    assert (chat["num_prompts"], chat["num_turns"], code["num_turns"]) == (2, 5, 1)
    for category in report["categories"]:
        llm = LLM(model, **ENGINE, speculative_config={**spec, "num_speculative_tokens": 2})
        tokens = sum(played_by_hand(llm, d, 8) for d in load_dialogues(category["prompts"]))
        (result,) = category["results"]
        want = llm.engine.spec_stats.as_dict()
        assert result["output_tokens"] == tokens
        for key in ("num_steps", "num_drafted", "num_accepted", "mean_acceptance_length"):
            assert result[key] == want[key], (category["category"], key)


def test_suite_command_prints_a_table_per_category_and_a_summary(setup, suite, tmp_path, capsys):
    model, spec, _ = setup
    out = tmp_path / "suite.json"
    rc = main(["eval-acceptance", "--model", model, "--speculative-config", json.dumps(spec), "--suite", suite,
               "--categories", "code", "chat", "--k", "1", "--temperature", "0", "1", "--max-tokens", "4",
               "--max-model-len", "256", "--kv-cache-memory", KV_CACHE, "--no-baseline",
               "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [c["category"] for c in report["categories"]] == ["code", "chat"]
    assert "== code: 1 prompts, 1 turns" in table and "== chat: 2 prompts, 5 turns" in table
    summary = table.split("mean acceptance length per category\n", 1)[1].splitlines()
    assert summary[0].split() == ["category", "k=1", "T=0", "k=1", "T=1"]
    for line, category in zip(summary[2:], report["categories"]):
        assert line.split() == [category["category"]] + [f"{r['mean_acceptance_length']:.2f}"
                                                         for r in category["results"]]


@pytest.mark.parametrize("args,message", [
    (["--suite", "/no/such/dir"], "suite: /no/such/dir is not a directory"),
    (["--suite", "SUITE", "--categories", "math"], "categories: ['math'] are not categories of"),
    (["--prompts", "PROMPTS", "--categories", "chat"], "categories: picks categories of a suite"),
    (["--suite", "SUITE", "--all-turns"], "all_turns: is for --prompts"),
])
def test_bad_suite_arguments_fail_before_loading_anything(setup, suite, capsys, args, message):
    model, _, prompts = setup
    args = [{"SUITE": suite, "PROMPTS": prompts}.get(x, x) for x in args]
    assert main(["eval-acceptance", "--model", model, "--speculative-config", '{"method": "ngram"}'] + args) == 2
    assert message in capsys.readouterr().err


def test_all_turns_plays_mt_benchs_second_turn(setup):
    model, spec, prompts = setup
    first = evaluate(model, spec, prompts, [0.0], [2], max_tokens=8, num_prompts=1, baseline=False,
                     engine_kwargs=ENGINE)
    both = evaluate(model, spec, prompts, [0.0], [2], max_tokens=8, num_prompts=1, baseline=False,
                    engine_kwargs=ENGINE, all_turns=True)
    llm = LLM(model, **ENGINE, speculative_config={**spec, "num_speculative_tokens": 2})
    from specserve.prompt_files import load_dialogues

    (dialogue,) = load_dialogues(prompts, limit=1)
    assert both["results"][0]["output_tokens"] == played_by_hand(llm, dialogue, 8)
    assert first["results"][0]["output_tokens"] < both["results"][0]["output_tokens"]
