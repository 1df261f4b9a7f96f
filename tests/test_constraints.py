"""raydeploy.constraints with the real llguidance and the demo model's real tokenizer: `check`'s messages for
each kind of bad constraint, and the matchers' packed masks over the model's vocabulary as a valid output is
walked token by token to the grammar's end. No JAX."""

from __future__ import annotations

import json

import numpy as np
import pytest
from llguidance import LLMatcher

from raydeploy.constraints import Constraint, ConstraintError, GrammarEngine, check, to_grammar, words_for

EOS = 2
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]},
                                           "n": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammar(demo_checkpoint) -> GrammarEngine:
    return GrammarEngine.from_checkpoint(demo_checkpoint, 49152, [EOS])


def allowed_ids(words: np.ndarray) -> np.ndarray:
    """Token ids whose bit is set (bit i % 32 of word i // 32), read independently of the matcher."""
    return np.nonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))[0]


def walk(grammar: GrammarEngine, c: Constraint, text: str) -> tuple[list[int], object]:
    """Tokenize `text`, check each token is allowed by the mask before it and accepted; the matcher after it."""
    m = grammar.matcher(c)
    tokens = grammar.tokenizer.tokenize_str(text)
    for t in tokens:
        assert not m.done
        assert t in set(allowed_ids(m.mask()).tolist()), (t, grammar.tokenizer.decode_bytes([t]))
        assert m.accept(t), m.error
    return tokens, m


@pytest.mark.parametrize(("c", "message"), [
    (Constraint("json_schema", "{bad"), "json_schema constraint: the schema is not valid JSON: Expecting property"),
    (Constraint("json_schema", "[1, 2]"), "the schema must be a JSON object (or true/false), not list"),
    (Constraint("json_schema", '{"type": "strin"}'), "the JSON schema cannot be used: Invalid type: strin"),
    (Constraint("json_schema", '{"not": {"type": "string"}}'),
     'the JSON schema cannot be used: Unimplemented keys: ["not"]'),
    (Constraint("json_schema", '{"type": "string", "format": "no-such-format"}'), "Unknown format: no-such-format"),
    (Constraint("json_schema", "false"), "the schema false matches no output"),
    (Constraint("regex", "a(b"), "regex constraint: the regex cannot be used: at 1(8): invalid regex"),
    (Constraint("regex", "[z-a]"), "regex constraint: the regex cannot be used"),
    (Constraint("choice", "[]"), "choice constraint: the list of choices is empty"),
    (Constraint("choice", '["a", 1]'), "choice constraint: the choices must be a JSON list of strings"),
    (Constraint("choice", "yes,no"), "choice constraint: the choice list is not valid JSON"),
    (Constraint("grammar", "start: foo"), 'grammar constraint: the Lark grammar cannot be used: at 1(8): unknown '
                                          'name: "foo"'),
    (Constraint("grammar", "  "), "grammar constraint: the grammar is empty"),
])
def test_check_names_the_problem(c, message):
    for _ in range(2):  # the second answer comes from the cache, with the same message
        with pytest.raises(ConstraintError) as e:
            check(c)
        assert message in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("c", [
    Constraint("json_schema", json.dumps(SCHEMA)), Constraint("json_schema", "true"), Constraint("json_object"),
    Constraint("regex", r"[0-9]{3}-[a-z]+"), Constraint("choice", '["yes", "no, \\"quoted\\"", "é"]'),
    Constraint("grammar", 'start: "a" b\nb: "b"+'),
])
def test_check_passes_good_constraints(c):
    check(c)
    assert LLMatcher.validate_grammar(to_grammar(c)) == ""


def test_json_schema_first_mask_allows_only_object_openers_and_a_valid_output_reaches_done(grammar):
    c = Constraint("json_schema", json.dumps(SCHEMA))
    first = allowed_ids(grammar.matcher(c).mask())
    texts = [grammar.tokenizer.decode_bytes([int(i)]) for i in first]
    assert texts and all(t.startswith(b"{") for t in texts), texts  # compact JSON: no leading whitespace
    assert EOS not in first
    tokens, m = walk(grammar, c, '{"color":"blue","n":7}')
    assert m.done and m.error is None and m.tokens == len(tokens)
    assert allowed_ids(m.mask()).tolist() == [EOS]  # only the end can follow


def test_mask_forbids_what_the_schema_forbids(grammar):
    c = Constraint("json_schema", json.dumps(SCHEMA))
    _, m = walk(grammar, c, '{"color":"')
    texts = {grammar.tokenizer.decode_bytes([int(i)]) for i in allowed_ids(m.mask())}
    assert texts and all(b"red".startswith(t) or b"blue".startswith(t) for t in texts), texts
    _, m = walk(grammar, c, '{"color":"red","n":')
    digits = {grammar.tokenizer.decode_bytes([int(i)]) for i in allowed_ids(m.mask())}
    assert b"0" not in digits and b"5" in digits and b"10" not in digits  # minimum 1, maximum 9
    bad = grammar.tokenizer.tokenize_str("0")[0]
    assert not m.accept(bad) and "doesn't satisfy the grammar" in m.error
    assert not allowed_ids(m.mask()).size  # a failed matcher allows nothing


