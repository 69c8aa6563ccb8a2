"""Typed errors of loramux.

Every error carries structured fields (the file, adapter, parameter it concerns) and a message that
says what went wrong and what to do next. Validation collects *all* problems and raises once, so a
user fixes a bad file in one round instead of one problem per attempt.

Every public error is defined here. The tree (``code`` is what the server puts in an error body):

    LoramuxError                    loramux_error
    ├── BackendError                backend_error        llama.cpp/ggml failed or changed
    ├── ModelError                  model_error          the base model cannot be used
    ├── PackageDataError            package_data_missing a file loramux ships is missing (a broken install)
    ├── GGUFFormatError             invalid_gguf         not a readable GGUF file
    ├── AdapterError                invalid_adapter      an adapter does not fit the base
    ├── AdapterNotFoundError        adapter_not_found    (also a KeyError)
    ├── FactorError                 invalid_factors      an in-place write was refused
    │   └── FactorStateError        invalid_factors      the adapter's writer is in no state for it (state, action)
    ├── AdapterVersionError         adapter_version_gone a request asked for a version no longer served
    ├── ScaleError                  invalid_scale        (also a ValueError)
    ├── SlotsBusyError              slots_busy           every bank slot is in use
    ├── AdapterCapacityError        adapter_capacity     an adapter set cannot be loaded at once (max_loaded)
    ├── AdapterDirError             invalid_adapter_dir  a directory of adapters to register cannot be (every problem)
    ├── SourceError                 invalid_source       a source cannot be resolved
    │   ├── DownloadError           download_failed
    │   │   ├── ChecksumError       checksum_mismatch
    │   │   └── DownloadRefused     download_refused     a safety limit refused it (reason)
    │   └── DownloadCancelled       download_cancelled
    ├── ConversionError             conversion_error     PEFT ↔ GGUF, merging
    ├── ControlVectorError          invalid_control_vector
    ├── ContextLengthError          context_length_exceeded (also a ValueError)
    ├── ParameterError              invalid_parameter    (also a ValueError)
    │   ├── GrammarError            invalid_grammar      a schema, regex, choice or GBNF cannot constrain output
    │   │   ├── GrammarSyntaxError  invalid_grammar      a GBNF grammar does not parse (reason, line, column)
    │   │   └── GrammarBudgetError  grammar_budget_exceeded  a grammar ran over its time budget
    │   └── ChatTemplateError       invalid_chat_template the chat template refused or failed on the messages
    ├── EngineClosedError           engine_closed        (also a RuntimeError)
    ├── RequestFailed               request_failed       one request failed; the others go on
    ├── RpcError                    rpc_unavailable      an RPC worker is unreachable or was lost
    ├── TrainingError               training_error
    ├── ServerError                 server_error         a loramux server refused a client's request
    └── ProbeMismatch               probe_mismatch
"""

from __future__ import annotations

from collections.abc import Iterable


class LoramuxError(Exception):
    """Base class of every error loramux raises on purpose."""

    #: Short machine-readable kind, used by the server to build OpenAI-shaped error bodies.
    code: str = "loramux_error"

    def __init__(self, message: str, *, problems: Iterable[str] = (), hint: str | None = None) -> None:
        self.problems: list[str] = list(problems)
        self.hint = hint
        text = message
        if self.problems:
            text += "".join(f"\n  - {p}" for p in self.problems)
        if hint:
            text += f"\n  → {hint}"
        super().__init__(text)
        self.message = message


class BackendError(LoramuxError):
    """llama.cpp or ggml returned an error (NULL handle, negative status) or its internals changed."""

    code = "backend_error"

    def __init__(self, function: str, code: int | None = None, detail: str = "", *, hint: str | None = None):
        self.function = function
        self.return_code = code
        msg = f"llama.cpp call {function} failed"
        if code is not None:
            msg += f" (returned {code})"
        if detail:
            msg += f": {detail}"
        super().__init__(msg, hint=hint)


class ModelError(LoramuxError):
    """The base model file cannot be used."""

    code = "model_error"

    def __init__(self, path: str, message: str, *, problems: Iterable[str] = (), hint: str | None = None):
        self.path = str(path)
        super().__init__(f"{path}: {message}", problems=problems, hint=hint)


class PackageDataError(LoramuxError):
    """A file of loramux's own package data (the example adapter, probe references...) is missing."""

    code = "package_data_missing"

    def __init__(self, path: str):
        self.path = str(path)
        super().__init__(f"{path}: this file of loramux's package data is missing",
                         hint="the installation is incomplete: reinstall loramux "
                              "(pip install --force-reinstall --no-deps loramux)")


