"""Architecture hyper-parameters of a Llama/Mistral/SmolLM3/Qwen2/Qwen3/Phi-3/Gemma 2/3/4 decoder,
read from an HF config.json or from GGUF metadata. Validated on construction.

Mistral is Llama with a sliding attention window (`sliding_window`: each query sees the keys at
positions p-W+1..p); SmolLM3 is Llama without RoPE on some layers (`rope_layers`); Phi-3 is Llama
with fused qkv_proj / gate_up_proj weights, an optional sliding window and optionally RoPE on only
the first `partial_rotary_factor` of each head.

Gemma 2 / Gemma 3 (models/gemma.py) scale the embeddings by sqrt(hidden_size), use (1 + weight)
RMSNorms with a norm after attention and around the GeGLU MLP, scale attention scores by
`query_pre_attn_scalar`**-0.5, and window only some layers (`sliding_layers`: Gemma 2 every other
one, Gemma 3 five of six). Gemma 2 soft-caps attention scores and logits (`attn_logit_softcapping`,
`final_logit_softcapping`); Gemma 3 normalizes q/k heads (`qk_norm`) and gives its windowed layers
their own unscaled RoPE base (`rope_local_theta`). Gemma 4 (models/gemma4.py, its fields read in
models/gemma_config.py) adds wider heads on its global layers, layers that reuse an earlier layer's
keys and values, and a second embedding feeding every layer."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ModelError
from .gemma_config import gemma4_fields, gemma4_hf_config, gemma4_weight_count, gemma_fields, gemma_hf_config

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gemma4", "qwen3_5", "qwen3moe",
                  "gpt-oss")
GEMMA_ARCHS = ("gemma2", "gemma3")          # (1 + weight) norms, the fused decoder's Gemma path
SUPPORTED_ROPE_SCALING = (None, "default", "linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True)
class ModelConfig:
    arch: str                      # "llama" (also Mistral, SmolLM3), "qwen2", "qwen3", "phi3", "gemma2/3/4"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # q/k/v projections have biases (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    qk_norm: bool = False          # RMSNorm over each q / k head before RoPE (Qwen3)
    sliding_window: int | None = None   # each query sees the last W keys (positions p-W+1..p); None = all
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dims of each head (Phi-3)
    sliding_layers: tuple[bool, ...] | None = None  # the layers the window applies to; None = all (Gemma: some)
    rope_local_theta: float | None = None           # RoPE base of the windowed layers, unscaled (Gemma 3)
    query_pre_attn_scalar: float | None = None      # scores scaled by this**-0.5; None = head_dim (Gemma)
    attn_logit_softcapping: float | None = None     # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None    # logits -> cap * tanh(logits / cap) (Gemma 2)
    linear_layers: tuple[bool, ...] | None = None   # Gated DeltaNet layers (Qwen3.5); the rest attention
    linear_attention: dict[str, int] | None = None  # their geometry: key_heads, value_heads, key_dim,
                                                    # value_dim, conv_kernel (models/qwen3_5.py)
    rope_layers: tuple[bool, ...] | None = None     # the layers RoPE applies to; None = all (SmolLM3: some)
    # Gemma 4 (models/gemma4.py)
    global_head_dim: int | None = None      # head dim of the global (full-attention) layers; None = head_dim
    global_kv_heads: int | None = None      # their kv heads; None = num_kv_heads
    k_eq_v: bool = False                    # the global layers' values are their keys (no v_proj)
    kv_shared_layers: int = 0               # the last n layers reuse the keys/values of an earlier layer
    per_layer_input_size: int = 0           # width of each layer's per-layer input; 0 = none
    per_layer_vocab_size: int = 0           # rows of the per-layer embedding table
    double_wide_mlp: bool = False           # the kv-shared layers' MLPs are twice intermediate_size
    # mixture of experts (models/moe.py): experts, used (routed per token), intermediate (each expert's),
    # norm_topk (the k weights renormalised), router / activation (gpt-oss's variants, models/moe.py);
    # moe_layers: which layers have them (the rest a dense MLP)
    moe: dict[str, Any] | None = None
    moe_layers: tuple[bool, ...] | None = None
    attention_sinks: bool = False           # a learned logit per q head joins each softmax's denominator (gpt-oss)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelError(f"architecture {self.arch!r} is not native (native: {', '.join(SUPPORTED_ARCHS)})")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type"))
        if kind not in SUPPORTED_ROPE_SCALING or (kind == "proportional") != (self.arch == "gemma4"):
            raise ModelError(f"rope_scaling type {kind!r} is not supported natively for {self.arch} "
                             f"(supported: linear, llama3, yarn; Gemma 4: proportional)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelError(f"sliding_window must be >= 1 (or null for none), got {self.sliding_window}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ModelError(f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1] and give an "
                             f"even number of rotary dims of head_dim {self.head_dim} (got {self.rotary_dim})")
        if self.sliding_layers is not None:          # a tuple also when read back from JSON
            object.__setattr__(self, "sliding_layers", tuple(bool(x) for x in self.sliding_layers))
        if self.linear_layers is not None:
            object.__setattr__(self, "linear_layers", tuple(bool(x) for x in self.linear_layers))
            if len(self.linear_layers) != self.num_layers:
                raise ModelError(f"layer_types names {len(self.linear_layers)} layers, the model has {self.num_layers}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ModelError(f"layer_types names {len(self.sliding_layers)} layers, the model has {self.num_layers}")
        if self.rope_layers is not None:
            object.__setattr__(self, "rope_layers", tuple(bool(x) for x in self.rope_layers))
            if len(self.rope_layers) != self.num_layers:
                raise ModelError(f"no_rope_layers names {len(self.rope_layers)} layers, "
                                 f"the model has {self.num_layers}")
        if self.arch == "gemma4":
            self._check_gemma4()
        if self.moe is not None:
            from .moe import check_config
            check_config(self)
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ModelError(f"{name} must be > 0 (or null for none), got {value}")

    def _check_gemma4(self) -> None:
        """Gemma 4's own fields: every kv-shared layer has an earlier layer of its type to read from."""
        if self.sliding_layers is None:
            raise ModelError("a Gemma 4 config needs layer_types")
        if not 0 <= self.kv_shared_layers < self.num_layers:
            raise ModelError(f"num_kv_shared_layers must be in [0, {self.num_layers - 1}] (a layer must make the "
                             f"keys the others reuse), got {self.kv_shared_layers}")
        first = self.num_layers - self.kv_shared_layers
        missing = set(self.sliding_layers[first:]) - set(self.sliding_layers[:first])
        if missing:
            kind = "sliding_attention" if missing.pop() else "full_attention"
            raise ModelError(f"num_kv_shared_layers {self.kv_shared_layers}: no {kind} layer before layer {first} "
                             f"makes the keys the shared {kind} layers reuse")
        for name in ("global_head_dim", "global_kv_heads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ModelError(f"{name} must be >= 1, got {value}")
        if self.global_kv_heads is not None and self.num_heads % self.global_kv_heads:
            raise ModelError(f"num_heads {self.num_heads} must be a multiple of num_global_key_value_heads "
                             f"{self.global_kv_heads}")
        if self.per_layer_input_size < 0 or (self.per_layer_input_size and self.per_layer_vocab_size < 1):
            raise ModelError(f"hidden_size_per_layer_input {self.per_layer_input_size} needs >= 0, and "
                             f"vocab_size_per_layer_input >= 1 when > 0 (got {self.per_layer_vocab_size})")

    @property
    def is_gemma(self) -> bool:
        return self.arch in GEMMA_ARCHS

    def layer_head_dim(self, layer: int) -> int:
        """Head dim of layer `layer` (Gemma 4's global layers may have wider heads)."""
        if self.global_head_dim is not None and self.sliding_layers is not None and not self.sliding_layers[layer]:
            return self.global_head_dim
        return self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        if self.global_kv_heads is not None and self.sliding_layers is not None and not self.sliding_layers[layer]:
            return self.global_kv_heads
        return self.num_kv_heads

    @property
    def kv_layers(self) -> list[int]:
        """The layers that keep keys/values in a cache, in cache order (Gemma 4's kv-shared layers keep
        none, nor do Qwen3.5's Gated DeltaNet layers)."""
        return [i for i in range(self.num_layers - self.kv_shared_layers)
                if self.linear_layers is None or not self.linear_layers[i]]

    def kv_geometry(self) -> tuple[int, int | tuple[int, ...], int | tuple[int, ...]]:
        """(cache layers, kv heads, head dim) for a KV cache of this model: ints when every cache layer
        has the same shape, else one per cache layer."""
        layers = self.kv_layers
        heads = tuple(self.layer_kv_heads(i) for i in layers)
        dims = tuple(self.layer_head_dim(i) for i in layers)
        return (len(layers), heads[0] if len(set(heads)) == 1 else heads, dims[0] if len(set(dims)) == 1 else dims)

    def kv_elements_per_token(self) -> int:
        """Key + value elements a token keeps in the cache, over all cache layers."""
        return 2 * sum(self.layer_kv_heads(i) * self.layer_head_dim(i) for i in self.kv_layers)

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer `layer` (None = it sees every earlier key)."""
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        """Dims of each q/k head that RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "")
        if model_type == "gemma4" and isinstance(cfg.get("text_config"), dict):   # the multimodal wrapper
            return cls(**gemma4_fields(dict(cfg["text_config"], tie_word_embeddings=cfg.get(
                "tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings", True)))))
        if model_type == "qwen3_5" and isinstance(cfg.get("text_config"), dict):
            cfg, model_type = {**cfg["text_config"], "model_type": "qwen3_5_text"}, "qwen3_5_text"
        if model_type == "qwen3_5_moe" and isinstance(cfg.get("text_config"), dict):
            cfg, model_type = {**cfg["text_config"], "model_type": "qwen3_5_moe_text"}, "qwen3_5_moe_text"
        arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama", "smollm3": "llama",
                "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma4_text": "gemma4",
                "qwen3_5_text": "qwen3_5", "qwen3_moe": "qwen3moe", "qwen3_5_moe_text": "qwen3_5"}.get(model_type)
        if model_type == "gpt_oss":
            from .gpt_oss_config import hf_fields as gpt_oss_fields
            return cls(**gpt_oss_fields(cfg))
        if arch is None:
            raise ModelError(f"model_type {model_type!r} is not native")
        if arch == "gemma4":
            return cls(**gemma4_fields(cfg))
        if arch in GEMMA_ARCHS:
            return cls(**gemma_fields(cfg, arch))
        if cfg.get("mlp_bias"):
            raise ModelError(f"mlp_bias (biases on the MLP projections) is not supported natively for {model_type}")
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes "rope_parameters" (with rope_theta inside); older "rope_scaling"
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = cfg.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0
        rope.pop("rope_theta", None)
        partial = float(cfg.get("partial_rotary_factor") or rope.pop("partial_rotary_factor", None)
                        or (0.25 if arch == "qwen3_5" else 1.0))     # Qwen3.5's default: a quarter of each head
        rope.pop("partial_rotary_factor", None)
        if rope.get("rope_type", rope.get("type")) in (None, "default"):
            rope = {}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        hybrid = {}
        if arch == "qwen3_5":
            types = cfg.get("layer_types") or ["full_attention" if (i + 1) % cfg.get("full_attention_interval", 4)
                                               == 0 else "linear_attention" for i in range(cfg["num_hidden_layers"])]
            hybrid = {"linear_layers": tuple(t == "linear_attention" for t in types),
                      "linear_attention": {"key_heads": cfg["linear_num_key_heads"],
                                           "value_heads": cfg["linear_num_value_heads"],
                                           "key_dim": cfg["linear_key_head_dim"],
                                           "value_dim": cfg["linear_value_head_dim"],
                                           "conv_kernel": cfg["linear_conv_kernel_dim"]}}
            # mrope_section: text positions are the same on its three grids, which is plain RoPE
        if arch == "qwen3moe":
            from .moe import hf_fields
            hybrid = hf_fields(cfg)
        if model_type == "qwen3_5_moe_text":       # the hybrid stack with MoE MLPs and a shared expert
            from .moe import qwen3_5_fields
            hybrid.update(qwen3_5_fields(cfg))
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope or None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "smollm3")),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=arch in ("qwen3", "qwen3_5", "qwen3moe"),
            sliding_window=_hf_window(cfg, model_type),
            partial_rotary_factor=partial,
            rope_layers=_hf_rope_layers(cfg, model_type),
            **hybrid,
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json that transformers can load (used for the converted-GGUF cache)."""
        # a windowed llama is Mistral (transformers' Llama has no window)
        if self.is_gemma:
            return gemma_hf_config(self)
        if self.arch == "qwen3_5":
            from .qwen3_5_gguf import hf_config
            return hf_config(self)
        if self.arch == "gemma4":
            return gemma4_hf_config(self)
        if self.arch == "gpt-oss":
            from .gpt_oss_config import hf_config as gpt_oss_config
            return gpt_oss_config(self)
        if self.moe is not None:
            from .moe import hf_config
            return hf_config(self)
        model_type = "mistral" if self.arch == "llama" and self.sliding_window else self.arch
        model_type = "smollm3" if self.rope_layers is not None else model_type
        arch_name = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                     "smollm3": "SmolLM3ForCausalLM"}[model_type]
        rope_layers = {} if self.rope_layers is None else {"no_rope_layers": [int(x) for x in self.rope_layers]}
        eos: Any = list(self.eos_token_ids)
        if len(eos) == 1:
            eos = eos[0]
        return {
            "architectures": [arch_name],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias if self.arch != "qwen2" else None,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "max_window_layers": 0,
            "partial_rotary_factor": self.partial_rotary_factor,
            **rope_layers,
        }

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def weight_count(self) -> int:
        """Parameters read per decoded token (the LM head counted once even when tied)."""
        if self.arch == "gemma4":
            return gemma4_weight_count(self)
        d, hd = self.hidden_size, self.head_dim
        attn = d * (self.num_heads + 2 * self.num_kv_heads) * hd + self.num_heads * hd * d
        per_layer = attn + (4 if self.is_gemma else 2) * d + (2 * hd if self.qk_norm else 0)
        mlps = sum(self.mlp_weight_count(layer) for layer in range(self.num_layers))
        return self.num_layers * per_layer + mlps + self.vocab_size * d + d

    def mlp_weight_count(self, layer: int) -> int:
        """Parameters of layer `layer`'s MLP read per token: a MoE layer's router and routed experts."""
        if self.moe is not None and self.moe_layers[layer]:
            return self.moe["experts"] * self.hidden_size + self.moe["used"] * 3 * self.hidden_size * self.moe[
                "intermediate"]
        return 3 * self.hidden_size * self.intermediate_size


def _hf_window(cfg: dict[str, Any], model_type: str) -> int | None:
    """The attention window an HF config asks for, on every layer, or None. Qwen2 configs carry a
    `sliding_window` that applies only with `use_sliding_window` true, and then only to layers from
    `max_window_layers` on; a window on some layers only is refused."""
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "smollm3"):
        if not cfg.get("use_sliding_window", False) or not window:
            return None
        first = cfg.get("max_window_layers", 0) or 0
        if first >= cfg["num_hidden_layers"]:
            return None
        if first > 0:
            raise ModelError(f"use_sliding_window with max_window_layers {first} (a window on layers {first}.. of "
                             f"{cfg['num_hidden_layers']} only) is not supported natively")
    layer_types = cfg.get("layer_types")
    if window and layer_types and len(set(layer_types)) > 1:
        raise ModelError(f"layer_types mixes {sorted(set(layer_types))}: a window on some layers only is not "
                         f"supported natively")
    if layer_types and set(layer_types) == {"full_attention"}:
        return None
    return int(window) if window else None


def _hf_rope_layers(cfg: dict[str, Any], model_type: str) -> tuple[bool, ...] | None:
    """SmolLM3's `no_rope_layers` (1: the layer uses RoPE, 0: it does not), or its default of no RoPE on
    every `no_rope_layer_interval`-th layer; None for the other families (RoPE everywhere)."""
    if model_type != "smollm3":
        return None
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [(i + 1) % every != 0 for i in range(cfg["num_hidden_layers"])]
    return tuple(bool(x) for x in flags)
