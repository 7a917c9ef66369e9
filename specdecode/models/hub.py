"""Models named by Hugging Face id: `ORG/NAME`, `ORG/NAME:QUANT` and `ORG/NAME/FILE.gguf`.

loader.model_path turns every model spec into a path (for load_model, a draft's default dtype, the
bench's llama.cpp peer; `info --model` does the same) and asks hub_path only for a spec that is not an
existing path: that spec is an id when it has one of these forms. Everything below the choice of files
is huggingface_hub's: its cache (HF_HUB_CACHE / HF_HOME), progress bars, resumed downloads, token
(HF_TOKEN or `hf auth login`) and HF_HUB_OFFLINE. Offline, or when the Hub cannot be reached, the
choice is made among the repository's files already in the cache, so a model used once keeps loading
without a network.

What an id becomes:
- a repository with a Hugging Face checkpoint (config.json and safetensors weights) and no `:QUANT`:
  a snapshot of the files a model directory needs (config, tokenizer, weights), loaded as a directory;
- otherwise its GGUF file: the one file it holds, the one whose name carries the quant tag `:QUANT`
  (case-insensitive, between non-alphanumerics, as llama.cpp's `-hf` matches), or the one named.
  Multimodal projectors (`mmproj`) are never chosen. A GGUF split into parts (`-00001-of-00003.gguf`)
  is refused before anything is downloaded: the loader reads single files.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelError

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
ID = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?::(?P<quant>[A-Za-z0-9._-]+)|/(?P<file>[^:\\]+\.gguf))?", re.I)
SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)
QUANT_TAG = re.compile(r"(?<![A-Za-z0-9])(I?Q\d+(?:_[A-Za-z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])", re.I)
# the files of a Hugging Face model directory (top level only: the loader reads no subfolder)
DIRECTORY_FILES = ("*.json", "tokenizer.model", "*.txt", "*.jinja")
LISTED = 8          # names shown in an error before "..."


@dataclass(frozen=True)
class HubId:
    repo: str                   # ORG/NAME
    quant: str | None = None    # ORG/NAME:QUANT
    file: str | None = None     # ORG/NAME/FILE.gguf

    def __str__(self) -> str:
        return self.repo + (f":{self.quant}" if self.quant else "") + (f"/{self.file}" if self.file else "")


def parse_id(spec: str) -> HubId | None:
    """The id `spec` spells, or None when it is not one (two names ending in .gguf are a file path)."""
    match = ID.fullmatch(spec)
    if match is None or ".." in spec or "--" in match["repo"]:
        return None
    if match["file"] is None and match["quant"] is None and spec.lower().endswith(".gguf"):
        return None
    return HubId(match["repo"], match["quant"], match["file"])


def hub_path(spec: str) -> Path | None:
    """The local file or snapshot directory for the id `spec`, downloaded (or found in the cache
    offline); None when `spec` is not an id. Every failure is one ModelError line."""
    ref = parse_id(spec)
    if ref is None:
        return None
    from huggingface_hub import constants
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )
    offline = bool(constants.HF_HUB_OFFLINE)
    cache = constants.HF_HUB_CACHE
    try:
        files, revision, why_local = _listing(ref.repo, offline)
        return _fetch(ref, files, revision, local=why_local is not None, where=_where(why_local, cache))
    except GatedRepoError:
        raise ModelError(f"{ref.repo} is a gated model: accept its terms on https://huggingface.co/{ref.repo}, "
                         f"then set HF_TOKEN or run `hf auth login`") from None
    except RepositoryNotFoundError:
        raise ModelError(f"model not found: {spec} is neither a local path nor a Hugging Face model id you can "
                         f"reach (a private model needs HF_TOKEN or `hf auth login`)") from None
    except LocalEntryNotFoundError:
        raise ModelError(f"{spec}: its files are not all in the Hugging Face cache at {cache}, and "
                         f"{'HF_HUB_OFFLINE is set' if offline else 'the Hub cannot be reached'}") from None
    except EntryNotFoundError as exc:
        raise ModelError(f"{spec}: a file is missing on the Hub ({_first_line(exc)})") from None
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            raise ModelError(f"{ref.repo}: the Hub refused access ({status}): set HF_TOKEN or run "
                             f"`hf auth login` with an account that may read it") from None
        raise ModelError(f"{spec}: the Hugging Face Hub answered {_first_line(exc)}") from None
    except OSError as exc:                  # the cache cannot be written: disk full, no permission
        raise ModelError(f"{spec}: cannot download into the Hugging Face cache at {cache} "
                         f"({type(exc).__name__}: {exc}; HF_HUB_CACHE moves it)") from None


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _where(why_local: str | None, cache: str) -> str:
    """How an error qualifies a listing: the Hub's, or the cache's when offline."""
    return "" if why_local is None else f" among its files in the Hugging Face cache at {cache} ({why_local})"


def _listing(repo: str, offline: bool) -> tuple[list[str], str | None, str | None]:
    """(the repository's files, the revision to fetch, why only the cache is used or None).
    Online: the Hub's listing of the main branch. Offline or unreachable: the files of its cached
    snapshot (main's, else the newest), found by huggingface_hub's cache scan."""
    from huggingface_hub import HfApi, constants, scan_cache_dir
    from huggingface_hub.utils import CacheNotFound, HfHubHTTPError, RepositoryNotFoundError
    why_local = "HF_HUB_OFFLINE is set"
    if not offline:
        try:
            info = HfApi().model_info(repo)
            return [s.rfilename for s in info.siblings or []], None, None
        except RepositoryNotFoundError:
            raise
        except HfHubHTTPError as exc:       # 401/403 need a token; a Hub fault (5xx) falls back to the cache
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if status in (401, 403):
                raise
            why_local = f"the Hub answered {_first_line(exc)}"
        except Exception as exc:  # noqa: BLE001 -- the HTTP client's transport errors (no network): use the cache
            why_local = f"the Hub cannot be reached: {type(exc).__name__}: {_first_line(exc)}"
    cache = constants.HF_HUB_CACHE
    try:
        scan = scan_cache_dir(cache)
    except CacheNotFound:
        scan = None
    repos = [r for r in (scan.repos if scan else ()) if r.repo_type == "model" and r.repo_id == repo]
    revisions = sorted((rev for r in repos for rev in r.revisions), key=lambda rev: ("main" in rev.refs,
                                                                                    rev.last_modified))
    if not revisions:
        how = "unset it to download the model" if offline else "download it once with a network"
        raise ModelError(f"model not found: {repo} is neither a local path nor in the Hugging Face cache at "
                         f"{cache}, and {why_local} ({how})")
    newest = revisions[-1]
    files = sorted(str(f.file_path.relative_to(newest.snapshot_path).as_posix()) for f in newest.files)
    return files, newest.commit_hash, why_local


def _fetch(ref: HubId, files: list[str], revision: str | None, local: bool, where: str) -> Path:
    """Choose the files `ref` names among `files` and download them (or find them in the cache)."""
    from huggingface_hub import hf_hub_download, snapshot_download
    top = [f for f in files if "/" not in f]
    weights = [f for f in top if f.endswith(".safetensors")]
    weights = [f for f in weights if f.startswith("model")] or weights       # not Mistral's consolidated copy
    if ref.file is None and ref.quant is None and "config.json" in top and weights:
        names = weights + [f for f in top if any(fnmatch.fnmatch(f, p) for p in DIRECTORY_FILES)]
        return Path(snapshot_download(ref.repo, revision=revision, allow_patterns=names, local_files_only=local))
    if not _ggufs(files) and "config.json" in top and weights:
        raise ModelError(f"{ref.repo} holds a Hugging Face checkpoint, not GGUF files{where}: give {ref.repo} "
                         f"alone (no :QUANT or /FILE.gguf)")
    chosen = _gguf_choice(ref, files, where)
    split = SPLIT.search(chosen)
    if split:
        raise ModelError(f"{ref}: {chosen} is one of {int(split[2])} parts of a split GGUF file, which specdecode "
                         f"cannot read: merge them with `llama-gguf-split --merge` and give the merged file's path")
    return Path(hf_hub_download(ref.repo, chosen, revision=revision, local_files_only=local))


def _gguf_choice(ref: HubId, files: list[str], where: str) -> str:
    """The GGUF file `ref` asks for (the first part of a split one), or a ModelError saying how to choose."""
    if ref.file is not None:
        if ref.file not in files:
            raise ModelError(f"{ref.repo} has no file {ref.file}{where}; its GGUF files: {_names(_ggufs(files))}")
        return ref.file
    groups: dict[str, list[str]] = {}           # the parts of a split file count as one
    for name in _ggufs(files):
        groups.setdefault(SPLIT.sub(".gguf", name), []).append(name)
    if not groups:
        hint = f", so there is no :{ref.quant} to choose" if ref.quant else ""
        raise ModelError(f"{ref.repo} has neither GGUF files nor a Hugging Face checkpoint (config.json and "
                         f"*.safetensors){where}{hint}; its files: {_names(files)}")
    if ref.quant is not None:
        tag = re.compile(rf"(?<![A-Za-z0-9]){re.escape(ref.quant)}(?![A-Za-z0-9_])", re.I)
        matching = {key: parts for key, parts in groups.items() if tag.search(key)}
        if not matching:
            raise ModelError(f"{ref.repo} has no GGUF file tagged {ref.quant}{where}; "
                             f"its quants: {_choices(ref.repo, groups)}")
        if len(matching) > 1:
            raise ModelError(f"{ref} matches {len(matching)} GGUF files{where} ({_names(list(matching))}): "
                             f"name one as {ref.repo}/FILE.gguf")
        groups = matching
    if len(groups) > 1:
        raise ModelError(f"{ref.repo} holds {len(groups)} GGUF files{where}: choose one as {ref.repo}:QUANT "
                         f"({_choices(ref.repo, groups)}) or {ref.repo}/FILE.gguf")
    return sorted(next(iter(groups.values())))[0]


def _ggufs(files: list[str]) -> list[str]:
    return [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]


def _choices(repo: str, groups: dict[str, list[str]]) -> str:
    """Each file's quant tag, or its name where it has none."""
    tags = []
    for key in sorted(groups):
        found = QUANT_TAG.findall(Path(key).stem)
        tags.append(f"{repo}:{found[-1]}" if found else f"{repo}/{key}")
    return _names(list(dict.fromkeys(tags)))


def _names(names: list[str]) -> str:
    if not names:
        return "none"
    return ", ".join(names[:LISTED]) + (f", ... ({len(names) - LISTED} more)" if len(names) > LISTED else "")
