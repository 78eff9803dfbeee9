"""Grammar state follows the committed tokens: rebuilt after a loss, rolled back, batched."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")

from llmserve.structured_output import StructuredOutputSpec  # noqa: E402
from llmserve.structured_output.compiler import GrammarCompiler  # noqa: E402
from llmserve.structured_output.matchers import GrammarMatchers, bitmask_words  # noqa: E402
from tests.model.tiny_checkpoints import default_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler():
    tok = default_tokenizer()
    return GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)


def masks(matchers, rows, vocab):
    out = np.full((len(rows), bitmask_words(vocab)), -1, dtype=np.int32)
    matchers.fill([(i, rid, g, toks) for i, (rid, g, toks) in enumerate(rows)], out)
    return out


def allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.nonzero(bits)[0].tolist())


def test_compile_is_cached_by_schema_hash(compiler):
    a = compiler.compile(StructuredOutputSpec("json", SCHEMA))
    b = compiler.compile(StructuredOutputSpec("json", json.loads(json.dumps(SCHEMA))))
    assert a is b and compiler.hits >= 1


def test_state_is_rebuilt_and_rolled_back_from_committed_tokens(compiler):
    tok = default_tokenizer()
    vocab = tok.vocab_size
    grammar = compiler.compile(StructuredOutputSpec("json", SCHEMA))
    text = tok.encode('{"a":12,"b":"x"}', add_special_tokens=False)
    m = GrammarMatchers()
    step_by_step = []
    for n in range(len(text) + 1):   # one token committed per step, as the engine does
        step_by_step.append(masks(m, [("r", grammar, text[:n])], vocab)[0].copy())
    assert allowed(step_by_step[-1]) and allowed(step_by_step[-1]) <= set(tok.eos_token_ids)
    assert len(allowed(step_by_step[0])) < 50   # '{' (and few spellings of it) only
    m.release("r")   # state lost (e.g. dropped at preemption): rebuilt from the tokens
    assert (masks(m, [("r", grammar, text[:5])], vocab)[0] == step_by_step[5]).all()
    assert m.rebuilds_total == 1
    assert (masks(m, [("r", grammar, text[:3])], vocab)[0] == step_by_step[3]).all()  # rollback
    both = masks(m, [("r", grammar, text[:3]), ("s", grammar, text[:7])], vocab)
    assert (both[0] == step_by_step[3]).all() and (both[1] == step_by_step[7]).all()
    assert m.mask_rows_total >= len(text) + 4


def test_unsupported_schema_feature_is_named(compiler):
    from llmserve.structured_output.spec import UnsupportedGrammarError

    with pytest.raises(UnsupportedGrammarError, match="uniqueItems"):
        compiler.compile(StructuredOutputSpec("json", {"type": "array", "uniqueItems": True}))


@pytest.mark.parametrize("whitespace, pretty_ok", [("flexible", True), ("compact", False)])
def test_json_whitespace_decides_whether_pretty_printed_json_is_allowed(whitespace, pretty_ok):
    """--json-whitespace flexible (the default) lets a JSON answer carry newlines and
    indentation between its tokens, as vLLM does; compact allows only '{"a":12,...}'."""
    tok = default_tokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids,
                               json_whitespace=whitespace)
    grammar = compiler.compile(StructuredOutputSpec("json", SCHEMA))

    def accepts(text: str) -> bool:
        matcher = grammar.new_matcher()
        return all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()

    assert accepts('{"a":12,"b":"x"}')
    assert accepts('{\n  "a": 12,\n  "b": "x"\n}') is pretty_ok
    assert not accepts('{"a":"12","b":"x"}')       # the schema still holds either way
    with pytest.raises(ValueError, match="json_whitespace"):
        GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids, json_whitespace="pretty")


@pytest.mark.parametrize("text, ok", [
    ('{\n\n  "a": 12,\n  "b": "x"\n}', True),          # a blank line
    ('{\n  "a": 12 \n  ,"b": "x"\n\n}', True),          # a space before a line break
    ('{\t"a":\t12,\r\n\t"b": "x"}', True),           # tabs, CRLF
    ('{\n\n\n  "a": 12, "b": "x"}', False),              # three line breaks in one run
    ('{"a":' + " " * 9 + '12, "b": "x"}', False),        # nine spaces
    ('{\n' + " " * 33 + '"a": 12, "b": "x"}', False),   # an indentation of 33
])
def test_flexible_json_whitespace_takes_what_models_emit_and_stays_bounded(text, ok):
    """``flexible`` lets through the whitespace a model writes in JSON on its own (blank
    lines, a space before a line break; masking them bent a third of the default model's
    sampled answers) and still bounds a run between two tokens, so sampling cannot pad an
    answer with blank lines until ``max_tokens``."""
    tok = default_tokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
    matcher = compiler.compile(StructuredOutputSpec("json", SCHEMA)).new_matcher()
    accepted = all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
    assert (accepted and matcher.is_accepting()) is ok
