"""A staged step array (worker/staged_inputs.py) holding only a header and extras, for the kernels that find
their rows through the header."""
from __future__ import annotations

import numpy as np
import torch

from specserve.worker.staged_inputs import StagedExtra, pack_step_inputs


def staged_extras(extras: dict[StagedExtra, np.ndarray], num_tokens: int = 0, device: str = "cpu") -> torch.Tensor:
    """A staged array of num_tokens (zero) tokens, no requests, and `extras`, on `device`."""
    host = np.full(64 + num_tokens * 4 + sum(v.size + 1 for v in extras.values()), -9, dtype=np.int64)
    tokens = np.zeros(num_tokens, dtype=np.int64)
    none = np.zeros(0, dtype=np.int64)
    pack_step_inputs(host, tokens, tokens, tokens, none, none, np.zeros((0, 0), dtype=np.int64), extras)
    return torch.from_numpy(host).to(device)
