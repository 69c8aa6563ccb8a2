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

import contextlib
import fcntl
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any, Literal
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

import httpx

from .errors import ChecksumError, DownloadCancelled, DownloadError, ParameterError, SourceError

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
_POLICIES = ("use", "revalidate", "refresh")
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
    if opts.policy not in _POLICIES:
        raise ParameterError("policy", f"must be one of {', '.join(_POLICIES)}, not {opts.policy!r}")
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


# ---------------------------------------------------------------------------------------------- URLs


def default_cache_dir() -> Path:
    """loramux's cache root: ``$LORAMUX_CACHE``, else ``$XDG_CACHE_HOME/loramux``, else ``~/.cache/loramux``."""
    if os.environ.get("LORAMUX_CACHE"):
        return Path(os.environ["LORAMUX_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "loramux"
    return Path.home() / ".cache" / "loramux"


def url_cache_path(url: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where a download of ``url`` is cached: ``<cache>/downloads/<hash of the URL>-<basename>``.

    The hash ignores credentials and the fragment, so pins and passwords do not create duplicate copies.
    """
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", unquote(PurePosixPath(urlsplit(url).path).name)).lstrip(".")[-80:]
    digest = hashlib.sha256(_cache_key(url).encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "downloads" / f"{digest}-{base or 'download'}"


def _cache_key(url: str) -> str:
    """The URL without credentials and fragment: what identifies a download (and may be written to disk)."""
    parts = urlsplit(url)
    netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme.lower(), netloc, parts.path, parts.query, ""))


class _Retry(Exception):
    """A transient failure: the attempt may be repeated after a backoff."""

    def __init__(self, reason: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason, self.status, self.retry_after = reason, status, retry_after


class _UrlDownload:
    """One URL fetched into the cache: lock, attempts with retries, resume, checks, atomic publish."""

    def __init__(self, src: Source, opts: SourceOptions, pin: str | None) -> None:
        assert src.url is not None
        self.src, self.opts, self.pin = src, opts, pin
        self.label = _redact(src.url)  # messages and logs never show passwords or signed query strings
        self.final = url_cache_path(src.url, opts.cache_dir)
        self.partial = self.final.with_name(self.final.name + ".partial")
        self.partial_meta = self.final.with_name(self.final.name + ".partial.json")
        self.meta = self.final.with_name(self.final.name + ".json")
        self.key = _cache_key(src.url)  # recorded in the sidecars instead of the URL, which may hold a password
        self.progressed = False  # whether the current attempt wrote any byte
        self.total: int | None = None  # full file size announced by the current response

    def run(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        if self._cached_ok():  # published files are complete (atomic replace), so no lock is needed to read
            return self.final
        with _file_lock(self.final.with_name(self.final.name + ".lock"), self.opts.cancel, self.label):
            if self._cached_ok():  # another thread or process published it while we waited
                return self.final
            timeout = httpx.Timeout(self.opts.timeout)
            with httpx.Client(timeout=timeout, follow_redirects=False) as self.client:
                return self._with_retries()

    def _cached_ok(self) -> bool:
        if self.opts.policy != "use" or not self.final.is_file():
            return False
        if self.pin:
            meta = _read_json(self.meta)
            known = meta.get("sha256") if meta.get("size") == self.final.stat().st_size else None
            if (known or _sha256_file(self.final)) != self.pin:
                return False  # stale copy of another version: download again under the pin
        self._report(self.final.stat().st_size, self.final.stat().st_size)
        return True

    def _with_retries(self) -> Path:
        failures = 0
        while True:
            self.progressed, self.total = False, None
            try:
                return self._attempt()
            except httpx.RequestError as exc:
                retry = _Retry(self._transport_reason(exc))
            except _Retry as exc:
                retry = exc
            failures = 1 if self.progressed else failures + 1  # a flaky link that makes progress is not dead
            if failures > self.opts.retries:
                raise DownloadError(self.label, f"{retry.reason} (gave up after {failures} attempts)",
                                    status=retry.status, hint=_status_hint(retry.status)) from retry
            delay = min(self.opts.backoff * 2 ** (failures - 1), self.opts.backoff_max)
            if retry.retry_after is not None:
                delay = max(delay, min(retry.retry_after, self.opts.backoff_max))
            cancel = self.opts.cancel
            if cancel is None:
                time.sleep(delay)
            elif cancel.wait(delay):  # a cancel during the backoff ends the wait at once
                raise DownloadCancelled(self.label, self._partial_size())

    def _transport_reason(self, exc: httpx.RequestError) -> str:
        if isinstance(exc, httpx.TimeoutException):
            return f"timed out after {self.opts.timeout:g}s ({type(exc).__name__})"
        size = self._partial_size()
        if isinstance(exc, httpx.RemoteProtocolError) and self.total is not None and size < self.total:
            return f"body truncated: received {size} of {self.total} bytes (the partial file is kept)"
        return f"connection error: {exc or type(exc).__name__}"

    def _attempt(self) -> Path:
        headers, offset, revalidating = self._request_headers()
        with self._open(headers) as resp:
            status = resp.status_code
            if status == 304 and revalidating:
                return self.final
            if status == 416 and offset:
                self._drop_partial()
                raise _Retry("the server refused to resume (HTTP 416); restarting from zero", status)
            if status in (408, 429) or status >= 500:
                raise _Retry(f"HTTP {status} {resp.reason_phrase}", status, _retry_after(resp))
            if status not in (200, 206):
                raise DownloadError(self.label, f"HTTP {status} {resp.reason_phrase}", status=status,
                                    hint=_status_hint(status))
            if status == 206:
                self.total = self._check_content_range(resp, offset)
            else:  # a full body: the server ignored our Range, or If-Range saw a changed file
                length = resp.headers.get("Content-Length", "")
                offset, self.total = 0, int(length) if length.isdigit() else None
            encoded = resp.headers.get("Content-Encoding", "identity").lower() not in ("", "identity")
            if encoded and offset:  # a compressed range cannot be appended to decoded bytes
                self._drop_partial()
                raise _Retry("the server compressed a resumed range; restarting from zero", status)
            self.total = None if encoded else self.total
            self._save_partial_meta(resp, resumable=not encoded)
            self._receive(resp, offset, encoded)
        return self._finish()

    def _request_headers(self) -> tuple[dict[str, str], int, bool]:
        headers = {"Accept-Encoding": "identity", "User-Agent": "loramux"}
        headers.update(self.opts.headers)
        if self.opts.token:
            headers["Authorization"] = f"Bearer {self.opts.token}"
        if self.opts.policy == "revalidate" and self.final.is_file():
            meta = _read_json(self.meta)
            if meta.get("etag"):
                headers["If-None-Match"] = meta["etag"]
            if meta.get("last_modified"):
                headers["If-Modified-Since"] = meta["last_modified"]
            if "If-None-Match" in headers or "If-Modified-Since" in headers:
                return headers, 0, True  # a conditional GET is about the whole file; no resume
        offset = self._resume_offset()
        if offset:
            headers["Range"] = f"bytes={offset}-"
            meta = _read_json(self.partial_meta)
            etag = meta.get("etag") or ""
            # If-Range needs a strong validator; without one a changed file would be spliced onto the old part.
            validator = etag if etag and not etag.startswith("W/") else meta.get("last_modified")
            if validator:
                headers["If-Range"] = validator
        return headers, offset, False

    def _resume_offset(self) -> int:
        size = self._partial_size()
        meta = _read_json(self.partial_meta)
        if size and meta.get("url") == self.key and meta.get("resumable"):
            return size
        return 0

    @contextlib.contextmanager
    def _open(self, headers: dict[str, str]) -> Iterator[httpx.Response]:
        """GET with redirects followed by hand, so credentials never travel to another origin."""
        url = self.src.url or ""
        for _ in range(MAX_REDIRECTS + 1):
            resp = self.client.send(self.client.build_request("GET", url, headers=headers), stream=True)
            if not resp.has_redirect_location:
                try:
                    yield resp
                finally:
                    resp.close()
                return
            resp.close()
            target = urljoin(url, resp.headers["Location"])
            if urlsplit(target).scheme not in ("http", "https"):
                raise DownloadError(self.label, f"redirect to an unsupported URL {_redact(target)}")
            if _origin(target) != _origin(url):
                # We cannot tell which custom header is a secret, so every header the user gave stays behind.
                headers = {k: v for k, v in headers.items() if k.lower() in _SAFE_HEADERS}
            url = target
        raise DownloadError(self.label, f"more than {MAX_REDIRECTS} redirects")

    def _check_content_range(self, resp: httpx.Response, offset: int) -> int | None:
        match = _CONTENT_RANGE.match(resp.headers.get("Content-Range", "").strip())
        if match is None or int(match.group(1)) != offset:
            self._drop_partial()
            raise _Retry(f"the server answered the resume with a bad Content-Range "
                         f"{resp.headers.get('Content-Range')!r}; restarting from zero", 206)
        total = None if match.group(3) == "*" else int(match.group(3))
        known = _read_json(self.partial_meta).get("total")
        if known is not None and total is not None and known != total:
            self._drop_partial()
            raise _Retry("the file changed size upstream; restarting from zero", 206)
        return total

    def _receive(self, resp: httpx.Response, offset: int, encoded: bool) -> None:
        # No chunk_size: httpx would hold back a partial chunk and lose it when the connection drops. httpcore
        # reads at most 64 KiB at a time, which keeps cancel checks frequent.
        chunks = resp.iter_bytes() if encoded else resp.iter_raw()
        received = offset
        with open(self.partial, "ab" if offset else "wb") as out:
            self._report(received, self.total)
            for chunk in chunks:
                out.write(chunk)
                received += len(chunk)
                self.progressed = self.progressed or bool(chunk)
                self._report(received, self.total)
                # Checked after the write so that everything received stays in the partial for a resume.
                _raise_if_cancelled(self.opts.cancel, self.label, received)
            out.flush()
            os.fsync(out.fileno())

    def _finish(self) -> Path:
        """Check the partial and publish it; a partial that can never become right is deleted."""
        size = self._partial_size()
        if self.total is not None and size < self.total:
            raise _Retry(f"body truncated: received {size} of {self.total} bytes (the partial file is kept)")
        if self.total is not None and size > self.total:
            self._drop_partial()
            raise _Retry(f"received {size} bytes but {self.total} were announced; restarting from zero")
        with open(self.partial, "rb") as f:
            head = f.read(16)
        if self.opts.expect_gguf and head[:4] != b"GGUF":
            self._drop_partial()
            raise DownloadError(self.label, _not_gguf_message(head),
                                hint="check that the URL serves the raw file (a Hugging Face /resolve/ URL or "
                                     "hf://owner/repo/file.gguf, not a /blob/ page); pass token= if it needs a login")
        digest = _sha256_file(self.partial)
        if self.pin and digest != self.pin:
            self._drop_partial()
            raise ChecksumError(self.label, self.pin, digest)
        meta = _read_json(self.partial_meta)
        os.replace(self.partial, self.final)
        _write_json(self.meta, {"url": self.key, "etag": meta.get("etag"), "size": size, "sha256": digest,
                                "last_modified": meta.get("last_modified")})
        self.partial_meta.unlink(missing_ok=True)
        return self.final

    def _save_partial_meta(self, resp: httpx.Response, resumable: bool) -> None:
        _write_json(self.partial_meta, {"url": self.key, "etag": resp.headers.get("ETag"),
                                        "last_modified": resp.headers.get("Last-Modified"),
                                        "total": self.total, "resumable": resumable})

    def _partial_size(self) -> int:
        try:
            return self.partial.stat().st_size
        except FileNotFoundError:
            return 0

    def _drop_partial(self) -> None:
        self.partial.unlink(missing_ok=True)
        self.partial_meta.unlink(missing_ok=True)

    def _report(self, received: int, total: int | None) -> None:
        if self.opts.progress is not None:
            self.opts.progress(received, total)


@contextlib.contextmanager
def _file_lock(path: Path, cancel: CancelToken | None, label: str) -> Iterator[None]:
    """Exclusive ``flock`` on ``path``; works between threads (one open file each) and processes."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # polled rather than blocking so a cancel is seen while waiting
                if cancel is None:
                    time.sleep(0.05)
                elif cancel.wait(0.05):
                    raise DownloadCancelled(label, 0) from None
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _raise_if_cancelled(cancel: CancelToken | None, label: str, received: int) -> None:
    if cancel is not None and cancel.cancelled:
        raise DownloadCancelled(label, received)


def _not_gguf_message(head: bytes) -> str:
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
    return f"the server returned {what}, not a GGUF file (got {head[:9].decode('latin-1')!r}...)"


def _status_hint(status: int | None) -> str | None:
    if status in (401, 403):
        return "the server wants credentials: pass token= or headers="
    if status == 404:
        return "check the URL"
    if status is not None and (status >= 500 or status in (408, 429)):
        return "the server is failing or busy; try again later or raise retries="
    return None


def _retry_after(resp: httpx.Response) -> float | None:
    try:
        return float(resp.headers.get("Retry-After", ""))
    except ValueError:
        return None  # an HTTP-date Retry-After is rare; the normal backoff applies


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


def _redact(url: str) -> str:
    """The URL without user:password and with any query (often a signature) elided."""
    parts = urlsplit(url)
    netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "…" if parts.query else "", ""))


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # missing or torn sidecar: behave as if there were none
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


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


def tqdm_progress(desc: str, **tqdm_kwargs: Any) -> TqdmProgress:
    """Return a progress callback ``(received, total)`` that shows a tqdm bar labelled ``desc``."""
    return TqdmProgress(desc, **tqdm_kwargs)