class GGUFFormatError(LoramuxError):
    """The file is not a readable GGUF (bad magic, truncated header, unknown type)."""

    code = "invalid_gguf"

    def __init__(self, path: str, message: str, *, field: str | None = None):
        self.path = str(path)
        self.field = field  # the header field at fault ("general.architecture: string length"), when one is
        super().__init__(f"{path}: {message}",
                         hint="check that the file is a complete GGUF (re-download or re-convert it)")


class AdapterError(LoramuxError):
    """An adapter file is invalid or does not fit the base model. Lists every problem found."""

    code = "invalid_adapter"

    def __init__(self, path: str, message: str, *, problems: Iterable[str] = (), hint: str | None = None,
                 name: str | None = None, fields: Iterable[str] = ()):
        self.path = str(path)
        self.name = name
        self.fields: list[str] = list(dict.fromkeys(fields))  # every file field at fault ("file": it changed)
        self.field: str | None = self.fields[0] if self.fields else None  # the first of them
        super().__init__(f"adapter {path}: {message}", problems=problems, hint=hint)


class AdapterNotFoundError(LoramuxError, KeyError):
    """An adapter name that is not loaded was asked for."""

    code = "adapter_not_found"

    def __init__(self, name: str, known: Iterable[str] = ()):
        self.name = name
        self.known = sorted(known)
        known_txt = ", ".join(self.known) if self.known else "none loaded"
        LoramuxError.__init__(self, f"no adapter named {name!r} is loaded (loaded: {known_txt})",
                              hint="load it first with set_lora(...) or check the spelling")

    def __str__(self) -> str:  # KeyError would quote the message otherwise
        return LoramuxError.__str__(self)


class FactorError(LoramuxError):
    """An in-place factor write or read was refused (unknown factor, shape, rank, non-finite values)."""

    code = "invalid_factors"

    def __init__(self, adapter: str, message: str, *, problems: Iterable[str] = (), factor: str | None = None):
        self.adapter = adapter
        self.factor = factor
        super().__init__(f"adapter {adapter!r}: {message}", problems=problems)


class FactorStateError(FactorError):
    """An adapter's factor writer was asked for a step its state does not allow (`engine/factor_writer.py`).

    `state` is the writer's state when asked (``"staging"``: an `edit()` block of the adapter is open;
    ``"closed"``: the adapter was unloaded), `action` what was asked (``"write"``, ``"edit"``, ``"publish"``,
    ``"restore"``). Nothing was written.
    """

    def __init__(self, adapter: str, state: str, action: str, message: str, *, problems: Iterable[str] = ()):
        self.state = state
        self.action = action
        super().__init__(adapter, message, problems=problems)


class AdapterVersionError(LoramuxError):
    """A request asked for an adapter version other than the one served (it was replaced, or is to come)."""

    code = "adapter_version_gone"

    def __init__(self, name: str, asked: int, current: int):
        self.name = name
        self.asked = asked
        self.current = current
        when = "no longer served" if asked < current else "not served yet"
        super().__init__(f"adapter {name!r}: version {asked} is {when}; the version served is {current}",
                         hint=f"ask for {name}@{current}, or for {name} without a version")


class ScaleError(LoramuxError, ValueError):
    """A scale or strength is not a finite number, or one this engine cannot serve safely."""

    code = "invalid_scale"


class SlotsBusyError(LoramuxError):
    """Every slot of the bank holds an adapter that a running request uses."""

    code = "slots_busy"


class AdapterCapacityError(LoramuxError):
    """The adapters a request or load needs cannot be loaded at once under `max_loaded`: the adapters that
    may not be evicted (pinned, active by default, written in place, in use, or needed together) fill it."""

    code = "adapter_capacity"

    def __init__(self, names: Iterable[str], max_loaded: int, kept: Iterable[str] = ()) -> None:
        self.names = list(names)
        self.max_loaded = max_loaded
        self.kept = sorted(kept)
        kept_txt = ", ".join(self.kept) or "none"
        LoramuxError.__init__(self, f"no room to load {', '.join(map(repr, self.names))}: max_loaded={max_loaded} "
                                    f"and the adapters that stay loaded (pinned, active, written in place or in "
                                    f"use: {kept_txt}) "
                                    "leave too little", hint="unload or unpin an adapter, or raise max_loaded "
                                                             "(--max-loaded)")


class AdapterDirError(LoramuxError):
    """Directories of adapters to register at start (`--lora-dir`) hold files that cannot be registered: bad
    names, files outside the directory, duplicate names, more than the bound. Lists every problem at once."""

    code = "invalid_adapter_dir"

    def __init__(self, dirs: Iterable[str], problems: Iterable[str], *, hint: str | None = None) -> None:
        self.dirs = [str(d) for d in dirs]
        LoramuxError.__init__(self, f"cannot register the adapters of {', '.join(self.dirs)}", problems=problems,
                              hint=hint)


