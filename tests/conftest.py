"""Shared fixtures: tiny random Llama/Qwen2/Qwen3.5 models with a tiny trained BPE tokenizer, made
on the fly (no network), and the embedded SmolLM2-135M for the slow tests."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)

CORPUS = [
    "the quick brown fox jumps over the lazy dog. " * 3,
    "speculative decoding drafts tokens and verifies them in one pass of the target model.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Summarize the following text. The cat sat on the mat. The mat was red. The cat was happy.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FIM_SPECIALS = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def make_tokenizer(folder: Path, vocab_size: int = 300, specials: tuple[str, ...] = ()) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS + list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE}))


def hf_reference(path):
    """The transformers model of a checkpoint directory, float32, for comparing logits and generate()."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def make_model(folder: Path, arch: str, seed: int, layers: int = 2, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, tie: bool = True, rope_scaling=None, scale: float = 1.0,
               specials: tuple[str, ...] = ()) -> Path:
    """A random model saved like any HF checkpoint. `scale` sharpens the output distribution;
    `specials`: special tokens besides the chat ones (e.g. FIM_SPECIALS)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder, specials=specials)
    vocab = json.loads((folder / "tokenizer.json").read_text())
    base = len(vocab["model"]["vocab"])
    vocab_size = base + len([t for t in vocab["added_tokens"] if t["id"] >= base])
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie, eos_token_id=2, bos_token_id=None,
                  rope_scaling=rope_scaling)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=hidden // heads))
        with torch.no_grad():   # q/k norm weights away from 1 so the per-head norm is tested
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():   # give the q/k/v biases real values so they are tested
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(scale / 0.02 * 0.05)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


QWEN35_PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox",
                  "def add(a, b):\n    return a + b\n", "1 2 3 4 5 6 7 8"]     # the MTP drafter's tests'


def make_qwen35(folder: Path, mtp: bool = False):
    """A tiny random Qwen3.5 text model saved in `folder`; returns the transformers model. 4 layers,
    three DeltaNet to one attention, more value heads than key heads (as Qwen3.5's), norms away from
    their neutral value. With `mtp`: random weights of a one-layer multi-token-prediction head added
    as a Qwen3.5 checkpoint ships them (`mtp.*` in its safetensors, which transformers neither saves
    nor loads; `mtp_num_hidden_layers` in config.json)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip("this transformers has no Qwen3.5")
    make_tokenizer(folder)
    vocab = json.loads((folder / "tokenizer.json").read_text())
    size = len(vocab["model"]["vocab"]) + len([t for t in vocab["added_tokens"]
                                               if t["id"] >= len(vocab["model"]["vocab"])])
    config = transformers.Qwen3_5TextConfig(
        vocab_size=size, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=2, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.3, 0.3)
        model.model.embed_tokens.weight.mul_(2.5)         # sharper logits: fewer near-ties
    model.save_pretrained(folder)
    if mtp:
        from safetensors.torch import load_file, save_file
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
        torch.manual_seed(1)
        layer = Qwen3_5DecoderLayer(config, config.layer_types.index("full_attention"))
        d = config.hidden_size
        # fc's embedding half is the identity: the residual stream of this random target mostly carries
        # the current token, so the head then predicts roughly what the target will after the next
        # token, and its drafts are accepted now and then (random everywhere, they never are)
        head = {"fc.weight": torch.cat([torch.eye(d), torch.randn(d, d) * (2 * d) ** -0.5], dim=1),
                **{f"{name}.weight": torch.empty(d).uniform_(-0.3, 0.3)
                   for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")},
                **{f"layers.0.{name}": (t.uniform_(-0.3, 0.3) if "norm" in name else t).detach()
                   for name, t in layer.state_dict().items()}}
        weights = load_file(str(folder / "model.safetensors"))
        weights.update({f"mtp.{name}": t.contiguous() for name, t in head.items()})
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    return model


def exact_joint(next_probs, length: int) -> dict[tuple[int, ...], float]:
    """P(the first `length` tokens) under plain sampling, enumerating every prefix with mass;
    `next_probs(prefix)`: the distribution [vocab] of the token after the prompt + prefix."""
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == length:
            out[tuple(prefix)] = prob
            return
        probs = next_probs(prefix)
        for token in torch.nonzero(probs).flatten().tolist():
            walk(prefix + [token], prob * float(probs[token]))
    walk([], 1.0)
    return out


def draw_samples(llm, prompt: list[int], params, n: int, k: int, seed0: int, rows: int = 2_000):
    """n sampled continuations of `prompt` (sample i drawn with `params(seed0 + i)`, `rows` to a
    call, k draft tokens a step) as a Counter, and the acceptance rate of their drafts."""
    from collections import Counter
    counts: Counter = Counter()
    drafted = accepted = 0
    for start in range(0, n, rows):
        size = min(rows, n - start)
        outs = llm.generate([prompt] * size, [params(seed0 + start + i) for i in range(size)],
                            num_speculative_tokens=k)
        counts.update(tuple(o.token_ids) for o in outs)
        drafted += sum(o.stats["drafted_tokens"] for o in outs)
        accepted += sum(o.stats["accepted_tokens"] for o in outs)
    return counts, accepted / drafted if drafted else 0.0


def null_tv(exact: dict, n: int) -> float:
    """Expected total variation of n exact samples (normal approximation per cell)."""
    return 0.5 * sum(math.sqrt(2 * q * (1 - q) / (math.pi * n)) for q in exact.values())


def check_seeded_alone_as_batched(llm, prompts, seeds: int = 6, k: int = 4) -> None:
    """A seeded sampled request gives the same text alone and beside a request whose draft size
    differs (its own shrinks near its max_tokens while the other's does not): a row draws its drafts
    from its own generator, one number per draft it keeps."""
    from specdecode import SamplingParams
    for seed in range(seeds):
        short = SamplingParams(max_tokens=7, temperature=1.0, seed=seed, ignore_eos=True)
        long = SamplingParams(max_tokens=24, temperature=1.0, seed=100 + seed, ignore_eos=True)
        alone = llm.generate(prompts[0], short, num_speculative_tokens=k)[0]
        batch = llm.generate([prompts[0], prompts[1]], [short, long], num_speculative_tokens=k)
        assert batch[0].token_ids == alone.token_ids, seed
        assert batch[1].token_ids == llm.generate(prompts[1], long, num_speculative_tokens=k)[0].token_ids, seed


def compare_samples(counts, exact: dict) -> tuple[float, float, int]:
    """Samples (a Counter of continuations) against their exact distribution: (chi-square p-value,
    total variation, samples outside the exact support). Sparse cells (expected < 5) and strays
    are merged into one."""
    from scipy.stats import chisquare
    n = sum(counts.values())
    outside = sum(c for seq, c in counts.items() if seq not in exact)
    total = sum(exact.values())
    observed, expected, rest_o, rest_e = [], [], outside, 0.0
    for seq, q in exact.items():
        if q * n >= 5:
            observed.append(counts[seq])
            expected.append(q / total * n)
        else:
            rest_o += counts[seq]
            rest_e += q / total * n
    if rest_o or rest_e:
        observed.append(rest_o)
        expected.append(max(rest_e, 1e-9))
    scale = sum(observed) / sum(expected)
    p_value = float(chisquare(observed, [e * scale for e in expected]).pvalue)
    keys = set(exact) | set(counts)
    tv = 0.5 * sum(abs(counts.get(s, 0) / n - exact.get(s, 0.0) / total) for s in keys)
    return p_value, tv, outside


# Tiny random Gemma 4 text models (tests/models/test_gemma4.py, tests/drafters/test_assistant.py), shaped like
# E2B: windowed layers (window 8, so it matters within the prompts) and global ones with twice as wide heads
GEMMA4_WINDOW = 8
GEMMA4_BOS, GEMMA4_EOS = 3, 2         # make_tokenizer's ids: <|im_end|> is 2, then the specials (<bos> 3)
GEMMA4_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def gemma4_text_config(vocab_size: int, variant: str, layers: int = 5):
    """5 layers, the last two reusing the keys/values of the last earlier layer of their type, or 2 without;
    variant "k_eq_v": global layers whose values are their keys, with one kv head."""
    from transformers import Gemma4TextConfig
    shape = dict(num_hidden_layers=5, layer_types=GEMMA4_TYPES, num_kv_shared_layers=2) if layers == 5 else dict(
        num_hidden_layers=2, layer_types=GEMMA4_TYPES[1:3], num_kv_shared_layers=0)
    extra = dict(attention_k_eq_v=True, num_global_key_value_heads=1) if variant == "k_eq_v" else {}
    return Gemma4TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, sliding_window=GEMMA4_WINDOW, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=vocab_size, use_double_wide_mlp=True, final_logit_softcapping=10.0,
        max_position_embeddings=256, bos_token_id=GEMMA4_BOS, eos_token_id=GEMMA4_EOS, pad_token_id=0, **shape,
        **extra)


def make_gemma4(folder: Path, variant: str = "e2b", layers: int = 5, seed: int = 13) -> Path:
    """A random gemma4_text checkpoint saved by transformers, with make_tokenizer's tokenizer."""
    from transformers import Gemma4ForCausalLM
    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder, specials=("<bos>", "<turn|>"))
    vocab_size = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(gemma4_text_config(vocab_size, variant, layers))
    randomize_gemma4(model)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def randomize_gemma4(model) -> None:
    """Norm weights and layer scalars away from 1 (Gemma 4's start at 1), a sharper output distribution."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.6 + 0.1 * i)
        model.model.embed_tokens.weight.mul_(4.0)       # fewer near-ties


async def post_completions(url: str, jobs) -> list[dict]:
    """POST /v1/completions for every (prompt, max_tokens, extra body fields) job at once, greedy,
    with token ids; the JSON answers in job order."""
    import asyncio

    import httpx
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(prompt, n, extra):
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, **extra}
            return (await client.post("/v1/completions", json=body)).json()
        return await asyncio.gather(*(one(*job) for job in jobs))


def mixed_rows_through_server(llm, texts: list[str]) -> tuple[list, list, list, str, dict]:
    """Eight greedy requests at once through a small server (3 rows, 4-token blocks, 16-token prefill
    chunks): every third with speculation off, every third forced on, the rest automatic; prompts
    from `texts`, every other one doubled. Returns (jobs, each job's plain `LLM.generate` tokens,
    the answers, the /metrics text, the /api/stats JSON); a job is (prompt, extra body, max_tokens)."""
    import asyncio

    import httpx

    from specdecode import SamplingParams
    from specdecode.engine.config import EngineConfig
    from specdecode.serve.app import create_app
    from specdecode.serve.server import BackgroundServer, build_state
    jobs = [(texts[i % len(texts)] * (1 + i % 2), {0: {}, 1: {"speculate": False}, 2: {"speculate": True}}[i % 3],
             20 + 4 * i) for i in range(8)]
    wants = [llm.generate([llm.tokenizer.encode(p)], SamplingParams(max_tokens=n, ignore_eos=True),
                          num_speculative_tokens=0)[0].token_ids for p, _, n in jobs]
    state = build_state(llm, EngineConfig(max_batch_size=3, block_size=4, prefill_chunk=16, max_model_len=200,
                                         served_model_name="tiny"))
    with BackgroundServer(create_app(state)) as server:
        outs = asyncio.run(post_completions(server.url, [(p, n, extra) for p, extra, n in jobs]))
        text = httpx.get(server.url + "/metrics", timeout=10).text
        stats = httpx.get(server.url + "/api/stats", timeout=10).json()
    return jobs, wants, outs, text, stats


def assert_drafts_accepted_and_exact(target, drafter, question: str, max_tokens: int) -> None:
    """Greedy generation of a chat `question` with `drafter` (k=4, fixed size) equals plain decoding,
    and some of its drafts are accepted (a shipped, trained drafter)."""
    from specdecode import SamplingParams

    tok = target.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]), add_special=False)
    params = [SamplingParams(max_tokens=max_tokens)]
    plain = run_engine(target, None, 0, [ids], params)[0]
    spec = run_engine(target, drafter, 4, [ids], params, adaptive=False)[0]
    assert spec.output_ids == plain.output_ids
    assert spec.stats.accepted > 0


def assert_tree_paths_match_chains(model, reference, low: int = 0) -> None:
    """Two branches (depth 3 and 2) drafted as one tree after a 12-token prompt: every node's
    logits equal those of its own root-to-node path run as a chain through `reference` (a
    transformers model), so masks, positions and windows follow each path."""
    from specdecode.forward import ForwardBatch

    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(low, model.vocab_size, (1, 12), generator=gen)
    nodes = torch.randint(low, model.vocab_size, (1, 5), generator=gen)
    parents = torch.tensor([[-1, 0, 1, -1, 3]])
    cache = model.new_cache(1, 64)
    model.forward(prompt[:, :11], cache, 0)
    fb = ForwardBatch.tree(torch.cat([prompt[:, 11:], nodes], 1), torch.tensor([11]), None, [1], parents)
    got = model.logits(model.run(fb, cache))[0]                          # [6, vocab]
    for branch, index in (([0, 1, 2], [1, 2, 3]), ([3, 4], [4, 5])):
        with torch.no_grad():
            expected = reference(torch.cat([prompt, nodes[:, branch]], 1)).logits[0, 11:]
        torch.testing.assert_close(got[[0] + index], expected, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread is as fast when the cores are idle and ~7x faster when other
    work shares the 2 cores (spinning OpenMP workers); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Targets and drafts of both architectures (drafts share the tokenizer, other weights)."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": make_model(root / "llama", "llama", seed=1, layers=3),
        "llama_draft": make_model(root / "llama_draft", "llama", seed=2, layers=1),
        "qwen2": make_model(root / "qwen2", "qwen2", seed=3, layers=2, tie=False),
        "qwen2_draft": make_model(root / "qwen2_draft", "qwen2", seed=4, layers=1, tie=False),
    }


@pytest.fixture(scope="session")
def qwen35(tmp_path_factory):
    """(directory, transformers model): make_qwen35's tiny Qwen3.5, without an MTP head."""
    folder = tmp_path_factory.mktemp("qwen3_5")
    return folder, make_qwen35(folder)


