"""`logit_bias` in OpenAI's form and in llama-server's, as (token, bias) pairs for llama.cpp's logit-bias
sampler (the first of the chain, so every later sampler and the grammar see the biased logits).

    OpenAI:        {"<token id>": bias}                       bias in [-100, 100]
    llama-server:  {"<token id>" | "<text>": bias | false}    a text stands for each of its tokens
                   [[<token id> | "<text>", bias | false], ...]

`false` bans the token (a bias of -inf). A token id outside the vocabulary, a bias that is not a number
within ±MAX_BIAS, `true`, or more than MAX_LOGIT_BIAS entries is a 400 naming `logit_bias` (llama-server skips such
entries silently; loramux does not ignore what it was asked).
"""

from __future__ import annotations

import math
from typing import Any

from ..engine.runtime import Engine
from .errors import APIError

MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias (each a text to tokenize at most MAX_TEXT characters)
MAX_TEXT = 256
MAX_BIAS = 1e4  # |bias|: far past any logit, and a sum llama.cpp's float32 logits hold (1e308 would be inf)


def _bad(message: str) -> APIError:
    return APIError(400, f"logit_bias: {message}", code="invalid_logit_bias", param="logit_bias")


def _bias(value: Any, key: Any) -> float:
    if value is False:
        return -math.inf
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or abs(value) > MAX_BIAS):
        raise _bad(f"the bias of {key!r} must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}], or false to ban the "
                   f"token; got {value!r}")
    return float(value)


def _tokens(key: Any, engine: Engine) -> list[int]:
    n_vocab = engine.model.n_vocab
    if isinstance(key, int) or (isinstance(key, str) and key.lstrip("-").isdigit()):
        t = int(key)
        if not 0 <= t < n_vocab:
            raise _bad(f"token id {t} is not in the vocabulary [0, {n_vocab})")
        return [t]
    if not isinstance(key, str) or not key or len(key) > MAX_TEXT:
        raise _bad(f"{key!r} is neither a token id nor a text of 1 to {MAX_TEXT} characters")
    return engine.tokenize(key, add_bos=False, special=False)


def resolve(engine: Engine, value: dict[str, Any] | list[Any] | None) -> tuple[tuple[int, float], ...]:
    """The request's logit_bias as (token, bias) pairs (worker thread: a text key is tokenized)."""
    if not value:
        return ()
    items = list(value.items()) if isinstance(value, dict) else value
    if len(items) > MAX_LOGIT_BIAS:
        raise _bad(f"at most {MAX_LOGIT_BIAS} entries, got {len(items)}")
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise _bad(f"each list entry must be [token id or text, bias], got {item!r}")
        key, raw = item
        bias = _bias(raw, key)
        for t in _tokens(key, engine):
            out[t] = bias
    return tuple(out.items())


__all__ = ["MAX_BIAS", "MAX_LOGIT_BIAS", "MAX_TEXT", "resolve"]
