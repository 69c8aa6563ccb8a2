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
from ..errors import DownloadCancelled, DownloadRefused, ParameterError, SourceError

Kind = Literal["path", "url", "hf"]
Policy = Literal["use", "revalidate", "refresh"]
ProgressCallback = Callable[[int, "int | None"], None]

ACCEPTED_FORMS = ("accepted forms: a local path (relative, absolute, ~/..., file:///...), an http(s):// URL "
                  "(optionally ending in #sha256=<64 hex>), or hf://owner/repo/path/in/repo.gguf[@revision]")
POLICIES = ("use", "revalidate", "refresh")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_HF_REPO_TYPES = {"datasets": "dataset", "spaces": "space"}
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
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
    try:
        host, port = parts.hostname or "", parts.port
    except ValueError:  # a malformed port: show no authority rather than one that may hold a password
        host, port = "", None
    netloc = (f"[{host}]" if ":" in host else host) + (f":{port}" if port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "…" if parts.query else "", ""))


def display(source: str | os.PathLike[str], *, full_paths: bool = False) -> str:
    """How a source may be shown to someone who did not configure it: no URL userinfo, no query string (it
    may be a signature), and a local path cut to its file name unless ``full_paths`` (the operator's view)."""
    try:
        src = Source.parse(source)
    except SourceError:
        return "(invalid source)"
    if src.kind == "path":
        assert src.path is not None
        return str(src.path) if full_paths else src.path.name
    return str(src)


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
        parts, shown = urlsplit(raw), redact(raw)  # errors never repeat a password or a signed query
        try:
            parts.port  # noqa: B018 - raises ValueError on a malformed port
        except ValueError:
            raise SourceError(shown, "malformed URL: the port is not a number from 0 to 65535",
                              hint=ACCEPTED_FORMS) from None
        if not parts.hostname:
            raise SourceError(shown, "the URL has no host", hint=ACCEPTED_FORMS)
        pin = None
        if parts.fragment.lower().startswith("sha256="):
            pin = parts.fragment[len("sha256="):]
            if not _HEX64.match(pin):
                raise SourceError(shown, "a #sha256= pin must be 64 hexadecimal digits")
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
        src = cls(kind="hf", text=raw, repo_id="/".join(segments[:2]), filename="/".join(segments[2:]),
                  revision=revision, repo_type=repo_type)
        src.check_hf()
        return src

    def check_hf(self) -> None:
        """Refuse an ``hf://`` source whose names could leave the Hugging Face cache.

        The repo id must pass huggingface_hub's own ``validate_repo_id``. The revision becomes a path inside
        the cache (``refs/<revision>`` is read as a file), so it may not start with ``/`` nor hold a ``..``
        segment or a control character; ``refs/pr/1`` and branch names with ``/`` stay valid. The file name
        may not hold ``.``, ``..`` or empty segments, nor a backslash or control character.
        """
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        label = str(self)
        try:
            validate_repo_id(self.repo_id)
        except HFValidationError as exc:
            raise SourceError(label, f"invalid Hugging Face repo id {self.repo_id!r}: {exc}",
                              hint="write hf://owner/repo/path/in/repo.gguf") from None
        if self.revision is not None and (self.revision.startswith("/") or ".." in self.revision.split("/")
                                          or _CONTROL.search(self.revision)):
            raise SourceError(label, f"invalid revision {self.revision!r}: a revision may not start with '/' "
                                     "nor hold a '..' segment or a control character",
                              hint="name a branch, a tag, a commit hash or refs/pr/N")
        name = self.filename or ""
        if any(s in ("", ".", "..") for s in name.split("/")) or "\\" in name or _CONTROL.search(name):
            raise SourceError(label, f"invalid file name {name!r} inside the repo",
                              hint="write the path of the file inside the repo, e.g. sub/adapter.gguf")

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

    Limits for sources someone else chose (the server sets both): ``max_bytes`` caps the file size, checked
    against the announced length (Content-Length, Content-Range, the Hub's metadata) before a body byte is
    stored and again while streaming; ``None`` means no cap. ``allow_private_networks=False`` refuses
    http(s):// hosts that resolve to a loopback, link-local, private, multicast, unspecified or otherwise
    non-public address, every address of the name checked before connecting (to the checked address) and
    again on every redirect; with it, proxies from the environment are not used (a proxy resolves names
    itself, where no check could follow). The library default allows them: ``resolve()`` on one's own
    machine is expected to reach one's own servers. ``hf://`` goes to the configured Hub endpoint and is
    not subject to this check. Bodies are never content-decoded (a compressed body is refused).
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
    max_bytes: int | None = None
    allow_private_networks: bool = True

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
        if self.max_bytes is not None and (type(self.max_bytes) is not int or self.max_bytes < 1):
            raise ParameterError("max_bytes", f"must be a positive whole number of bytes or None, "
                                              f"not {self.max_bytes!r}")


def too_large(label: str, size: int, max_bytes: int, what: str = "the file is") -> DownloadRefused:
    """The refusal for a file of ``size`` bytes over ``max_bytes``."""
    return DownloadRefused(label, f"{what} {size} bytes, over the limit max_bytes={max_bytes}", reason="too_large",
                           hint="raise max_bytes (the server's --max-adapter-bytes) if this adapter is expected")


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
    # The bytes themselves are not quoted: they may be part of a file the caller must not see.
    return f"{subject} {what}, not a GGUF file (it does not start with the GGUF magic)"


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


__all__ = ["ACCEPTED_FORMS", "POLICIES", "SAFE_HEADERS", "CancelToken", "Kind", "Policy", "ProgressCallback",
           "Source", "SourceOptions", "TqdmProgress", "default_cache_dir", "display", "not_gguf_message",
           "raise_if_cancelled", "redact", "status_hint", "too_large", "tqdm_progress"]