def hub_repo(cache: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """A model repository in a Hugging Face cache laid out as huggingface_hub writes it (blobs named
    by git's hash, or by sha256 for weights; the snapshot's files relative symlinks to them; refs/main
    naming the commit), checked with huggingface_hub.scan_cache_dir. Files of equal content share one
    blob, as in a real cache; a blob is a hard link to its source where the file system allows.
    Returns the snapshot folder."""
    import hashlib
    import os
    import shutil

    from huggingface_hub import scan_cache_dir
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for name, source in files.items():
        data = source.read_bytes()
        lfs = name.endswith((".gguf", ".safetensors"))
        digest = (hashlib.sha256(data) if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data)).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            blob.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, blob)
            except OSError:
                shutil.copyfile(source, blob)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    scan = scan_cache_dir(cache)
    assert not scan.warnings, scan.warnings
    [cached] = [r for r in scan.repos if r.repo_id == repo_id]
    [revision] = cached.revisions
    assert revision.refs == {"main"} and {f.file_name for f in revision.files} == {Path(n).name for n in files}
    return snapshot


@pytest.fixture(scope="session")
def hub_cache(tiny_models, tmp_path_factory) -> Path:
    """A Hugging Face cache holding test-org/tiny-gguf (the embedded model's GGUF file under two quant
    names), test-org/tiny-llama (the tiny Llama's safetensors directory) and test-org/split-gguf (a
    GGUF split in two parts, the parts mere bytes)."""
    from specdecode.models.loader import default_model_path
    cache = tmp_path_factory.mktemp("hf_hub")
    gguf = default_model_path()
    hub_repo(cache, "test-org/tiny-gguf", {"SmolLM2-135M-Instruct.Q4_1.gguf": gguf,
                                           "SmolLM2-135M-Instruct.Q8_0.gguf": gguf})
    llama = tiny_models["llama"]
    hub_repo(cache, "test-org/tiny-llama", {p.name: p for p in llama.iterdir() if p.is_file()})
    part = cache.parent / "part.bin"
    part.write_bytes(b"GGUF")
    hub_repo(cache, "test-org/split-gguf", {f"x-Q4_0-0000{i}-of-00002.gguf": part for i in (1, 2)})
    return cache


