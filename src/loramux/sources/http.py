"""URL downloads into loramux's cache: lock, resume with Range/If-Range, retries, checks, atomic publish.

:func:`download` serves ``sources.resolve`` for http(s):// sources. A download goes to ``<final>.partial``
and reaches the final name only after every check passed (length, GGUF magic, sha256 pin). Redirects are
followed by hand (at most :data:`MAX_REDIRECTS`) so that credentials stay with the origin (scheme, host name,
port) the user named. Bodies are stored as sent: ``Accept-Encoding: identity`` is always asked for and a
compressed body is refused, never decoded (a small gzip body can expand without bound). ``max_bytes`` is
checked against the announced length before a body byte is stored and again while streaming; with
``allow_private_networks=False`` every connection goes through :mod:`.guard`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

import httpx

from ..errors import ChecksumError, DownloadCancelled, DownloadError, DownloadRefused
from ..gguf_io import sha256_file
from .guard import GuardedTransport
from .spec import (
    SAFE_HEADERS,
    CancelToken,
    Source,
    SourceOptions,
    default_cache_dir,
    not_gguf_message,
    raise_if_cancelled,
    redact,
    status_hint,
    too_large,
)

#: Redirects followed per request; a Hub file needs one or two, a mirror a few.
MAX_REDIRECTS = 5
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class _RedactedRequestLog(logging.Filter):
    """httpx logs every request's URL at INFO; a source URL may hold a password or a signed query string.
    This filter on the ``httpx`` logger shows such URLs redacted (it changes nothing else, drops nothing)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(a, httpx.URL) for a in record.args):
            record.args = tuple(redact(str(a)) if isinstance(a, httpx.URL) and (a.userinfo or a.query) else a
                                for a in record.args)
        return True


if not any(isinstance(f, _RedactedRequestLog) for f in logging.getLogger("httpx").filters):
    logging.getLogger("httpx").addFilter(_RedactedRequestLog())


def download(src: Source, opts: SourceOptions, pin: str | None) -> Path:
    """Fetch the http(s) source ``src`` into the cache (or reuse the cached copy) and return the file's path.

    ``pin`` is the sha256 the file must have, if any. Raises :class:`DownloadError`, :class:`ChecksumError`
    or :class:`DownloadCancelled`.
    """
    return _UrlDownload(src, opts, pin).run()


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
        self.label = redact(src.url)  # messages and logs never show passwords or signed query strings
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
            guarded = None if self.opts.allow_private_networks else GuardedTransport(self.label)
            with httpx.Client(timeout=timeout, follow_redirects=False, transport=guarded) as self.client:
                return self._with_retries()

    def _cached_ok(self) -> bool:
        if self.opts.policy != "use" or not self.final.is_file():
            return False
        size = self.final.stat().st_size
        if self.opts.max_bytes is not None and size > self.opts.max_bytes:
            raise too_large(self.label, size, self.opts.max_bytes, "the cached file is")
        if self.pin:
            meta = _read_json(self.meta)
            known = meta.get("sha256") if meta.get("size") == self.final.stat().st_size else None
            if (known or sha256_file(self.final)) != self.pin:
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
                                    status=retry.status, hint=status_hint(retry.status)) from retry
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
                                    hint=status_hint(status))
            if status == 206:
                self.total = self._check_content_range(resp, offset)
            else:  # a full body: the server ignored our Range, or If-Range saw a changed file
                length = resp.headers.get("Content-Length", "")
                offset, self.total = 0, int(length) if length.isdigit() else None
            self._check_body(resp)
            self._save_partial_meta(resp, resumable=True)
            self._receive(resp, offset)
        return self._finish()

    def _check_body(self, resp: httpx.Response) -> None:
        """Refuse, before a body byte is stored, a compressed body or a file announced over ``max_bytes``."""
        encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise DownloadRefused(self.label, f"the server sent a Content-Encoding: {encoding} body although "
                                              "loramux asked for identity; compressed bodies are never decoded "
                                              "(a small one can expand without bound)", reason="content_encoding",
                                  hint="serve the file uncompressed (as application/octet-stream)")
        cap = self.opts.max_bytes
        if cap is not None and self.total is not None and self.total > cap:
            self._drop_partial()  # a resumed part of a file that will never be accepted
            raise too_large(self.label, self.total, cap, "the server announced")

    def _request_headers(self) -> tuple[dict[str, str], int, bool]:
        headers = {"User-Agent": "loramux"}
        headers.update({k: v for k, v in self.opts.headers.items() if k.lower() != "accept-encoding"})
        headers["Accept-Encoding"] = "identity"  # whatever the caller asked for: bodies are stored as sent
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
                raise DownloadError(self.label, f"redirect to an unsupported URL {redact(target)}")
            if _origin(target) != _origin(url):
                # We cannot tell which custom header is a secret, so every header the user gave stays behind.
                headers = {k: v for k, v in headers.items() if k.lower() in SAFE_HEADERS}
                # So do the cookies servers set on the way: a jar would send a non-Secure cookie set over https
                # on to http on the same host name (cookies ignore scheme and port).
                self.client.cookies.clear()
            url = target
        raise DownloadRefused(self.label, f"more than {MAX_REDIRECTS} redirects", reason="redirects",
                              hint="use the final URL of the file")

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

    def _receive(self, resp: httpx.Response, offset: int) -> None:
        # No chunk_size: httpx would hold back a partial chunk and lose it when the connection drops. httpcore
        # reads at most 64 KiB at a time, which keeps cancel checks frequent. iter_raw: never content-decoded.
        received, cap = offset, self.opts.max_bytes
        with open(self.partial, "ab" if offset else "wb") as out:
            self._report(received, self.total)
            for chunk in resp.iter_raw():
                if cap is not None and received + len(chunk) > cap:  # checked before the write: never over
                    out.close()
                    self._drop_partial()
                    raise too_large(self.label, received + len(chunk), cap, "the body reached")
                out.write(chunk)
                received += len(chunk)
                self.progressed = self.progressed or bool(chunk)
                self._report(received, self.total)
                # Checked after the write so that everything received stays in the partial for a resume.
                raise_if_cancelled(self.opts.cancel, self.label, received)
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
            raise DownloadError(self.label, not_gguf_message(head),
                                hint="check that the URL serves the raw file (a Hugging Face /resolve/ URL or "
                                     "hf://owner/repo/file.gguf, not a /blob/ page); pass token= if it needs a login")
        digest = sha256_file(self.partial)
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


def _retry_after(resp: httpx.Response) -> float | None:
    try:
        return float(resp.headers.get("Retry-After", ""))
    except ValueError:
        return None  # an HTTP-date Retry-After is rare; the normal backoff applies


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


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


__all__ = ["MAX_REDIRECTS", "download", "url_cache_path"]