class SourceError(LoramuxError):
    """An adapter source (path, URL, hf://) could not be parsed or resolved."""

    code = "invalid_source"

    def __init__(self, source: str, message: str, *, hint: str | None = None, problems: Iterable[str] = ()):
        self.source = source
        super().__init__(f"{source}: {message}", hint=hint, problems=problems)


class DownloadError(SourceError):
    """A download failed (HTTP status, timeout, truncated body, wrong content)."""

    code = "download_failed"

    def __init__(self, source: str, message: str, *, status: int | None = None, hint: str | None = None):
        self.status = status
        super().__init__(source, message, hint=hint)


class ChecksumError(DownloadError):
    """A downloaded file's sha256 differs from the pinned one; nothing was published."""

    code = "checksum_mismatch"

    def __init__(self, source: str, expected: str, actual: str):
        self.expected = expected
        self.actual = actual
        super().__init__(source, f"sha256 mismatch: expected {expected}, got {actual}",
                         hint="the file changed upstream or the pin is wrong; nothing was saved under the final name")


class DownloadRefused(DownloadError):
    """A download was refused by a safety limit before it could do harm; ``reason`` says which one.

    ``reason`` is ``"private_network"`` (the host resolves to a loopback, link-local, private, multicast or
    otherwise non-public address), ``"too_large"`` (over ``max_bytes``), ``"content_encoding"`` (a compressed
    body, which loramux never decodes) or ``"redirects"`` (too many).
    """

    code = "download_refused"

    def __init__(self, source: str, message: str, *, reason: str, hint: str | None = None):
        self.reason = reason
        super().__init__(source, message, hint=hint)


class DownloadCancelled(SourceError):
    """A download was cancelled through its cancel token; the partial file is kept for a later resume."""

    code = "download_cancelled"

    def __init__(self, source: str, received: int = 0):
        self.received = received
        super().__init__(source, f"download cancelled after {received} bytes",
                         hint="run the same pull again to resume from the partial file")


class ConversionError(LoramuxError):
    """A PEFT ⇄ GGUF conversion or a merge cannot be done; lists every problem, writes nothing."""

    code = "conversion_error"

    def __init__(self, path: str, message: str, *, problems: Iterable[str] = (), hint: str | None = None):
        self.path = str(path)
        super().__init__(f"{path}: {message}", problems=problems, hint=hint)


class ControlVectorError(LoramuxError):
    """A control vector does not fit the model (n_embd, layer count, range, non-finite values)."""

    code = "invalid_control_vector"

    def __init__(self, source: str, message: str, *, problems: Iterable[str] = (), hint: str | None = None):
        self.source = str(source)
        super().__init__(f"control vector {source}: {message}", problems=problems, hint=hint)


class ContextLengthError(LoramuxError, ValueError):
    """A prompt (plus the requested tokens) does not fit the context."""

    code = "context_length_exceeded"

    def __init__(self, n_tokens: int, n_ctx: int, what: str = "prompt"):
        self.n_tokens = n_tokens
        self.n_ctx = n_ctx
        super().__init__(f"{what} has {n_tokens} tokens but the context holds {n_ctx}",
                         hint="shorten the input or load the engine with a larger n_ctx")


class ParameterError(LoramuxError, ValueError):
    """A parameter value is out of range; names the parameter."""

    code = "invalid_parameter"

    def __init__(self, parameter: str, message: str, *, hint: str | None = None):
        self.parameter = parameter
        super().__init__(f"{parameter}: {message}", hint=hint)


class GrammarError(ParameterError):
    """A constraint (JSON schema, regex, choice list, GBNF grammar, tool schema) cannot be enforced.

    `parameter` names the request field it came from (`response_format`, `guided_regex`, `grammar`, ...).
    """

    code = "invalid_grammar"


class GrammarSyntaxError(GrammarError):
    """A GBNF grammar does not parse. `reason` is one of `undefined_rule`, `unclosed_group`,
    `unmatched_close`, `unclosed_literal`, `bad_escape`, `missing_root`, `unknown_token` or `syntax`;
    `line` and `column` (from 1) say where, None when it concerns the whole grammar (`missing_root`)."""

    def __init__(self, parameter: str, reason: str, message: str, *, line: int | None = None,
                 column: int | None = None, hint: str | None = None):
        self.reason, self.line, self.column = reason, line, column
        super().__init__(parameter, message, hint=hint)


