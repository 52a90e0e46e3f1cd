"""benchmarks/fp8_accuracy.py runs and prints its table: on the tiny model in float32, the unquantized row agrees
with its own engine and its perplexities are the reference; the FP8 row's figures are shares and ratios of them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from specserve.bench.fidelity import positionwise_agreement, prefix_agreement

ROOT = Path(__file__).resolve().parents[2]


def test_agreement_up_to_the_first_difference_and_by_position():
    reference = [[1, 2, 3, 4], [5, 6]]
    changed = [[1, 9, 3, 4], [5, 6]]  # parts at the second token, then holds the same tokens again
    assert prefix_agreement(reference, changed) == 3 / 6
    assert positionwise_agreement(reference, changed) == 5 / 6


def test_the_table_has_an_unquantized_and_an_fp8_row(tiny_llama, tmp_path):
    path, _ = tiny_llama
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("Hello there", "Numbers: 1 2 3", "abc")))
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_accuracy.py"), "--model", str(path),
                           "--prompts", str(prompts), "--max-tokens", "8", "--texts", str(text), "--device", "cpu",
                           "--dtype", "float32", "--max-model-len", "256", "--weight-groups", "0"], env=env, capture_output=True, text=True, timeout=600, check=True)
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in done.stdout.splitlines() if r.startswith("| float32") or r.startswith("| fp8")
            or r.startswith("| e4m3")}
    assert set(rows) == {"float32", "fp8", "e4m3 weights, scale per channel"}, done.stdout
    assert 0 <= float(rows["e4m3 weights, scale per channel"][0]) <= 1
    reference, fp8 = rows["float32"], rows["fp8"]
    # Teacher-forced in one pass and through the decode path: the unquantized model against its own engine.
    assert all(float(x) >= 0.9 for x in reference[0].split(" / ")) and len(reference[0].split(" / ")) == 2
    assert reference[1] == "1.0000 / 1.0000" and reference[2].endswith("(+0.00%)")
    assert all(0 <= float(x) <= 1 for x in fp8[0].split(" / ") + fp8[1].split(" / "))
    assert float(fp8[2].split()[0]) > 0


def test_finer_weight_scales_round_closer_and_a_group_must_divide_k():
    import importlib.util

    import pytest
    import torch

    spec = importlib.util.spec_from_file_location("fp8_accuracy", ROOT / "benchmarks" / "fp8_accuracy.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def model():
        torch.manual_seed(0)
        outer = torch.nn.Module()
        outer.model = torch.nn.Module()
        outer.model.layers = torch.nn.ModuleList([torch.nn.Linear(64, 32, bias=False)])
        # Weights along K of sizes a million apart, past e4m3's range under one scale a channel.
        outer.model.layers[0].weight.data *= torch.logspace(-6, 0, 64)
        return outer

    exact = model().model.layers[0].weight.detach().double()
    errors = {}
    for group in (0, 16):
        m = model()
        script.round_weights_to_e4m3(m, group)
        errors[group] = ((m.model.layers[0].weight.double() - exact).abs() / exact.abs()).mean().item()
    assert 0 < errors[16] < errors[0] / 2
    with pytest.raises(SystemExit, match="not a multiple"):
        script.round_weights_to_e4m3(model(), 24)
