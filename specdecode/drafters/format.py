"""The on-disk format of a trained drafter (version 1).

A drafter is a directory:

    drafter.json        {"format": "specdecode-drafter", "version": 1, "kind": "eagle" | "draft-lm" | "medusa",
                         "target": {"name", "fingerprint", "vocab_size", "hidden_size", "num_layers"},
                         "config": {...kind-specific...}, "training": {...how it was made, metrics...}}
    model.safetensors   kind "eagle": the head's own weights (fc, qkv, o, gate_up, down, in_norm,
                        attn_norm, mlp_norm, draft_vocab) -- the target's embedding, final norm and
                        LM head are NOT stored: the drafter reads them from the target at load.
                        kind "draft-lm": a standard Hugging Face Llama checkpoint (config.json,
                        model.safetensors, tokenizer files beside it), usable by transformers'
                        assisted generation and other engines as well.
                        kind "medusa": the heads' `weight` [K, D, D], `bias` [K, D] and `draft_vocab`;
                        config["version"] versions the heads' layout (drafters/medusa.py).

`target.fingerprint` is `specdecode.models.loader.weights_fingerprint` of the target the drafter
was trained for (dtype independent). Loading against another target warns: the drafter still
works and stays lossless (verification guarantees it), but its acceptance will be poor.
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

from .base import DrafterError

FORMAT = "specdecode-drafter"
VERSION = 1
KINDS = ("eagle", "draft-lm", "medusa")
SHIPPED = Path(__file__).resolve().parent.parent / "data" / "drafters"


class DrafterMismatchWarning(UserWarning):
    """A drafter trained for a different target."""


def target_info(target) -> dict:
    c = target.model.config
    return {"name": target.name, "fingerprint": target.fingerprint, "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "num_layers": c.num_layers}


def write_meta(out_dir: Path, kind: str, target, config: dict, training: dict) -> None:
    meta = {"format": FORMAT, "version": VERSION, "kind": kind, "target": target_info(target),
            "config": config, "training": training}
    (out_dir / "drafter.json").write_text(json.dumps(meta, indent=1) + "\n")


def read_meta(path: Path, kind: str | None = None) -> dict:
    path = Path(path).expanduser()
    meta_path = path / "drafter.json"
    if not meta_path.is_file():
        raise DrafterError(f"{path} is not a specdecode drafter (no drafter.json); train one with "
                           f"`specdecode distill --target MODEL --out DIR`")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise DrafterError(f"{meta_path} is not valid JSON: {exc}") from None
    if meta.get("format") != FORMAT:
        raise DrafterError(f"{meta_path}: format must be {FORMAT!r}, got {meta.get('format')!r}")
    if not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
        raise DrafterError(f"{meta_path}: format version {meta.get('version')!r} is newer than this specdecode "
                           f"reads (<= {VERSION}); upgrade specdecode")
    if kind is not None and meta.get("kind") != kind:
        raise DrafterError(f"{path} holds a {meta.get('kind')!r} drafter, not {kind!r}")
    return meta


HELD_OUT_SHARE = 0.5    # of a head's held-out first-draft acceptance, what its draft budget assumes at the start:
                        # the held-out text is the distill corpus (the target's own answers), which a head
                        # predicts far better than other prompts (docs/training.md, "What was tried")


def prior_acceptance(meta: dict) -> float | None:
    """The per-position acceptance a draft budget starts from for a trained drafter: HELD_OUT_SHARE of
    its held-out first-draft acceptance (`training.final_eval.accept_depth[0]`), None if not recorded."""
    try:
        depth_one = float(meta["training"]["final_eval"]["accept_depth"][0])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return HELD_OUT_SHARE * depth_one if 0.0 <= depth_one <= 1.0 else None


def check_target(meta: dict, target, path: Path) -> bool:
    """Warn (once, clearly) when the drafter was trained for other weights; True if it matches."""
    want = meta.get("target", {})
    if want.get("vocab_size") not in (None, target.model.config.vocab_size):
        raise DrafterError(f"drafter {path} was trained for a target with {want['vocab_size']} tokens; "
                           f"{target.name} has {target.model.config.vocab_size}")
    width = want.get("hidden_size")
    if width not in (None, target.model.config.hidden_size) and meta.get("kind") in ("eagle", "medusa"):
        raise DrafterError(f"{meta['kind']} drafter {path} reads features of width {want['hidden_size']}; "
                           f"{target.name} has hidden size {target.model.config.hidden_size}")
    if want.get("fingerprint") and target.fingerprint and want["fingerprint"] != target.fingerprint:
        message = (f"drafter {path} was trained for target {want.get('name')!r} (weights {want['fingerprint']}), "
                   f"but the target is {target.name!r} (weights {target.fingerprint}): output stays exact, "
                   f"acceptance will likely be low; retrain with `specdecode distill --target ...`")
        warnings.warn(message, DrafterMismatchWarning, stacklevel=3)
        print(f"warning: {message}", file=sys.stderr)
        return False
    return True


def shipped_drafter(target, kind: str = "eagle") -> Path | None:
    """The drafter shipped in the package for this target (by weights fingerprint), if any."""
    if not SHIPPED.is_dir() or not target.fingerprint:
        return None
    for meta_path in sorted(SHIPPED.glob("*/drafter.json")):
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError:
            continue
        if meta.get("kind") == kind and meta.get("target", {}).get("fingerprint") == target.fingerprint:
            return meta_path.parent
    return None


def save_eagle(head, out_dir: Path, target, training: dict) -> Path:
    """Write an EagleHead (drafters/head.py) as a version-1 drafter directory."""
    from safetensors.torch import save_file
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in head.state_dict().items()}
    state = {n: (t if n == "draft_vocab" else t.to(torch.bfloat16)) for n, t in state.items()}
    save_file(state, str(out_dir / "model.safetensors"))
    write_meta(out_dir, "eagle", target, head.config.as_dict(), training)
    return out_dir


def save_medusa(heads, out_dir: Path, target, training: dict) -> Path:
    """Write MedusaHeads (drafters/medusa.py) as a version-1 drafter directory of kind "medusa"."""
    from safetensors.torch import save_file
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in heads.state_dict().items()}
    state = {n: (t if n == "draft_vocab" else t.to(torch.bfloat16)) for n, t in state.items()}
    save_file(state, str(out_dir / "model.safetensors"))
    write_meta(out_dir, "medusa", target, heads.config.as_dict(), training)
    return out_dir
