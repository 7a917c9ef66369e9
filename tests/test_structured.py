"""Structured output (llguidance): every finished constrained output parses and validates; greedy
output is identical with and without speculation (a chain and a tree drafter) while the grammar's
forced tokens are accepted as drafts; the server takes response_format / guided_* through the
unchanged openai client; bad schemas, regexes and grammars get one clear error naming the field."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from specdecode import LLM, SamplingParams
from specdecode.engine.config import EngineConfig
from specdecode.params import ParamError
from specdecode.serve.app import create_app
from specdecode.serve.server import BackgroundServer, build_state
from specdecode.structured import Structured, structured_from_body

pytestmark = pytest.mark.usefixtures("one_thread")
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "country": {"type": "string", "enum": ["France", "Spain", "Japan", "Other"]},
                                      "sunny": {"type": "boolean"}},
     "required": ["city", "country", "sunny"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                "minItems": 1, "maxItems": 3}},
     "required": ["items"], "additionalProperties": False},
]
PROMPTS = ["Describe Maria, a 34 year old nurse, as JSON.", "Where is Kyoto? Answer as JSON.",
           "List three fruits as JSON."]


@pytest.fixture(scope="module")
def llm():
    return LLM(method="ngram", progress=False, adaptive=False, num_speculative_tokens=8)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_outputs_validate_and_speculation_changes_nothing(llm, schema):
    params = SamplingParams(max_tokens=96, structured=Structured("json_schema", schema))
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    spec = llm.generate(PROMPTS, params)
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
        assert s.finish_reason == "stop", s.text          # bounded schemas finish
        jsonschema.validate(json.loads(s.text), schema)
    # keys and punctuation are forced tokens: drafted for free and accepted
    assert max(s.stats["mean_accepted_length"] for s in spec) > 1.5


def test_sampled_outputs_validate_and_tree_drafter(llm):
    schema = SCHEMAS[0]
    sampled = SamplingParams(max_tokens=96, temperature=0.8, top_p=0.95, seed=3,
                             structured=Structured("json_schema", schema))
    for out in llm.generate(PROMPTS * 2, sampled):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)
    tree = LLM(method="suffix", progress=False, adaptive=False, num_speculative_tokens=16)
    greedy = SamplingParams(max_tokens=96, structured=Structured("json_schema", SCHEMAS[1]))
    assert [o.token_ids for o in tree.generate(PROMPTS, greedy)] == \
        [o.token_ids for o in tree.generate(PROMPTS, greedy, num_speculative_tokens=0)]


def test_regex_choice_and_grammar(llm):
    number = SamplingParams(max_tokens=12, structured=Structured("regex", r"[0-9]{1,3}"))
    out = llm.generate(["What is 6 times 7?"], number)[0]
    assert re.fullmatch(r"[0-9]{1,3}", out.text)
    choice = SamplingParams(max_tokens=8, structured=Structured("choice", ["yes", "no"]))
    out = llm.generate(["Is the sky blue?"], choice)[0]
    assert out.text in ("yes", "no")
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    out = llm.generate(["Is water wet?"], SamplingParams(max_tokens=16, structured=Structured("grammar", gbnf)))[0]
    assert re.fullmatch(r"The answer is (yes|no)\.", out.text), out.text
    assert out.stats["mean_accepted_length"] > 1.5           # "The answer is " is forced


def test_length_limit_ends_with_length_not_a_crash(llm):
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    out = llm.generate(["Tell a long story as JSON."], SamplingParams(max_tokens=10,
                                                                       structured=Structured("json_schema", schema)))[0]
    assert out.finish_reason == "length" and out.text.startswith('{"story": "')


def test_bad_inputs_name_the_field():
    with pytest.raises(ParamError, match="structured kind must be one of"):
        Structured("yaml", "x")
    with pytest.raises(ParamError, match="choice needs a non-empty list"):
        Structured("choice", [])
    with pytest.raises(ParamError, match=r"guided_regex: invalid regex"):
        structured_from_body({"guided_regex": "(unclosed"})
    with pytest.raises(ParamError, match=r"at most one of response_format"):
        structured_from_body({"guided_regex": "a", "guided_choice": ["a"]})
    with pytest.raises(ParamError, match=r"guided_grammar: invalid grammar"):
        structured_from_body({"guided_grammar": "root ::= ( 'a'"})
    with pytest.raises(ParamError, match="response_format must be"):
        structured_from_body({"response_format": {"type": "xml"}})
    assert structured_from_body({"response_format": {"type": "text"}}) == (None, None)


@pytest.fixture(scope="module")
def client(llm):
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=512, served_model_name="m"))
    with BackgroundServer(create_app(state)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_openai_client_response_format_streamed_and_not(client):
    schema = SCHEMAS[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": PROMPTS[0]}]
    full = client.chat.completions.create(model="m", messages=messages, max_tokens=96, temperature=0,
                                          response_format=fmt)
    jsonschema.validate(json.loads(full.choices[0].message.content), schema)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=messages, max_tokens=96, temperature=0, response_format=fmt, stream=True) if c.choices)
    assert streamed == full.choices[0].message.content
    obj = client.chat.completions.create(model="m", messages=messages, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")
    choice = client.completions.create(model="m", prompt="Is the sky blue?", max_tokens=5, temperature=0,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="m", prompt="x", max_tokens=5, extra_body={"guided_json": {"type": 5}})
    assert err.value.body["param"] == "guided_json"


@pytest.mark.parametrize("method", ["plain", "ngram"])
def test_transformers_peer_follows_the_same_grammar(llm, method):
    """The bench's transformers peer: generate() with the grammar as a logits processor gives
    valid JSON, plain and with prompt lookup (which calls the processor on prefixes that go back)."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    from specdecode.bench.systems import GrammarLogitsProcessor
    from specdecode.structured import grammar_tokenizer
    model = AutoModelForCausalLM.from_pretrained(str(llm.target.dense_path()), dtype=torch.float32).eval()
    schema = SCHEMAS[0]
    ids = llm.encode(PROMPTS[0], chat=True)
    constraint = grammar_tokenizer(llm.target).constraint(Structured("json_schema", schema))
    processor = GrammarLogitsProcessor(constraint, len(ids))
    x = torch.tensor([ids])
    kwargs = {"prompt_lookup_num_tokens": 8} if method == "ngram" else {}
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=96, do_sample=False,
                             eos_token_id=list(llm.target.eos_token_ids), pad_token_id=llm.target.eos_token_ids[0],
                             logits_processor=LogitsProcessorList([processor]), **kwargs)
    text = llm.tokenizer.decode([t for t in out[0, len(ids):].tolist() if t not in llm.target.eos_token_ids])
    jsonschema.validate(json.loads(text), schema)


