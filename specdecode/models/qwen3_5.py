"""Qwen3.5's text decoder natively (Qwen Team 2026), as transformers computes it
(models/qwen3_5/modeling_qwen3_5.py): a hybrid of Gated DeltaNet layers (Yang et al. 2024,
"Gated Delta Networks") and gated attention layers (`layer_types`: three linear to one full).

- Norms multiply by (1 + weight), computed in float32 (as Gemma's), except the DeltaNet output
  norm, which multiplies by its weight and then by silu(z), z a projection of the layer input.
- A DeltaNet layer: q|k|v from one projection go through a causal depthwise conv1d (its state: the
  last kernel-1 inputs) and silu; q and k are L2-normalized per head, q scaled by dk**-0.5; each
  value head keeps a [dk, dv] state S, decayed by exp(g) (g = -exp(A_log) softplus(a + dt_bias))
  and corrected by the delta rule with strength beta = sigmoid(b):
      S <- S exp(g) + k (beta (v - S^T k))^T,   out = S^T q.
  A pass of a few tokens runs that token by token; a long one (prefill) in chunks of CHUNK tokens,
  the same recurrence in matrix form (the WY / UT transform of DeltaNet), both in float32.
- An attention layer's q projection carries a gate per head: out = o(attn * sigmoid(gate)); q and
  k heads are normalized; RoPE rotates the first quarter of each head (partial_rotary_factor).

The recurrent states live in cache/recurrent.py's HybridCache (a pass reads them, `truncate`
sets them), so speculation rolls back by a length change as for every other model. Chains only.

A checkpoint's multi-token-prediction head (`mtp.*`: one more gated attention layer, which
transformers does not load) is kept as `mtp`; drafters/mtp.py drafts with it.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from ..cache.recurrent import REPLAY_TOKENS, HybridCache, delta_step
from ..fast.quant import QuantWeight
from ..forward import ForwardBatch
from .config import ModelConfig, ModelError
from .gemma import fp32_rms_norm
from .moe import build_layer as build_moe
from .moe import build_shared, moe_mlp
from .moe import projections as moe_projections
from .transformer import Transformer, apply_rope, attention_mask, cat_rows, eager_linear, rope_at, rope_inv_freq

CHUNK = 64              # tokens per chunk of the chunked delta rule
RECURRENT_TOKENS = 16   # eager passes up to this many tokens run token by token
NATIVE_TOKENS = 64      # native passes up to this many tokens (fast/deltanet.py MAX_TOKENS) run token by token
STACK_ROWS = 64         # passes of up to this many token rows run the whole stack in one call (fast/hybrid.py)


class Qwen35Transformer(Transformer):
    supports_trees = False          # a tree's nodes would each need their own path's recurrent state
    fused_in_init = False           # the fused C decoder knows attention layers only: eager here

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], make_linear=eager_linear) -> None:
        self.config = c = config
        self.embed = weights["model.embed_tokens.weight"]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        lin = c.linear_attention
        self.kernel = lin["conv_kernel"]
        self.layers, kv_index, state_index = [], 0, 0
        for i in range(c.num_layers):
            linear = c.linear_layers[i]
            self.layers.append(self._layer(weights, f"model.layers.{i}.", linear, state_index if linear else kv_index,
                                           make_linear))
            state_index, kv_index = state_index + linear, kv_index + (not linear)
        self.num_attention_layers, self.num_recurrent_layers = kv_index, state_index
        self.native = self._native_delta_net(make_linear)
        ops = getattr(make_linear, "row_ops", None)
        self.ops = ops() if ops is not None and self.device.type == "cpu" else None   # native norms etc.
        if self.ops is not None and not self.ops.supports(self.dtype):
            self.ops = None
        self.final_norm = self._norm(weights["model.norm.weight"])
        head = weights.get("lm_head.weight")
        if head is None or (c.tie_word_embeddings and not isinstance(head, QuantWeight)):
            head = self.embed
        self.lm_head = make_linear(head, None)
        self._make_linear = make_linear
        self._head_weight = self._head_source = head
        self.quantized = any(isinstance(w, QuantWeight) for w in weights.values())
        nbytes = lambda w: w.nbytes if isinstance(w, QuantWeight) else w.numel() * w.element_size()   # noqa: E731
        routed = c.moe["used"] / c.moe["experts"] if c.moe else 1.0      # the share of the experts a token reads
        self._weight_bytes = int(sum(nbytes(w) * (routed if ".mlp.experts." in name else 1.0)
                                     for name, w in weights.items() if not name.startswith("mtp.")
                                     and (name != "model.embed_tokens.weight" or head is self.embed)))
        self.mtp, self.mtp_problem = self._mtp_head(weights, make_linear)
        self.mtp_bytes = sum(nbytes(w) for name, w in weights.items() if name.startswith("mtp."))
        angles = torch.outer(torch.arange(c.max_position_embeddings + 64, dtype=torch.float32), rope_inv_freq(c))
        angles = torch.cat([angles, angles], dim=-1)                     # [max_pos, rotary_dim]
        self.rope_cos = angles.cos().to(self.dtype).to(self.device)
        self.rope_sin = angles.sin().to(self.dtype).to(self.device)
        self.fused = None
        self._skip_decoders: dict = {}
        stack = getattr(make_linear, "hybrid_stack", None)     # short passes in one native call (fast/hybrid.py)
        self.stack = stack(self) if stack is not None and self.device.type == "cpu" else None
        # prompts prefill in passes the stack takes whole (faster than longer passes through the chunked
        # rule in torch: RESULTS.md); None: the engine's own prefill chunk
        self.prefill_tokens = STACK_ROWS if self.stack is not None else None

    def _native_delta_net(self, make_linear):
        """The native DeltaNet kernels (fast/deltanet.py) for short passes, each linear layer's
        constants under "native"; None (eager) where make_linear has none or they cannot run this model."""
        loader = getattr(make_linear, "delta_net", None)
        native = loader() if loader is not None and self.device.type == "cpu" else None
        if native is None or native.supports(self.config.linear_attention, self.dtype) is not None:
            return None
        for layer in self.layers:
            if layer["kind"] == "linear":
                layer["native"] = native.layer(layer, self.config.linear_attention, self.config.rms_norm_eps,
                                               self.dtype)
        return native

    @staticmethod
    def _norm(weight: torch.Tensor) -> torch.Tensor:
        return 1.0 + weight.float()          # (1 + weight) in float32, as the reference multiplies

    def _layer(self, weights: dict, p: str, linear: bool, index: int, make_linear) -> dict:
        """One decoder layer's weights under prefix `p`: a DeltaNet layer's (`index`: its recurrent
        state) or a gated attention layer's (`index`: its layer of the KV cache)."""
        layer = {"attn_norm": self._norm(weights[p + "input_layernorm.weight"]),
                 "mlp_norm": self._norm(weights[p + "post_attention_layernorm.weight"]), "index": index}
        if p + "mlp.gate.weight" in weights:          # Qwen3.5-MoE: routed experts and a shared one (models/moe.py)
            layer.update(build_moe(weights, p, self.config, make_linear), moe=self.config.moe,
                         **build_shared(weights, p, make_linear, lambda ws: cat_rows(ws, self.dtype)))
        else:
            layer.update(gate_up=make_linear(cat_rows([weights[p + "mlp.gate_proj.weight"],
                                                       weights[p + "mlp.up_proj.weight"]], self.dtype), None),
                         down=make_linear(weights[p + "mlp.down_proj.weight"], None))
        if linear:
            a = p + "linear_attn."
            inputs = cat_rows([weights[a + f"in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a")], self.dtype)
            layer.update(kind="linear", inputs=make_linear(inputs, None),
                         conv=weights[a + "conv1d.weight"].reshape(-1, 1, self.kernel),   # [conv_dim, 1, kernel]
                         conv_f32=weights[a + "conv1d.weight"].reshape(-1, 1, self.kernel).float(),
                         decay_rate=-weights[a + "A_log"].float().exp(),                 # [Hv]
                         dt_bias=weights[a + "dt_bias"].float(),
                         out_norm=weights[a + "norm.weight"],
                         out=make_linear(weights[a + "out_proj.weight"], None))
        else:
            s = p + "self_attn."
            layer.update(kind="attention",
                         qkv=make_linear(cat_rows([weights[s + f"{n}_proj.weight"] for n in "qkv"], self.dtype), None),
                         o=make_linear(weights[s + "o_proj.weight"], None),
                         q_norm=self._norm(weights[s + "q_norm.weight"]),
                         k_norm=self._norm(weights[s + "k_norm.weight"]))
        return layer

    def _mtp_head(self, weights: dict, make_linear) -> tuple[dict | None, str]:
        """The checkpoint's multi-token-prediction head (`mtp.*`, which transformers does not load;
        drafters/mtp.py drafts with it), else None and what is wrong with it ("": a checkpoint without one)."""
        names = [n for n in weights if n.startswith("mtp.")]
        if not names:
            return None, ""
        layers = sorted({n.split(".")[2] for n in names if n.startswith("mtp.layers.")})
        if layers != ["0"]:
            return None, f"has {len(layers)} layers, where the drafter runs one (mtp.layers.0)"
        try:
            head = {"fc": make_linear(weights["mtp.fc.weight"], None),
                    "embed_norm": self._norm(weights["mtp.pre_fc_norm_embedding.weight"]),
                    "hidden_norm": self._norm(weights["mtp.pre_fc_norm_hidden.weight"]),
                    "norm": self._norm(weights["mtp.norm.weight"]),
                    "layer": self._layer(weights, "mtp.layers.0.", False, 0, make_linear)}
        except KeyError as exc:
            return None, f"lacks the tensor {exc.args[0]}"
        return head, ""

    def projections(self) -> list:
        return [self.lm_head] + [lin for ly in self.layers for lin in (
            [ly[k] for k in ("qkv", "o", "inputs", "out", "gate_up", "down") if k in ly]
            + (moe_projections(ly) if "router" in ly else []))]

    def weight_bytes(self) -> int:
        """Bytes of weights read per decoded token (the embedding table only as a tied head)."""
        return self._weight_bytes

    def new_paged_cache(self, rows: int, max_len: int, num_blocks: int, block_size: int) -> HybridCache:
        c, lin = self.config, self.config.linear_attention
        conv_dim = 2 * lin["key_heads"] * lin["key_dim"] + lin["value_heads"] * lin["value_dim"]
        return HybridCache(self.num_attention_layers, self.num_recurrent_layers, conv_dim, self.kernel,
                           lin["value_heads"], lin["key_dim"], lin["value_dim"], rows, c.num_kv_heads, c.head_dim,
                           max_len, num_blocks, block_size, self.dtype, self.device,
                           replay=self.native.replay if self.native is not None else None)

    def new_cache(self, batch_size: int, max_len: int):
        raise ModelError("a Qwen3.5 model runs on its paged hybrid cache (new_paged_cache)")

    @torch.inference_mode()
    def run(self, fb: ForwardBatch, cache: HybridCache, skip: frozenset[int] = frozenset()) -> torch.Tensor:
        """One chain pass (specdecode/forward.py): writes the attention layers' keys and values,
        records the recurrent layers' states for `cache.truncate`; [B, T, D] hidden states."""
        if not fb.is_chain:
            raise ModelError("Qwen3.5's recurrent layers verify chains only: use a drafter that proposes chains")
        c = self.config
        batch, num_tokens = fb.tokens.shape
        rows = list(range(batch)) if fb.rows is None else [int(r) for r in fb.rows.tolist()]
        starts, widths = fb.starts(), fb.lengths or [num_tokens] * batch
        if self.stack is not None and not skip and batch * num_tokens <= STACK_ROWS and num_tokens <= NATIVE_TOKENS:
            return self.stack.run(fb.tokens, cache, rows, starts, widths)
        cos, sin = rope_at(self.rope_cos, self.rope_sin, fb, self.device)
        mask = attention_mask(fb, None, self.device)
        hidden = F.embedding(fb.tokens, self.embed)                          # [B, T, D]

        layout = []                   # the native attention's cache layout, made by its first layer

        def attend(index: int, q, k, v):
            if self.ops is not None and num_tokens <= NATIVE_TOKENS:    # natively, as the DeltaNet layers
                if not layout:
                    layout.append(cache.layout(rows, starts, num_tokens))
                out = self.ops.chain_attention(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
                                               v.transpose(1, 2).contiguous(),
                                               layout[0], index, starts, c.head_dim ** -0.5)
                return out.transpose(1, 2)
            keys, values = cache.write(index, fb.rows, fb.start, k, v)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        for index, layer in enumerate(self.layers):
            if index in skip:
                continue
            if layer["kind"] == "linear":
                mix = partial(self._delta_net, layer, cache=cache, rows=rows, starts=starts, widths=widths)
            else:
                mix = partial(gated_attention, layer, c, cos=cos, sin=sin, attend=partial(attend, layer["index"]),
                              ops=self.ops)
            hidden = decoder_layer(layer, c.rms_norm_eps, hidden, mix, self.ops)
        return hidden

    def _delta_net(self, layer: dict, x: torch.Tensor, cache: HybridCache, rows: list[int], starts: list[int],
                   widths: list[int]) -> torch.Tensor:
        lin = self.config.linear_attention
        batch, num_tokens, _ = x.shape
        hk, hv, dk, dv = lin["key_heads"], lin["value_heads"], lin["key_dim"], lin["value_dim"]
        conv_dim = 2 * hk * dk + hv * dv
        proj = layer["inputs"](x)                                            # [B, T, conv_dim + hv*dv + 2 hv]
        if self.native is not None and num_tokens <= NATIVE_TOKENS:     # one native call: see fast/deltanet.py
            conv_states, states = cache.state_refs(layer["index"], rows)
            conv_inputs, final, steps, gated = self.native.mix(layer["native"], proj, conv_states, rows, states,
                                                               widths)
            cache.record(layer["index"], rows, starts, widths, conv_inputs, final, steps)
            return layer["out"](gated)
        qkv, z, b, a = proj.split([conv_dim, hv * dv, hv, hv], dim=-1)
        conv_state, state = cache.states(layer["index"], rows)               # [B, C, K-1], [B, Hv, dk, dv]
        conv_inputs = torch.cat([conv_state, qkv.transpose(1, 2)], dim=2)     # [B, C, K-1+T]
        if num_tokens <= RECURRENT_TOKENS:    # a few windows: a product and a sum (conv1d's call costs more)
            windows = conv_inputs.unfold(2, self.kernel, 1).float()                          # [B, C, T, K]
            mixed = F.silu((windows * layer["conv_f32"]).sum(-1)).to(x.dtype).transpose(1, 2)  # [B, T, C]
        else:
            mixed = F.silu(F.conv1d(conv_inputs, layer["conv"], groups=conv_dim)).transpose(1, 2)
        q, k, v = mixed.float().split([hk * dk, hk * dk, hv * dv], dim=-1)
        q = _l2norm(q.view(batch, num_tokens, hk, dk)) * dk ** -0.5
        k = _l2norm(k.view(batch, num_tokens, hk, dk))
        if hv != hk:        # each q/k head serves hv / hk value heads: grouped, or tiled (a GGUF file's order)
            if lin.get("tiled"):
                q, k = q.repeat(1, 1, hv // hk, 1), k.repeat(1, 1, hv // hk, 1)
            else:
                q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
        v = v.view(batch, num_tokens, hv, dv)
        beta = torch.sigmoid(b).float()                                                   # [B, T, Hv]
        decay = layer["decay_rate"] * F.softplus(a.float() + layer["dt_bias"])           # [B, T, Hv] (<= 0)
        if any(w != num_tokens for w in widths):      # padding after a row's tokens leaves its state alone
            real = torch.arange(num_tokens)[None, :] < torch.tensor(widths)[:, None]      # [B, T]
            beta, decay = beta * real[..., None], decay * real[..., None]
        if num_tokens <= RECURRENT_TOKENS:
            out, final = _recurrent(q, k, v, decay, beta, state)
        else:
            out, final = _chunked(q, k, v, decay, beta, state)
        cache.record(layer["index"], rows, starts, widths, conv_inputs, final,
                     (q, k, v, decay, beta) if num_tokens <= REPLAY_TOKENS else None)
        out = out.to(x.dtype)                                                              # [B, T, Hv, dv]
        normed = F.rms_norm(out.float(), (dv,), None, self.config.rms_norm_eps).to(x.dtype) * layer["out_norm"]
        gated = (normed * F.silu(z.view(batch, num_tokens, hv, dv).float())).to(x.dtype)
        return layer["out"](gated.reshape(batch, num_tokens, hv * dv))

    def _final(self, hidden: torch.Tensor, head=None) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        hidden = fp32_rms_norm(hidden, self.final_norm, eps) if self.ops is None else \
            self.ops.rms_norm(hidden.contiguous(), self.final_norm, eps)
        return (self.lm_head if head is None else head)(hidden).float()


def decoder_layer(layer: dict, eps: float, hidden: torch.Tensor,      # [B, T, D]
                  mix: Callable[[torch.Tensor], torch.Tensor], ops=None) -> torch.Tensor:
    """One layer: hidden + mix(norm(hidden)) (the token mixer: DeltaNet or gated attention),
    then hidden + the SwiGLU MLP of norm(hidden). `ops`: the native row ops (fast/rowops.py), or
    None for torch's."""
    if ops is not None:
        hidden, x = ops.add_rms_norm(hidden, mix(ops.rms_norm(hidden, layer["attn_norm"], eps)), layer["mlp_norm"],
                                     eps)
        if "router" in layer:
            return hidden + moe_mlp(layer, x, layer["moe"])
        return hidden + layer["down"](ops.silu_mul(layer["gate_up"](x)))
    hidden = hidden + mix(fp32_rms_norm(hidden, layer["attn_norm"], eps))
    x = fp32_rms_norm(hidden, layer["mlp_norm"], eps)
    if "router" in layer:
        return hidden + moe_mlp(layer, x, layer["moe"])
    gate, up = layer["gate_up"](x).chunk(2, dim=-1)
    return hidden + layer["down"](F.silu(gate) * up)


def gated_attention(layer: dict, c, x: torch.Tensor,     # c: num_heads, num_kv_heads, head_dim, rms_norm_eps
                    cos: torch.Tensor, sin: torch.Tensor,  # broadcastable to [B, heads, T, rotary_dim]
                    attend: Callable,      # (q, k, v) -> [B, H, T, hd]; it keeps the keys
                    ops=None) -> torch.Tensor:     # the native row ops (fast/rowops.py), or None: torch's
    """A gated attention layer's output for its normed input x [B, T, D]: q heads carry a gate,
    out = o(attention * sigmoid(gate)); q and k heads are normalized, then RoPE'd (partially)."""
    batch, num_tokens, _ = x.shape
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q_gate, k, v = layer["qkv"](x).split([2 * q_size, kv_size, kv_size], dim=-1)
    q, gate = q_gate.view(batch, num_tokens, c.num_heads, 2 * c.head_dim).chunk(2, dim=-1)
    if ops is not None:           # norm + RoPE of each head in one call, the gate in another
        rot = cos.shape[-1]
        cos, sin = cos.reshape(-1, rot), sin.reshape(-1, rot)           # [T or B*T, rot]: row of (b, t)
        q = ops.rms_norm(q, layer["q_norm"], c.rms_norm_eps, cos, sin).transpose(1, 2)           # [B, H, T, hd]
        k = ops.rms_norm(k.view(batch, num_tokens, c.num_kv_heads, c.head_dim), layer["k_norm"], c.rms_norm_eps,
                         cos, sin).transpose(1, 2)
        v = v.view(batch, num_tokens, c.num_kv_heads, c.head_dim).transpose(1, 2)
        attn = attend(q, k, v).transpose(1, 2).contiguous()                                     # [B, T, H, hd]
        return layer["o"](ops.sigmoid_gate(attn, gate).view(batch, num_tokens, q_size))
    q = fp32_rms_norm(q, layer["q_norm"], c.rms_norm_eps).transpose(1, 2)          # [B, H, T, hd]
    k = fp32_rms_norm(k.view(batch, num_tokens, c.num_kv_heads, c.head_dim), layer["k_norm"],
                      c.rms_norm_eps).transpose(1, 2)
    v = v.view(batch, num_tokens, c.num_kv_heads, c.head_dim).transpose(1, 2)
    attn = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
    attn = attn.transpose(1, 2).reshape(batch, num_tokens, q_size)
    return layer["o"](attn * torch.sigmoid(gate.reshape(batch, num_tokens, q_size)))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _recurrent(q, k, v, decay, beta, state):
    """Token by token: out [B, T, H, dv], the state after the last token [B, H, dk, dv]."""
    outs = []
    for t in range(q.shape[1]):
        state, out = delta_step(state, q[:, t], k[:, t], v[:, t], decay[:, t], beta[:, t])
        outs.append(out)                                                      # [B, H, dv]
    return torch.stack(outs, dim=1), state


def _chunked(q, k, v, decay, beta, state):
    """The same recurrence CHUNK tokens at a time: within a chunk, the delta rule's corrections
    solved at once (a unit lower-triangular system), then one state update per chunk."""
    batch, num_tokens, heads, dk = k.shape
    pad = -num_tokens % CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(1, 2) for t in (q, k, v))      # [B, H, T', d]
    decay, beta = (F.pad(t, (0, 0, 0, pad)).transpose(1, 2) for t in (decay, beta))      # [B, H, T']
    n = q.shape[2] // CHUNK
    q, k, v = (t.reshape(batch, heads, n, CHUNK, -1) for t in (q, k, v))                 # [B, H, n, C, d]
    cum = decay.reshape(batch, heads, n, CHUNK).cumsum(-1)                                # [B, H, n, C]
    beta = beta.reshape(batch, heads, n, CHUNK)[..., None]
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()   # [B, H, n, C, C]
    lower = ((beta * k) @ k.transpose(-1, -2) * pair).masked_fill(causal.logical_not() | torch.eye(
        CHUNK, dtype=torch.bool), 0.0)
    system = lower + torch.eye(CHUNK)
    values = torch.linalg.solve_triangular(system, beta * v, upper=False, unitriangular=True)
    keys = torch.linalg.solve_triangular(system, beta * k * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * pair                                             # [B, H, n, C, C]
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(values)
    for i in range(n):
        corrected = values[:, :, i] - keys[:, :, i] @ state                               # [B, H, C, dv]
        out[:, :, i] = q_decayed[:, :, i] @ state + scores[:, :, i] @ corrected
        state = state * cum[:, :, i, -1].exp()[..., None, None] + k_to_end[:, :, i].transpose(-1, -2) @ corrected
    out = out.reshape(batch, heads, n * CHUNK, -1)[:, :, :num_tokens].transpose(1, 2)
    return out, state
