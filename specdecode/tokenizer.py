"""Tokenizer and chat template of a model, read from the model's own files.

A thin wrapper over the `tokenizers` library (tokenizer.json) and a sandboxed Jinja2
environment for the chat template, the same way transformers renders it, without
paying for importing transformers on every start.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from .models.config import ModelError


def _special(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"{model_dir} has no tokenizer.json (a fast tokenizer file is required)")
        self.backend = HFTokenizer.from_file(str(path))
        cfg: dict[str, Any] = {}
        if (model_dir / "tokenizer_config.json").is_file():
            cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self._template = None                      # compiled on first use
        self.bos_token = _special(cfg.get("bos_token"))
        self.eos_token = _special(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.token_id(self.bos_token)
        if add_special and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def id_to_token(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or f"<{token_id}>"

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, variables: dict | None = None) -> str:
        """`variables`: more names for the template (a request's `chat_template_kwargs`, e.g.
        `enable_thinking`); they cannot replace the ones set here."""
        if not self.chat_template:
            raise ModelError("this model has no chat template; use --no-chat (chat=False)")
        extra = {"tools": tools} if tools else {}
        return self._compiled_template().render(
            **(variables or {}), messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)

    @property
    def template_takes_tools(self) -> bool:
        return bool(self.chat_template) and "tools" in self.chat_template

    def _compiled_template(self):
        """The chat template compiled once, in a sandbox, with the helpers transformers provides."""
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        return self._template

    def vocab_fingerprint(self, count: int = 0) -> list[str]:
        """The first `count` tokens by id (all when 0): what two models must share to draft for each other."""
        n = self.vocab_size if count == 0 else min(count, self.vocab_size)
        return [self.id_to_token(i) for i in range(n)]
