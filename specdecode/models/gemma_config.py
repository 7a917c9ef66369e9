"""What a Gemma 2 / Gemma 3 model's config says, read from an HF config.json or a llama.cpp GGUF
file's metadata, and written back as a config.json (the GGUF cache); and what a Gemma 4 text config
says (an HF config.json, model_type gemma4_text or the text_config of the multimodal gemma4). Apart
from models/gemma.py and models/gemma4.py (the decoders) so that models/config.py can read Gemma
configs without importing the decoders."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import ModelError

ModelConfig = Any                   # models/config.py's ModelConfig (which imports this module)

LAYER_TYPES = ("sliding_attention", "full_attention")
# llama.cpp's layer pattern when the file has no attention.sliding_window_pattern: layer i is windowed
# when i % n < n - 1 (as transformers' default layer_types)
DEFAULT_PATTERN = {"gemma2": 2, "gemma3": 6}


def gemma_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 2 (model_type gemma2) or Gemma 3 text (gemma3_text) config.json,
    in the old (rope_theta, rope_local_base_freq, sliding_window_pattern) or the transformers >= 5
    (rope_parameters per layer type, layer_types) spelling."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelError(f"hidden_activation {act!r} is not supported natively for {arch} (gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelError("use_bidirectional_attention (an encoder) is not supported natively")
    if cfg.get("attention_bias"):
        raise ModelError(f"attention_bias (biases on q/k/v/o) is not supported natively for {arch}")
    layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        pattern = DEFAULT_PATTERN[arch] if arch == "gemma2" else int(cfg.get("sliding_window_pattern") or 6)
        layer_types = [LAYER_TYPES[0] if (i + 1) % pattern else LAYER_TYPES[1] for i in range(layers)]
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ModelError(f"layer_types {unknown} are not supported natively (supported: {', '.join(LAYER_TYPES)})")
    rope = dict(cfg.get("rope_parameters") or {})
    if arch == "gemma3" and set(rope) & set(LAYER_TYPES):        # transformers >= 5: per layer type
        global_rope, local_rope = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    else:                          # one set for the global layers; the local base apart (Gemma 3)
        global_rope = rope or dict(cfg.get("rope_scaling") or {})
        local_rope = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    theta = global_rope.pop("rope_theta", None) or cfg.get("rope_theta") or (1e6 if arch == "gemma3" else 1e4)
    local_theta = local_rope.pop("rope_theta", None) or 10000.0
    if local_rope.get("rope_type", local_rope.get("type")) not in (None, "default"):
        raise ModelError(f"rope scaling on the sliding-window layers ({local_rope}) is not supported natively")
    if global_rope.get("rope_type", global_rope.get("type")) in (None, "default"):
        global_rope = {}
    window = cfg.get("sliding_window")
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    gemma2 = arch == "gemma2"
    return dict(
        arch=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=layers, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=global_rope or None,
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        qk_norm=not gemma2, sliding_window=int(window) if window else None,
        sliding_layers=tuple(t == LAYER_TYPES[0] for t in layer_types),
        rope_local_theta=None if gemma2 else float(local_theta),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        # transformers' defaults when the key is absent; Gemma 3's attention ignores the attention cap
        attn_logit_softcapping=cfg.get("attn_logit_softcapping", 50.0) if gemma2 else None,
        final_logit_softcapping=cfg.get("final_logit_softcapping", 30.0 if gemma2 else None),
    )


def gemma_hf_config(c: ModelConfig) -> dict[str, Any]:
    """A config.json for `c` that transformers and `gemma_fields` both read (the GGUF cache)."""
    gemma2 = c.arch == "gemma2"
    global_rope = dict(c.rope_scaling or {"rope_type": "default"}, rope_theta=c.rope_theta)
    eos: Any = list(c.eos_token_ids)
    layer_types = [LAYER_TYPES[0] if s else LAYER_TYPES[1] for s in (c.sliding_layers or [True] * c.num_layers)]
    return {
        "architectures": ["Gemma2ForCausalLM" if gemma2 else "Gemma3ForCausalLM"],
        "model_type": "gemma2" if gemma2 else "gemma3_text",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": global_rope if gemma2 else {
            "full_attention": global_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta}},
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "float32",
        "sliding_window": c.sliding_window, "layer_types": layer_types,
        "query_pre_attn_scalar": c.query_pre_attn_scalar,
        "attn_logit_softcapping": c.attn_logit_softcapping, "final_logit_softcapping": c.final_logit_softcapping,
    }


def gguf_fields(arch: str, g: Callable[..., Any], config: ModelConfig) -> dict[str, Any]:
    """The Gemma fields of a llama.cpp gemma2 / gemma3 file (`g(key, default)` reads `<arch>.key`),
    with llama.cpp's rules for what the file leaves out: the window pattern (every 2nd / 6th layer
    global), the local RoPE base (10000), and the score scale (1/sqrt(head_dim), or
    1/sqrt(hidden/heads) for the 27B models, which llama.cpp tells apart by their layer count)."""
    pattern = g("attention.sliding_window_pattern", DEFAULT_PATTERN[arch])
    if isinstance(pattern, (list, tuple)):
        sliding = tuple(bool(x) for x in pattern)
    else:
        n = int(pattern)
        sliding = tuple(n == 0 or i % n < n - 1 for i in range(config.num_layers))
    big = config.num_layers == {"gemma2": 46, "gemma3": 62}[arch]
    attn_cap, final_cap = g("attn_logit_softcapping"), g("final_logit_softcapping")
    return dict(
        qk_norm=arch == "gemma3", sliding_layers=sliding,
        rope_local_theta=float(g("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
        query_pre_attn_scalar=float(config.hidden_size // config.num_heads if big else config.head_dim),
        attn_logit_softcapping=float(attn_cap if attn_cap is not None else 50.0) if arch == "gemma2" else None,
        final_logit_softcapping=(float(final_cap) if final_cap is not None
                                 else (30.0 if arch == "gemma2" else None)),
    )


# llama.cpp's Gemma layer norms (ffn_norm is the pre-feedforward norm, not Llama's post-attention one)
GGUF_NAMES = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
              "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def gguf_norm_shift(hf_name: str, config: ModelConfig) -> float:
    """What llama.cpp added to a Gemma tensor (1 on every norm weight), to subtract on reading."""
    return 1.0 if config.is_gemma and hf_name.endswith("norm.weight") else 0.0


# ---------------------------------------------------------------- Gemma 4
GEMMA4_PATTERN = 6           # transformers' default layer_types: five sliding layers, then a global one
GEMMA4_OVERRIDES = ("head_dim", "num_key_value_heads")     # what per_layer_config may change on a layer


def gemma4_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 4 text config (transformers' Gemma4TextConfig, with its defaults
    for absent keys). The global layers' head shape is `global_head_dim` / `num_global_key_value_heads`
    as checkpoints write it, or `per_layer_config` overrides as transformers >= 5.24 saves it."""
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelError(f"hidden_activation {act!r} is not supported natively for gemma4 (gelu_pytorch_tanh)")
    for key, what in (("use_bidirectional_attention", "bidirectional attention"),
                      ("attention_bias", "biases on q/k/v/o")):
        if cfg.get(key):
            raise ModelError(f"{key} ({what}) is not supported natively for gemma4")
    layers = cfg.get("num_hidden_layers", 30)
    layer_types = list(cfg.get("layer_types") or [
        LAYER_TYPES[0] if (i + 1) % GEMMA4_PATTERN else LAYER_TYPES[1] for i in range(layers)])
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ModelError(f"layer_types {unknown} are not supported natively (supported: {', '.join(LAYER_TYPES)})")
    if len(layer_types) != layers:
        raise ModelError(f"layer_types names {len(layer_types)} layers, the model has {layers}")
    layer_types[-1] = LAYER_TYPES[1]            # as transformers: the last layer is always global
    rope = cfg.get("rope_parameters") or {}
    local = dict(rope.get("sliding_attention") or {"rope_theta": 10000.0})
    full = dict(rope.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1e6})
    if local.get("rope_type", "default") != "default":
        raise ModelError(f"rope scaling on the sliding-window layers ({local}) is not supported natively")
    if full.get("rope_type", "default") not in ("default", "proportional"):
        raise ModelError(f"rope_type {full.get('rope_type')!r} on the global layers is not supported natively "
                         f"(default, proportional)")
    proportion = float(full.get("partial_rotary_factor", 1.0)) if full.get("rope_type") == "proportional" else 1.0
    head_dim, kv_heads = cfg.get("head_dim", 256), cfg.get("num_key_value_heads", 4)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    overrides = cfg.get("per_layer_config")
    if overrides is None:      # transformers' defaults: global heads 512 wide, their kv heads only with k_eq_v
        overrides = {i: {"head_dim": cfg.get("global_head_dim", 512)} for i, t in enumerate(layer_types)
                     if t == LAYER_TYPES[1]}
        if k_eq_v and cfg.get("num_global_key_value_heads") is not None:
            for o in overrides.values():
                o["num_key_value_heads"] = cfg["num_global_key_value_heads"]
    shapes = {t: set() for t in LAYER_TYPES}
    for i, t in enumerate(layer_types):
        o = dict(overrides.get(str(i), overrides.get(i)) or {})
        if set(o) - set(GEMMA4_OVERRIDES):
            raise ModelError(f"per_layer_config of layer {i} sets {sorted(set(o) - set(GEMMA4_OVERRIDES))}, "
                             f"which is not supported natively (only {', '.join(GEMMA4_OVERRIDES)})")
        shapes[t].add((o.get("head_dim", head_dim), o.get("num_key_value_heads", kv_heads)))
    if shapes[LAYER_TYPES[0]] - {(head_dim, kv_heads)} or len(shapes[LAYER_TYPES[1]]) > 1:
        raise ModelError(f"per_layer_config gives the layers of one type different head shapes ({shapes}), "
                         f"which is not supported natively")
    global_dim, global_heads = next(iter(shapes[LAYER_TYPES[1]]))
    eos = cfg.get("eos_token_id", 1)
    window = cfg.get("sliding_window", 512)
    moe = {}
    if cfg.get("enable_moe_block"):          # 26B-A4B: a MoE block beside every layer's MLP (models/moe.py)
        from .moe import gemma4_fields as moe_fields
        moe = moe_fields(cfg)
    return dict(
        arch="gemma4", vocab_size=cfg.get("vocab_size", 262144), hidden_size=cfg.get("hidden_size", 2304),
        intermediate_size=cfg.get("intermediate_size", 9216), num_layers=layers,
        num_heads=cfg.get("num_attention_heads", 8), num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(full.get("rope_theta", 1e6)),
        rope_scaling={"rope_type": "proportional", "partial_rotary_factor": proportion,
                      "factor": float(full.get("factor", 1.0))},
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), bos_token_id=cfg.get("bos_token_id", 2),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        qk_norm=True, sliding_window=int(window) if window else None,
        sliding_layers=tuple(t == LAYER_TYPES[0] for t in layer_types),
        rope_local_theta=float(local.get("rope_theta", 10000.0)), query_pre_attn_scalar=1.0,   # scores unscaled
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        global_head_dim=global_dim, global_kv_heads=global_heads, k_eq_v=k_eq_v,
        kv_shared_layers=cfg.get("num_kv_shared_layers", 0),
        per_layer_input_size=cfg.get("hidden_size_per_layer_input", 256) or 0,
        per_layer_vocab_size=cfg.get("vocab_size_per_layer_input", 262144) or 0,
        double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)),
        **moe,
    )