@pytest.fixture
def offline_hub(hub_cache, monkeypatch) -> Path:
    """hub_cache as huggingface_hub's cache, offline: the environment for child processes, and the
    settings huggingface_hub read from it at import for this one."""
    from huggingface_hub import constants
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default target in fp32 (loaded once per session)."""
    from specdecode.models.loader import load_model
    return load_model(None, dtype="fp32", progress=False)


def run_engine(target, drafter, k: int, prompts, params, adaptive: bool = True):
    """The finished sequences of one offline call on a fresh engine core (as LLM.generate runs)."""
    from specdecode.engine import offline
    core = offline.offline_core(target, drafter, k, adaptive)
    return offline.run(core, [list(p) for p in prompts], list(params))


def make_seq(request_id, prompt_ids, params, eos_token_ids=(), row: int = 0, drafter_state=None):
    """A Sequence outside an engine (drafter tests): its request, a row, no speculation state;
    `drafter_state`: what the drafter's prepare returned (an engine sets it at admission)."""
    from specdecode.engine.controller import RowSpec
    from specdecode.engine.sequence import Request, Sequence
    request = Request(list(prompt_ids), params, sink=lambda event: None, id=request_id)
    s = Sequence(request, tuple(eos_token_ids), row, RowSpec(0))
    s.drafter_state = drafter_state
    return s


