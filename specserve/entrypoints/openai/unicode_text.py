"""The type of every string a request holds: Unicode text, which a lone UTF-16 surrogate is not."""
from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError


def _valid_unicode(text: str) -> str:
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"), which is no character: no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(
            "invalid_unicode", "is not valid Unicode: character {index} is a lone surrogate ({code}); "
            "send UTF-8 text, with \\ud800-\\udfff escapes only as the pairs that encode one character",
            {"index": e.start, "code": f"\\u{ord(text[e.start]):04x}"}) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
