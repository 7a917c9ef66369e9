"""Write a random model of a published shape as a GGUF file llama.cpp loads, for speed measurements
without the real weights (their values do not change the work a decode step does): Qwen3.5-0.8B's
(`--arch qwen35`, the default), Qwen3-30B-A3B's (`--arch qwen3moe`), gpt-oss-20b's (`--arch gpt-oss`) or
Gemma 4 26B-A4B's (`--arch gemma4`).

--arch qwen35: a model of llama.cpp's "qwen35" architecture. The shape is Qwen3.5-0.8B's published
config.json: hidden 1024, 24 layers (three Gated DeltaNet to one gated attention), 8 attention heads
over 2 kv heads of 256, linear attention with 16 key and 16 value heads of 128, conv kernel 4, MLP
3584, vocabulary 248320, tied embeddings.

The tensors and metadata are written as llama.cpp's convert_hf_to_gguf.py writes them
(tests/gguf_writer.py: write_qwen35_gguf); the vocabulary is a small byte-level BPE padded with
unused tokens to 248320 rows. --qtype Q8_0 quantizes every matrix (as `--outtype q8_0`); for Q4_K_M,
quantize that file with llama.cpp (llama-quantize, or --quantize below). --mtp adds a
random multi-token-prediction head of the released checkpoint's shape (mtp_num_hidden_layers 1: one
gated attention layer as the decoder's, fc [1024, 2048], three norms; the LM head shared) as the
converter writes it (blk.24.nextn.*), for `--method mtp`.

--arch qwen3moe: Qwen3-30B-A3B's published config.json (Qwen/Qwen3-30B-A3B): 48 layers, hidden 2048, 32 q
heads and 4 kv heads of 128 (q/k RMSNorm), 128 experts of moe_intermediate_size 768 with 8 routed per
token (norm_topk_prob), intermediate_size 6144 (written as feed_forward_length; every layer is a MoE
layer), rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40960, vocabulary 151936, untied
embeddings. Tensors and metadata as llama.cpp's convert_hf_to_gguf.py (Qwen3MoeModel) writes them:
expert matrices stacked per layer (blk.N.ffn_{gate,up,down}_exps [128, out, in]), the router
blk.N.ffn_gate_inp in F32, written block by block (random Q8_0 blocks drawn directly, a few hundred MB in
memory at a time), so a full-depth file (~32 GB as Q8_0) needs little memory. The token embedding is
drawn with standard deviation 1 (the other matrices 0.02): with small embeddings the attention output,
nearly the same for every row of a pass over random weights, would decide the routing and the rows of a
verify pass would share most experts (measured: 8 rows read 15.6 distinct experts per layer of 128);
so each token's own embedding decides its experts, which spread as under random routing: the worst
case for the experts a verify pass reads.
--arch gpt-oss: gpt-oss-20b's published config.json (openai/gpt-oss-20b): 24 layers, hidden 2880, 64 q heads
and 8 kv heads of 64 (q/k/v/o biases, a sink per q head), 32 experts of intermediate_size 2880 with 4 routed
per token (a biased router, softmax over the top 4, biased experts with the clamped SwiGLU), sliding window
128 on every other layer, rope_theta 150000 with YaRN factor 32 over an initial context of 4096
(max_position_embeddings 131072), rms_norm_eps 1e-5, vocabulary 201088, untied embeddings. As llama.cpp's
converter (GptOssModel) writes it and as its published gpt-oss-20b file holds it (about 12 GB at 24
layers): the expert stacks blk.N.ffn_{gate,up,down}_exps [32, out, in] in MXFP4 (random codes under the
scale 2^-8), their biases, the router, sinks, norms and attention biases in F32, the embedding, attention
and output matrices in Q8_0; written block by block as for qwen3moe. The o200k vocabulary is not here: the
small BPE padded to 201088 rows (the LM head's cost is the real one's).
--arch gemma4: Gemma 4 26B-A4B's text model (google/gemma-4-26B-A4B's config.json, text_config; the hub
is not reachable here: the values are those several public repositories quote from it in their tests,
which agree): 30 layers, hidden 2816, 16 q heads; windowed layers 8 kv heads of 256 (window 1024, RoPE
base 1e4), every sixth layer global with 2 kv heads of 512 whose values are their keys (attention_k_eq_v:
no attn_v) and proportional RoPE (base 1e6, partial_rotary_factor 0.25); every layer a dense GeGLU MLP
of 2112 beside a MoE block of 128 experts of 704, 8 routed; final_logit_softcapping 30, rms_norm_eps
1e-6, max_position_embeddings 262144, vocabulary 262144, tied embeddings, no per-layer inputs, no kv
sharing. Tensors and metadata as llama.cpp's converter (Gemma4Model) writes them: head dims per layer
type (key_length 512, key_length_swa 256), head_count_kv per layer, the window pattern, rope_freqs (1 on
the global heads' 64 turning frequencies, 1e30 on the rest), the expert stacks ffn_gate_up_exps
[128, 1408, 2816] and ffn_down_exps [128, 2816, 704], the router (ffn_gate_inp, F32) with its scale
(ffn_gate_inp.scale) and the per-expert scales (ffn_down_exps.scale), norms and scales 1; block by
block as for qwen3moe (a full-depth file is about 27 GB as Q8_0). With fewer --layers the last one is
global (as transformers makes the last layer of any Gemma 4).
--qtype Q4_K_M draws the file directly in the types llama.cpp's Q4_K_M quantization gives each tensor (its
llama_tensor_get_type: Q6_K for the output matrix and for attn_v and ffn_down_exps on the layers its
use_more_bits picks, Q4_K for the other matrices, the norms and routers F32), random blocks of valid scales,
tensor by tensor: a full-depth file (~17.5 GB) without the 32 GB Q8_0 file that llama.cpp's quantizer would read.
--llamacpp-python PY --quantize Q4_K_M instead runs llama.cpp's own quantizer (llama_model_quantize,
through llama-cpp-python in that interpreter) on the written file into --quantized-out.

Usage: python scripts/measure/make_random_gguf.py --out qwen35-0.8b-random-q8_0.gguf [--qtype Q8_0] [--layers 24]
       [--mtp]
       python scripts/measure/make_random_gguf.py --arch qwen3moe --qtype Q4_K_M --out qwen3moe-48l-q4_k_m.gguf
       python scripts/measure/make_random_gguf.py --arch qwen3moe --layers 8 --out qwen3moe-8l-q8_0.gguf
       [--llamacpp-python ~/llama-venv/bin/python --quantize Q4_K_M --quantized-out qwen3moe-8l-q4_k_m.gguf]
       python scripts/measure/make_random_gguf.py --arch gpt-oss --layers 8 --out gpt-oss-8l-mxfp4.gguf
       python scripts/measure/make_random_gguf.py --arch gemma4 --layers 6 --out gemma4-26b-a4b-6l-q8_0.gguf
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ["the quick brown fox jumps over the lazy dog. " * 4, "def add(a, b):\n    return a + b\n" * 4,
          "speculative decoding drafts tokens and verifies them in one pass of the target model. " * 4]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def qwen35_08b_config(layers: int = 24):
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16,
        max_position_embeddings=262144, tie_word_embeddings=True, rms_norm_eps=1e-6, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True})


def random_mtp_head(config) -> dict:
    """Random `mtp.*` tensors of the released checkpoint's shape: fc, three norms, one gated attention layer."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
    layer = Qwen3_5DecoderLayer(config, config.layer_types.index("full_attention"))
    d = config.hidden_size
    norms = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
    head = {"mtp.fc.weight": torch.randn(d, 2 * d) * 0.02, **{f"mtp.{n}.weight": torch.zeros(d) for n in norms}}
    head.update({f"mtp.layers.0.{name}": t.detach() for name, t in layer.state_dict().items()})
    return head