class GrammarBudgetError(GrammarError):
    """A request's grammar took more engine time than its budget (per token or per request) while it was
    being served: that request ended, the others went on. `budget` names the setting."""

    code = "grammar_budget_exceeded"

    def __init__(self, parameter: str, budget: str, message: str):
        self.budget = budget
        super().__init__(parameter, message, hint=f"a simpler grammar (fewer alternatives, fewer optional items), "
                                                  f"or a larger {budget} on the server")


class ChatTemplateError(ParameterError):
    """The chat template raised (`raise_exception`) or failed on these messages; `template` names it."""

    code = "invalid_chat_template"

    def __init__(self, template: str, message: str, *, parameter: str = "messages", hint: str | None = None):
        self.template = template
        super().__init__(parameter, f"the chat template ({template}) {message}", hint=hint)


class EngineClosedError(LoramuxError, RuntimeError):
    """The engine was closed; no more work is accepted."""

    code = "engine_closed"


class RequestFailed(LoramuxError):
    """One request failed while it was being served (sampling, text assembly, its decode); only it ended.

    `stage` says where ("decode", "sample"), `adapters` the adapter set it ran with, `cause` the error.
    """

    code = "request_failed"

    def __init__(self, stage: str, adapters: Iterable[str], cause: BaseException, *, hint: str | None = None):
        self.stage = stage
        self.adapters = list(adapters)
        self.cause = cause
        on = ", ".join(self.adapters) or "the base model"
        # No claim about other requests here: what reached them depends on the failure (see kv_guard.py).
        super().__init__(f"the request failed during {stage} with {on}: {type(cause).__name__}: {cause}",
                         hint=hint or "the engine goes on serving; if this repeats with one adapter, lower "
                                      "its scale or check or reload that adapter")


class RpcError(LoramuxError):
    """llama.cpp's RPC backend cannot be used: this build lacks it, a worker is unreachable, or was lost.

    `endpoint` is the worker ("host:port"; None when the build lacks RPC), `reason` what happened:
    "unsupported" (no -DGGML_RPC=on), "invalid" (not host:port), "unreachable", "version" (another
    protocol) or "lost" (the connection broke while serving; this process cannot use RPC again).
    """

    code = "rpc_unavailable"

    def __init__(self, endpoint: str | None, reason: str, message: str, *, hint: str | None = None):
        self.endpoint = endpoint
        self.reason = reason
        where = f"RPC worker {endpoint}" if endpoint else "RPC"
        super().__init__(f"{where}: {message}", hint=hint)


class TrainingError(LoramuxError):
    """Zeroth-order training stopped (bad data, non-finite loss); factors were restored."""

    code = "training_error"

    def __init__(self, message: str, *, problems: Iterable[str] = (), hint: str | None = None,
                 step: int | None = None):
        self.step = step
        # What was learned up to the failure (a train.zo.TrainResult): set by the trainer as the error
        # leaves it, once the factors are restored and the log written.
        self.result: object | None = None
        super().__init__(message, problems=problems, hint=hint)


class ServerError(LoramuxError):
    """A loramux server refused a request of `loramux.client`: the HTTP status and the error's fields."""

    code = "server_error"

    def __init__(self, status: int, body: object):
        self.status = status
        err = body.get("error", {}) if isinstance(body, dict) else {}
        self.error_code = err.get("code") if isinstance(err, dict) else None
        self.param = err.get("param") if isinstance(err, dict) else None
        msg = err.get("message") if isinstance(err, dict) else str(body)
        super().__init__(f"HTTP {status}: {msg}")


class ProbeMismatch(LoramuxError):
    """A probe check found rows that moved (`rows`: row -> what moved), or a reference from another build
    (`foreign`: the build fields on which it differs)."""

    code = "probe_mismatch"

    def __init__(self, message: str, *, problems: Iterable[str] = (), hint: str | None = None,
                 foreign: Iterable[str] = (), rows: dict[str, str] | None = None):
        self.foreign: list[str] = list(foreign)
        self.rows: dict[str, str] = dict(rows or {})
        super().__init__(message, problems=problems, hint=hint)


__all__ = [
    "AdapterCapacityError", "AdapterDirError", "AdapterError", "AdapterNotFoundError", "AdapterVersionError", "BackendError", "ChecksumError", "ContextLengthError",
    "ControlVectorError", "ConversionError", "DownloadCancelled", "DownloadError", "DownloadRefused",
    "ChatTemplateError", "EngineClosedError", "FactorError", "GGUFFormatError", "GrammarBudgetError", "GrammarError",
    "GrammarSyntaxError",
    "LoramuxError", "ModelError", "PackageDataError", "ParameterError", "ProbeMismatch", "RequestFailed", "RpcError",
    "ScaleError", "ServerError", "SlotsBusyError",
    "SourceError", "TrainingError",
    "FactorStateError",
]
