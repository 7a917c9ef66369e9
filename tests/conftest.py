"""Shared fixtures: tiny random Llama/Qwen2 models with a tiny trained BPE tokenizer, made
on the fly (no network), and the embedded SmolLM2-135M for the slow tests."""
from __future__ import annotations

import json
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
    """(directory, transformers model): 4 layers, three DeltaNet to one attention, more value heads
    than key heads (as Qwen3.5's), norms away from their neutral value."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip("this transformers has no Qwen3.5")
    folder = tmp_path_factory.mktemp("qwen3_5")
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
    return folder, model


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


def make_seq(request_id, prompt_ids, params, eos_token_ids=(), row: int = 0):
    """A Sequence outside an engine (drafter tests): its request, a row, no speculation state."""
    from specdecode.engine.controller import RowSpec
    from specdecode.engine.sequence import Request, Sequence
    request = Request(list(prompt_ids), params, sink=lambda event: None, id=request_id)
    return Sequence(request, tuple(eos_token_ids), row, RowSpec(0))


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
