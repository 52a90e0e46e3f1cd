"""The loading bar counts the tensors it loads, out of the total, and stays on screen with the count."""
from __future__ import annotations

from specserve.models.loader import hf_named_weights, open_model_source


def test_the_bar_counts_every_tensor_of_a_directory(tiny_llama, capsys):
    path, hf = tiny_llama
    names = [name for name, _ in hf_named_weights(open_model_source(str(path)))]
    # Every tensor transformers saved, once.
    assert sorted(names) == sorted(hf.state_dict())
    last = capsys.readouterr().err.split("\r")[-1]
    assert last.startswith(f"Loading {path.name}: 100%") and f"| {len(names)}/{len(names)} [" in last