# The speculative loop against plain decoding on the tiny Llama: engine/test_drafts.py, test_stops.py,
# test_sampling_params.py, test_api_inputs.py, drafters/test_draft_model.py. (Shared helpers live here,
# not in a conftest.py of a subfolder: a second conftest would shadow this one for `from conftest import`.)
PROMPTS = [
    "the quick brown fox jumps over the lazy dog. the quick brown fox",
    "def add(a, b):\n    return a + b\n",
    "Summarize the following text. The cat sat on the mat.",
    "1 2 3 4 5 6 7 8",
]
DRAFTERS = ["ngram", "model", "self"]


@pytest.fixture(scope="module")
def llms(tiny_models):
    """Plain / ngram / draft-model / self-draft engines over the same tiny Llama target."""
    from specdecode import LLM
    target = str(tiny_models["llama"])
    opts = dict(dtype="fp32", progress=False, adaptive=False)
    return {
        "ngram": LLM(model=target, method="ngram", **opts),
        "model": LLM(model=target, draft=str(tiny_models["llama_draft"]), method="model", **opts),
        "self": LLM(model=target, draft=target, method="model", draft_confidence=0.0, **opts),   # full chains
    }


_PLAIN: dict[str, list] = {}


def plain(llms, prompts, params):
    """Plain decoding (k = 0) of the target, memoized: many tests compare to the same runs."""
    key = repr((prompts, params))
    if key not in _PLAIN:
        _PLAIN[key] = llms["ngram"].generate(prompts, params, num_speculative_tokens=0)
    return _PLAIN[key]


