"""Grammars and JSON schemas: exact constrained decoding, with and without speculation."""

from __future__ import annotations

import json
import time

import jsonschema
import numpy as np
import pytest
from reference import assert_greedy_as_llama, chi_square_pvalue, law_after

from edgespec import Engine
from edgespec.errors import EdgespecError
from edgespec.grammar import Grammar, GrammarError, json_schema_gbnf
from edgespec.sampling import SamplingParams, constrained, constrained_argmax

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "born": {"type": "integer"},
        "alive": {"type": "boolean"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "born", "alive", "skills"],
}
ORDER = {
    "type": "object",
    "properties": {
        "size": {"enum": ["small", "medium", "large"]},
        "extras": {"type": "array", "items": {"enum": ["milk", "sugar", "cream"]}, "maxItems": 3},
        "price": {"type": "number"},
        "note": {"type": ["string", "null"], "maxLength": 30},
    },
    "required": ["size", "extras", "price", "note"],
}
ADA = "Extract the person as JSON: Ada Lovelace, born 1815, died 1852, was a mathematician and writer."
COFFEE = "Order for the café as JSON: a large coffee with milk and sugar, 3.50, no note."
LIST_GBNF = 'root ::= item ("\\n" item){2}\nitem ::= "- " [a-z]+ (" " [a-z]+)?'


@pytest.mark.parametrize(
    "prompt,constraint", [(ADA, {"json_schema": PERSON}), ("List three fruits.", {"grammar": LIST_GBNF})]
)
@pytest.mark.slow
def test_greedy_under_a_grammar_equals_llama_cpp_python(smollm2, smollm2_path, requant_engine, prompt, constraint):
    """Greedy is the argmax of p_g: the same tokens as llama-cpp-python's with llama.cpp's grammar
    sampler (reference.py), with no draft, with copies and forced text, and with a draft model."""
    engine = Engine(smollm2)
    gbnf = constraint.get("grammar") or json_schema_gbnf(constraint["json_schema"])
    plain = engine.generate(prompt, temperature=0, max_tokens=120, speculative=False, **constraint)
    assert_greedy_as_llama("grammar no draft", engine, prompt, plain.tokens, limit=120, gbnf=gbnf)
    for name, run in {
        "free drafts": engine.generate(prompt, temperature=0, max_tokens=120, draft_mode="copy", **constraint),
        "draft model": requant_engine.generate(prompt, temperature=0, max_tokens=120, **constraint),
    }.items():
        assert_greedy_as_llama(f"grammar {name}", engine, prompt, run.tokens, limit=120, gbnf=gbnf)
    # a fixed gamma drafts whatever the costs measured on a busy machine say (auto may draft nothing)
    free = engine.generate(prompt, temperature=0, max_tokens=120, draft_mode="copy", gamma=4, **constraint)
    assert_greedy_as_llama("grammar fixed free drafts", engine, prompt, free.tokens, limit=120, gbnf=gbnf)
    assert free.stats.accepted_by_source.get("grammar", 0) > 0  # forced text was drafted and kept


PARAMS = dict(temperature=1.0, top_k=8, top_p=1.0, min_p=0.0)
# the first tokens are forced ("{\"a\": ") but may be split several ways; then a digit is free
DIGITS = 'root ::= "{\\"a\\": " [0-9] [0-9]? "}"'


@pytest.mark.parametrize("drafting", ["forced", "model"])
@pytest.mark.slow
def test_first_two_tokens_follow_the_constrained_law(smollm2, requant_engine, drafting):
    """Sampled: the first two tokens over 1500 runs follow p_g(t1) p_g(t2 | t1) (chi-square),
    through forced drafts and through a draft model whose q is masked the same way."""
    engine = Engine(smollm2, None, gamma=4, draft_mode="copy") if drafting == "forced" else requant_engine
    prompt = "Write a JSON object with one small number in it."
    width = 5  # the verify batch of gamma 4 (see reference.py)
    p1 = law_after(engine, prompt, width=width, raw=False, gbnf=DIGITS, **PARAMS)
    support = np.flatnonzero(p1)
    p2 = {
        int(t): law_after(engine, prompt, [int(t)], width=width - 1, raw=False, gbnf=DIGITS, **PARAMS) for t in support
    }
    joint = np.concatenate([p1[t] * p2[int(t)] for t in support])
    counts = np.zeros(len(support) * len(p1))
    sources = set()
    rng = np.random.default_rng(9)
    runs = 1500
    for _ in range(runs):
        events = engine.stream(prompt, grammar=DIGITS, max_tokens=2, seed=int(rng.integers(2**32)), **PARAMS)
        first, second = next(events), next(events)
        events.close()
        counts[int(np.flatnonzero(support == first.token)[0]) * len(p1) + second.token] += 1
        sources.add(first.source)
    assert sources == {"draft", "target"}  # drafts were kept and rejected
    assert len(support) > 1 and chi_square_pvalue(counts, joint, runs) > 0.01


