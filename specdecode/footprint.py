"""Bytes of a native model's weights and of its KV cache per token, from its config (the
server's memory budget; a draft model's cost relative to its target)."""
from __future__ import annotations


def weights_bytes(model) -> int:
    """Bytes of a native model's weights, from its config (an untied LM head counted too)."""
    if model is None:
        return 0
    c = model.config
    element = model.embed.element_size()
    if getattr(model, "quantized", False):      # quantized projections: their own bytes
        return (sum(lin.nbytes if hasattr(lin, "nbytes") else lin.out_features * lin.in_features * element
                    for lin in model.projections()) + model.embed.numel() * element)
    untied_head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    return (c.weight_count() + untied_head) * element


def kv_bytes_per_token(model) -> int:
    if model is None or not hasattr(model, "config"):     # none, or the transformers adapter's own caches
        return 0
    return model.config.kv_elements_per_token() * model.embed.element_size()
