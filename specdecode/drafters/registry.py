"""The drafter registry: method name -> drafter class.

Three sources, looked up in this order:
  * `register(name)`: a class decorator, for drafters defined in any module (the built-in ones
    use it too; their modules are imported on first lookup);
  * the built-in drafters (`BUILTIN`: name -> "module:Class", imported only when used);
  * the Python entry-point group `specdecode.drafters` (`ENTRY_POINT_GROUP`) of installed
    distributions, e.g. in a third-party pyproject.toml:

        [project.entry-points."specdecode.drafters"]
        mine = "my_package.drafter:MyDrafter"

    The entry point's object is a `Drafter` subclass; it is registered under the entry point's
    name when first looked up.

`method_names()` lists every method without importing any drafter module (so the CLI can offer
them as choices cheaply); `build_drafter(method, target, **options)` constructs one. This module
imports nothing heavy and nothing from the rest of specdecode at module level.
"""
from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from ..models.loader import LoadedModel
    from .base import Drafter

ENTRY_POINT_GROUP = "specdecode.drafters"
BUILTIN = {"ngram": "specdecode.drafters.ngram:NgramDrafter",
           "eagle": "specdecode.drafters.eagle:EagleDrafter",
           "eagle2": "specdecode.drafters.eagle:Eagle2Drafter",
           "cascade": "specdecode.drafters.cascade:CascadeDrafter",
           "model": "specdecode.drafters.model:ModelDrafter",
           "text-model": "specdecode.drafters.cross_tokenizer:TextModelDrafter",
           "self-quant": "specdecode.drafters.self_quant:SelfQuantDrafter",
           "recycle": "specdecode.drafters.recycle:RecycleDrafter",
           "suffix": "specdecode.drafters.suffix:SuffixDrafter",
           "lookahead": "specdecode.drafters.lookahead:LookaheadDrafter",
           "layer-skip": "specdecode.drafters.layer_skip:LayerSkipDrafter",
           "medusa": "specdecode.drafters.medusa:MedusaDrafter",
           "mtp": "specdecode.drafters.mtp:MtpDrafter",
           "assistant": "specdecode.drafters.assistant:AssistantDrafter"}
RESERVED = ("none", "plain")      # "none": no drafter (API / CLI); "plain": plain decoding (bench)

_registered: dict[str, type] = {}
T = TypeVar("T", bound=type)


def _drafter_errors():
    from .base import DrafterError
    return DrafterError


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make a `Drafter` subclass available as method `name` (LLM(method=name),
    `specdecode generate --method name`, the server, the bench)."""
    if not isinstance(name, str) or not name or not name.replace("-", "_").isidentifier():
        raise ValueError(f"a drafter name must be an identifier-like string, got {name!r}")
    if name in RESERVED:
        raise ValueError(f"drafter name {name!r} is reserved ({', '.join(RESERVED)})")

    def wrap(cls: T) -> T:
        from .base import Drafter
        if not (isinstance(cls, type) and issubclass(cls, Drafter)):
            raise TypeError(f"register({name!r}) decorates a Drafter subclass, got {cls!r}")
        cls.name = name
        _registered[name] = cls
        return cls
    return wrap


def unregister(name: str) -> None:
    """Forget a drafter registered with `register` (tests; built-ins come back on next lookup)."""
    _registered.pop(name, None)


def _entry_points() -> dict:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def method_names() -> list[str]:
    """Every drafter method: built-ins first, then registered ones, then entry points."""
    return list(dict.fromkeys([*BUILTIN, *_registered, *_entry_points()]))


def drafter_class(method: str) -> type[Drafter]:
    if method in _registered:
        return _registered[method]
    if method in BUILTIN:
        module, _, attr = BUILTIN[method].partition(":")
        return getattr(importlib.import_module(module), attr)     # its @register fills _registered
    entry = _entry_points().get(method)
    if entry is None:
        raise _drafter_errors()(f"method must be one of {', '.join(sorted([*method_names(), 'none']))}, "
                                f"got {method!r}")
    try:
        cls = entry.load()
    except Exception as exc:  # noqa: BLE001 -- a broken third-party package: say which one
        raise _drafter_errors()(f"drafter {method!r} (entry point {entry.value!r} in group {ENTRY_POINT_GROUP!r}) "
                                f"cannot be loaded: {type(exc).__name__}: {exc}") from None
    return register(method)(cls)


def drafter_option_names(method: str) -> list[str]:
    """The keyword options a method's drafter takes (its constructors' named parameters along the
    class hierarchy, `target` excluded)."""
    import inspect
    names: dict[str, None] = {}
    for cls in drafter_class(method).__mro__:
        init = cls.__dict__.get("__init__")
        if init is None or cls is object:
            continue
        for param in list(inspect.signature(init).parameters.values())[1:]:
            if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY) and param.name != "target":
                names[param.name] = None
    return list(names)


def check_drafter_options(method: str, options: dict) -> None:
    """DrafterError naming any option that `method`'s drafter does not take (method "none" takes none)."""
    if not options:
        return
    if method == "none":
        raise _drafter_errors()(f"drafter option {next(iter(options))!r} needs a drafter "
                                f"(method 'none' drafts nothing)")
    known = drafter_option_names(method)
    unknown = [name for name in options if name not in known]
    if unknown:
        raise _drafter_errors()(f"drafter option {unknown[0]!r} is not one of method {method!r}'s: "
                                f"{', '.join(known) or '(none)'}")


def build_drafter(method: str, target: LoadedModel, adaptive: bool | None = None, **options) -> Drafter:
    """A drafter of `method` for `target`; options are passed to its constructor (each drafter
    takes what it knows: draft=, drafter_path=, ngram_min=, ... and ignores the rest).
    `adaptive=False` (fixed draft sizes): k drafts every step, as asked, so a drafter's own early
    stop (`draft_confidence`) is off unless given."""
    if adaptive is False and "draft_confidence" not in options and "draft_confidence" in drafter_option_names(method):
        options["draft_confidence"] = 0.0
    return drafter_class(method)(target, **options)
