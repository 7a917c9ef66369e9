"""The second drafter kind: a small standalone draft language model for a target.

It keeps the target's tokenizer, embedding, final norm and LM head, and `--layers N` decoder
layers copied from the target at evenly spaced depths (first and last included); it is then
trained to predict the target's greedy token at every corpus position (self-distillation with
hard labels, the quantity greedy acceptance depends on). It is saved as a standard Hugging Face
Llama checkpoint (config.json, model.safetensors, tokenizer files) plus drafter.json, so
transformers' assisted generation and other engines can use it as well as `--draft DIR`.
"""
from __future__ import annotations

import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters.format import write_meta
from ..drafters.head import target_layer_weights
from .features import FeatureSet
from .train import batches, bf16_autocast_pays, split

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def build_draft(target, num_layers: int):
    """A transformers LlamaForCausalLM with `num_layers` layers taken from the target."""
    from transformers import LlamaConfig, LlamaForCausalLM
    c = target.model.config
    picks = sorted({round(i * (c.num_layers - 1) / max(1, num_layers - 1)) for i in range(num_layers)})
    if c.attention_bias:
        raise ValueError("draft-lm is built as a Llama model; targets with q/k/v biases (Qwen2) need --kind eagle")
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=len(picks), num_attention_heads=c.num_heads,
                         num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                         max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                         rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
                         eos_token_id=list(target.eos_token_ids), bos_token_id=None)
    draft = LlamaForCausalLM(config)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed.float())
        draft.model.norm.weight.copy_(target.model.final_norm.float())
        if not c.tie_word_embeddings:
            draft.lm_head.weight.copy_(target.model.lm_head_weight.float())
        for mine, index in zip(draft.model.layers, picks):
            w = target_layer_weights(target.model, index)
            mine.self_attn.q_proj.weight.copy_(w["qkv"][:q])
            mine.self_attn.k_proj.weight.copy_(w["qkv"][q:q + kv])
            mine.self_attn.v_proj.weight.copy_(w["qkv"][q + kv:])
            mine.self_attn.o_proj.weight.copy_(w["o"])
            gate, up = w["gate_up"].chunk(2, dim=0)
            mine.mlp.gate_proj.weight.copy_(gate)
            mine.mlp.up_proj.weight.copy_(up)
            mine.mlp.down_proj.weight.copy_(w["down"])
            mine.input_layernorm.weight.copy_(w["attn_norm"])
            mine.post_attention_layernorm.weight.copy_(w["mlp_norm"])
    draft.model.embed_tokens.weight.requires_grad_(False)     # shared with the LM head when tied
    draft.lm_head.weight.requires_grad_(False)
    return draft, picks


def _batch(data: FeatureSet, ids: list[int]):
    width = max(data.length(s) for s in ids)
    tokens = torch.zeros(len(ids), width, dtype=torch.long)
    labels = torch.full((len(ids), width), -100, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for row, s in enumerate(ids):
        a, n = int(data.offsets[s]), data.length(s)
        tokens[row, :n] = data.tokens[a:a + n].long()
        known = data.labels[a:a + n].long()
        labels[row, :n] = torch.where(known >= 0, known, torch.full_like(known, -100))   # prompt: no label
        mask[row, :n] = 1
    return tokens, labels, mask


@torch.no_grad()
def held_out_accuracy(draft, data: FeatureSet, ids: list[int], budget: int) -> float:
    """Share of held-out positions where the draft's argmax equals the target's greedy token."""
    draft.eval()
    right = total = 0
    for group in batches(data, ids, budget, random.Random(0)):
        tokens, labels, mask = _batch(data, group)
        logits = draft(input_ids=tokens, attention_mask=mask).logits
        valid = labels != -100
        right += int((logits.argmax(-1) == labels)[valid].sum())
        total += int(valid.sum())
    draft.train()
    return right / max(total, 1)


def train_draft_lm(args, target, data: FeatureSet, out: Path) -> Path:
    draft, picks = build_draft(target, args.layers)
    train_ids, held_ids = split(data, 0.04, 0)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr or 2e-4, betas=(0.9, 0.95))
    budget, seconds, step, curve = args.batch_tokens, 0.0, 0, []
    total = sum(data.length(s) for s in train_ids)
    seen = 0
    print(f"      {len(picks)} layers from target depths {picks}; {sum(p.numel() for p in params) / 1e6:.1f}M trained "
          f"parameters", file=sys.stderr)
    curve.append({"seconds": 0.0, "step": 0, "held_out_accuracy": round(held_out_accuracy(draft, data, held_ids,
                                                                                           budget), 4)})
    rng = random.Random(0)
    use_bf16 = bf16_autocast_pays(torch.device("cpu"))     # AVX2-only CPUs: fp32 is far faster
    last_eval = 0.0
    while seconds < args.minutes * 60 and seen < args.epochs * total:
        for group in batches(data, train_ids, budget, rng):
            t0 = time.perf_counter()
            tokens, labels, mask = _batch(data, group)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
                logits = draft(input_ids=tokens, attention_mask=mask).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            seconds += time.perf_counter() - t0
            step += 1
            seen += int(mask.sum())
            if seconds - last_eval >= args.eval_every * 60 or seconds >= args.minutes * 60:
                last_eval = seconds
                acc = held_out_accuracy(draft, data, held_ids, budget)
                curve.append({"seconds": round(seconds, 1), "step": step, "loss": round(loss.item(), 4),
                              "held_out_accuracy": round(acc, 4)})
                print(f"\n      eval @ {seconds / 60:.1f} min: held-out top-1 agreement with the target {acc:.3f}",
                      file=sys.stderr)
            if seconds >= args.minutes * 60 or seen >= args.epochs * total:
                break
    (out / "curve.json").write_text(json.dumps(curve, indent=1))
    drafter_dir = out / "drafter"
    draft.to(torch.bfloat16).save_pretrained(str(drafter_dir), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (target.path / name).is_file():
            shutil.copy(target.path / name, drafter_dir / name)
    write_meta(drafter_dir, "draft-lm", target, {"layers_from_target": picks, "num_layers": len(picks)},
               {"train_seconds": round(seconds, 1), "steps": step, "curve": curve})
    return drafter_dir

