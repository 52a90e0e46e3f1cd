"""`specserve bench decode` on the CPU: the tiny preset end to end, the full preset's plan, dummy weights."""
from __future__ import annotations

import json

import pytest
import torch

from specserve.attention.backend import get_attention_backend
from specserve.bench.cli import config_from_args
from specserve.bench.decode import run_decode_bench
from specserve.bench.decode_plan import EngineJob, HFJob, SpecSetting, plan, preset_config
from specserve.bench.models import build_hf_model, distinct_params, prepare_model
from specserve.entrypoints.cli import build_parser
from specserve.engine import core
from specserve.engine.step_costs_measure import measured_batch_sizes
from specserve.errors import ConfigError
from specserve.models.loader import build_model, open_model_source
from specserve.spec_decode.step_costs import StepCosts

from scripted_policy import timed_by_costs


def test_dummy_load_makes_the_shape_without_weight_files(tmp_path):
    model = prepare_model("tiny", tmp_path, torch.float32)
    assert not list(tmp_path.rglob("*.safetensors"))
    ours, arch = build_model(open_model_source(model.path), torch.bfloat16, "cpu", get_attention_backend("torch"),
                             load_format="dummy", seed=1)
    hf = build_hf_model(model, torch.bfloat16, "cpu")
    assert distinct_params(ours) == distinct_params(hf)
    assert ours.model.layers[0].self_attn.qkv_proj.weight.shape == (
        (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim, arch.hidden_size)
    assert ours.lm_head.weight.shape == (arch.vocab_size, arch.hidden_size)
    for name, p in ours.named_parameters():
        assert p.dtype == torch.bfloat16, name
        if p.dim() == 1:
            assert torch.all(p == 1), name
        else:
            assert abs(p.float().std().item() - 0.02) < 0.005, name
    again, _ = build_model(open_model_source(model.path), torch.bfloat16, "cpu", get_attention_backend("torch"),
                           load_format="dummy", seed=1)
    assert torch.equal(again.model.embed_tokens.weight, ours.model.embed_tokens.weight)


def test_tiny_preset_rows_json_and_markdown(tmp_path):
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    results = run_decode_bench(preset_config("tiny"), js, md)
    got = {(r.system, r.mode, r.spec, r.batch) for r in results.rows}
    assert got == {(system, mode, spec, b) for b in (1, 4) for system, mode, spec in
                   [("specserve", "NONE", "none"), ("specserve", "NONE", "eagle3 k=2 p=0.8"),
                    ("transformers", "eager", "none")]}
    assert all(r.error is None and r.tok_s > 0 for r in results.rows)
    data = json.loads(js.read_text())
    assert data["bandwidth_bytes_s"] > 0 and data["models"]["tiny"]["weight_bytes"] > 0
    for row in data["rows"]:
        assert row["ms_per_token"] > 0
        if row["system"] == "specserve":
            assert row["x_transformers"] > 0
        if row["spec"] == "none":
            assert row["limit_tok_s"] > 0 and row["x_no_spec"] is None
        else:
            assert row["x_no_spec"] > 0 and 1.0 <= row["accept_len"] <= 3.0
    assert [e["spec"] for e in data["engines"]] == ["none", "eagle3 k=2 p=0.8"]
    assert all(e["build_s"] > 0 for e in data["engines"])
    table = md.read_text()
    assert "| system | graph mode | speculation | batch | tok/s |" in table
    assert table.count("| specserve | NONE |") == 4 and table.count("| transformers | eager |") == 2


def test_a_failing_model_leaves_the_others_measured(tmp_path):
    cfg = preset_config("tiny", models=["tiny", str(tmp_path / "missing")], spec=[], hf_batch_sizes=[],
                        batch_sizes=[1], mode_batch_sizes=[1])
    rows = run_decode_bench(cfg).rows
    assert [(r.model, r.tok_s is not None) for r in rows] == [("tiny", True), (str(tmp_path / "missing"), False)]
    assert "ModelLoadError" in rows[1].error


def test_full_preset_plan():
    cfg = preset_config("full")
    jobs = plan(cfg)
    engines = [j for j in jobs if isinstance(j, EngineJob)]
    assert len(engines) == 2 * (5 + 4) and sum(isinstance(j, HFJob) for j in jobs) == 2
    # Most wanted first: each model's default-mode sweep (the engine's own capture sizes) and transformers.
    first = jobs[0]
    assert (first.model, first.mode, first.spec, first.capture_sizes) == ("llama3-8b", "FULL_AND_PIECEWISE", None, None)
    assert first.batch_sizes == (1, 8, 32, 64, 128, 256)
    assert jobs[1] == HFJob("llama3-8b", (1, 64))
    spec = next(j for j in engines if j.spec == SpecSetting(5, 0.8) and j.model == "smollm2-135m")
    assert spec.batch_sizes == (1, 8, 64) and spec.capture_sizes == (1, 6, 8, 48, 64, 384)
    none = next(j for j in engines if j.mode == "NONE")
    assert none.capture_sizes is None and none.batch_sizes == (1, 64)
    assert {j.mode for j in engines} == {"NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"}


def test_cli_overrides_the_preset():
    args = build_parser().parse_args(["bench", "decode", "--preset", "tiny", "--spec", "3:0.6,5:0.8",
                                      "--model", "other.gguf", "--batch-sizes", "2,8", "--hf-batch-sizes", ""])
    cfg = config_from_args(args)
    assert cfg.models == ["tiny", "other.gguf"] and cfg.device == "cpu"
    assert cfg.spec == [SpecSetting(3, 0.6), SpecSetting(5, 0.8)]
    assert cfg.batch_sizes == [2, 8] and cfg.hf_batch_sizes == []


def test_fp8_kv_cache_and_weights_run_every_engine_with_them(tmp_path, monkeypatch):
    from specserve.worker.kv_layout import KVCaches

    dtypes = []
    allocate = KVCaches.allocate
    monkeypatch.setattr(KVCaches, "allocate", lambda self, n: dtypes.append(self.dtype) or allocate(self, n))
    args = build_parser().parse_args(["bench", "decode", "--preset", "tiny", "--kv-cache-dtype", "fp8",
                                      "--quantization", "fp8", "--batch-sizes", "1", "--spec-batch-sizes", "1",
                                      "--hf-batch-sizes", ""])
    md = tmp_path / "r.md"
    results = run_decode_bench(config_from_args(args), markdown_path=md)
    assert all(r.error is None and r.tok_s > 0 for r in results.rows)
    assert len(results.engines) == 2 and dtypes and set(dtypes) == {torch.float8_e4m3fn}
    assert "float32, KV cache fp8, weights fp8;" in md.read_text()


@pytest.mark.parametrize("overrides, field", [
    (dict(kv_cache_dtype="fp16"), "bench.kv_cache_dtype"),
    (dict(modes=["FULL"]), "bench.modes"),
    (dict(default_mode="EAGER"), "bench.modes"),
    (dict(new_tokens=1), "bench.new_tokens"),
    (dict(batch_sizes=[0]), "bench.batch_sizes"),
    (dict(capture_sizes="some"), "bench.capture_sizes"),
])
def test_bad_settings_are_refused(overrides, field):
    with pytest.raises(ConfigError) as e:
        preset_config("tiny", **overrides)
    assert e.value.field == field


def test_spec_setting_parse():
    assert SpecSetting.parse("3:0.8") == SpecSetting(3, 0.8)
    assert SpecSetting.parse("3:0.8:dynamic") == SpecSetting(3, 0.8, dynamic=True)
    assert SpecSetting(3, 0.8, dynamic=True).label == "eagle3 k=3 p=0.8 dynamic"
    for bad in ("3", "x:0.5", "3:1.5", "0:0.5", "3:0.8:sometimes"):
        with pytest.raises(ConfigError):
            SpecSetting.parse(bad)


def test_the_dynamic_policy_beside_no_speculation(tmp_path, monkeypatch):
    """The sweep the H100 runs (docs/design.md, 'Dynamic speculation'), tiny: each row of the dynamic policy beside
    no speculation at the same batch, with the share of its steps that drafted."""
    # Drafting steps 50% slower at every batch size. The start-up measurement (tested in
    # tests/spec_decode/test_dynamic_speculation.py) is left out: on a busy CPU its few steps of a tiny model can
    # find drafting no dearer than decoding, and then drafts that are never accepted cost nothing to the policy.
    def slower_drafting(engine):
        sizes = measured_batch_sizes(engine.config.max_num_seqs)
        k = engine.scheduler.policy.max_drafts
        return StepCosts(sizes, {0: tuple(1e-3 * b for b in sizes), k: tuple(1.5e-3 * b for b in sizes)})

    monkeypatch.setattr(core, "measure_step_costs", slower_drafting)
    # Each measured step takes those seconds too: one noisy comparison would keep a bucket drafting.
    timed_by_costs(monkeypatch)
    cfg = preset_config("tiny", spec=[SpecSetting(2, 0.0, dynamic=True)], hf_batch_sizes=[], new_tokens=48)
    results = run_decode_bench(cfg, tmp_path / "r.json")
    rows = {(r.spec, r.batch): r for r in results.rows}
    assert set(rows) == {(spec, b) for spec in ("none", "eagle3 k=2 p=0 dynamic") for b in (1, 4)}
    assert all(r.error is None and r.tok_s > 0 for r in rows.values())
    data = json.loads((tmp_path / "r.json").read_text())
    dynamic = [row for row in data["rows"] if row["spec"] != "none"]
    assert all(row["x_no_spec"] > 0 and 0.0 <= row["drafting_share"] <= 1.0 for row in dynamic)
    # No draft is ever accepted: drafting is measured slower at every batch size and dropped after its first
    # probe.
    assert dynamic[-1]["drafting_share"] < 0.5
