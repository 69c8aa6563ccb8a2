"""Request bodies of the OpenAI-compatible API, with loramux's extensions.

Every field is honoured or refused with a 400 that names it, never accepted and ignored: an unknown
field is a 400 (`extra="forbid"`), and a known field set to something this server cannot do is
refused by `unsupported()`. Fields that clients send back as null or empty (an assistant message's
`refusal`, `annotations`, `audio`, `function_call`) are accepted only so. Extensions, as in
llama-server and vLLM: `lora` (per-request adapter stack), `control_vector`, `top_k`, `min_p`,
`repeat_penalty`, `ignore_eos`, `return_token_ids`, `prompt_logprobs` (docs/scoring.md), `adapter_sets`
(fan-out: one result per adapter set, docs/server.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .llama_fields import LlamaFields

# Input limits (docs/server.md, "Security"); each violation is a 400 naming the parameter.
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_MESSAGES = 1024  # chat messages per request
MAX_CONTENT_PARTS = 256  # content parts per message
MAX_CONTENT_CHARS = 1 << 18  # characters of one message's text (262,144)
MAX_PROMPT_CHARS = 1 << 20  # characters of a string prompt (1,048,576)
MAX_LORA_REFS = 32  # entries of a per-request `lora` list
MAX_NAME_CHARS = 1024  # characters of a `model` or control vector name
MAX_STRENGTH = 1000.0  # |control_vector.strength|
MAX_INT32 = 2**31 - 1  # what llama.cpp's sampler takes for top_k
MAX_TOP_LOGPROBS = 20  # logprobs / top_logprobs / prompt_logprobs alternatives per token (OpenAI's bound)
MAX_PROMPTS = 64  # prompts of one /v1/completions request
MAX_N = 16  # n and best_of
MAX_ADAPTER_SETS = MAX_N  # entries of `adapter_sets` (fan-out, server/fanout.py): bounded like n
MAX_CHOICES = 128  # sequences one request may run: prompts × best_of (or n)
MAX_METADATA = 16  # OpenAI's limits for `metadata`: 16 pairs, keys ≤ 64 and values ≤ 512 characters
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
MAX_USER_CHARS = 256


def _check_text(texts: Iterable[str], what: str) -> None:
    """JSON may carry lone UTF-16 surrogates ("\\ud800") that no UTF-8 text can hold: refuse them here (a 400
    naming the field) rather than fail in the tokenizer."""
    for t in texts:
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{what} is not valid Unicode text: a lone surrogate at character {e.start}") from None


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Checked(_Body):
    """A body whose every string (its own fields, and inside its free-form dicts and lists: schemas, grammars,
    tool arguments, template variables) must be valid Unicode: a lone surrogate is a 400 naming the field."""

    @model_validator(mode="after")
    def _unicode(self) -> _Checked:
        for name, value in self:
            stack = [value]
            while stack:
                v = stack.pop()
                if isinstance(v, str):
                    _check_text([v], name)
                elif isinstance(v, dict):
                    stack += [*v.keys(), *v.values()]
                elif isinstance(v, (list, tuple)):
                    stack += list(v)
        return self


class LoraRef(_Body):
    """One entry of a per-request `lora` list: an adapter by name or by /lora-adapters id."""

    name: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    id: int | None = None
    scale: float | None = None

    @model_validator(mode="after")
    def _one_key(self) -> LoraRef:
        if (self.name is None) == (self.id is None):
            raise ValueError("each lora entry needs exactly one of 'name' or 'id'")
        return self


class AdapterSet(_Body):
    """One entry of `adapter_sets` (fan-out): an adapter stack with scales, `lora: []` the base alone;
    `name` labels its results (default: the stack written as `a:0.5+b:1`, or the base model's name)."""

    name: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    lora: list[LoraRef] = Field(default_factory=list, max_length=MAX_LORA_REFS)


class ControlRef(_Body):
    """A control vector loaded at start (`--control-vector NAME=FILE`), with a strength."""

    name: str = Field(max_length=MAX_NAME_CHARS)
    strength: float = Field(default=1.0, ge=-MAX_STRENGTH, le=MAX_STRENGTH)


class StreamOptions(_Body):
    include_usage: bool = False


MAX_TOOLS = 128  # tools per request
MAX_TOOL_CALLS = 128  # tool calls per assistant message


class JsonSchemaFormat(_Checked):
    """`response_format.json_schema`: OpenAI's named schema, `strict` as OpenAI defines it."""

    name: str = Field(default="response", max_length=MAX_NAME_CHARS)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Checked):
    """`response_format`: text, JSON mode, or a JSON schema (llama-server's inline `schema` too)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class StructuredOutputs(_Checked):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar (or json_object)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: Any = None


class SamplingFields(LlamaFields, _Checked):
    """Fields shared by /v1/completions and /v1/chat/completions (and llama-server's: llama_fields.py)."""

    model: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=MAX_INT32)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Any] | list[Any] | None = None  # OpenAI's and llama-server's forms (logit_bias.py)
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)  # logged with the request
    metadata: dict[str, str] | None = None  # logged with the request (OpenAI's 16 pairs)
    store: bool | None = None  # loramux stores nothing: only false/null
    ignore_eos: bool = False
    return_token_ids: bool = False
    lora: list[LoraRef] | None = Field(default=None, max_length=MAX_LORA_REFS)
    adapter_sets: list[AdapterSet] | None = Field(default=None, min_length=1, max_length=MAX_ADAPTER_SETS)
    control_vector: ControlRef | None = None
    # constrained output (server/structured.py): at most one of these per request
    response_format: ResponseFormat | None = None
    grammar: str | None = None  # llama-server: GBNF
    json_schema: dict[str, Any] | None = None  # llama-server: a JSON schema
    guided_json: dict[str, Any] | str | None = None  # vLLM (older names)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(items)}")
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in items):
            raise ValueError(f"stop strings may have at most {MAX_STOP_CHARS} characters each, got "
                             f"{max(len(s) for s in items)}")
        _check_text(items, "a stop string")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > MAX_METADATA:
            raise ValueError(f"at most {MAX_METADATA} metadata pairs, got {len(v)}")
        if any(len(k) > MAX_METADATA_KEY or len(x) > MAX_METADATA_VALUE for k, x in v.items()):
            raise ValueError(f"metadata keys may have at most {MAX_METADATA_KEY} characters and values "
                             f"{MAX_METADATA_VALUE}")
        _check_text([*v, *v.values()], "metadata")
        return v

    def unsupported(self) -> list[tuple[str, str]]:
        """(parameter, why) for every field set to something this server cannot do."""
        out = self.llama_unsupported()
        if self.store:
            out.append(("store", "loramux does not store completions; send store: false or leave it out"))
        if self.guided_decoding_backend:
            out.append(("guided_decoding_backend", "loramux has one backend, llama.cpp's grammar sampler: drop it"))
        if self.guided_whitespace_pattern:
            out.append(("guided_whitespace_pattern", "a custom whitespace pattern is not supported"))
        so = self.structured_outputs
        if so is not None:
            for name in ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                         "structural_tag"):
                if getattr(so, name):
                    out.append((f"structured_outputs.{name}", "is not supported"))
        return out

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt_size(cls, v: Any) -> Any:
        texts = [v] if isinstance(v, str) else [p for p in v if isinstance(p, str)]
        if any(len(t) > MAX_PROMPT_CHARS for t in texts):
            raise ValueError(f"a prompt may have at most {MAX_PROMPT_CHARS} characters")
        _check_text(texts, "the prompt")
        return v

    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's extension
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        n_prompts = len(self.prompt_list())
        if n_prompts > MAX_PROMPTS:
            out.append(("prompt", f"at most {MAX_PROMPTS} prompts per request, got {n_prompts}"))
        if self.best_of is not None and self.best_of < self.n:
            out.append(("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})"))
        if self.best_of is not None and self.best_of > self.n and self.stream:
            out.append(("best_of", "best_of > n cannot be streamed (the best are known only at the end)"))
        if n_prompts * max(self.n, self.best_of or 1) > MAX_CHOICES:
            out.append(("n", f"prompts × max(n, best_of) may be at most {MAX_CHOICES}"))
        if self.suffix:
            out.append(("suffix", "suffix (insertion) is not supported"))
        return out

    def prompt_list(self) -> list[str | list[int]]:
        """Every prompt of the request, in order: a string, or token ids."""
        p: Any = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a string or token ids); several prompts are refused."""
        p: Any = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("only one prompt per request is supported")
            p = p[0]
        if isinstance(p, list) and not p:
            raise ValueError("the prompt is empty")
        return p


class TextPart(_Body):
    type: str
    text: str | None = None
    # Anthropic-style prompt-caching hint (Open WebUI sends it): loramux always reuses the KV of a
    # prefix it has just decoded, so the hint asks for what already happens
    cache_control: dict[str, str] | None = None


class FunctionDef(_Checked):
    """A function tool: its name, description and parameters (a JSON schema)."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Checked):
    type: Literal["function"]
    function: FunctionDef


