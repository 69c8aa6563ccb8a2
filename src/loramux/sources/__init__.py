"""Adapter sources: turn what a user typed (a path, a URL, an ``hf://`` file) into a verified local file.

Accepted forms:

* a local path: ``adapters/x.gguf``, ``/abs/x.gguf``, ``~/x.gguf``, ``file:///abs/x.gguf``;
* an ``http://`` or ``https://`` URL, optionally pinned with ``#sha256=<64 hex>``;
* ``hf://owner/repo/path/in/repo.gguf[@revision]`` (``hf://datasets/owner/repo/...`` for a dataset repo).

URLs are downloaded into loramux's own cache (``$LORAMUX_CACHE``, else ``$XDG_CACHE_HOME/loramux``, else
``~/.cache/loramux``; files under ``downloads/``) with resume, retries, a file lock against concurrent
downloads, content checks and an optional sha256 pin. Nothing reaches the final name unless it passed every
check. ``hf://`` goes through ``huggingface_hub.hf_hub_download`` so the usual Hugging Face cache, ``HF_TOKEN``,
``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` behave as users expect.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from ..errors import ChecksumError, DownloadCancelled, DownloadError, ParameterError, SourceError
from .http import (
    TqdmProgress,
    _not_gguf_message,
    _raise_if_cancelled,
    _redact,
    _sha256_file,
    _status_hint,
    _UrlDownload,
    default_cache_dir,
    tqdm_progress,
    url_cache_path,
)

__all__ = [
    "CancelToken", "Source", "SourceOptions", "TqdmProgress", "default_cache_dir", "pull", "resolve",
    "tqdm_progress", "url_cache_path",
]

Kind = Literal["path", "url", "hf"]
Policy = Literal["use", "revalidate", "refresh"]
ProgressCallback = Callable[[int, "int | None"], None]

ACCEPTED_FORMS = ("accepted forms: a local path (relative, absolute, ~/..., file:///...), an http(s):// URL "
                  "(optionally ending in #sha256=<64 hex>), or hf://owner/repo/path/in/repo.gguf[@revision]")
MAX_REDIRECTS = 10
POLICIES = ("use", "revalidate", "refresh")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
# Headers that carry no credentials; every other header stays with the host the user named.
_SAFE_HEADERS = frozenset({"accept", "accept-encoding", "accept-language", "user-agent", "range", "if-range",
                           "if-none-match", "if-modified-since"})
_HF_REPO_TYPES = {"datasets": "dataset", "spaces": "space"}


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

    def __str__(self) -> str:
        if self.kind == "path":
            return str(self.path)
        if self.kind == "url":
            return _redact(self.url or "") + (f"#sha256={self.sha256}" if self.sha256 else "")
        prefix = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        return f"hf://{prefix}{self.repo_id}/{self.filename}" + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class SourceOptions:
    """How to fetch one source.

    ``headers`` and ``token`` (sent as ``Authorization: Bearer``) go only to the URL's own host, never to a
    host a redirect points at. ``cache_dir`` is loramux's cache root (downloads land in ``downloads/``);
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


def resolve(source: str | os.PathLike[str] | Source, options: SourceOptions | None = None,
            **overrides: Any) -> Path:
    """Resolve ``source`` to an existing, verified local file and return its path.

    ``options`` and/or keyword overrides are the fields of :class:`SourceOptions`. Raises
    :class:`SourceError` (bad form, missing file), :class:`DownloadError` (HTTP status, timeout, truncated
    or wrong content), :class:`ChecksumError` (sha256 pin mismatch) or :class:`DownloadCancelled`.
    """
    src = source if isinstance(source, Source) else Source.parse(source)
    opts = replace(options or SourceOptions(), **overrides)
    _check_options(opts)
    pin = _merge_pin(src, opts.sha256)
    if src.kind == "path":
        return _resolve_path(src, pin)
    if src.kind == "hf":
        return _resolve_hf(src, opts, pin)
    return _UrlDownload(src, opts, pin).run()


pull = resolve  # the CLI verb; same behaviour


def _check_options(opts: SourceOptions) -> None:
    if opts.policy not in POLICIES:
        raise ParameterError("policy", f"must be one of {', '.join(POLICIES)}, not {opts.policy!r}")
    if opts.retries < 0:
        raise ParameterError("retries", f"must be >= 0, not {opts.retries}")
    if not opts.timeout > 0:
        raise ParameterError("timeout", f"must be a positive number of seconds, not {opts.timeout}")
    if opts.sha256 is not None and not _HEX64.match(opts.sha256):
        raise ParameterError("sha256", "must be 64 hexadecimal digits")


def _merge_pin(src: Source, option: str | None) -> str | None:
    if option and src.sha256 and option.lower() != src.sha256:
        raise SourceError(src.text, "the sha256 option and the #sha256= fragment disagree",
                          hint="keep one of the two pins")
    return (option or src.sha256 or "").lower() or None


def _resolve_path(src: Source, pin: str | None) -> Path:
    assert src.path is not None
    path = src.path.absolute()
    if not path.exists():
        raise SourceError(str(path), "no such file",
                          hint=f"check the path (relative paths are taken from {Path.cwd()})")
    if not path.is_file():
        raise SourceError(str(path), "not a regular file (a directory?)", hint="name the .gguf file itself")
    if pin:
        digest = _sha256_file(path)
        if digest != pin:
            raise ChecksumError(str(path), pin, digest)
    return path