def test_validation_workload_at_small_scale(llm):
    """The scale check (specdecode/bench/structured_check.py, 100 prompts x 5 schemas in
    RESULTS.md) on 1 prompt per schema: every answer validates, greedy is identical with
    speculation, sampled answers validate too."""
    from specdecode.bench.structured_check import check, load_workload, table
    prompts, schemas = load_workload(1)
    assert len(schemas) == 5 and len(prompts) == 5
    result = check(llm, prompts, schemas, k=8, batch_size=5, max_tokens=112)
    assert result["failures"] == [], result["failures"]
    assert all(r["identical"] == r["prompts"] == 1 for r in result["per_schema"].values())
    assert "| person | 1 |" in table(result)


def test_greedy_masks_only_where_the_argmax_is_forbidden(llm):
    """Greedy rows check the argmax against the grammar and compute a mask only where it is
    forbidden: the outputs equal those with every mask computed (a row reporting log-probabilities
    gets every mask), plain and speculating; and at each position of an answer, for every token of
    the vocabulary, `mask_allows` agrees with the mask wherever it answers."""
    from specdecode.structured import grammar_tokenizer
    for schema in SCHEMAS:
        lazy = SamplingParams(max_tokens=64, structured=Structured("json_schema", schema))
        full = SamplingParams(max_tokens=64, structured=Structured("json_schema", schema), logprobs=0)
        for k in (0, 8):
            assert [o.token_ids for o in llm.generate(PROMPTS, lazy, num_speculative_tokens=k)] == \
                [o.token_ids for o in llm.generate(PROMPTS, full, num_speculative_tokens=k)]
    schema = SCHEMAS[1]
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=64, structured=Structured("json_schema", schema)))[0]
    c = grammar_tokenizer(llm.target).constraint(Structured("json_schema", schema))
    answered = 0
    for i in range(len(out.token_ids) + 1):
        mask = c.allowed()
        for t in range(0, llm.target.model.vocab_size, 1 if i % 6 == 0 else 97):
            said = c.mask_allows([], t)
            if said is not None:
                answered += 1
                assert said == bool(mask[t]), (i, t)
        if i < len(out.token_ids):
            c.consume([out.token_ids[i]])
    assert answered > 100_000