def step_sizes(llm, prompts, params, k):
    """Run and record how many tokens each step appended, per row."""
    sizes: dict[int, list[int]] = {}

    def on_tokens(seq, tokens):
        sizes.setdefault(seq.request_id, []).append(len(tokens))
    out = llm.generate(prompts, params, num_speculative_tokens=k, on_tokens=on_tokens)
    return out, [sizes[i] for i in range(len(out))]


def check_openai_schema(instance: dict, name: str) -> None:
    """Every violation of OpenAI's response schema `name` (tests/serve/data, trimmed from their
    openapi.yaml by scripts/setup/trim_openapi.py), listed: the first error alone hides the rest."""
    import jsonschema
    schemas = json.loads((Path(__file__).parent / "serve" / "data" / "openai_responses.schema.json").read_text())
    validator = jsonschema.Draft202012Validator({"$ref": f"#/$defs/{name}", "$defs": schemas["$defs"]})
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(instance)]
    assert not errors, f"{name}: " + "; ".join(errors)


# ---------------------------------------------------------------- thinking models (serve/reasoning.py)
THINKING_CORPUS = ["the quick brown fox jumps over the lazy dog. what is the weather in paris? 1 2 3 4 5",
                   '{"name": "get_time", "arguments": {"city": "Oslo"}} let me think about it first',
                   "analysis final commentary assistant user system thought model",
                   "<function=get_time>\n<parameter=city>\nOslo\n</parameter>\n</function> call:get_time{city:"]
_TURNS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n")
_OFF = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
_QWEN_TOOLS = ("{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
               "\n</tools>\nReturn each call as <tool_call>\n{\"name\": <function-name>, \"arguments\": <args>}\n"
               "</tool_call><|im_end|>\n{% endif %}")
NL = "{{ '\\n' }}"                # a line break right after a block tag (the templates trim the first one)
# Qwen3.5's tools and calls: XML (<function=NAME><parameter=KEY>VALUE</parameter>), results as <tool_response> turns
_QWEN35_TOOLS = ("{% if tools %}<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
                 "{% for t in tools %}" + NL + "{{ t | tojson }}{% endfor %}" + NL + "</tools>\n\nIf you choose to "
                 "call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_"
                 "function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>"
                 "<|im_end|>" + NL + "{% endif %}")
_QWEN35_TURNS = ("{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
                 "{% for c in m.tool_calls or [] %}{% if not loop.first or m.content %}" + NL + "{% endif %}<tool_call>"
                 "\n<function={{ c.function.name }}>" + NL + "{% for k, v in c.function.arguments | items %}<parameter="
                 "{{ k }}>\n{{ v if v is string else v | tojson }}\n</parameter>" + NL + "{% endfor %}</function>\n"
                 "</tool_call>{% endfor %}<|im_end|>" + NL + "{% elif m.role == 'tool' %}{% if loop.first or "
                 "loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}" + NL + "<tool_response>\n{{ m.content }}"
                 "\n</tool_response>{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>" + NL + "{% endif %}"
                 "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>" + NL + "{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n")
# Gemma 4's tools and calls: <|tool>declaration:...<tool|>, <|tool_call>call:NAME{key:<|"|>text<|"|>}<tool_call|>,
# each result after its call as <|tool_response>response:NAME{value:...}<tool_response|> in the model's turn
_GEMMA4_ARG = ("{% macro arg(v) %}{% if v is string %}<|\"|>{{ v }}<|\"|>{% elif v is boolean %}"
               "{{ 'true' if v else 'false' }}{% elif v is mapping %}{{ '{' }}{% for k, x in v | dictsort %}"
               "{% if not loop.first %},{% endif %}{{ k }}:{{ arg(x) }}{% endfor %}{{ '}' }}{% elif v is sequence %}"
               "[{% for x in v %}{% if not loop.first %},{% endif %}{{ arg(x) }}{% endfor %}]{% else %}{{ v }}"
               "{% endif %}{% endmacro %}")
