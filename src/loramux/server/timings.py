"""llama-server's `timings` object and `system_fingerprint`, reported by the OpenAI routes and the native API.

    {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
     "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}

`prompt_ms` runs from the request's arrival to its first token (queueing included: loramux decodes prompts
of several requests in one batch, so a prompt has no time of its own); `predicted_ms` from the first token
on. `prompt_n` counts the prompt tokens decoded, `cache_n` those reused from the KV cache.
"""

from __future__ import annotations

import time
from typing import Any

from .. import __version__
from .generation import Job

SYSTEM_FINGERPRINT = f"loramux-{__version__}"


def _rate(n: int, ms: float) -> tuple[float, float]:
    """(ms per token, tokens per second), 0.0 where nothing was measured."""
    return (ms / n if n else 0.0), (1e3 * n / ms if ms > 0 else 0.0)


def timings(job: Job, n_generated: int, cached: int | None = None) -> dict[str, Any]:
    """The timings of `job` so far (`n_generated` tokens out), llama-server's shape."""
    now = time.monotonic()
    first = getattr(job.request, "first_token_at", None)
    cache_n = int(getattr(job.request, "cached", 0) or 0) if cached is None else cached
    prompt_n = max(0, len(job.prompt) - cache_n)
    prompt_ms = ((first if first is not None else now) - job.started) * 1e3
    predicted_ms = (now - first) * 1e3 if first is not None else 0.0
    steps = max(0, n_generated - 1)  # the first token comes with the prompt's logits, as llama-server counts
    p_tok, p_sec = _rate(prompt_n, prompt_ms)
    g_tok, g_sec = _rate(steps, predicted_ms)
    return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": p_tok,
            "prompt_per_second": p_sec, "predicted_n": n_generated, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": g_tok, "predicted_per_second": g_sec}


def generated(job: Job) -> int:
    """Tokens the job generated so far (read from the loop: a length, never the engine's list itself)."""
    return len(getattr(job.request, "generated", ()) or ())


__all__ = ["SYSTEM_FINGERPRINT", "generated", "timings"]