def test_forbidden_drafts_are_trimmed_before_the_pass(llm):
    """A draft node the grammar forbids, and its subtree, is dropped before the target pass
    (chains and trees); allowed nodes keep their order and parents."""
    from conftest import make_seq

    from specdecode.drafters.base import DraftProposal
    from specdecode.structured import grammar_tokenizer, trim_drafts
    tok = llm.tokenizer
    structured = Structured("json_schema", SCHEMAS[0])
    seq = make_seq(0, tok.encode("x", False), SamplingParams(structured=structured), (0,), row=0)
    seq.constraint = grammar_tokenizer(llm.target).constraint(structured)
    ok = tok.encode('{"name": "Ann", "age": 3', False)
    seq.constraint.consume(ok[:-2])                              # before ', "age"'-ish: any allowed path works
    good = ok[-2:]
    bad = tok.encode("]", False)
    chain = DraftProposal.from_lists([good + bad + good])
    trimmed = trim_drafts([seq], chain)
    assert trimmed.num_tokens.tolist() == [2] and trimmed.tokens[0, :2].tolist() == good
    tree = DraftProposal.from_trees([[(bad[0], -1), (good[0], -1), (good[1], 1), (good[1], 0)]])
    trimmed = trim_drafts([seq], tree)
    assert trimmed.num_tokens.tolist() == [2] and trimmed.tokens[0, :2].tolist() == good and trimmed.parents is None
    free = make_seq(1, tok.encode("x", False), SamplingParams(), (0,), row=1)   # unconstrained rows keep theirs
    both = DraftProposal.from_lists([bad + good, bad + good])
    trimmed = trim_drafts([seq, free], both)
    assert trimmed.num_tokens.tolist() == [0, 3]


def test_text_match_drafts_across_a_tokenization_boundary(llm):
    """A value copied from the prompt is not the prompt's tokens after a quote (`"Maria` vs
    ` Maria`): token lookup finds nothing there, the text match drafts the rest of the value."""
    from specdecode.drafters.ngram import NgramDrafter, longest_text_match
    assert longest_text_match("abcXYZabc") == (3, 3)
    assert longest_text_match("abcdab", min_chars=3) == (0, 0)
    assert longest_text_match("xyzxyz") == (3, 3)
    tok = llm.tokenizer
    ids = tok.encode("Text: Maria Lopez is 34 years old.\n", False) + tok.encode('{"name": "Maria', False)
    with_text = NgramDrafter(llm.target, text_match=True).draft_one(ids, 4)
    assert tok.decode(with_text) == " Lopez is 3", tok.decode(with_text)        # digits are single tokens
    tokens_only = NgramDrafter(llm.target).draft_one(ids, 4)
    assert not tok.decode(tokens_only).startswith(" Lopez")
    assert NgramDrafter(llm.target, ngram_min=16, ngram_max=16, text_match=True).draft_one(ids, 4) == []   # >= 48 chars
