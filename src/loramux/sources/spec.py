"""What a source is: the accepted forms, their parsing, the fetch options and the helpers every fetcher shares.

The ground of the ``sources`` package: ``http`` and ``hub`` import this module, it imports neither.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from ..config import cache_dir as _config_cache_dir
from ..errors import DownloadCancelled, ParameterError, SourceError

Kind = Literal["path", "url", "hf"]
Policy = Literal["use", "revalidate", "refresh"]
ProgressCallback = Callable[[int, "int | None"], None]

ACCEPTED_FORMS = ("accepted forms: a local path (relative, absolute, ~/..., file:///...), an http(s):// URL "
                  "(optionally ending in #sha256=<64 hex>), or hf://owner/repo/path/in/repo.gguf[@revision]")
POLICIES = ("use", "revalidate", "refresh")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_HF_REPO_TYPES = {"datasets": "dataset", "spaces": "space"}
#: Request headers that carry no credentials (lower-case). Every other header a user gives stays with the
#: origin (scheme, host name, port) of the source it was given for.
SAFE_HEADERS = frozenset({"accept", "accept-encoding", "accept-language", "user-agent", "range", "if-range",
                          "if-none-match", "if-modified-since"})


def default_cache_dir() -> Path:
    """loramux's cache root: ``$LORAMUX_CACHE``, else ``$XDG_CACHE_HOME/loramux``, else ``~/.cache/loramux``."""
    return _config_cache_dir()


def redact(url: str) -> str:
    """The URL without user:password and with any query (often a signature) elided."""
    parts = urlsplit(url)
    netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "…" if parts.query else "", ""))


