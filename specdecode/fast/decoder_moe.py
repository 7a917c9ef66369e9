"""The fused decoder's mixture-of-experts layers (decoder_moe.c; the eager form: models/moe.py)."""
from __future__ import annotations

import ctypes

import torch

from .quant import QuantLinear


def bind_moe(model, m, keep: list, arr, kept_layers: list, Dp: int, max_rows: int, packed) -> torch.Tensor:
    """Mixture-of-experts layers (models/moe.py, decoder_moe.c): routers, each expert's projections
    (packed or quantized, per layer an array of E) and biases, the router and activation variants, and
    the scratch of a pass's routed rows, set in the fused decoder's sd_model `m` (`arr`: its pointer
    arrays, kept alive in `keep`). Returns the [layers]
    int32 tensor where each pass leaves the distinct experts each layer read. `max_rows`: the rows of one
    native call (decoder.MAX_MOE_T); `packed`: a linear's packed weight or None (decoder._packed)."""
    c, dt = model.config, model.dtype
    moe_layers = [ly for ly in kept_layers if "router" in ly]
    E, K = c.moe["experts"], c.moe["used"]
    EI, EIp = c.moe["intermediate"], moe_layers[0]["experts_down"][0].Kp if moe_layers else 32
    for ly in moe_layers:
        if ly["router"].Kp != Dp or any(lin.Kp != EIp for lin in ly["experts_down"]):
            raise RuntimeError("MoE projections with another padded width")

    def per_layer(key, pick):
        return arr([arr([pick(lin) for lin in ly[key]]).value if "router" in ly else None for ly in kept_layers])

    m.E, m.EK, m.EI, m.EIp, m.norm_topk = E, K, EI, EIp, int(bool(c.moe["norm_topk"]))
    m.router_w = arr([packed(ly["router"]) if "router" in ly else None for ly in kept_layers])
    quant = any(isinstance(lin, QuantLinear) for ly in moe_layers for lin in ly["experts_gate_up"])
    qmat = lambda lin: ctypes.addressof(lin.qmat) if isinstance(lin, QuantLinear) else None  # noqa: E731
    if quant:
        m.egu_q, m.edn_q = per_layer("experts_gate_up", qmat), per_layer("experts_down", qmat)
    m.egu_w, m.edn_w = per_layer("experts_gate_up", packed), per_layer("experts_down", packed)
    if any(lin.bias32 is not None for ly in moe_layers for lin in [ly["router"]] + ly["experts_gate_up"]
           + ly["experts_down"]):                                        # gpt-oss's biases
        m.router_b = arr([ly["router"].bias32 if "router" in ly else None for ly in kept_layers])
        bias = lambda lin: lin.bias32  # noqa: E731
        m.egu_b, m.edn_b = per_layer("experts_gate_up", bias), per_layer("experts_down", bias)
    m.router_kind = int(c.moe.get("router", "softmax") == "topk_softmax")
    if c.moe.get("activation") == "swiglu_clamp":
        m.act_kind, m.swiglu_alpha, m.swiglu_limit = 1, c.moe["alpha"], c.moe["limit"]
    rows = max_rows * K
    scratch = dict(ex=torch.zeros(rows, Dp, dtype=dt), egu=torch.zeros(rows, 2 * EI, dtype=dt),
                   eact=torch.zeros(rows, EIp, dtype=dt), ey=torch.zeros(rows, c.hidden_size, dtype=dt),
                   rlog=torch.zeros(max_rows, E, dtype=dt))
    moe_count = torch.zeros(len(kept_layers), dtype=torch.int32)
    keep += list(scratch.values()) + [moe_count]
    for name, tensor in scratch.items():
        setattr(m, name, tensor.data_ptr())
    m.moe_count = moe_count.data_ptr()
    return moe_count

