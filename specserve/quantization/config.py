"""The `quantization` option of the engine (`--quantization`); what it means for a checkpoint is
checkpoint.py's model_fp8_scheme."""
from __future__ import annotations

from specserve.errors import ConfigError

# None: the checkpoint's own (an FP8 checkpoint loads as FP8, any other unquantized), as vLLM detects it.
QUANTIZATION_METHODS = ("fp8",)


def check_quantization(value: object, field: str = "quantization") -> None:
    """Raises ConfigError naming the fix unless value is None or a supported method."""
    if value is not None and value not in QUANTIZATION_METHODS:
        raise ConfigError(field, f"must be one of {', '.join(QUANTIZATION_METHODS)} or None (the checkpoint's own), "
                          f"got {value!r}; pass 'fp8' for FP8 weights")