# ---------------------------------------------------------------------------------------------- hf://


def _resolve_hf(src: Source, opts: SourceOptions, pin: str | None) -> Path:
    from huggingface_hub import hf_hub_download  # lazy: keeps `import loramux` fast
    from huggingface_hub.errors import LocalEntryNotFoundError

    # huggingface_hub reads these variables once at import time; read them per call so that a variable set
    # after import (tests, notebooks, a CLI flag) still takes effect.
    offline = any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
                  for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    kwargs: dict[str, Any] = dict(
        repo_id=src.repo_id, filename=src.filename, revision=src.revision, repo_type=src.repo_type,
        cache_dir=_hf_cache_dir(), endpoint=os.environ.get("HF_ENDPOINT", "").rstrip("/") or None,
        token=opts.token, headers=dict(opts.headers) or None, etag_timeout=opts.timeout, library_name="loramux",
        tqdm_class=_hub_progress_class(src, opts))
    _raise_if_cancelled(opts.cancel, str(src), 0)
    try:
        if offline:
            path = hf_hub_download(**kwargs, local_files_only=True)
        elif opts.policy == "refresh":
            path = hf_hub_download(**kwargs, force_download=True)
        elif opts.policy == "use":
            try:  # a cached file is used without touching the network, like loramux's own cache
                path = hf_hub_download(**kwargs, local_files_only=True)
            except LocalEntryNotFoundError:
                path = hf_hub_download(**kwargs)
        else:
            path = hf_hub_download(**kwargs)
    except DownloadCancelled:
        raise
    except Exception as exc:
        if opts.cancel is not None and opts.cancel.cancelled:
            raise DownloadCancelled(str(src)) from exc
        raise _hub_error(src, exc, offline) from exc
    result = Path(str(path))
    with open(result, "rb") as f:
        head = f.read(16)
    if opts.expect_gguf and head[:4] != b"GGUF":
        raise DownloadError(str(src), _not_gguf_message(head).replace("the server returned", "the repo file is"),
                            hint="name the .gguf file of the repo (convert PEFT safetensors first)")
    if pin:
        digest = _sha256_file(result)
        if digest != pin:
            raise ChecksumError(str(src), pin, digest)
    return result


def _hub_error(src: Source, exc: Exception, offline: bool) -> SourceError:
    """Translate a huggingface_hub exception into a loramux error with a next step."""
    from huggingface_hub import errors as hub

    name = str(src)
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, hub.LocalEntryNotFoundError | hub.OfflineModeIsEnabled):
        if offline:
            return SourceError(name, "not in the Hugging Face cache and HF_HUB_OFFLINE is set",
                               hint="run once online (unset HF_HUB_OFFLINE) or check HF_HOME / HF_HUB_CACHE")
        return DownloadError(name, "the Hugging Face Hub could not be reached and the file is not cached",
                             hint="check the network connection and HF_ENDPOINT")
    cases: list[tuple[type[BaseException], str, str]] = [
        (hub.GatedRepoError, "the repo is gated", "accept its terms on the Hub and set HF_TOKEN"),
        (hub.RepositoryNotFoundError, "repo not found (or private)",
         "check owner/repo; for a private repo set HF_TOKEN or pass token="),
        (hub.RevisionNotFoundError, f"revision {src.revision or 'main'!r} not found",
         "check the @revision (a branch, tag or commit hash)"),
        (hub.RemoteEntryNotFoundError, f"file {src.filename!r} not found in the repo",
         "check the path of the file inside the repo"),
    ]
    for kind, message, hint in cases:
        if isinstance(exc, kind):
            return DownloadError(name, message, status=status, hint=hint)
    if isinstance(exc, hub.HFValidationError):
        return SourceError(name, f"invalid Hugging Face repo or file name: {exc}", hint=ACCEPTED_FORMS)
    if status is not None:
        return DownloadError(name, f"the Hub answered HTTP {status}", status=status, hint=_status_hint(status))
    return DownloadError(name, f"download from the Hugging Face Hub failed: {exc}",
                         hint="check the network connection and HF_ENDPOINT, then retry")


def _hub_progress_class(src: Source, opts: SourceOptions) -> type | None:
    """A silent tqdm class that forwards huggingface_hub's byte counts to our callback and honours cancel."""
    if opts.progress is None and opts.cancel is None:
        return None
    from tqdm import tqdm

    progress, cancel, bars = opts.progress, opts.cancel, []

    class _HubBar(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            super().__init__(*args, **{**kwargs, "disable": True})
            bars.append(self)

        def update(self, n: float | None = 1) -> bool | None:
            self.n += n or 0  # a disabled tqdm does not count
            if progress is not None and self is bars[0]:  # xet opens a second (transfer) bar: report one
                progress(int(self.n), int(self.total) if self.total else None)
            _raise_if_cancelled(cancel, str(src), int(self.n))
            return None

    return _HubBar


def _hf_cache_dir() -> str | None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.path.expanduser(os.path.expandvars(os.environ[var]))
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.path.expandvars(os.environ["HF_HOME"])), "hub")
    return None  # huggingface_hub's own default


