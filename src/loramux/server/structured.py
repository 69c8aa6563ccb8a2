"""The constraint of a request: OpenAI's `response_format` (and llama-server's `json_object` + `schema`),
llama-server's `grammar` / `json_schema`, vLLM's
`guided_*` and `structured_outputs`. At most one per request; each one honoured or a 400 naming it.

Only OpenAI's `strict: true` makes a schema strict (keywords the grammar cannot enforce are a 400); the
others are converted with such keywords left unenforced, as docs/structured.md lists.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..engine import grammar as G
from ..errors import GrammarError
from .schemas import SamplingFields


def _schema(value: Any, param: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise GrammarError(param, "is not valid JSON") from None
        except RecursionError:
            raise GrammarError(param, "the JSON schema nests too deep") from None
    return value


def response_schema(body: SamplingFields) -> tuple[dict[str, Any] | None, bool]:
    """(the JSON schema the answer must follow, strict) from response_format json_schema; (None, False) else."""
    rf = body.response_format
    if rf is None or rf.type != "json_schema":
        return None, False
    js = rf.json_schema
    schema = js.schema_ if js is not None and js.schema_ is not None else rf.schema_
    if schema is None:
        raise GrammarError("response_format", "type json_schema needs json_schema.schema")
    return schema, bool(js is not None and js.strict)


def request_grammar(body: SamplingFields) -> G.Grammar | None:
    """The one grammar the request's constraint fields ask for, or None."""
    found: list[tuple[str, Callable[[], G.Grammar]]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object" and rf.schema_ is not None:  # llama-server's extension
        found.append(("response_format", lambda: G.json_schema(rf.schema_ or {"type": "object"},
                                                               param="response_format.schema", strict=False)))
    elif rf is not None and rf.type == "json_object":
        found.append(("response_format", lambda: G.json_object("response_format")))
    if rf is not None and rf.type == "json_schema":
        schema, strict = response_schema(body)
        found.append(("response_format", lambda: G.json_schema(schema, param="response_format", strict=strict)))
    if body.grammar is not None:
        found.append(("grammar", lambda: G.gbnf(body.grammar, "grammar")))
    if body.json_schema is not None:
        found.append(("json_schema", lambda: G.json_schema(body.json_schema, param="json_schema", strict=False)))
    if body.guided_json is not None:
        found.append(("guided_json", lambda: G.json_schema(_schema(body.guided_json, "guided_json"),
                                                           param="guided_json", strict=False)))
    if body.guided_regex is not None:
        found.append(("guided_regex", lambda: G.regex(body.guided_regex, "guided_regex")))
    if body.guided_choice is not None:
        found.append(("guided_choice", lambda: G.choice(body.guided_choice, "guided_choice")))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", lambda: G.gbnf(body.guided_grammar, "guided_grammar")))
    found += _structured_outputs(body)
    if len(found) > 1:
        raise GrammarError(found[1][0], f"only one output constraint per request: got {found[0][0]} and "
                                        f"{found[1][0]}")
    return found[0][1]() if found else None


def _structured_outputs(body: SamplingFields) -> list[tuple[str, Callable[[], G.Grammar]]]:
    so = body.structured_outputs
    if so is None:
        return []
    p = "structured_outputs"
    out: list[tuple[str, Callable[[], G.Grammar]]] = []
    if so.json_ is not None:
        out.append((f"{p}.json", lambda: G.json_schema(_schema(so.json_, f"{p}.json"), param=f"{p}.json",
                                                       strict=False)))
    if so.regex is not None:
        out.append((f"{p}.regex", lambda: G.regex(so.regex, f"{p}.regex")))
    if so.choice is not None:
        out.append((f"{p}.choice", lambda: G.choice(so.choice, f"{p}.choice")))
    if so.grammar is not None:
        out.append((f"{p}.grammar", lambda: G.gbnf(so.grammar, f"{p}.grammar")))
    if so.json_object:
        out.append((f"{p}.json_object", lambda: G.json_object(f"{p}.json_object")))
    if not out:
        raise GrammarError(p, "needs one of json, regex, choice, grammar or json_object")
    return out


__all__ = ["request_grammar", "response_schema"]