def small_tokenizer(folder: Path, specials: tuple[str, ...] = ()) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS + list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


# Qwen3-30B-A3B's config.json (Qwen/Qwen3-30B-A3B)
QWEN3_30B_A3B = dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, used=8,
                     expert_ff=768, ff=6144, vocab=151936, rope_theta=1_000_000.0, eps=1e-6, context=40960)
QUANTIZE_CHILD = r"""
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.allow_requantize = True
params.nthread = int(sys.argv[4])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""


def random_q8_0(rng, rows: int, cols: int, std: float = 0.02):
    """[rows, cols] weights as random Q8_0 blocks (bytes [rows, cols / 32 * 34]): int8 values uniform in
    -127..127 under one fp16 scale, so the weights have standard deviation `std`."""
    import numpy as np
    blocks = np.empty((rows, cols // 32, 34), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(std * 3 ** 0.5 / 127).tobytes(), dtype=np.uint8)
    blocks[:, :, 2:] = rng.integers(-127, 128, size=(rows, cols // 32, 32), dtype=np.int8).view(np.uint8)
    return blocks.reshape(rows, cols // 32 * 34)


# ggml type ids (gguf.GGMLQuantizationType) and the bytes of one block of 256 weights
Q4_K, Q6_K = 12, 14
K_BLOCK_BYTES = {Q4_K: 144, Q6_K: 210}
# the standard deviation of a K block's weights per unit of its fp16 scale d, the block's bytes uniformly random
# (Q4_K: d * sc * q - dmin * m with sc, m 6-bit, q 4-bit and dmin = 7.5 d, so the mean is 0; Q6_K: d * s * (q - 32)
# with s int8, q 6-bit); the script's tests check the drawn weights' spread against these
K_STD_PER_D = {Q4_K: (63 * 127 / 6 * 15 * 31 / 6 - (31.5 * 7.5) ** 2 + 7.5 ** 2 * (64 ** 2 - 1) / 12) ** 0.5,
               Q6_K: (sum(s * s for s in range(-128, 128)) / 256 * sum((q - 32) ** 2 for q in range(64)) / 64) ** 0.5}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits (llama-quant.cpp): the layers whose attn_v and ffn_down(_exps) Q4_K_M
    writes as Q6_K: the first and last eighth, and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layers: int) -> int:
    """The type llama.cpp's Q4_K_M quantization gives a qwen3moe matrix (llama_tensor_get_type): Q6_K for the
    output matrix and, on use_more_bits layers, attn_v and ffn_down_exps; Q4_K for the rest."""
    if name == "output.weight":
        return Q6_K
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down_exps") and use_more_bits(int(parts[1]), layers):
        return Q6_K
    return Q4_K


def random_k_blocks(rng, qtype: int, rows: int, cols: int, std: float = 0.02):
    """[rows, cols] weights as random Q4_K or Q6_K blocks (bytes [rows, cols / 256 * block bytes]): every byte
    uniformly random (any 6-bit scale and 4- / 6-bit value is a valid one) but the fp16 super-block scales,
    set so that the weights have mean 0 and standard deviation `std` (finite: no NaN / Inf dequantized)."""
    import numpy as np
    size = K_BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    d = np.float16(std / K_STD_PER_D[qtype])
    if qtype == Q4_K:           # d, dmin first, then 12 bytes of 6-bit scales and mins, then 128 of 4-bit values
        blocks[:, :, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
        blocks[:, :, 2:4] = np.frombuffer(np.float16(float(d) * 7.5).tobytes(), dtype=np.uint8)
    else:                       # 128 + 64 bytes of 6-bit values, 16 int8 scales, d last
        blocks[:, :, 208:210] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, cols // 256 * size)


def write_qwen3moe(out: Path, layers: int, seed: int, shape: dict | None = None, qtype: str = "Q8_0") -> None:
    """A random qwen3moe file of `shape` (default Qwen3-30B-A3B's), tensor by tensor (see the module docstring):
    `qtype` Q8_0 (every matrix), or Q4_K_M (each matrix in the type llama.cpp's Q4_K_M gives it, q4_k_m_type)."""
    import gguf
    import numpy as np
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_writer import write_tokenizer

    c, rng = shape or QWEN3_30B_A3B, np.random.default_rng(seed)
    d, hd, ff, e = c["hidden"], c["head_dim"], c["expert_ff"], c["experts"]
    writer = gguf.GGUFWriter(str(out), "qwen3moe")
    writer.add_name("random-qwen3-30b-a3b-shape")
    writer.add_block_count(layers)
    writer.add_context_length(c["context"])
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(c["ff"])
    writer.add_head_count(c["heads"])
    writer.add_head_count_kv(c["kv_heads"])
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["eps"])
    writer.add_expert_count(e)
    writer.add_expert_used_count(c["used"])
    writer.add_expert_feed_forward_length(ff)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "Q8_0" else gguf.LlamaFileType.MOSTLY_Q4_K_M)
    write_tokenizer(writer, padded_vocabulary(c["vocab"]), "<|im_end|>")
    # (name, shape [.., rows, cols], kind): "q8" random Q8_0 blocks ("embed": of standard deviation 1), "router"
    # random F32, "norm" ones in F32
    plan = [("token_embd.weight", (c["vocab"], d), "embed")]
    for i in range(layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (d,), "norm"), (b + "attn_q.weight", (c["heads"] * hd, d), "q8"),
                 (b + "attn_k.weight", (c["kv_heads"] * hd, d), "q8"),
                 (b + "attn_v.weight", (c["kv_heads"] * hd, d), "q8"),
                 (b + "attn_output.weight", (d, c["heads"] * hd), "q8"), (b + "attn_q_norm.weight", (hd,), "norm"),
                 (b + "attn_k_norm.weight", (hd,), "norm"), (b + "ffn_norm.weight", (d,), "norm"),
                 (b + "ffn_gate_inp.weight", (e, d), "router"), (b + "ffn_gate_exps.weight", (e, ff, d), "q8"),
                 (b + "ffn_up_exps.weight", (e, ff, d), "q8"), (b + "ffn_down_exps.weight", (e, d, ff), "q8")]
    plan += [("output_norm.weight", (d,), "norm"), ("output.weight", (c["vocab"], d), "q8")]
    if qtype == "Q4_K_M":       # "q4k" / "q6k" random K blocks ("embed_q4k": of standard deviation 1)
        kinds = {Q4_K: "q4k", Q6_K: "q6k"}
        plan = [(name, dims, "embed_q4k" if kind == "embed" else kinds[q4_k_m_type(name, layers)]
                 if kind == "q8" else kind) for name, dims, kind in plan]
    write_plan(writer, plan, rng)


