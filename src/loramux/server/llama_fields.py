"""llama-server's request fields, which its clients send on the OpenAI routes too (docs/llama-server.md).

Each is honoured or refused with a 400 naming it:

- `n_predict`: the token limit (llama-server's name; it wins over `max_tokens`, as there). -1 (no limit) on
  chat: up to the context; on /v1/completions refused (send a number; /completion takes -1).
- `n_probs`: top-N alternatives per generated token: chat's `logprobs` + `top_logprobs`, completions' `logprobs`.
- `cache_prompt`: true is what loramux always does (a cached prefix of the same adapter set is reused);
  false is refused (the prefix cache cannot be bypassed per request).
- `timings_per_token`: `timings` in every streamed chunk (protocols/openai.py, protocols/llama_server.py).
- `id_slot`: -1 (any) only; loramux places sequences itself.
- `return_tokens`, `response_fields`: honoured on /completion and /infill (their response has those fields);
  refused on the OpenAI routes, whose responses have no place for them (`return_token_ids` there).
- `post_sampling_probs`, `return_progress`, `verbose`: false only.
- the other samplers and the code-completion limits: llama_samplers.py.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from .llama_samplers import SamplerFields

MAX_RESPONSE_FIELDS = 64  # entries of `response_fields`
MAX_N_PROBS = 20  # as MAX_TOP_LOGPROBS: each alternative is a pass over the vocabulary on the engine thread


class LlamaFields(SamplerFields):
    """The llama-server fields of a generation request, mixed into schemas.SamplingFields."""

    n_predict: int | None = Field(default=None, ge=-1)
    n_probs: int | None = Field(default=None, ge=0, le=MAX_N_PROBS)
    cache_prompt: bool | None = None
    timings_per_token: bool = False
    id_slot: int | None = None
    return_tokens: bool | None = None
    response_fields: list[str] | None = Field(default=None, max_length=MAX_RESPONSE_FIELDS)
    post_sampling_probs: bool | None = None
    return_progress: bool | None = None
    verbose: bool | None = None

    @model_validator(mode="after")
    def _translate(self) -> Any:
        """n_predict and n_probs in the internal request's own fields (max_tokens, logprobs)."""
        fields: dict[str, Any] = dict(self)
        if self.n_predict is not None and self.n_predict >= 0:
            if fields.get("max_completion_tokens") is not None:
                object.__setattr__(self, "max_completion_tokens", self.n_predict)
            object.__setattr__(self, "max_tokens", self.n_predict)
        elif self.n_predict == -1 and "messages" in fields:  # chat: no limit = up to the context
            object.__setattr__(self, "max_tokens", None)
            object.__setattr__(self, "max_completion_tokens", None)
        if self.n_probs:
            if "messages" in fields:
                object.__setattr__(self, "logprobs", True)
                object.__setattr__(self, "top_logprobs", self.n_probs)
            else:
                object.__setattr__(self, "logprobs", self.n_probs)
        return self

    def llama_unsupported(self) -> list[tuple[str, str]]:
        """(parameter, why) for each llama-server field set to what this route cannot do."""
        out = self.sampler_problems()
        if self.n_predict == -1 and "messages" not in dict(self):
            out.append(("n_predict", "-1 (no limit) is taken by /completion; on /v1/completions send a number"))
        if self.cache_prompt is False:
            out.append(("cache_prompt", "loramux always reuses a cached prompt prefix of the same adapter set; "
                                        "send true or leave it out"))
        if self.id_slot is not None and self.id_slot != -1:
            out.append(("id_slot", "loramux places each sequence itself: send -1 or leave it out"))
        if self.return_tokens:
            out.append(("return_tokens", "is answered by /completion; on this route send return_token_ids"))
        if self.response_fields:
            out.append(("response_fields", "is answered by /completion and /infill only"))
        for name, why in (("post_sampling_probs", "probabilities are reported before sampling (logprobs)"),
                          ("return_progress", "prompt progress events are not sent"),
                          ("verbose", "the __verbose debug field is not sent")):
            if getattr(self, name):
                out.append((name, f"{why}: send false or leave it out"))
        return out


__all__ = ["MAX_N_PROBS", "MAX_RESPONSE_FIELDS", "LlamaFields"]