def gemma4_weight_name(name: str) -> str | None:
    """The name a Gemma 4 decoder reads a checkpoint tensor under: the multimodal wrapper's text model
    (model.language_model.*) as the text-only model's (model.*); None for its vision and audio towers."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith(("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")):
        return None
    return name


def gemma4_weight_count(c: ModelConfig) -> int:
    """Parameters a Gemma 4 decoder reads per decoded token: attention (no k/v on kv-shared layers, no v
    with k_eq_v on global ones), the MLP (twice as wide on shared layers with double_wide_mlp), the
    per-layer input gate / projection and the model-wide projection into them, norms, the LM head."""
    d, p, first = c.hidden_size, c.per_layer_input_size, c.num_layers - c.kv_shared_layers
    total = c.vocab_size * d + d + (d * c.num_layers * p + p if p else 0)
    for i in range(c.num_layers):
        hd, kv = c.layer_head_dim(i), c.layer_kv_heads(i)
        values = 0 if c.k_eq_v and not c.sliding_layers[i] else 1
        kv_rows = 0 if i >= first else (1 + values) * kv * hd
        wide = 2 if c.double_wide_mlp and i >= first else 1
        total += d * (2 * c.num_heads * hd + kv_rows) + 3 * d * c.intermediate_size * wide + 4 * d + 2 * hd
        total += 2 * d * p + d if p else 0
        if c.moe is not None and c.moe_layers[i]:    # the MoE block: router, its scales, 3 norms, routed experts
            total += c.moe["experts"] * (d + 1) + 4 * d + 3 * d * c.moe["intermediate"] * c.moe["used"]
    return total


def gemma4_hf_config(c: ModelConfig) -> dict[str, Any]:
    """A gemma4_text config.json for `c` that transformers and `gemma4_fields` both read back to `c`
    (the GGUF cache): the global layers' head shape as per_layer_config, the MoE block's keys where
    the model has one."""
    layer_types = [LAYER_TYPES[0] if s else LAYER_TYPES[1] for s in c.sliding_layers]
    rope = dict(c.rope_scaling or {})
    full = {"rope_type": "proportional", "partial_rotary_factor": float(rope.get("partial_rotary_factor", 1.0)),
            "rope_theta": c.rope_theta}
    if float(rope.get("factor", 1.0)) != 1.0:
        full["factor"] = float(rope["factor"])
    eos: Any = list(c.eos_token_ids)
    moe = {} if c.moe is None else {"enable_moe_block": True, "num_experts": c.moe["experts"],
                                    "top_k_experts": c.moe["used"], "moe_intermediate_size": c.moe["intermediate"]}
    return {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "global_head_dim": c.layer_head_dim(layer_types.index(LAYER_TYPES[1])), "attention_k_eq_v": c.k_eq_v,
        "per_layer_config": {str(i): {"head_dim": c.layer_head_dim(i), "num_key_value_heads": c.layer_kv_heads(i)}
                             for i, t in enumerate(layer_types) if t == LAYER_TYPES[1]},
        "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta},
                            "full_attention": full},
        "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos, "sliding_window": c.sliding_window,
        "layer_types": layer_types, "final_logit_softcapping": c.final_logit_softcapping,
        "num_kv_shared_layers": c.kv_shared_layers, "hidden_size_per_layer_input": c.per_layer_input_size,
        "vocab_size_per_layer_input": c.per_layer_vocab_size, "use_double_wide_mlp": c.double_wide_mlp,
        "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "float32", **moe,
    }
