"""train-eagle end to end on a tiny random target: the loss falls, the head it writes serves losslessly
through our loader with far better acceptance than an untrained one, and resuming equals not stopping."""
from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

from conftest import CORPUS, make_hf_model
from single_thread import one_thread  # noqa: F401  (autouse)
from specserve import LLM, SamplingParams
from specserve.entrypoints.cli import main
from specserve.errors import ConfigError
from specserve.models.arch_config import ArchConfig
from specserve.models.loader import load_tokenizer, open_model_source, safetensors_weights
from specserve.prompt_files import load_prompt_file, prompt_token_ids
from specserve.train.batches import collate
from specserve.train.config import SEQUENCES_NAME, TrainConfig
from specserve.train.data import generate_data, load_sequences, run_requests
from specserve.train.export import export_head, hf_tensors
from specserve.train.pipeline import draft_vocab, make_trainer, train_eagle3
from specserve.train.questions import topic_mix, vocabulary_words
from specserve.train.request_templates import templated_requests
from specserve.train.ttt import unroll
from specserve.train.vocab import build_draft_vocab

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# A KV pool sized for these tests rather than the default 2 GB, which takes seconds to allocate.
ENGINE = {"max_model_len": 96, "num_kv_blocks": 256}


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    path = tmp_path_factory.mktemp("target")
    make_hf_model(path, tokenizer_dir, "llama", seed=3, num_hidden_layers=4)
    return path


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    sentences = sorted(set(CORPUS))
    rows = [{"prompt": " ".join(s.split()[: 2 + i % 4])} for i, s in enumerate(sentences * 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(target, out, **kw) -> TrainConfig:
    # Follow-ups only where a test asks for them: at max_seq_len 96 few would fit, and counts would blur.
    base = dict(target=str(target), out=str(out), num_prompts=18, max_new_tokens=24, max_seq_len=96,
                follow_up_fraction=0.0, max_num_seqs=32, kv_cache_memory=10 << 20, data_seconds=None,
                draft_vocab_size=200, epochs=12, batch_size=4, lr=5e-3, ttt_steps=3, val_fraction=0.2,
                train_seconds=None, save_every=5, device="cpu", progress=False, soft_labels=False, document_prompts=0)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target, prompt_file):
    out = tmp_path_factory.mktemp("run") / "head"
    cfg = config(target, out, prompts=str(prompt_file))
    return cfg, train_eagle3(cfg)


def trainer_for(cfg: TrainConfig, data_dir: str | None = None):
    """(trainer for a fresh head, or cfg.init_from's, head config, draft vocabulary) over the data a run wrote
    to data_dir (default cfg.work_dir), built as the pipeline builds them."""
    sequences_path = Path(data_dir or cfg.work_dir) / SEQUENCES_NAME
    sequences = load_sequences(sequences_path)
    arch = ArchConfig.from_hf_config(open_model_source(cfg.target).hf_config)
    vocab = draft_vocab(cfg, sequences, arch.vocab_size)
    digest = hashlib.sha256(sequences_path.read_bytes()).hexdigest()
    trainer, head_config = make_trainer(cfg, arch, cfg.aux_layers or (2, 2, 1), sequences, vocab, digest)
    return trainer, head_config, vocab


def test_run_writes_a_loadable_head_and_reports_each_phase(trained):
    cfg, summary = trained
    assert [f.name for f in summary.files] == ["model.safetensors"]
    assert set(summary.seconds) == {"data", "vocab", "training", "export"}
    assert summary.data.prompts == 18 and summary.data.sequences == 18 + 9
    assert summary.steps == 12 * -(-(27 - 5) // 4)
    head_cfg = json.loads((summary.out / "config.json").read_text())
    assert head_cfg["specserve_training"]["steps"] == summary.steps
    assert len(summary.validation.accuracy) == cfg.ttt_steps


@pytest.mark.parametrize("soft_labels,warm_start", [(False, False), (True, False), (False, True)])
def test_loss_falls(trained, tmp_path, soft_labels, warm_start):
    cfg, _ = trained
    trainer = trainer_for(config(cfg.target, tmp_path / "head", steps=40, soft_labels=soft_labels,
                                 warm_start=warm_start), data_dir=cfg.work_dir)[0]
    losses = [trainer.train_step([trainer.train_set[i] for i in range(k % 5, k % 5 + 4)]).read()[0]
              for k in range(40)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, losses


def test_trained_head_is_lossless_and_accepts_far_more_than_an_untrained_one(trained, tmp_path):
    cfg, summary = trained
    untrained, head_config, vocab = trainer_for(config(cfg.target, tmp_path / "x"), data_dir=cfg.work_dir)
    export_head(tmp_path / "untrained", untrained.head, vocab, head_config, cfg.max_shard_bytes)
    plain = LLM(cfg.target, **ENGINE)
    # The prompts as the data saw them: through the chat template.
    prompts = [prompt_token_ids(plain, c) for c in load_prompt_file(cfg.prompts)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    lengths = {}
    for name, path in (("trained", summary.out), ("untrained", tmp_path / "untrained")):
        llm = LLM(cfg.target, **ENGINE,
                  speculative_config={"method": "eagle3", "model": str(path), "num_speculative_tokens": 3})
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == want, name
        lengths[name] = llm.engine.spec_stats.mean_acceptance_length
    assert lengths["trained"] > lengths["untrained"] + 0.5, lengths


def test_engine_accepts_exactly_what_the_training_forward_predicts(trained):
    """Walk each greedy answer as the drafter does (a chain at the last accepted token, drafts kept while they
    equal the target's tokens) using the training forward's predictions: the engine's counts must be the same."""
    cfg, summary = trained
    trainer, _, _ = trainer_for(cfg)
    assert trainer.resume()
    with torch.no_grad():
        for name, p in trainer.head.named_parameters():  # the exported weights are bfloat16
            p.copy_(p.to(torch.bfloat16).float())
    greedy = [s for s in load_sequences(Path(cfg.work_dir) / SEQUENCES_NAME) if s.temperature == 0]
    k, steps, accepted = 3, 0, [0, 0, 0]
    for seq in greedy:
        batch = collate([seq])
        with torch.no_grad():
            normed = list(unroll(trainer.head, trainer.features(batch).aux, batch.ids, k))
        drafts = [trainer.draft_to_target[trainer.head.lm_head(h).argmax(-1)].tolist() for h in normed]
        ids, p = seq.ids, len(seq.prompt_ids) - 1
        while p + 2 < len(ids):
            steps += 1
            a = 0
            while a < k and p + a + 2 < len(ids) and drafts[a][p] == ids[p + a + 2]:
                accepted[a] += 1
                a += 1
            p += a + 1
    llm = LLM(cfg.target, **ENGINE,
              speculative_config={"method": "eagle3", "model": str(summary.out), "num_speculative_tokens": k})
    outs = llm.generate([s.prompt_ids for s in greedy], SamplingParams(temperature=0, max_tokens=cfg.max_new_tokens),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [s.response_ids for s in greedy]
    stats = llm.engine.spec_stats
    assert sum(accepted) > 0
    assert (stats.num_steps, stats.accepted_per_position) == (steps, accepted)


def test_resuming_from_a_checkpoint_equals_training_without_a_stop(trained, tmp_path):
    cfg, _ = trained

    def fresh(name: str, **kw):
        return trainer_for(config(cfg.target, tmp_path / name, steps=12, **kw), data_dir=cfg.work_dir)[0]

    straight = fresh("a")
    straight.run()
    stopped = fresh("b")
    stopped.run(max_steps=7)
    resumed = fresh("b")
    assert resumed.resume() and resumed.step == 7
    resumed.run()
    assert resumed.step == straight.step == 12
    assert resumed.schedule == straight.schedule
    for (name, a), b in zip(straight.head.named_parameters(), resumed.head.parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(straight.optimizer.state_dict()["state"][1]["exp_avg"],
                       resumed.optimizer.state_dict()["state"][1]["exp_avg"])


def test_command_with_resume_reuses_the_data_and_the_finished_checkpoint(trained, capsys):
    cfg, summary = trained
    weights = (summary.out / "model.safetensors").read_bytes()
    args = ["train-eagle", "--resume", "--no-progress"]
    for f in fields(TrainConfig):
        value, flag = getattr(cfg, f.name), f.name.replace("_", "-")
        if isinstance(value, bool):
            args += [] if f.name in ("resume", "progress") else ["--" + ("" if value else "no-") + flag]
        elif value is not None:
            args += ["--" + flag, str(value)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"data: reused {summary.num_sequences} answers" in out and f"; {summary.steps} steps" in out
    assert (summary.out / "model.safetensors").read_bytes() == weights


def test_a_run_trains_on_the_joined_data_of_data_only_runs(target, prompt_file, tmp_path):
    parts = [train_eagle3(config(target, tmp_path / f"part{seed}", prompts=str(prompt_file), data_only=True,
                                 seed=seed, num_prompts=6 + seed))
             for seed in (1, 2)]
    dirs = tuple(str(p.out) for p in parts)
    head = train_eagle3(config(target, tmp_path / "head", data_from=dirs, steps=4))
    assert head.data is None and head.steps == 4
    joined = load_sequences(tmp_path / "head.work" / SEQUENCES_NAME)
    assert joined == load_sequences(parts[0].out / SEQUENCES_NAME) + load_sequences(parts[1].out / SEQUENCES_NAME)
    assert head.num_sequences == len(joined) == parts[0].num_sequences + parts[1].num_sequences
    with pytest.raises(ConfigError, match="--resume"):
        config(target, tmp_path / "head", data_from=dirs, resume=True)
    with pytest.raises(ConfigError, match="hold no sequences.jsonl"):
        config(target, tmp_path / "head", data_from=(str(tmp_path),))


def test_data_only_then_resume_trains_on_that_data(target, prompt_file, tmp_path):
    data = train_eagle3(config(target, tmp_path / "head", prompts=str(prompt_file), data_only=True))
    assert data.files == [] and data.steps == 0 and data.data.sequences == data.num_sequences > 0
    assert (data.out / SEQUENCES_NAME).is_file() and not (tmp_path / "head").exists()
    head = train_eagle3(config(target, tmp_path / "head", prompts=str(prompt_file), resume=True, steps=4))
    assert head.data is None and head.num_sequences == data.num_sequences and head.steps == 4
    assert (tmp_path / "head" / "config.json").is_file()


def test_resume_refuses_a_checkpoint_of_other_settings(trained, tmp_path):
    cfg, _ = trained
    first = trainer_for(config(cfg.target, tmp_path / "a", steps=4), data_dir=cfg.work_dir)[0]
    first.run()
    other = trainer_for(config(cfg.target, tmp_path / "a", steps=4, lr=1e-3), data_dir=cfg.work_dir)[0]
    with pytest.raises(ConfigError, match=r"resume: .* made with lr=0.005, this run has 0.001"):
        other.resume()


def test_a_time_budget_shrinks_the_plan_once_the_pace_is_known(trained, tmp_path):
    cfg, _ = trained
    tight = trainer_for(config(cfg.target, tmp_path / "a", steps=100, train_seconds=1e-3), data_dir=cfg.work_dir)[0]
    tight.run()
    # The pace is measured over steps 3..23; nothing more fits, so the plan ends one step later.
    assert tight.schedule.fitted and tight.step == tight.schedule.total_steps == 24
    roomy = trainer_for(config(cfg.target, tmp_path / "b", steps=30, train_seconds=1e6), data_dir=cfg.work_dir)[0]
    roomy.run()
    assert roomy.schedule.fitted and roomy.step == roomy.schedule.total_steps == 30


def test_init_from_continues_the_exported_head_with_its_vocabulary_and_layers(trained, target, tmp_path):
    """A run from an exported head starts with that head's weights (as served: bfloat16), draft vocabulary
    and auxiliary layers, whatever its own data would choose, and records where it started."""
    cfg, summary = trained
    source = json.loads((summary.out / "config.json").read_text())
    # Other data: greedy answers to other prompts than the source head's, so a vocabulary chosen afresh differs.
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"prompt": f"{w} {w}"}) + "\n" for w in ("cold", "river", "ninety", "sand")))
    follow = config(target, tmp_path / "next", prompts=str(other), init_from=str(summary.out), sampled_fraction=0.0,
                    steps=3, draft_vocab_size=None)
    assert follow.draft_vocab_size == source["draft_vocab_size"]
    assert follow.aux_layers == tuple(source["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    data = train_eagle3(replace(follow, data_only=True, init_from=None, draft_vocab_size=cfg.draft_vocab_size,
                                aux_layers=None))
    sequences = load_sequences(data.out / SEQUENCES_NAME)
    arch = ArchConfig.from_hf_config(open_model_source(cfg.target).hf_config)
    fresh = build_draft_vocab([s.response_ids for s in sequences], arch.vocab_size, cfg.draft_vocab_size)

    continued, _, vocab = trainer_for(follow)
    exported = dict(safetensors_weights(summary.out))
    want = exported["d2t"] + torch.arange(exported["d2t"].numel())
    assert torch.equal(vocab.draft_to_target, want) and not torch.equal(fresh.draft_to_target, want)
    assert torch.equal(continued.head.d2t, exported["d2t"])
    for name, tensor in hf_tensors(continued.head, vocab).items():
        assert torch.equal(tensor, exported[name]), name
    # The source head scores the same on any data whether it is read back from its export or continued.
    source_trainer = trainer_for(replace(cfg, out=str(tmp_path / "src")), data_dir=cfg.work_dir)[0]
    source_trainer.head.load_weights(safetensors_weights(summary.out))
    continued_on_source = trainer_for(replace(follow, out=str(tmp_path / "c2")), data_dir=cfg.work_dir)[0]
    assert source_trainer.evaluate(source_trainer.val_set) == continued_on_source.evaluate(source_trainer.val_set)

    run = train_eagle3(replace(follow, resume=True))
    written = json.loads((run.out / "config.json").read_text())
    assert run.steps == 3 and written["draft_vocab_size"] == source["draft_vocab_size"]
    assert written["specserve_training"]["init_from"] == {"head": str(summary.out), **source["specserve_training"]}
    assert torch.equal(dict(safetensors_weights(run.out))["d2t"], exported["d2t"])


def test_init_from_a_narrower_head_widens_it_computing_the_same_then_serves_losslessly(trained, tmp_path):
    """A wider MLP than the initial head's: its units keep their weights and the new ones start silent, so the
    head scores exactly as before; training then uses the new units, and the engine serves the wider head."""
    cfg, summary = trained
    width = json.loads((summary.out / "config.json").read_text())["intermediate_size"]
    wide_cfg = config(cfg.target, tmp_path / "wide", init_from=str(summary.out), draft_vocab_size=None,
                      head_intermediate_size=2 * width, steps=6)
    wide, wide_config, _ = trainer_for(wide_cfg, data_dir=cfg.work_dir)
    assert wide_config["intermediate_size"] == 2 * width
    same = trainer_for(replace(wide_cfg, head_intermediate_size=width, out=str(tmp_path / "same")),
                       data_dir=cfg.work_dir)[0]
    # Summing over twice the units reorders float32 sums, nothing more.
    before, after = same.evaluate(same.val_set), wide.evaluate(same.val_set)
    assert after.accuracy == before.accuracy
    assert after.loss == pytest.approx(before.loss, rel=1e-5)
    down = wide.head.layer.mlp.down_proj.weight
    assert torch.count_nonzero(down[:, width:]) == 0 and torch.count_nonzero(down[:, :width]) > 0
    wide.run()
    assert torch.count_nonzero(down[:, width:]) > 0.9 * down[:, width:].numel()

    work = tmp_path / "served.work"
    work.mkdir()
    shutil.copy(Path(cfg.work_dir) / SEQUENCES_NAME, work)
    out = train_eagle3(replace(wide_cfg, out=str(tmp_path / "served"), work_dir=str(work), resume=True))
    assert json.loads((out.out / "config.json").read_text())["intermediate_size"] == 2 * width
    plain = LLM(cfg.target, **ENGINE)
    prompts = [prompt_token_ids(plain, c) for c in load_prompt_file(cfg.prompts)][:6]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(cfg.target, **ENGINE,
              speculative_config={"method": "eagle3", "model": str(out.out), "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert llm.engine.spec_stats.mean_acceptance_length > 1.5


@pytest.mark.parametrize("kw,field,message", [
    (dict(head_intermediate_size=8), "head_intermediate_size", "can only widen it"),
    (dict(warm_start=True), "warm_start", "give one of them"),
    (dict(draft_vocab_size=64), "draft_vocab_size", "drafts from 200 tokens"),
    (dict(aux_layers=(0, 1, 2)), "aux_layers", "reads target layers"),
])
def test_settings_an_initial_head_fixes_must_agree_with_it(trained, tmp_path, kw, field, message):
    cfg, summary = trained
    with pytest.raises(ConfigError, match=message) as e:
        config(cfg.target, tmp_path / "h", init_from=str(summary.out), **kw)
    assert e.value.field == field


def test_an_initial_head_must_be_an_eagle3_head_of_this_target(target, tmp_path, capsys):
    with pytest.raises(ConfigError, match="neither a shipped head nor a directory with a config.json") as e:
        config(target, tmp_path / "h", init_from=str(tmp_path / "missing"))
    assert e.value.field == "init_from"
    with pytest.raises(ConfigError, match="not an EAGLE-3 head"):
        config(target, tmp_path / "h", init_from=str(target))
    # The shipped head is SmolLM2's: 576 wide, where the tiny target is not.
    args = ["train-eagle", "--target", str(target), "--out", str(tmp_path / "h"), "--device", "cpu",
            "--init-from", "smollm2-135m-eagle3"]
    assert main(args) == 2
    assert "it was trained for another target" in capsys.readouterr().err
    assert not (tmp_path / "h.work").exists()


def test_the_target_writes_its_own_prompts_then_follows_up_on_its_answers(target, tmp_path):
    cfg = config(target, tmp_path / "head", num_prompts=6, max_new_tokens=8, max_seq_len=320, sampled_fraction=0.0,
                 follow_up_fraction=1.0, word_topic_fraction=0.5)
    sequences, stats = generate_data(cfg, tmp_path / "work")
    written = load_prompt_file(tmp_path / "work" / "prompts.jsonl")
    assert stats.prompts == len(written) > 3
    # Half from hand-written templates, the rest written by the target.
    tokenizer = load_tokenizer(open_model_source(str(target)))
    topics = topic_mix(vocabulary_words(tokenizer), 6, cfg.word_topic_fraction, cfg.seed)
    assert set(templated_requests(3, cfg.seed, topics)) <= {c[0]["content"] for c in written}
    assert all(len(c[0]["content"].split()) >= 4 for c in written)
    assert all(0 < len(s.response_ids) <= 8 and s.temperature == 0.0 for s in sequences)
    first, second = sequences[:stats.prompts], sequences[stats.prompts:]
    assert 0 < stats.follow_ups == len(second) <= len(first) and stats.sequences == len(sequences)
    # Every second-round prompt quotes a first-round answer (as the assistant's turn or as a passage).
    # The random target writes stray bytes, which decode and re-encode differently: compare their printable ASCII.

    def text(ids: list[int]) -> str:
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        return "".join(ch for ch in decoded if ch.isascii() and ch.isprintable() and not ch.isspace())

    answers = [text(s.response_ids) for s in first]
    assert all(any(a and a in text(s.prompt_ids) for a in answers) for s in second)
    plain, _ = generate_data(config(target, tmp_path / "head", num_prompts=6, max_new_tokens=8, max_seq_len=320,
                                    sampled_fraction=0.0), tmp_path / "plain")
    assert len(plain) == stats.prompts
    with pytest.raises(ConfigError, match="max_seq_len: 64 tokens leave no room to ask the target for prompts"):
        generate_data(config(target, tmp_path / "head", max_seq_len=64), tmp_path / "work")


def test_data_budget_spent_aborts_what_is_unfinished(target):
    llm = LLM(str(target), **ENGINE)
    outs = run_requests(llm, [[5, 6, 7]] * 3, [GREEDY] * 3, deadline=0.0, desc="test", progress=False)
    assert outs == [None, None, None]
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kw,field", [
    (dict(lr=0), "lr"), (dict(batch_size=0), "batch_size"), (dict(sampled_fraction=1.5), "sampled_fraction"),
    (dict(follow_up_fraction=-0.1), "follow_up_fraction"),
    (dict(val_fraction=0.5), "val_fraction"), (dict(ttt_steps=0), "ttt_steps"), (dict(data_seconds=-1), "data_seconds"),
    (dict(prompts="/no/such.jsonl"), "prompts"), (dict(dtype="int8"), "dtype"), (dict(aux_layers=(-1,)), "aux_layers"),
    (dict(data_only=True, resume=True), "data_only"),
])
def test_bad_settings_name_their_field(tmp_path, kw, field):
    with pytest.raises(ConfigError) as e:
        config("smollm2-135m", tmp_path / "head", **kw)
    assert e.value.field == field


def test_settings_the_target_rules_out_fail_before_any_work(target, tmp_path, capsys):
    args = ["train-eagle", "--target", str(target), "--out", str(tmp_path / "h"), "--device", "cpu"]
    assert main(args + ["--aux-layers", "1", "9"]) == 2
    assert "aux_layers: (1, 9) are not all layers of the 4-layer target" in capsys.readouterr().err
    assert main(args + ["--draft-vocab-size", "100000"]) == 2
    assert "exceeds the target's vocabulary" in capsys.readouterr().err
    assert main(args + ["--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl is not a file" in capsys.readouterr().err
    assert not (tmp_path / "h.work").exists()


def test_long_document_requests_are_answered_beside_the_prompts(target, prompt_file, tmp_path):
    cfg = config(target, tmp_path / "head", prompts=str(prompt_file), num_prompts=4, max_new_tokens=8,
                 max_seq_len=512, sampled_fraction=0.0, document_prompts=3)
    sequences, stats = generate_data(cfg, tmp_path / "work")
    assert (stats.prompts, stats.documents, stats.sequences) == (7, 3, 7)
    plain = LLM(str(target), **{**ENGINE, "max_model_len": 512})
    file_prompts = {tuple(prompt_token_ids(plain, c)) for c in load_prompt_file(prompt_file, limit=4)}
    long = [s for s in sequences if tuple(s.prompt_ids) not in file_prompts]
    assert len(long) == 3 and all(300 <= len(s.prompt_ids) <= 504 and s.response_ids for s in long)
