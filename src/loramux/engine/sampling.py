"""Generation pieces that need no engine: sampling settings, stop strings, text assembly, chat templates."""

from __future__ import annotations

import codecs
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ParameterError


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's sampler chain settings. temperature 0 means greedy."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> SamplingParams:
        problems = []
        if self.max_tokens < 0:
            problems.append(("max_tokens", "must be ≥ 0"))
        for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                problems.append((name, f"must be a finite number ≥ 0, got {v}"))
        if not 0 <= self.top_p <= 1:
            problems.append(("top_p", "must be in [0, 1]"))
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(("stop", "stop strings must be non-empty strings"))
        if problems:
            raise ParameterError(problems[0][0], problems[0][1])
        return self


@dataclass
class Completion:
    """The result of a generation."""

    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (EOS or stop string) | "length" | "cancelled"
    prompt_tokens: int
    loras: dict[str, float] = field(default_factory=dict)
    alora: dict[str, bool] = field(default_factory=dict)  # aLoRA name -> invocation found in the prompt

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)


class TextAssembler:
    """Turns sampled tokens into text chunks: UTF-8 safe, stop strings never leak partially.

    Text that could be the start of a stop string is held back until it is clearly not one.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything decoded so far (never past a stop string)
        self.emitted = 0  # how much of `text` was handed out
        self.stopped = False

    def feed(self, piece: bytes) -> str:
        """Add a token's bytes; return the new text that is safe to show."""
        self.text += self._dec.decode(piece)
        hit = self._find_stop()
        if hit is not None:
            self.text = self.text[:hit]
            self.stopped = True
            return self._take(len(self.text))
        return self._take(len(self.text) - self._holdback())

    def flush(self) -> str:
        """At the end: everything not yet shown (a held-back prefix that never became a stop)."""
        if not self.stopped:
            self.text += self._dec.decode(b"", final=True)
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted:upto]
        self.emitted = upto
        return out

    def _find_stop(self) -> int | None:
        # Only the tail can contain a new match: search from before the unshown part.
        start = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _holdback(self) -> int:
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    best = max(best, k)
                    break
        return best


# ----------------------------------------------------------------------------------------------
# Chat templates
# ----------------------------------------------------------------------------------------------

# Used when a GGUF carries no template (the embedded Gemma 3 270M file has none).
FALLBACK_TEMPLATES = {
    "gemma": (
        "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
        "<start_of_turn>{{ role }}\n{% if m['role'] == 'system' %}{{ m['content'] | trim }}\n\n"
        "{% else %}{{ m['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
}


def fallback_template(architecture: str) -> str:
    return FALLBACK_TEMPLATES["gemma" if architecture.startswith("gemma") else "chatml"]


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], *, bos_token: str, eos_token: str,
                add_generation_prompt: bool = True, **extra: Any) -> str:
    """Render messages with a chat template in a sandboxed jinja2, as transformers does."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ParameterError(f"messages[{i}]", "each message needs 'role' and 'content'")

    def raise_exception(msg: str) -> None:
        raise ParameterError("messages", f"the chat template refused the messages: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    msgs = [dict(m) for m in messages]
    # Templates such as Gemma's fold a system message into the first user turn; ours passes it through.
    return env.from_string(template).render(messages=msgs, bos_token=bos_token, eos_token=eos_token,
                                            add_generation_prompt=add_generation_prompt, **extra)