class CancelToken:
    """A thread-safe flag that stops a running download; ``cancel()`` from any thread."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        """Ask every download holding this token to stop at its next chunk."""
        self._event.set()

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel()`` was called."""
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, waking early on cancel; returns ``cancelled``."""
        return self._event.wait(seconds)


def raise_if_cancelled(cancel: CancelToken | None, label: str, received: int) -> None:
    """Raise :class:`DownloadCancelled` for ``label`` (``received`` bytes so far) if ``cancel`` was set."""
    if cancel is not None and cancel.cancelled:
        raise DownloadCancelled(label, received)


@dataclass(frozen=True)
class Source:
    """A parsed adapter source. Build it with :meth:`Source.parse`.

    ``kind`` is ``"path"`` (``path`` set), ``"url"`` (``url`` set, without fragment) or ``"hf"``
    (``repo_id``, ``filename``, ``revision``, ``repo_type`` set). ``sha256`` is the pin from a
    ``#sha256=`` fragment, if any.
    """

    kind: Kind
    text: str
    path: Path | None = None
    url: str | None = None
    repo_id: str | None = None
    filename: str | None = None
    revision: str | None = None
    repo_type: str = "model"
    sha256: str | None = None

    @classmethod
    def parse(cls, text: str | os.PathLike[str]) -> Source:
        """Parse a path, ``file://``, ``http(s)://`` or ``hf://`` source; raise :class:`SourceError` otherwise."""
        raw = os.fspath(text).strip() if isinstance(text, str | os.PathLike) else ""
        if not raw:
            raise SourceError(repr(text), "empty or non-text adapter source", hint=ACCEPTED_FORMS)
        match = _SCHEME.match(raw)
        if match is None:
            return cls(kind="path", text=raw, path=Path(raw).expanduser())
        scheme = match.group(1).lower()
        if scheme == "file":
            return cls._parse_file(raw)
        if scheme in ("http", "https"):
            return cls._parse_url(raw)
        if scheme == "hf":
            return cls._parse_hf(raw)
        raise SourceError(raw, f"unsupported source scheme {scheme}://", hint=ACCEPTED_FORMS)

    @classmethod
    def _parse_file(cls, raw: str) -> Source:
        parts = urlsplit(raw)
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise SourceError(raw, "a file:// source must name a local file, e.g. file:///abs/x.gguf",
                              hint=ACCEPTED_FORMS)
        return cls(kind="path", text=raw, path=Path(unquote(parts.path)).expanduser())

    @classmethod
    def _parse_url(cls, raw: str) -> Source:
        parts = urlsplit(raw)
        try:
            parts.port  # noqa: B018 - raises ValueError on a malformed port
        except ValueError as exc:
            raise SourceError(raw, f"malformed URL: {exc}", hint=ACCEPTED_FORMS) from None
        if not parts.hostname:
            raise SourceError(raw, "the URL has no host", hint=ACCEPTED_FORMS)
        pin = None
        if parts.fragment.lower().startswith("sha256="):
            pin = parts.fragment[len("sha256="):]
            if not _HEX64.match(pin):
                raise SourceError(raw, "a #sha256= pin must be 64 hexadecimal digits")
            pin = pin.lower()
        url = urlunsplit(parts._replace(fragment=""))
        return cls(kind="url", text=raw, url=url, sha256=pin)

    @classmethod
    def _parse_hf(cls, raw: str) -> Source:
        rest, revision = raw[len("hf://"):], None
        if "@" in rest:  # the last '@' starts the revision: a file name with '@' needs an explicit @revision
            rest, _, revision = rest.rpartition("@")
            if not revision:
                raise SourceError(raw, "empty revision after '@'", hint="write hf://owner/repo/file.gguf@main")
        segments = rest.split("/")
        repo_type = _HF_REPO_TYPES.get(segments[0], "model")
        if repo_type != "model":
            segments = segments[1:]
        if len(segments) < 3 or any(s in ("", ".", "..") for s in segments):
            raise SourceError(raw, "an hf:// source must name a file inside a repo",
                              hint="write hf://owner/repo/path/in/repo.gguf, optionally followed by @revision")
        return cls(kind="hf", text=raw, repo_id="/".join(segments[:2]), filename="/".join(segments[2:]),
                   revision=revision, repo_type=repo_type)

    def pin(self, option: str | None) -> str | None:
        """The sha256 the file must have: the ``sha256`` option and/or the ``#sha256=`` fragment, lower-case.

        Raises :class:`SourceError` when both are given and differ.
        """
        if option and self.sha256 and option.lower() != self.sha256:
            raise SourceError(self.text, "the sha256 option and the #sha256= fragment disagree",
                              hint="keep one of the two pins")
        return (option or self.sha256 or "").lower() or None

    def __str__(self) -> str:
        if self.kind == "path":
            return str(self.path)
        if self.kind == "url":
            return redact(self.url or "") + (f"#sha256={self.sha256}" if self.sha256 else "")
        prefix = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        return f"hf://{prefix}{self.repo_id}/{self.filename}" + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class SourceOptions:
    """How to fetch one source.

    ``headers`` and ``token`` (sent as ``Authorization: Bearer``) go only to the source's own origin (scheme,
    host name, port), never to another origin a redirect points at, nor do cookies set on the way. For
    ``hf://`` the token (or ``HF_TOKEN``, or an ``Authorization`` header) goes to the Hub endpoint only, and
    other headers that may carry credentials are refused, because huggingface_hub would send them on to the
    storage host a file redirects to. ``cache_dir`` is loramux's cache root (downloads land in ``downloads/``);
    ``hf://`` files use the Hugging Face cache instead. ``retries`` counts extra attempts after the first,
    waiting ``backoff * 2**n`` seconds (at most ``backoff_max``). ``timeout`` is in seconds (connect and
    each read). ``policy``: ``"use"`` a cached file without network, ``"revalidate"`` it with a conditional
    request, or ``"refresh"`` (always download). ``sha256`` pins the content. ``expect_gguf`` rejects
    files that do not start with ``GGUF``. For ``hf://``, huggingface_hub does its own retries and caching;
    ``timeout`` bounds its metadata request and ``progress``/``cancel`` are honoured per 10 MB chunk.
    """

    headers: Mapping[str, str] = field(default_factory=dict)
    token: str | None = None
    cache_dir: str | os.PathLike[str] | None = None
    retries: int = 4
    timeout: float = 30.0
    backoff: float = 0.5
    backoff_max: float = 8.0
    cancel: CancelToken | None = None
    progress: ProgressCallback | None = None
    policy: Policy = "use"
    sha256: str | None = None
    expect_gguf: bool = True

    def check(self) -> None:
        """Raise :class:`ParameterError` naming the first invalid field."""
        if self.policy not in POLICIES:
            raise ParameterError("policy", f"must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if self.retries < 0:
            raise ParameterError("retries", f"must be >= 0, not {self.retries}")
        if not self.timeout > 0:
            raise ParameterError("timeout", f"must be a positive number of seconds, not {self.timeout}")
        if self.sha256 is not None and not _HEX64.match(self.sha256):
            raise ParameterError("sha256", "must be 64 hexadecimal digits")


def not_gguf_message(head: bytes, subject: str = "the server returned") -> str:
    """Say what the first bytes ``head`` look like instead of a GGUF file, for an error message."""
    text = head.lstrip().lower()
    if text.startswith((b"<!doctype", b"<html", b"<head", b"<body")):
        what = "an HTML page"
    elif text.startswith((b"{", b"[")):
        what = "JSON"
    elif len(head) >= 9 and head[8:9] == b"{":
        what = "what looks like a safetensors file (convert it to GGUF first)"
    elif not head:
        what = "an empty body"
    else:
        what = "something else"
    return f"{subject} {what}, not a GGUF file (got {head[:9].decode('latin-1')!r}...)"


def status_hint(status: int | None) -> str | None:
    """The next step for an HTTP error status, or None when there is nothing useful to say."""
    if status in (401, 403):
        return "the server wants credentials: pass token= or headers="
    if status == 404:
        return "check the URL"
    if status is not None and (status >= 500 or status in (408, 429)):
        return "the server is failing or busy; try again later or raise retries="
    return None


class TqdmProgress:
    """A progress callback drawing a tqdm bar; ``close()`` it (or use it as a context manager) when done."""

    def __init__(self, desc: str, **tqdm_kwargs: Any) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024, total=None, **tqdm_kwargs)

    def __call__(self, received: int, total: int | None) -> None:
        if total is not None and self._bar.total != total:
            self._bar.total = total
        # update() with a difference (possibly negative after a restart) keeps tqdm's rate-limited redraws.
        self._bar.update(received - self._bar.n)

    def close(self) -> None:
        """Finish and remove the bar."""
        self._bar.close()

    def __enter__(self) -> TqdmProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def tqdm_progress(desc: str, **tqdm_kwargs: Any) -> TqdmProgress:
    """Return a progress callback ``(received, total)`` that shows a tqdm bar labelled ``desc``."""
    return TqdmProgress(desc, **tqdm_kwargs)