# Gemma 4 26B-A4B's text_config (google/gemma-4-26B-A4B; see the module docstring)
GEMMA4_26B_A4B = dict(hidden=2816, layers=30, heads=16, kv_heads=8, head_dim=256, global_kv_heads=2,
                      global_head_dim=512, ff=2112, experts=128, used=8, expert_ff=704, vocab=262144, window=1024,
                      rope_theta=1_000_000.0, rope_local=10_000.0, partial_rotary=0.25, softcap=30.0, eps=1e-6,
                      context=262144, pattern=6)


def write_gemma4(out: Path, layers: int, seed: int, shape: dict | None = None) -> None:
    """A random gemma4 file of `shape` (default Gemma 4 26B-A4B's), tensor by tensor (see the module docstring)."""
    import gguf
    import numpy as np
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_writer import write_tokenizer

    c, rng = shape or GEMMA4_26B_A4B, np.random.default_rng(seed)
    d, e, eff = c["hidden"], c["experts"], c["expert_ff"]
    swa = [(i + 1) % c["pattern"] != 0 and i != layers - 1 for i in range(layers)]
    writer = gguf.GGUFWriter(str(out), "gemma4")
    writer.add_name("random-gemma-4-26b-a4b-shape")
    writer.add_block_count(layers)
    writer.add_context_length(c["context"])
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(c["ff"])
    writer.add_head_count(c["heads"])
    writer.add_head_count_kv([c["kv_heads"] if s else c["global_kv_heads"] for s in swa])
    writer.add_key_length(c["global_head_dim"])
    writer.add_value_length(c["global_head_dim"])
    writer.add_key_length_swa(c["head_dim"])
    writer.add_value_length_swa(c["head_dim"])
    writer.add_layer_norm_rms_eps(c["eps"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_rope_freq_base_swa(c["rope_local"])
    writer.add_rope_dimension_count(c["global_head_dim"])
    writer.add_rope_dimension_count_swa(c["head_dim"])
    writer.add_final_logit_softcapping(c["softcap"])
    writer.add_sliding_window(c["window"])
    writer.add_sliding_window_pattern(swa)
    writer.add_shared_kv_layers(0)
    writer.add_embedding_length_per_layer_input(0)
    writer.add_expert_count(e)
    writer.add_expert_used_count(c["used"])
    writer.add_expert_feed_forward_length(eff)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    with tempfile.TemporaryDirectory() as tmp:
        spec = json.loads(small_tokenizer(Path(tmp), ("<bos>",)).read_text())
    size = max(len(spec["model"]["vocab"]), max(t["id"] for t in spec["added_tokens"]) + 1)
    spec["model"]["vocab"].update({f"<unused{i}>": i for i in range(size, c["vocab"])})
    write_tokenizer(writer, spec, "<|im_end|>", "<bos>")
    turning = int(c["global_head_dim"] * c["partial_rotary"] / 2)
    # (name, shape [.., rows, cols], kind) as in write_qwen3moe; "freqs": the proportional RoPE factors
    plan = [("rope_freqs.weight", (c["global_head_dim"] // 2,), "freqs"),
            ("token_embd.weight", (c["vocab"], d), "embed")]
    for i in range(layers):
        b, hd = f"blk.{i}.", c["head_dim"] if swa[i] else c["global_head_dim"]
        kv = (c["kv_heads"] if swa[i] else c["global_kv_heads"]) * hd
        plan += [(b + "attn_norm.weight", (d,), "norm"), (b + "attn_q.weight", (c["heads"] * hd, d), "q8"),
                 (b + "attn_k.weight", (kv, d), "q8")] + ([(b + "attn_v.weight", (kv, d), "q8")] if swa[i] else []) + [
                 (b + "attn_output.weight", (d, c["heads"] * hd), "q8"), (b + "attn_q_norm.weight", (hd,), "norm"),
                 (b + "attn_k_norm.weight", (hd,), "norm"), (b + "post_attention_norm.weight", (d,), "norm"),
                 (b + "ffn_norm.weight", (d,), "norm"), (b + "ffn_gate.weight", (c["ff"], d), "q8"),
                 (b + "ffn_up.weight", (c["ff"], d), "q8"), (b + "ffn_down.weight", (d, c["ff"]), "q8"),
                 (b + "post_ffw_norm.weight", (d,), "norm"), (b + "ffn_gate_inp.weight", (e, d), "router"),
                 (b + "ffn_gate_inp.scale", (d,), "norm"), (b + "ffn_gate_up_exps.weight", (e, 2 * eff, d), "q8"),
                 (b + "ffn_down_exps.weight", (e, d, eff), "q8"), (b + "ffn_down_exps.scale", (e,), "norm"),
                 (b + "pre_ffw_norm_2.weight", (d,), "norm"), (b + "post_ffw_norm_1.weight", (d,), "norm"),
                 (b + "post_ffw_norm_2.weight", (d,), "norm"), (b + "layer_output_scale.weight", (1,), "norm")]
    plan += [("output_norm.weight", (d,), "norm")]
    write_plan(writer, plan, rng, {"freqs": lambda shape: np.array([1.0] * turning + [1e30] * (shape[0] - turning),
                                                                     dtype=np.float32)})


def write_plan(writer, plan: list, rng, extra: dict | None = None) -> None:
    """The tensors of `plan` ((name, shape [.., rows, cols], kind) in file order), one in memory at a time:
    "q8" random Q8_0 blocks ("embed": of standard deviation 1), "mxfp4" random MXFP4 blocks, "router" and
    "bias" random F32 (standard deviation 0.02), "norm" ones, "zero" zeros in F32, or `extra[kind](shape)`."""
    import gguf
    import numpy as np
    quant = {"q8": (gguf.GGMLQuantizationType.Q8_0, 34), "embed": (gguf.GGMLQuantizationType.Q8_0, 34),
             "mxfp4": (gguf.GGMLQuantizationType.MXFP4, 17), "q4k": (Q4_K, 144 / 8), "embed_q4k": (Q4_K, 144 / 8),
             "q6k": (Q6_K, 210 / 8)}     # bytes per 32 weights (the K formats: blocks of 256)
    for name, shape, kind in plan:
        if kind in quant:
            byte_shape = (*shape[:-1], int(shape[-1] // 32 * quant[kind][1]))
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                                   raw_dtype=gguf.GGMLQuantizationType(quant[kind][0]))
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _name, shape, kind in plan:
        rows = int(np.prod(shape[:-1]))
        if kind in ("q8", "embed"):
            std = 1.0 if kind == "embed" else 0.02
            writer.write_tensor_data(random_q8_0(rng, rows, shape[-1], std).reshape(*shape[:-1], -1))
        elif kind in ("q4k", "q6k", "embed_q4k"):
            std = 1.0 if kind == "embed_q4k" else 0.02
            blocks = random_k_blocks(rng, Q6_K if kind == "q6k" else Q4_K, rows, shape[-1], std)
            writer.write_tensor_data(blocks.reshape(*shape[:-1], -1))
        elif kind == "mxfp4":
            writer.write_tensor_data(random_mxfp4(rng, rows, shape[-1]).reshape(*shape[:-1], -1))
        elif kind in ("router", "bias"):
            writer.write_tensor_data(rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))
        elif kind == "norm":
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
        elif kind == "zero":
            writer.write_tensor_data(np.zeros(shape, dtype=np.float32))
        else:
            writer.write_tensor_data(extra[kind](shape))
    writer.close()


def random_mxfp4(rng, rows: int, cols: int):
    """[rows, cols] weights as random MXFP4 blocks (bytes [rows, cols / 32 * 17]): every e2m1 code equally
    likely under the scale 2^-8 (E8M0 byte 120), so the weights have standard deviation about 0.023."""
    import numpy as np
    blocks = np.empty((rows, cols // 32, 17), dtype=np.uint8)
    blocks[:, :, 0] = 120
    blocks[:, :, 1:] = rng.integers(0, 256, size=(rows, cols // 32, 16), dtype=np.uint8)
    return blocks.reshape(rows, cols // 32 * 17)


# gpt-oss-20b's config.json (openai/gpt-oss-20b)
GPT_OSS_20B = dict(hidden=2880, layers=24, heads=64, kv_heads=8, head_dim=64, experts=32, used=4, expert_ff=2880,
                   vocab=201088, window=128, rope_theta=150000.0, yarn_factor=32.0, yarn_context=4096, eps=1e-5,
                   context=131072)


def write_gpt_oss(out: Path, layers: int, seed: int, shape: dict | None = None) -> None:
    """A random gpt-oss file of `shape` (default gpt-oss-20b's), tensor by tensor (see the module docstring)."""
    import gguf
    import numpy as np
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_writer import write_gpt_oss_metadata, write_tokenizer

    c, rng = shape or GPT_OSS_20B, np.random.default_rng(seed)
    d, hd, ff, e = c["hidden"], c["head_dim"], c["expert_ff"], c["experts"]
    writer = gguf.GGUFWriter(str(out), "gpt-oss")
    writer.add_name("random-gpt-oss-20b-shape")
    write_gpt_oss_metadata(writer, argparse.Namespace(
        num_hidden_layers=layers, max_position_embeddings=c["context"], hidden_size=d, intermediate_size=ff,
        num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"], head_dim=hd, rms_norm_eps=c["eps"],
        rope_parameters={"rope_theta": c["rope_theta"], "factor": c["yarn_factor"],
                         "original_max_position_embeddings": c["yarn_context"]},
        num_local_experts=e, num_experts_per_tok=c["used"], sliding_window=c["window"]))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    write_tokenizer(writer, padded_vocabulary(c["vocab"]), "<|im_end|>")
    q, kv = c["heads"] * hd, c["kv_heads"] * hd
    plan = [("token_embd.weight", (c["vocab"], d), "embed")]
    for i in range(layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (d,), "norm"),
                 (b + "attn_q.weight", (q, d), "q8"), (b + "attn_q.bias", (q,), "bias"),
                 (b + "attn_k.weight", (kv, d), "q8"), (b + "attn_k.bias", (kv,), "bias"),
                 (b + "attn_v.weight", (kv, d), "q8"), (b + "attn_v.bias", (kv,), "bias"),
                 (b + "attn_output.weight", (d, q), "q8"), (b + "attn_output.bias", (d,), "bias"),
                 (b + "attn_sinks.weight", (c["heads"],), "zero"), (b + "post_attention_norm.weight", (d,), "norm"),
                 (b + "ffn_gate_inp.weight", (e, d), "router"), (b + "ffn_gate_inp.bias", (e,), "bias"),
                 (b + "ffn_gate_exps.weight", (e, ff, d), "mxfp4"), (b + "ffn_gate_exps.bias", (e, ff), "bias"),
                 (b + "ffn_up_exps.weight", (e, ff, d), "mxfp4"), (b + "ffn_up_exps.bias", (e, ff), "bias"),
                 (b + "ffn_down_exps.weight", (e, d, ff), "mxfp4"), (b + "ffn_down_exps.bias", (e, d), "bias")]
    plan += [("output_norm.weight", (d,), "norm"), ("output.weight", (c["vocab"], d), "q8")]
    write_plan(writer, plan, rng)


def padded_vocabulary(size: int) -> dict:
    """The small byte-level BPE of `small_tokenizer`, padded with unused tokens to `size` rows."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = json.loads(small_tokenizer(Path(tmp)).read_text())
    first = max(len(spec["model"]["vocab"]), max(t["id"] for t in spec["added_tokens"]) + 1)
    spec["model"]["vocab"].update({f"<|unused_{i}|>": i for i in range(first, size)})
    return spec


def quantize_with_llamacpp(python: str, source: Path, out: Path, qtype: str, threads: int) -> None:
    """llama.cpp's own quantizer (llama_model_quantize through llama-cpp-python in `python`)."""
    result = subprocess.run([python, "-c", QUANTIZE_CHILD, str(source), str(out), qtype, str(threads)])
    if result.returncode != 0:
        raise SystemExit(f"llama.cpp's quantizer failed on {source} (exit {result.returncode})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the GGUF file to write")
    parser.add_argument("--arch", choices=("qwen35", "qwen3moe", "gpt-oss", "gemma4"), default="qwen35",
                        help="qwen35: Qwen3.5-0.8B's shape; qwen3moe: Qwen3-30B-A3B's; gpt-oss: gpt-oss-20b's; "
                             "gemma4: Gemma 4 26B-A4B's")
    parser.add_argument("--qtype", choices=("Q8_0", "F32", "Q4_K_M"), default="Q8_0",
                        help="the matrices' format (qwen35: Q8_0 or F32; qwen3moe: Q8_0, or Q4_K_M drawn directly in "
                             "the types llama.cpp's Q4_K_M gives each tensor)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (qwen35: a multiple of 4, 24 as 0.8B; qwen3moe: 48 as 30B-A3B; "
                             "gemma4: 30 as 26B-A4B)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mtp", action="store_true", help="add a random MTP head (blk.N.nextn.*; qwen35)")
    parser.add_argument("--llamacpp-python", help="a Python with llama-cpp-python, for --quantize")
    parser.add_argument("--quantize", choices=("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q4_0"),
                        help="quantize the written file with llama.cpp's quantizer into --quantized-out")
    parser.add_argument("--quantized-out", type=Path, help="where --quantize writes")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's quantizer threads")
    args = parser.parse_args(argv)
    if args.quantize and not (args.llamacpp_python and args.quantized_out):
        parser.error("--quantize needs --llamacpp-python and --quantized-out")
    if args.arch in ("qwen3moe", "gpt-oss", "gemma4"):
        shape, write = {"qwen3moe": (QWEN3_30B_A3B, write_qwen3moe), "gpt-oss": (GPT_OSS_20B, write_gpt_oss),
                        "gemma4": (GEMMA4_26B_A4B, write_gemma4)}[args.arch]
        layers = shape["layers"] if args.layers is None else args.layers
        if not 1 <= layers <= shape["layers"]:
            parser.error(f"--layers must be in [1, {shape['layers']}] for {args.arch}, got {layers}")
        if args.qtype != "Q8_0" and not (args.arch == "qwen3moe" and args.qtype == "Q4_K_M"):
            parser.error(f"--qtype for {args.arch} must be Q8_0{' or Q4_K_M' if args.arch == 'qwen3moe' else ''}, "
                         f"got {args.qtype}")
        if args.arch == "qwen3moe":
            write(args.out, layers, args.seed, qtype=args.qtype)
        else:
            write(args.out, layers, args.seed)
        kind = {"qwen3moe": args.qtype, "gpt-oss": "MXFP4 experts, Q8_0 matrices", "gemma4": "Q8_0"}[args.arch]
        print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.0f} MiB, {kind}, {layers} layers)")
        if args.quantize:
            quantize_with_llamacpp(args.llamacpp_python, args.out, args.quantized_out, args.quantize, args.threads)
            print(f"wrote {args.quantized_out} ({args.quantized_out.stat().st_size / 2**20:.0f} MiB, {args.quantize})")
        return 0
    if args.qtype == "Q4_K_M":
        parser.error("--qtype Q4_K_M is for --arch qwen3moe (qwen35: Q8_0 or F32, then --quantize)")
    args.layers = 24 if args.layers is None else args.layers
    if args.layers < 4 or args.layers % 4:
        parser.error(f"--layers must be a multiple of 4 (three DeltaNet layers to one attention), got {args.layers}")
    import torch
    from transformers import Qwen3_5ForCausalLM
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_writer import write_qwen35_gguf

    torch.manual_seed(args.seed)
    config = qwen35_08b_config(args.layers)
    model = Qwen3_5ForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        write_qwen35_gguf(args.out, model, small_tokenizer(Path(tmp)), "<|im_end|>", qtype=args.qtype,
                          vocab_size=config.vocab_size, mtp=random_mtp_head(config) if args.mtp else None)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.0f} MiB, {args.qtype})")
    if args.quantize:
        quantize_with_llamacpp(args.llamacpp_python, args.out, args.quantized_out, args.quantize, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
