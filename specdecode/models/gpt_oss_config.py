"""gpt-oss's config fields (transformers' `gpt_oss` config.json to ModelConfig's fields and back),
apart from the decoder (models/gpt_oss.py) so that models/config.py reads them without importing it.
"""
from __future__ import annotations

from .errors import ModelError

MODEL_TYPE = "gpt_oss"
ARCH = "gpt-oss"


def hf_fields(cfg: dict) -> dict:
    """The ModelConfig fields of a gpt_oss config.json."""
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != layers:
        raise ModelError(f"layer_types must name sliding_attention / full_attention for each of {layers} layers, "
                         f"got {types}")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta") or rope.pop("rope_theta", None) or 150000.0)
    rope.pop("rope_theta", None)
    if rope.get("rope_type", rope.get("type")) in (None, "default"):
        rope = {}
    heads = int(cfg["num_attention_heads"])
    eos = cfg.get("eos_token_id")
    window = cfg.get("sliding_window")
    return dict(
        arch=ARCH, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=layers, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=theta, rope_scaling=rope or None,
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", True)), bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        sliding_window=int(window) if window else None,
        sliding_layers=tuple(t == "sliding_attention" for t in types) if window else None,
        attention_sinks=True,
        moe={"experts": int(cfg.get("num_local_experts") or cfg.get("num_experts")),
             "used": int(cfg["num_experts_per_tok"]), "intermediate": int(cfg["intermediate_size"]),
             "norm_topk": False, "router": "topk_softmax", "activation": "swiglu_clamp",
             "alpha": float(cfg.get("swiglu_alpha", 1.702)), "limit": float(cfg.get("swiglu_limit", 7.0))},
        moe_layers=(True,) * layers)


def hf_config(config) -> dict:
    """config.json for transformers' GptOssForCausalLM (the converted-GGUF cache)."""
    moe = config.moe
    eos = list(config.eos_token_ids)
    rope = dict(config.rope_scaling or {"rope_type": "default"}, rope_theta=config.rope_theta)
    return {"architectures": ["GptOssForCausalLM"], "model_type": MODEL_TYPE, "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "intermediate_size": moe["intermediate"],
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "rms_norm_eps": config.rms_norm_eps, "rope_parameters": rope,
            "max_position_embeddings": config.max_position_embeddings,
            "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
            "bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "num_local_experts": moe["experts"], "num_experts_per_tok": moe["used"],
            "swiglu_alpha": moe["alpha"], "swiglu_limit": moe["limit"], "sliding_window": config.sliding_window,
            "layer_types": ["sliding_attention" if config.layer_window(i) else "full_attention"
                            for i in range(config.num_layers)], "torch_dtype": "float32"}
