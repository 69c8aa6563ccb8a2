"""Chat templates: the GGUF's own jinja2 template in a sandbox that matches transformers, or a fallback.

The environment is what transformers gives templates: `ImmutableSandboxedEnvironment` with
`trim_blocks`/`lstrip_blocks`, the loop-controls extension (`{% break %}`, `{% continue %}`), its
`tojson` (not HTML-escaped, `ensure_ascii=False`, `indent`, `separators`, `sort_keys`),
`raise_exception(msg)` (here a `ChatTemplateError`, a 400 naming the template) and `strftime_now(fmt)`.

Models without a template get a fallback by family (`FALLBACK_TEMPLATES`): Gemma's own layout (a system
message folded into the first user turn, as Gemma's published template does) or ChatML.

User text never becomes control tokens: `tokenize_chat` parses the template's own markers as special
tokens but tokenizes any message text that spells one (say a forged `<end_of_turn>`) as plain text.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..errors import ChatTemplateError, ParameterError

if TYPE_CHECKING:
    from .model import Model

GEMMA_FALLBACK = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] | trim + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for m in loop_messages -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ m['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if loop_messages | length == 0 and first_user_prefix -%}"
    "{{ '<start_of_turn>user\n' + first_user_prefix | trim + '<end_of_turn>\n' }}{%- endif -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
CHATML_FALLBACK = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Used when a GGUF carries no template (the embedded Gemma 3 270M file has none).
FALLBACK_TEMPLATES = {"gemma": GEMMA_FALLBACK, "chatml": CHATML_FALLBACK}
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def fallback_template(architecture: str) -> str:
    """The fallback template for a model family (by GGUF architecture)."""
    return FALLBACK_TEMPLATES["gemma" if architecture.startswith("gemma") else "chatml"]


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' tojson: jinja2's own HTML-escapes (<, >, &, ') which would corrupt tool schemas
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and where it came from (named in its errors)."""

    source: str
    name: str

    @classmethod
    def for_model(cls, model: Model) -> ChatTemplate:
        """The GGUF's `tokenizer.chat_template`, or the family fallback when it has none."""
        if model.chat_template:
            return cls(model.chat_template, "the model's tokenizer.chat_template")
        fam = "gemma" if model.architecture.startswith("gemma") else "chatml"
        return cls(FALLBACK_TEMPLATES[fam], f"loramux's {fam} fallback template")

    @property
    def capabilities(self) -> TemplateCapabilities:
        """What the template does with tools, found by rendering test conversations (cached per source)."""
        return _capabilities(self.source)

    @property
    def handles_tools(self) -> bool:
        """Whether the template itself renders a `tools` list (else tools.py describes them in a message)."""
        return self.capabilities.tools

    @property
    def handles_tool_calls(self) -> bool:
        """Whether the template renders assistant `tool_calls` and `tool` messages itself."""
        return self.capabilities.tool_calls

    def render(self, messages: Sequence[Mapping[str, Any]], *, bos_token: str = "", eos_token: str = "",
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None, kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text for `messages`, as transformers' `apply_chat_template(tokenize=False)` gives it."""
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ParameterError(f"messages[{i}]", "each message needs 'role' and 'content'")
        extra = dict(kwargs or {})
        clash = [k for k in RESERVED_KWARGS if k in extra]
        if clash:
            raise ParameterError("chat_template_kwargs", f"may not set {', '.join(clash)}: use the request's own "
                                                         "fields")
        if continue_final_message:
            if add_generation_prompt:
                raise ParameterError("continue_final_message", "cannot be combined with add_generation_prompt "
                                     "true: send add_generation_prompt false")
            if not messages or messages[-1].get("role") != "assistant":
                raise ParameterError("continue_final_message", "the last message must be the assistant's turn "
                                     "to continue")
        try:
            tmpl = _compiled(self.source)
            text = tmpl.render(messages=[dict(m) for m in messages], bos_token=bos_token, eos_token=eos_token,
                               add_generation_prompt=add_generation_prompt, tools=list(tools) if tools else None,
                               raise_exception=_raise_exception, **extra)
        except _TemplateRaised as e:
            raise ChatTemplateError(self.name, f"refused the messages: {e}") from None
        except Exception as e:  # noqa: BLE001 - jinja2 syntax, undefined, sandbox: the template failed, not us
            raise ChatTemplateError(self.name, f"failed: {type(e).__name__}: {e}",
                                    hint="fix the template, or pass --chat-template") from None
        if continue_final_message:
            text = _cut_after(text, str(messages[-1]["content"]))
        return text


@dataclass(frozen=True)
class TemplateCapabilities:
    """What a chat template does with tools, read off its output for test conversations (as llama.cpp's
    chat-template detection does), not off the words in its source: a template that only mentions `tools` in
    a comment does not render them.

    `tools`: a `tools` list passed to it shows up in the prompt. `tool_calls`: an assistant message's
    `tool_calls` show up. `call_text`: the prompt of a conversation ending in one such call ('' when the
    template fails on it), where the tool-call formats look for their markers."""

    tools: bool
    tool_calls: bool
    call_text: str


PROBE_TOOL = "loramux_probe_tool"
_PROBE_TOOLS = [{"type": "function", "function": {"name": PROBE_TOOL, "description": "probe",
                                                  "parameters": {"type": "object", "properties": {}}}}]
_PROBE_CALL = [{"role": "user", "content": "probe"},
               {"role": "assistant", "content": "", "tool_calls": [{
                   "id": "call_probe", "type": "function",
                   "function": {"name": PROBE_TOOL, "arguments": {"q": "probe"}}}]}]


@functools.lru_cache(maxsize=32)
def _capabilities(source: str) -> TemplateCapabilities:
    template = ChatTemplate(source, "the probe")

    def rendered(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        try:
            return template.render(messages, add_generation_prompt=False, tools=tools)
        except (ChatTemplateError, ParameterError):
            return ""  # a template that refuses the test conversation cannot take it from a client either
    with_tools = rendered([{"role": "user", "content": "probe"}], _PROBE_TOOLS)
    call_text = rendered(_PROBE_CALL, None)
    return TemplateCapabilities(tools=PROBE_TOOL in with_tools, tool_calls=PROBE_TOOL in call_text,
                                call_text=call_text)


def _cut_after(text: str, final: str) -> str:
    for piece in (final, final.strip()):
        if piece and piece in text:
            return text[: text.rindex(piece) + len(piece)]
    raise ParameterError("continue_final_message", "the final message does not appear in the rendered prompt")


def special_texts(model: Model) -> tuple[str, str]:
    """The BOS and EOS token texts, as templates expect them."""
    h = model.handle
    return (model.token_text(h.bos) if h.bos >= 0 else "", model.token_text(h.eos) if h.eos >= 0 else "")


def user_strings(*values: Any) -> list[str]:
    """Every string inside messages, tools and template variables (the client's text, wherever it sits)."""
    out: list[str] = []
    stack = list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return out


def tokenize_chat(model: Model, text: str, user_texts: Sequence[str]) -> list[int]:
    """Tokens of a rendered chat: the template's markers as special tokens, `user_texts` never.

    When no user text spells a special token this is one tokenization of the whole prompt. Otherwise each
    such text is located in the prompt (in order) and tokenized on its own without special parsing.
    """
    risky = [t for t in dict.fromkeys(user_texts) if t and model.tokenize(t, add_bos=False, special=True)
             != model.tokenize(t, add_bos=False, special=False)]
    if not risky:
        return model.tokenize(text, add_bos=False, special=True)
    spans: list[tuple[int, int]] = []
    for t in risky:
        piece = t if t in text else t.strip()
        if not piece or piece not in text:
            raise ParameterError("messages", "a message spells a control token and the chat template changed "
                                             "its text, so it cannot be kept apart from the template's markers")
        pos = text.find(piece)
        while pos >= 0:
            spans.append((pos, pos + len(piece)))
            pos = text.find(piece, pos + len(piece))
    out: list[int] = []
    cur = 0
    for a, b in sorted(set(spans)):
        if a < cur:
            continue
        if a > cur:
            out += model.tokenize(text[cur:a], add_bos=False, special=True)
        out += model.tokenize(text[a:b], add_bos=False, special=False)
        cur = b
    if cur < len(text):
        out += model.tokenize(text[cur:], add_bos=False, special=True)
    return out


__all__ = ["CHATML_FALLBACK", "FALLBACK_TEMPLATES", "GEMMA_FALLBACK", "ChatTemplate", "TemplateCapabilities",
           "fallback_template",
           "special_texts", "tokenize_chat", "user_strings"]