@pytest.mark.parametrize("schema,prompt", [(PERSON, ADA), (ORDER, COFFEE)], ids=["person", "order"])
@pytest.mark.slow
def test_every_answer_under_a_schema_is_valid(smollm2, requant_engine, schema, prompt):
    """Greedy and sampled, with every drafter: each finished answer parses and validates."""
    finished = 0
    for engine, mode in ((Engine(smollm2), "off"), (Engine(smollm2), "copy"), (requant_engine, "model")):
        for seed in range(4):
            sampling = dict(temperature=0) if seed == 0 else dict(temperature=0.9, seed=seed)
            answer = engine.generate(prompt, json_schema=schema, max_tokens=160, draft_mode=mode, **sampling)
            if answer.finish_reason == "length":
                continue
            assert answer.finish_reason == "stop", answer.text
            jsonschema.validate(json.loads(answer.text), schema)
            assert ": " in answer.text and "\n" not in answer.text  # json.dumps's style
            finished += 1
    assert finished >= 9


def test_forced_text_and_its_ends(smollm2):
    grammar = Grammar(smollm2, json_schema_gbnf(PERSON))
    assert grammar.forced_text() == '{"name": "'
    for token in smollm2.tokenize('{"name": "Ada", "born": 1815', add_special=False):
        grammar.accept(token)
    assert grammar.forced_text() == ""  # more digits, or the next key
    for token in smollm2.tokenize(', "alive": true, "skills": []}', add_special=False):
        assert grammar.allows(np.array([token]))[0]
        grammar.accept(token)
    assert grammar.finished()


def test_a_list_of_types_keeps_its_limits(smollm2):
    """{"type": ["string", "null"], "maxLength": 5}: llama.cpp's converter alone drops the limit (an
    ORDER answer's 66-character note passed the grammar and failed the schema)."""

    def allowed(schema: dict, text: str) -> bool:
        tokens = smollm2.tokenize(text, add_special=False)
        return Grammar(smollm2, json_schema_gbnf(schema)).allowed_prefix(tokens) == tokens

    note = {"type": ["string", "null"], "maxLength": 5}
    assert allowed(note, '"abcde"') and allowed(note, "null") and not allowed(note, '"abcdef"')
    items = {"type": ["array", "null"], "items": {"type": "integer"}, "maxItems": 1}
    assert allowed(items, "[1]") and allowed(items, "null") and not allowed(items, "[1, 2]")


def test_constrained_law_keeps_p_where_it_can():
    """p_g ∝ p·1[allowed]; where the grammar forbids all of p's support, the allowed tokens' own law."""
    logits = np.array([5.0, 4.0, 3.0, 0.0, -1.0])
    allows = lambda ids: np.isin(ids, [1, 3, 4])  # noqa: E731
    params = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)
    p = constrained(logits, params, allows)
    assert p[1] == pytest.approx(1.0) and p.sum() == pytest.approx(1.0)  # top-2 was {0, 1}: only 1 is allowed
    only_low = constrained(logits, params, lambda ids: np.isin(ids, [3, 4]))
    np.testing.assert_allclose(only_low[[3, 4]], np.exp([0, -1]) / np.exp([0, -1]).sum())
    assert constrained_argmax(logits, allows) == 1


@pytest.mark.parametrize(
    "gbnf,says",
    [
        ("root ::= (", "does not parse"),
        ('root ::= foo\nbar ::= "x"', "Undefined rule"),
        ('root ::= root "a"', "does not parse"),
        ("root ::= " + "(" * 200 + '"a"' + ")" * 200, "nests groups 200 deep"),
        ('root ::= "' + "a" * 70000 + '"', "more than"),
        ("", "empty"),
    ],
)
def test_bad_grammars_get_one_line(smollm2, gbnf, says):
    with pytest.raises(EdgespecError) as e:
        Engine(smollm2).stream("Hi", grammar=gbnf)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "schema,says",
    [
        ("[1, 2", "not JSON"),
        ([1, 2], "is an object"),
        ({"$ref": "https://example.com/s.json"}, "remote schema"),
        ({"type": "string", "minLength": 10**8}, "fix the schema"),  # out of memory, or of time
        ({"type": "array", "items": {"type": "integer"}, "minItems": 10**6}, "grammar of"),
    ],
)
def test_bad_schemas_get_one_line(smollm2, schema, says):
    with pytest.raises(EdgespecError) as e:
        Engine(smollm2).stream("Hi", json_schema=schema)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_an_ambiguous_grammar_is_stopped_before_it_eats_memory(smollm2):
    """Each "a" doubles llama.cpp's parse stacks here; long tokens of "a"s would multiply
    them many times in one step, were they not taken a byte at a time once steps slow."""
    grammar = Grammar(smollm2, 'root ::= x\nx ::= "a" x "b" | "a" x "c" | "a"')
    aaaa = smollm2.tokenize("aaaaaaaa", add_special=False)
    start = time.perf_counter()
    with pytest.raises(GrammarError, match="grew too large"):
        for _ in range(40):
            for token in aaaa:
                grammar.accept(token)
    assert time.perf_counter() - start < 60


def test_a_forced_tool_call_follows_the_function_schema(smollm2):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = Engine(smollm2).generate("Weather in Paris?", tools=tools, tool_choice=choice, temperature=0)
    (call,) = answer.tool_calls
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    with pytest.raises(EdgespecError, match="not also"):
        Engine(smollm2).stream("Hi", tools=tools, tool_choice=choice, grammar=LIST_GBNF)
