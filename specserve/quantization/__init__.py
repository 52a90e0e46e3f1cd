"""Weight quantization (docs/design.md, 'FP8 weights')."""
