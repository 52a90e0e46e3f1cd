"""Grammar-constrained decoding (docs/design.md, 'Structured output')."""
from specserve.structured_output.spec import StructuredOutput, StructuredOutputKind

__all__ = ["StructuredOutput", "StructuredOutputKind"]