_GEMMA4 = (_GEMMA4_ARG + "{{ bos_token }}{% if enable_thinking or tools %}<|turn>system\n{% if enable_thinking %}"
           "<|think|>{% endif %}{% for t in tools or [] %}<|tool>declaration:{{ t.function.name }}{description:<|\"|>"
           "{{ t.function.description }}<|\"|>}<tool|>{% endfor %}<turn|>" + NL + "{% endif %}"
           "{% set ns = namespace(last='') %}{% for m in messages %}{% if m.role != 'tool' %}"
           "<|turn>{{ 'model' if m.role == 'assistant' else m.role }}" + NL +
           "{% for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}{{ arg(c.function.arguments) }}"
           "<tool_call|>{% endfor %}{% set ns.last = 'call' if m.tool_calls else '' %}{% if m.tool_calls %}"
           "{% set scan = namespace(on=true) %}{% for r in messages[loop.index0 + 1:] %}{% if r.role != 'tool' %}"
           "{% set scan.on = false %}{% elif scan.on %}{% set t = namespace(name='unknown') %}"
           "{% for c in m.tool_calls %}{% if c.id == r.tool_call_id %}{% set t.name = c.function.name %}{% endif %}"
           "{% endfor %}<|tool_response>response:{{ t.name }}{value:<|\"|>{{ r.content }}<|\"|>}<tool_response|>"
           "{% set ns.last = 'response' %}{% endif %}{% endfor %}{% endif %}{{ m.content }}"
           "{% if ns.last == 'call' %}<|tool_response>{% elif not (ns.last == 'response' and not m.content) %}<turn|>"
           + NL + "{% endif %}{% endif %}{% endfor %}{% if add_generation_prompt and ns.last == '' %}<|turn>model"
           + NL + "{% if not enable_thinking %}<|channel>thought" + NL + "<channel|>{% endif %}{% endif %}")
THINKING_FAMILIES = {   # name: (added tokens (special?), eos tokens, bos, chat template)
    # Qwen3: the model opens <think> itself; enable_thinking false renders an empty block
    "qwen3": ({"<|endoftext|>": True, "<|im_start|>": True, "<|im_end|>": True, "<think>": False,
               "</think>": False, "<tool_call>": False, "</tool_call>": False}, ["<|im_end|>"], None,
              _QWEN_TOOLS + _TURNS + _OFF + "{% endif %}{% endif %}"),
    # Qwen3.5 / DeepSeek-R1 distills: the generation prompt opens <think>
    "qwen3.5": ({"<|endoftext|>": True, "<|im_start|>": True, "<|im_end|>": True, "<think>": False,
                 "</think>": False, "<tool_call>": False, "</tool_call>": False}, ["<|im_end|>"], None,
                _QWEN35_TOOLS + _QWEN35_TURNS + _OFF + "{% else %}<think>\n{% endif %}{% endif %}"),
    # gpt-oss: harmony messages; <|return|> and <|call|> end the answer
    "gpt-oss": ({"<|startoftext|>": True, "<|start|>": True, "<|channel|>": True, "<|message|>": True,
                 "<|end|>": True, "<|constrain|>": True, "<|return|>": True, "<|call|>": True},
                ["<|return|>", "<|call|>"], "<|startoftext|>",
                "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final"
                "{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|start|>assistant{% endif %}"),
    # Gemma 4: turns, <|think|> in the system turn turns thinking on, and without it the generation
    # prompt closes an empty thought channel (as the larger Gemma 4 templates do)
    "gemma4": ({"<bos>": True, "<eos>": True, "<|turn>": True, "<turn|>": True, "<|think|>": True,
                "<|channel>": True, "<channel|>": True, "<|tool>": True, "<tool|>": True, "<|tool_call>": True,
                "<tool_call|>": True, "<|tool_response>": True, "<tool_response|>": True, '<|"|>': True},
               ["<turn|>", "<eos>", "<|tool_response>"], "<bos>", _GEMMA4),
}


def make_thinking_model(folder: Path, family: str) -> Path:
    """A 2-layer random Qwen2 model whose tokenizer holds a thinking family's markers and whose chat
    template lays out turns, thinking and tools the family's way (THINKING_FAMILIES; templates written
    for the tests)."""
    added, eos, bos, template = THINKING_FAMILIES[family]
    return make_marker_model(folder, added, eos, bos, template, THINKING_CORPUS, seed=7)


