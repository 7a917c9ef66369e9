"""Write a random Qwen3.5 model of Qwen3.5-0.8B's shape as a GGUF file of llama.cpp's "qwen35"
architecture, for speed measurements without the real weights (their values do not change the work
a decode step does). The shape is Qwen3.5-0.8B's published config.json: hidden 1024, 24 layers (three
Gated DeltaNet to one gated attention), 8 attention heads over 2 kv heads of 256, linear attention
with 16 key and 16 value heads of 128, conv kernel 4, MLP 3584, vocabulary 248320, tied embeddings.

The tensors and metadata are written as llama.cpp's convert_hf_to_gguf.py writes them
(tests/gguf_writer.py: write_qwen35_gguf); the vocabulary is a small byte-level BPE padded with
unused tokens to 248320 rows. --qtype Q8_0 quantizes every matrix (as `--outtype q8_0`); for Q4_K_M,
quantize that file with llama.cpp (llama-quantize, or llama_cpp.llama_model_quantize). --mtp adds a
random multi-token-prediction head of the released checkpoint's shape (mtp_num_hidden_layers 1: one
gated attention layer as the decoder's, fc [1024, 2048], three norms; the LM head shared) as the
converter writes it (blk.24.nextn.*), for `--method mtp`.

Usage: python scripts/measure/make_random_gguf.py --out qwen35-0.8b-random-q8_0.gguf [--qtype Q8_0] [--layers 24]
       [--mtp]
"""
from __future__ import annotations

import argparse
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


def small_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the GGUF file to write")
    parser.add_argument("--qtype", choices=("Q8_0", "F32"), default="Q8_0")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (a multiple of 4; 24 as 0.8B)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mtp", action="store_true", help="add a random MTP head (blk.N.nextn.*)")
    args = parser.parse_args(argv)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