class FunctionCall(_Checked):
    name: str = Field(max_length=128)
    arguments: str = ""


class ToolCall(_Checked):
    """An assistant message's tool call, as OpenAI returns it (and clients send it back)."""

    id: str | None = Field(default=None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None


class NamedFunction(_Checked):
    name: str = Field(max_length=128)


class NamedToolChoice(_Checked):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Checked):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS)  # honoured (tools.py)
    tool_call_id: str | None = Field(default=None, max_length=256)
    # what an assistant message carries when a client sends a response's message back: null or empty only
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    def unsupported(self, i: int) -> list[tuple[str, str]]:
        """(parameter, why) for fields of message i this server cannot honour when set."""
        out = []
        for field in ("refusal", "annotations", "audio", "function_call"):
            if getattr(self, field):
                out.append((f"messages.{i}.{field}", f"{field} in a message is not supported; send it as null"))
        return out

    @field_validator("content")
    @classmethod
    def _size(cls, v: str | list[TextPart] | None) -> str | list[TextPart] | None:
        if isinstance(v, list) and len(v) > MAX_CONTENT_PARTS:
            raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts per message, got {len(v)}")
        n = len(v) if isinstance(v, str) else sum(len(p.text or "") for p in v or ())
        if n > MAX_CONTENT_CHARS:
            raise ValueError(f"a message may have at most {MAX_CONTENT_CHARS} characters of text, got {n}")
        _check_text([v] if isinstance(v, str) else [p.text or "" for p in v or ()], "the message")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        bad = [p.type for p in self.content if p.type != "text"]
        if bad:
            raise ValueError(f"only text content parts are supported, got {', '.join(sorted(set(bad)))}")
        return "".join(p.text or "" for p in self.content)


class ChatRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        for i, m in enumerate(self.messages):
            out += m.unsupported(i)
        if self.top_logprobs is not None and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        if self.functions or self.function_call is not None:
            out.append(("functions", "the legacy functions/function_call API is not supported: send tools and "
                                     "tool_choice"))
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            out.append(("tool_choice", "needs tools"))
        if self.continue_final_message and self.add_generation_prompt:
            out.append(("continue_final_message", "cannot be true together with add_generation_prompt: one "
                                                  "continues the last message, the other starts a new one"))
        return out

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages for the chat template: developer → system; tool calls with their arguments as text."""
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                   for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out


MAX_DETOKENIZE = 1 << 17  # token ids of one /detokenize request


class TokenizeRequest(_Body):
    """POST /tokenize: vLLM's body (`prompt` or chat `messages`) or llama-server's (`content`)."""

    model: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    content: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)  # llama-server's name
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None  # vLLM: BOS for a prompt (default true), none for messages
    add_special: bool | None = None  # llama-server's name for the same
    add_generation_prompt: bool = True
    return_token_strs: bool = False  # vLLM: also each token's text
    with_pieces: bool = False  # llama-server: tokens as {"id", "piece"}

    @field_validator("prompt", "content")
    @classmethod
    def _text(cls, v: str | None) -> str | None:
        if v is not None:
            _check_text([v], "the text")
        return v

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        given = [k for k in ("prompt", "content", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'prompt', 'content' or 'messages'")
        return self


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's body; llama-server's is the same)."""

    model: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE)


class LoadAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's body, plus `scale`, `replace` and `pinned`)."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)
    scale: float = 1.0
    replace: bool = False
    pinned: bool = False


class UnloadAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None


class AdapterScale(_Body):
    """One entry of POST /lora-adapters (llama-server's body)."""

    id: int
    scale: float = 0.0


__all__ = ["MAX_ADAPTER_SETS", "MAX_CHOICES", "MAX_CONTENT_CHARS", "MAX_CONTENT_PARTS", "MAX_DETOKENIZE", "MAX_LORA_REFS", "MAX_MESSAGES",
           "MAX_N", "MAX_NAME_CHARS", "MAX_PROMPTS", "MAX_PROMPT_CHARS", "MAX_STOP", "MAX_STOP_CHARS", "MAX_STRENGTH",
           "MAX_TOOLS", "MAX_TOOL_CALLS", "MAX_TOP_LOGPROBS", "AdapterScale", "AdapterSet", "ChatMessage", "ChatRequest",
           "CompletionRequest", "ControlRef", "DetokenizeRequest", "FunctionCall", "FunctionDef", "JsonSchemaFormat",
           "NamedToolChoice", "ResponseFormat", "StructuredOutputs", "TokenizeRequest", "Tool", "ToolCall",
           "LoadAdapterRequest", "LoraRef", "SamplingFields", "StreamOptions", "UnloadAdapterRequest"]
