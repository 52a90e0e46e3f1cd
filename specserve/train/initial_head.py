"""An exported head to continue training from (`--init-from`): a run then fine-tunes it on new data.

Training is bounded by the time a run gets, so a head improves most by
adding runs: each one starts where the last head ended rather than from
noise. The new run keeps what the head was built with, its draft vocabulary
and the target layers it reads, since its weights only mean something over
those.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.errors import ConfigError


@dataclass(frozen=True)
class InitialHead:
    name: str  # as given: a shipped head's name or a directory
    path: Path
    config: dict

    @classmethod
    def open(cls, name: str) -> InitialHead:
        """A shipped head's name or an exported head's directory; ConfigError (field init_from) otherwise."""
        from specserve.heads import resolve_head

        path = Path(resolve_head(name)).expanduser()
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConfigError("init_from", f"{name} is neither a shipped head nor a directory with a config.json; "
                              "give a head that train-eagle wrote (its --out)")
        config = json.loads(config_file.read_text())
        if "LlamaForCausalLMEagle3" not in config.get("architectures", []):
            raise ConfigError("init_from", f"{path} holds a {config.get('architectures')} model, not an EAGLE-3 "
                              "head (LlamaForCausalLMEagle3); give a head that train-eagle wrote")
        return cls(name, path, config)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.config.get("draft_vocab_size") or self.config["vocab_size"])

    @property
    def intermediate_size(self) -> int:
        return int(self.config["intermediate_size"])

    def weights_for(self, fresh: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """The head's weights (Hugging Face names) for a new head whose freshly initialised tensors are fresh,
        whose MLP may be wider. Where a matrix grew, the new rows (new units) keep their fresh values and the
        new columns (inputs from new units) are zero: each new unit is computed but read by nothing, so the
        wider head computes what this one did, and the first step's gradient reaches the zero columns."""
        from specserve.models.loader import safetensors_weights

        for name, tensor in safetensors_weights(self.path):
            want = fresh.get(name)
            if want is None or want.shape == tensor.shape:
                yield name, tensor
                continue
            grown = want.to(tensor.dtype).clone()
            grown[:, tensor.shape[1]:] = 0
            grown[: tensor.shape[0], : tensor.shape[1]] = tensor
            yield name, grown

    @property
    def aux_layers(self) -> tuple[int, ...] | None:
        layers = (self.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return tuple(layers) if layers else None

    @property
    def lineage(self) -> dict:
        """What made the head, for the provenance of the one trained from it."""
        return {"head": self.name, **self.config.get("specserve_training", {})}

    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab_size] int64: the target id of each draft id, from the head's d2t offsets."""
        from specserve.models.loader import safetensors_weights

        d2t = next((t for name, t in safetensors_weights(self.path) if name == "d2t"), None)
        if d2t is None:
            # vLLM's loader reads such a head as drafting the target's first ids; a trained head never is one.
            raise ConfigError("init_from", f"{self.path} has no d2t tensor, so its draft vocabulary is unknown; "
                              "give a head that train-eagle wrote")
        return torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64)
