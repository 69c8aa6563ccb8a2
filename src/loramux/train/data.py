"""Training data for the zeroth-order trainer: JSONL records → (tokens, mask) examples.

Three record formats, one per line:

- ``{"text": "..."}``: every token after the first is scored.
- ``{"prompt": "...", "completion": "..."}``: only the completion's tokens are scored.
- ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}``: rendered
  with the model's chat template; only the assistant turns (their text and end-of-turn marker) are
  scored.

``mask[i]`` says whether token ``i`` is scored, the convention of ``Engine.loss_sum(..., masks=...)``
(token 0 has nothing before it and is never scored).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import LoramuxError, TrainingError

if TYPE_CHECKING:  # the engine loads llama.cpp: imported where it is used
    from ..engine.runtime import Engine

#: How many problems one error lists before it says "and N more".
MAX_LISTED = 20
FORMATS = "'text', 'prompt' + 'completion', or 'messages'"


@dataclass(frozen=True)
class Example:
    """One training example: token ids, which of them are scored, and where it came from."""

    tokens: tuple[int, ...]
    mask: tuple[bool, ...]
    source: str  # "FILE:LINE" or "data[i]"

    @property
    def n_scored(self) -> int:
        """Number of tokens whose NLL counts (token 0 never does)."""
        return sum(self.mask[1:])


class _Bad(Exception):
    """One record is unusable; collected and reported together with its line."""


DataArg = str | os.PathLike[str] | Sequence[Mapping[str, Any]] | Sequence[Example]


def load_examples(engine: Engine, data: DataArg, *, what: str = "data") -> list[Example]:
    """Turn a JSONL file (or a list of records, or ready Examples) into examples for `engine`.

    Every problem (malformed JSON, unknown format, empty completion, too long for the context...) is
    collected and raised once as a TrainingError whose problems name FILE:LINE.
    """
    if isinstance(data, str | os.PathLike):
        records = read_jsonl(data, what=what)
    else:
        items = list(data)
        if items and all(isinstance(x, Example) for x in items):
            examples = list(items)
            _check_lengths(engine, examples, what)
            return examples
        records = [(f"{what}[{i}]", r) for i, r in enumerate(items)]
    if not records:
        raise TrainingError(f"{_name(data, what)}: no examples",
                            hint=f"give at least one JSON object per line with {FORMATS}")
    examples, problems = [], []
    for where, rec in records:
        try:
            examples.append(encode_record(engine, rec, where))
        except _Bad as e:
            problems.append(f"{where}: {e}")
    _raise_problems(data, what, problems, len(records))
    _check_lengths(engine, examples, what)
    return examples


def read_jsonl(path: str | os.PathLike[str], *, what: str = "data") -> list[tuple[str, Any]]:
    """Parse a JSONL file into (``FILE:LINE``, object) pairs; blank lines are skipped."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise TrainingError(f"{what} file {p} not found", hint="pass a JSONL file, one example per line")
    out, problems = [], []
    with p.open("r", encoding="utf-8", errors="strict") as fh:
        try:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    out.append((f"{p}:{lineno}", json.loads(line)))
                except json.JSONDecodeError as e:
                    problems.append(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})")
        except UnicodeDecodeError as e:
            problems.append(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})")
    _raise_problems(p, what, problems, len(out) + len(problems))
    return out


def encode_record(engine: Engine, rec: Any, where: str) -> Example:
    """Tokens and mask of one record (any of the three formats)."""
    if not isinstance(rec, Mapping):
        raise _Bad(f"expected a JSON object with {FORMATS}, got {type(rec).__name__}")
    keys = set(rec)
    if "messages" in keys:
        tokens, mask = _encode_chat(engine, rec["messages"])
    elif "prompt" in keys or "completion" in keys:
        tokens, mask = _encode_completion(engine, rec.get("prompt"), rec.get("completion"))
    elif "text" in keys:
        text = _string(rec["text"], "text")
        tokens = engine.tokenize(text, add_bos=True)
        mask = [True] * len(tokens)
    else:
        raise _Bad(f"unknown format (keys {sorted(keys)}); expected {FORMATS}")
    ex = Example(tuple(tokens), tuple(mask), where)
    if ex.n_scored == 0:
        raise _Bad("no token to learn (the scored part is empty)")
    return ex