def thinking_grammar(tokenizer, vocab_size: int, eos_token_ids, *parts: str) -> str:
    """A Lark grammar (vLLM's guided_grammar) that makes a random model write `parts` in order: a
    marker the vocabulary holds as one token llguidance treats as special is named by its id
    (`<[id]>`: its spelled-out text does not match it), other parts are quoted text, and a part
    written `/regex/` stays a regex."""
    from specdecode.serve.tools.formats import single_token
    from specdecode.structured import grammar_tokenizer_for
    special = grammar_tokenizer_for(tokenizer, vocab_size, tuple(eos_token_ids)).is_special
    out = []
    for part in parts:
        token = single_token(tokenizer, part)
        if part.startswith("/") and part.endswith("/") and len(part) > 1:
            out.append(part)
        elif token is not None and special(token):
            out.append(f"<[{token}]>")
        else:
            out.append(json.dumps(part))
    return "start: " + " ".join(out) + "\n"


# Tiny random Qwen3-MoE (tests/models/test_qwen3_moe.py): 8 experts of which 2 routed, the router's and
# the experts' weights scaled so routing and the experts' outputs matter to the next token
def make_qwen3_moe(folder: Path, seed: int = 5, norm_topk: bool = True, mlp_only_layers: tuple[int, ...] = ()):
    """A tiny random Qwen3-MoE saved in `folder` as transformers saves it; returns the transformers model."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3MoeForCausalLM"):
        pytest.skip("this transformers has no Qwen3-MoE")
    make_tokenizer(folder)
    vocab = json.loads((folder / "tokenizer.json").read_text())
    base = len(vocab["model"]["vocab"])
    size = base + len([t for t in vocab["added_tokens"] if t["id"] >= base])
    config = transformers.Qwen3MoeConfig(
        vocab_size=size, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=norm_topk, mlp_only_layers=list(mlp_only_layers), max_position_embeddings=256,
        tie_word_embeddings=False, eos_token_id=2, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2.5)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.5)
                layer.mlp.experts.down_proj.mul_(5.0)
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


def make_qwen35_moe(folder: Path, seed: int = 3, mtp: bool = False):
    """A tiny random Qwen3.5-MoE text model (qwen3_5_moe_text: the hybrid stack, every MLP 8 experts of
    which 2 routed plus a gated shared expert) saved in `folder`; returns the transformers model. With
    `mtp`: a random multi-token-prediction head whose layer has the same MoE MLP (`mtp.*`, one matrix per
    expert as a checkpoint ships them), as make_qwen35 adds one."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
        pytest.skip("this transformers has no Qwen3.5-MoE")
    make_tokenizer(folder)
    vocab = json.loads((folder / "tokenizer.json").read_text())
    base = len(vocab["model"]["vocab"])
    size = base + len([t for t in vocab["added_tokens"] if t["id"] >= base])
    config = transformers.Qwen3_5MoeTextConfig(
        vocab_size=size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=2,
        rms_norm_eps=1e-6, moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2.5)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
            layer.mlp.experts.down_proj.mul_(5.0)
            layer.mlp.shared_expert_gate.weight.normal_(0, 0.5)
    model.save_pretrained(str(folder), safe_serialization=True)
    if mtp:
        from safetensors.torch import load_file, save_file
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer
        torch.manual_seed(seed + 1)
        layer = Qwen3_5MoeDecoderLayer(config, config.layer_types.index("full_attention"))
        d = config.hidden_size
        head = {"fc.weight": torch.cat([torch.eye(d), torch.randn(d, d) * (2 * d) ** -0.5], dim=1),
                **{f"{name}.weight": torch.empty(d).uniform_(-0.3, 0.3)
                   for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
        for name, t in layer.state_dict().items():
            if name.endswith("experts.gate_up_proj"):          # one matrix per expert, as checkpoints hold them
                for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                    head[f"layers.0.mlp.experts.{e}.gate_proj.weight"] = gate
                    head[f"layers.0.mlp.experts.{e}.up_proj.weight"] = up
            elif name.endswith("experts.down_proj"):
                head.update({f"layers.0.mlp.experts.{e}.down_proj.weight": w for e, w in enumerate(t)})
            else:
                head[f"layers.0.{name}"] = t.uniform_(-0.3, 0.3) if "norm" in name else t
        weights = load_file(str(folder / "model.safetensors"))
        weights.update({f"mtp.{name}": t.detach().contiguous() for name, t in head.items()})
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    return model


# --- gpt-oss (tests/models/test_gpt_oss.py) ---
def make_gpt_oss(folder: Path, seed: int = 7, window: int = 6):
    """A tiny random gpt_oss saved in `folder` as transformers saves it (4 layers alternating a `window`-key
    sliding window and full attention, 8 experts of which 2 routed, YaRN RoPE whose ramp reaches the
    tiny head, every bias and sink random); returns the transformers model."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip("this transformers has no gpt-oss")
    make_tokenizer(folder)
    vocab = json.loads((folder / "tokenizer.json").read_text())
    base = len(vocab["model"]["vocab"])
    size = base + len([t for t in vocab["added_tokens"] if t["id"] >= base])
    config = transformers.GptOssConfig(
        vocab_size=size, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=window,
        max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=2,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 150000.0})
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2.5)
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.o_proj):
                lin.bias.normal_(0, 0.1)
            layer.self_attn.q_proj.weight.mul_(4.0)                 # peaked attention: positions matter
            layer.self_attn.k_proj.weight.mul_(4.0)
            layer.mlp.router.weight.normal_(0, 0.5)
            layer.mlp.router.bias.normal_(0, 0.5)
            layer.mlp.experts.gate_up_proj.mul_(40.0)           # some gates and ups past the clamp's limit
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.5)
            layer.mlp.experts.down_proj.mul_(2.0)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.05)
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


# ---------------------------------------------------------------- tiny models with a family's markers (agents2)
def make_marker_model(folder: Path, added: dict[str, bool], eos: list[str], bos: str | None, template: str,
                      corpus: list[str], seed: int) -> Path:
    """A 2-layer random Qwen2 model whose byte-level BPE tokenizer (trained on `corpus`) holds a model
    family's marker tokens (`added`: text -> special?, as the family's own tokenizer has them), with the
    family's chat template and end tokens (`eos`, the first the tokenizer's): the tool-call and thinking
    families' models (test_tool_formats.py, THINKING_FAMILIES)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Config, Qwen2ForCausalLM
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus * 4, trainer)
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in added.items()])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos[0], "add_bos_token": False, "chat_template": template}))
    ids = [tok.token_to_id(t) for t in eos]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=2048, tie_word_embeddings=True,
                                         eos_token_id=ids[0], bos_token_id=None))
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


