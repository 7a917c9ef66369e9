"""A message's content as one string, for the Responses and Messages APIs: a string as it is, or
the text of a list of text parts (each API names its parts, joins them and words its errors its
own way: `Parts`). A part a text model cannot read (an image, a file, audio, a document) is a 400
naming it, as is anything else that is not a text part."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from .errors import ApiError

REFUSED = ("input_image", "input_file", "input_audio", "image_url", "image", "document")


def short(value) -> str:
    """A value as an error message quotes it: at most 80 characters."""
    text = json.dumps(value, ensure_ascii=False, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class Parts:
    """One API's text parts: their types, each one's text field, how texts join, how a part's
    place is written (`[0]`: OpenAI's, `.0`: Anthropic's) and its error (param, message) -> ApiError."""
    kinds: tuple[str, ...]
    bad: Callable[[str, str], ApiError]
    sep: str = ""
    index: str = "[{}]"

    def text(self, content, param: str, what: str | None = None) -> str:
        """`content` (a string, a list of text parts, or None: empty) as one string."""
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise self.bad(param, f"{what + ' ' if what else ''}must be a string or a list of text parts, "
                                  f"got {short(content)}")
        texts = []
        for j, part in enumerate(content):
            where = param + self.index.format(j)
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in REFUSED:
                raise self.bad(where, f"is an {kind} part: this server serves a text model (send the content "
                                      f"as text)")
            text = part.get("text", part.get("refusal")) if kind in self.kinds else None
            if not isinstance(text, str):
                raise self.bad(where, f"must be a text part {{'type': '{self.kinds[0]}', 'text': str}}, "
                                      f"got {short(part)}")
            texts.append(text)
        return self.sep.join(texts)