def _string(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise _Bad(f"'{key}' must be a string, got {type(value).__name__}")
    if not value:
        raise _Bad(f"'{key}' is empty")
    return value


def _encode_completion(engine: Engine, prompt: Any, completion: Any) -> tuple[list[int], list[bool]]:
    if prompt is None or completion is None:
        raise _Bad("'prompt' and 'completion' go together: both are needed")
    p = _string(prompt, "prompt")
    c = _string(completion, "completion")
    full = engine.tokenize(p + c, add_bos=True)
    # Tokens can merge across the boundary; score from the first token that is not the prompt's.
    start = _common_prefix(engine.tokenize(p, add_bos=True), full)
    return full, [i >= start for i in range(len(full))]


def _encode_chat(engine: Engine, messages: Any) -> tuple[list[int], list[bool]]:
    if not isinstance(messages, list) or not messages:
        raise _Bad("'messages' must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _Bad(f"messages[{i}] needs a string 'role' and a string 'content'")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise _Bad("no assistant turn: nothing to learn (roles must include 'assistant')")

    def render(msgs: list[Any], gen: bool) -> list[int]:
        try:
            text = engine.apply_chat_template(msgs, add_generation_prompt=gen)
        except LoramuxError as e:
            raise _Bad(e.message) from e
        except Exception as e:  # noqa: BLE001 - a template error is the record's fault
            raise _Bad(f"the chat template failed: {e}") from e
        # The template writes the BOS itself, as in Engine.chat.
        return engine.tokenize(text, add_bos=False)

    full = render(messages, False)
    mask = [False] * len(full)
    for i in turns:
        # Render incrementally: the prompt before turn i, then up to and including it; the tokens
        # in between (as far as they agree with the full rendering) are the assistant's.
        start = _common_prefix(render(messages[:i], True), full)
        end = _common_prefix(render(messages[:i + 1], False), full)
        for j in range(start, end):
            mask[j] = True
    return full, mask


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _check_lengths(engine: Engine, examples: list[Example], what: str) -> None:
    n_ctx = int(engine.n_ctx)
    long = [f"{e.source}: {len(e.tokens)} tokens, the context holds {n_ctx}" for e in examples
            if len(e.tokens) > n_ctx]
    if long:
        raise TrainingError(f"{what}: {len(long)} example(s) longer than the context", problems=_cap(long),
                            hint="shorten or split them, or load the engine with a larger n_ctx (--n-ctx)")


def _raise_problems(data: Any, what: str, problems: list[str], total: int) -> None:
    if problems:
        raise TrainingError(f"{_name(data, what)}: {len(problems)} of {total} record(s) unusable",
                            problems=_cap(problems),
                            hint=f"each line must be one JSON object with {FORMATS}; fix the lines listed")


def _cap(problems: list[str]) -> list[str]:
    if len(problems) <= MAX_LISTED:
        return problems
    return problems[:MAX_LISTED] + [f"... and {len(problems) - MAX_LISTED} more"]


def _name(data: Any, what: str) -> str:
    return str(data) if isinstance(data, str | os.PathLike) else what


def digest(examples: Sequence[Example]) -> str:
    """sha256 of the examples' tokens and masks (a checkpoint resumes only on the same data)."""
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.tokens, [int(m) for m in e.mask]], separators=(",", ":")).encode())
    return h.hexdigest()


__all__ = ["FORMATS", "MAX_LISTED", "DataArg", "Example", "digest", "encode_record", "load_examples", "read_jsonl"]
