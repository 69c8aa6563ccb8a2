"""A GBNF grammar that does not parse is a GrammarSyntaxError naming the reason, the line and the column
(llama.cpp's own parser only says that it failed): the common mistakes, each with its position."""

from __future__ import annotations

import pytest

import loramux as lm
from loramux.engine import grammar as G
from loramux.errors import GrammarError, GrammarSyntaxError

CASES = [  # (grammar, reason, line, column)
    ('root ::= "a" foo\n', "undefined_rule", 1, 14),
    ('root ::= item\nitem ::= "x" | itme\n', "undefined_rule", 2, 16),
    ('root ::= ( "a" | "b"\n', "unclosed_group", 1, 10),
    ('root ::= "a" (("b")\n', "unclosed_group", 1, 14),
    ('root ::= "a" )\n', "unmatched_close", 1, 14),
    ('root ::= [a-z] ]\n', "unmatched_close", 1, 16),
    ('root ::= "abc\n', "unclosed_literal", 1, 10),
    ('root ::= "x"\nrest ::= [a-z\n', "unclosed_literal", 2, 10),
    ('root ::= "a\\q"\n', "bad_escape", 1, 12),
    ('root ::= "\\x4g"\n', "bad_escape", 1, 11),
    ('root ::= [\\u12]\n', "bad_escape", 1, 11),
    ('other ::= "a"\n', "missing_root", None, None),
    ('root ::= "a"\nroot = "b"\n', "syntax", 2, 6),
]


@pytest.mark.parametrize(("text", "reason", "line", "column"), CASES)
def test_syntax_errors_name_reason_and_position(text, reason, line, column):
    with pytest.raises(GrammarSyntaxError) as ei:
        G.gbnf(text)
    e = ei.value
    assert (e.reason, e.line, e.column, e.parameter) == (reason, line, column, "grammar")
    assert isinstance(e, GrammarError) and e.code == "invalid_grammar"
    if line is not None:
        assert f"line {line}, column {column}" in str(e)


def test_a_grammar_that_parses_is_no_syntax_error():
    for text in ['root ::= "a" ( "b" | [c-d] )* x\nx ::= "\\x41\\u00e9"\n', 'root ::= "(" ")" "]"\n']:
        G.gbnf(text)


@pytest.fixture(scope="module")
def model(tiny_model):
    e = lm.Engine.load(tiny_model, n_ctx=256, n_threads=2)
    yield e.model
    e.close()


@pytest.mark.parametrize(("text", "column"), [("root ::= <nosuchtoken>", 10), ('root ::= "a" !<[99999]>', 15),
                                               ("root ::= <[12x]>", 10)])
def test_a_token_reference_outside_the_vocabulary_is_named(model, text, column):
    """`<...>` must be one token of the model's vocabulary: checked against it when the grammar compiles."""
    with pytest.raises(GrammarSyntaxError) as ei:
        G.gbnf(text).compile(model)
    assert (ei.value.reason, ei.value.line, ei.value.column) == ("unknown_token", 1, column)


def test_token_references_in_the_vocabulary_compile(model):
    for text in ["root ::= <[5]> [a-z]", "root ::= <start_of_turn> !<[7]>"]:
        G.gbnf(text).compile(model).close()