# ---------------------------------------------------------------- Gemma 4 with MoE blocks (26B-A4B's layout)
def gemma4_moe_text_config(vocab_size: int, layers: int = 5):
    """Gemma 4 26B-A4B's layout in small: a MoE block (8 experts, 2 routed) beside every layer's MLP,
    global layers with k_eq_v and one kv head, no per-layer inputs, no kv sharing."""
    from transformers import Gemma4TextConfig
    return Gemma4TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, sliding_window=GEMMA4_WINDOW, hidden_size_per_layer_input=0,
        num_hidden_layers=layers, layer_types=(GEMMA4_TYPES * 2)[:layers], num_kv_shared_layers=0,
        attention_k_eq_v=True, num_global_key_value_heads=1, final_logit_softcapping=10.0,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
        max_position_embeddings=256, bos_token_id=GEMMA4_BOS, eos_token_id=GEMMA4_EOS, pad_token_id=0)


def make_gemma4_moe(folder: Path, layers: int = 5, seed: int = 17) -> Path:
    """A random gemma4_text checkpoint with MoE blocks saved by transformers, make_tokenizer's tokenizer:
    norms, router scales and per-expert scales away from 1, sharp routing, experts loud enough to matter."""
    from transformers import Gemma4ForCausalLM
    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder, specials=("<bos>", "<turn|>"))
    vocab_size = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(gemma4_moe_text_config(vocab_size, layers))
    randomize_gemma4(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.router.proj.weight.normal_(0, 2.0)
            layer.router.scale.normal_(1.0, 0.3)
            layer.router.per_expert_scale.uniform_(0.5, 2.0)
            layer.experts.down_proj.mul_(8.0)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


# ---------------------------------------------------------------- a fuzzed server and its log (the API fuzz tests)
FUZZ_KEY = "fuzz-key"


class LogTracebacks(logging.Handler):
    """The warnings and errors logged with a traceback (exc_info, or one in the message)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.tracebacks: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "Traceback" in record.getMessage():
            self.tracebacks.append(self.format(record))


@pytest.fixture(scope="module")
def fuzz_served():
    """(a server on the embedded model behind FUZZ_KEY, its LogTracebacks): test_messages_fuzz.py,
    test_responses_fuzz.py."""
    from specdecode import LLM
    from specdecode.engine.config import EngineConfig
    from specdecode.serve.app import create_app
    from specdecode.serve.server import BackgroundServer, build_state
    llm = LLM(method="ngram", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=2048, served_model_name="m"))
    records = LogTracebacks()
    logging.getLogger().addHandler(records)
    try:
        with BackgroundServer(create_app(state, api_key=FUZZ_KEY)) as srv:
            yield srv, records
    finally:
        logging.getLogger().removeHandler(records)