def test_choice_regex_and_lark_walk_to_done_and_eos_where_the_grammar_may_end(grammar):
    for c, text in ((Constraint("choice", '["yes", "no, \\"quoted\\""]'), 'no, "quoted"'),
                    (Constraint("regex", r"[0-9]{3}"), "042"),
                    (Constraint("grammar", 'start: "a" "b"'), "ab")):
        _, m = walk(grammar, c, text)
        assert m.done, c
    _, m = walk(grammar, Constraint("regex", "ab+"), "ab")  # may end or go on
    ids = set(allowed_ids(m.mask()).tolist())
    assert not m.done and EOS in ids and len(ids) > 1
    assert m.accept(EOS) and m.done


def test_compiled_grammars_are_cached_and_matchers_independent(grammar):
    c = Constraint("regex", r"x[0-9]+y")
    before = grammar.compiles
    a, b = grammar.matcher(c), grammar.matcher(c)
    assert grammar.compiles == before + 1
    x = grammar.tokenizer.tokenize_str("x")[0]
    assert a.accept(x)
    assert not np.array_equal(a.mask(), b.mask())  # b is still at the start
    small = GrammarEngine(grammar.tokenizer_json, 49152, [EOS], cache_size=1)
    small.matcher(Constraint("regex", "a"))
    small.matcher(Constraint("regex", "b"))
    small.matcher(Constraint("regex", "a"))  # dropped by "b": compiled again
    assert small.compiles == 3


def test_compile_error_is_a_constraint_error(grammar):
    with pytest.raises(ConstraintError, match="regex constraint: the regex cannot be used: at 1.8.: invalid regex"):
        grammar.matcher(Constraint("regex", "a(b"))


@pytest.mark.parametrize("vocab", [49152 + 40, 49000])
def test_masks_cover_the_models_vocabulary(grammar, vocab):
    """A model vocabulary wider than the tokenizer's (padded embedding rows) never allows the padding; a narrower
    one never allows ids past it, and a token past it is refused naming it."""
    engine = GrammarEngine(grammar.tokenizer_json, vocab, [EOS])
    m = engine.matcher(Constraint("regex", "(?s:.*)"))
    words = m.mask()
    assert words.shape == (words_for(vocab),) and words.dtype == np.uint32
    ids = allowed_ids(words)
    assert ids.max() == min(vocab, 49152) - 1 and ids.size > 40000
    with pytest.raises(ValueError, match=rf"contiguous uint32 \[{words_for(vocab)}\]"):
        m.fill(np.zeros(words_for(vocab) + 1, np.uint32))
    assert not m.accept(49100 if vocab < 49152 else 49160)
    assert "outside the grammar's vocabulary" in m.error and not m.done


def test_from_hf_matches_from_checkpoint(grammar, demo_checkpoint):
    from transformers import AutoTokenizer

    hf = GrammarEngine.from_hf(AutoTokenizer.from_pretrained(str(demo_checkpoint), local_files_only=True), 49152)
    c = Constraint("json_schema", json.dumps(SCHEMA))
    assert hf.eos_ids == (EOS,)
    assert np.array_equal(hf.matcher(c).mask(), grammar.matcher(c).mask())


def _refused_at(grammar: GrammarEngine, c: Constraint, text: str) -> bool:
    """Whether the matcher refuses some token of `text` (walking it to its end otherwise)."""
    m = grammar.matcher(c)
    return not all(m.accept(t) for t in grammar.tokenizer.tokenize_str(text))


def test_objects_that_list_properties_take_no_others_unless_the_schema_says_so(grammar):
    from raydeploy.constraints.grammar import strict_schema

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "stops": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"}}}}}, "required": ["city"]}
    strict = strict_schema(schema)
    assert strict["additionalProperties"] is False and strict["properties"]["stops"]["items"][
        "additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed
    closed = Constraint("json_schema", json.dumps(schema))
    walk(grammar, closed, '{"city":"Paris","stops":[{"name":"Lyon"}]}')
    assert _refused_at(grammar, closed, '{"city":"Paris","extra":1}')
    assert _refused_at(grammar, closed, '{"city":"Paris","stops":[{"name":"Lyon","x":2}]}')
    opened = Constraint("json_schema", json.dumps({**schema, "additionalProperties": True}))
    walk(grammar, opened, '{"city":"Paris","extra":1}')


def test_json_takes_a_space_or_a_line_break_between_tokens(grammar):
    c = Constraint("json_object")
    walk(grammar, c, '{\n  "a": 1,\n  "b": [1, 2],\n  "c": {\n    "d": true\n  }\n}')  # pretty-printed
    walk(grammar, c, '{"a":1}')  # compact
    assert _refused_at(grammar, c, "{" + " " * 40 + '"a":1}')  # not a budget's worth of blanks
    assert _refused_at(grammar, c, '{"a":\n\n\n1}')  # nor line after line
