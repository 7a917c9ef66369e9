"""Fill-in-the-middle: the prompt a code model was trained on to write the code between a prefix
and a suffix (an editor's cursor), detected from the model's vocabulary.

Formats (the special tokens each family was trained with; the order their papers and model
cards give):
- Qwen2.5-Coder, CodeGemma: `<|fim_prefix|>` P `<|fim_suffix|>` S `<|fim_middle|>`, other files
  as `<|file_sep|>`name\\ntext (CodeGemma: `<|file_separator|>`), a `<|repo_name|>` first;
- StarCoder / StarCoder2, Granite code: `<fim_prefix>` P `<fim_suffix>` S `<fim_middle>`, files
  as `<file_sep>`name\\ntext after `<repo_name>`;
- CodeLlama: `▁<PRE>` P `▁<SUF>` S `▁<MID>`, the middle ends with `▁<EOT>`;
- DeepSeek-Coder: `<｜fim▁begin｜>` P `<｜fim▁hole｜>` S `<｜fim▁end｜>`;
- Codestral (Mistral): suffix first, `[SUFFIX]` S `[PREFIX]` P, the model writes the middle next.

The middle ends at the model's end of text or at a token that would start another document
(a file separator, a padding FIM token): `FimFormat.stop_token_ids`. The suffix is in the prompt,
so the lookup drafters find code the middle repeats from either side.
"""
from __future__ import annotations

from dataclasses import dataclass

from .params import ParamError

MAX_EXTRA_FILES = 32     # input_extra / other files given as context


@dataclass(frozen=True)
class FimFormat:
    name: str
    prefix: int                       # token ids of the format's markers
    suffix: int
    middle: int | None                # None: suffix-first formats that end with the prefix
    suffix_first: bool = False
    file_sep: int | None = None       # starts another file's text (context from other files)
    repo_name: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def prompt_ids(self, tokenizer, prefix: str, suffix: str, extra: list[tuple[str, str]] = (),
                   filename: str = "", repo: str = "", bos: int | None = None) -> list[int]:
        """The prompt for writing the middle between `prefix` and `suffix`; `extra`: (file name,
        text) of other files, put before it (with the current file's name) where the format has a
        file separator."""
        def enc(text: str) -> list[int]:
            return tokenizer.encode(text, add_special=False) if text else []
        ids = [] if bos is None else [bos]
        if extra and self.file_sep is not None:
            if self.repo_name is not None:
                ids += [self.repo_name] + enc(repo or "repo") + enc("\n")
            for name, text in extra:
                ids += [self.file_sep] + enc(f"{name}\n{text}")
            ids += [self.file_sep] + enc(f"{filename or 'file'}\n")
        if self.suffix_first:
            return ids + [self.suffix] + enc(suffix) + [self.prefix] + enc(prefix)
        ids += [self.prefix] + enc(prefix) + [self.suffix] + enc(suffix)
        return ids + ([self.middle] if self.middle is not None else [])


# (name, prefix, suffix, middle, suffix first, file separator, repo name, extra stop tokens)
_FORMATS = (
    ("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", False, "<|file_sep|>", "<|repo_name|>",
     ("<|fim_pad|>", "<|endoftext|>", "<|file_sep|>", "<|repo_name|>", "<|im_end|>")),
    ("codegemma", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", False, "<|file_separator|>", None,
     ("<|file_separator|>", "<eos>", "<end_of_turn>")),
    ("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", False, "<file_sep>", "<repo_name>",
     ("<|endoftext|>", "<file_sep>", "<fim_pad>")),
    ("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", False, None, None, ("▁<EOT>",)),
    ("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", False, None, None,
     ("<|EOT|>", "<｜end▁of▁sentence｜>")),
    ("codestral", "[PREFIX]", "[SUFFIX]", None, True, None, None, ()),
)


def detect(tokenizer, eos_token_ids: tuple[int, ...] = ()) -> FimFormat | None:
    """The FIM format this vocabulary carries, or None (the model was not trained for it)."""
    for name, pre, suf, mid, suffix_first, sep, repo, stops in _FORMATS:
        pre_id, suf_id, mid_id = tokenizer.token_id(pre), tokenizer.token_id(suf), tokenizer.token_id(mid)
        if pre_id is None or suf_id is None or (mid is not None and mid_id is None):
            continue
        if name == "qwen" and tokenizer.token_id("<|file_sep|>") is None:
            continue                          # <|fim_*|> without <|file_sep|>: CodeGemma's vocabulary
        stop_ids = [tokenizer.token_id(t) for t in stops] + list(eos_token_ids)
        return FimFormat(name, pre_id, suf_id, mid_id, suffix_first, tokenizer.token_id(sep) if sep else None,
                         tokenizer.token_id(repo) if repo else None,
                         tuple(dict.fromkeys(t for t in stop_ids if t is not None)))
    return None


def check_extra(extra, param: str = "input_extra") -> list[tuple[str, str]]:
    """llama.cpp's `input_extra`: a list of {"filename": str, "text": str} -> [(name, text)]."""
    if extra is None:
        return []
    if not isinstance(extra, list) or len(extra) > MAX_EXTRA_FILES:
        raise ParamError(f"{param} must be a list of at most {MAX_EXTRA_FILES} {{filename, text}} objects")
    out = []
    for i, item in enumerate(extra):
        if not isinstance(item, dict) or not isinstance(item.get("text"), str) \
                or not isinstance(item.get("filename", ""), str):
            raise ParamError(f"{param}[{i}] must be an object {{\"filename\": str, \"text\": str}}")
        out.append((item.get("filename", ""), item["text"]))
    return out
