"""``hf://`` sources through ``huggingface_hub.hf_hub_download``.

The usual Hugging Face cache, ``HF_TOKEN``, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` behave as users expect;
huggingface_hub is imported lazily so that ``import loramux`` stays fast.

The names of a source become paths inside the cache, so they are checked first (:meth:`Source.check_hf`), and
the file huggingface_hub returns must lie inside the cache once symlinks are resolved. ``max_bytes`` is
checked against the Hub's metadata before a download and bounds the stream as it is written. Errors never
quote what an unexpected exception says: it may quote a file huggingface_hub read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import (
    ChecksumError,
    DownloadCancelled,
    DownloadError,
    DownloadRefused,
    ParameterError,
    SourceError,
)
from ..gguf_io import sha256_file
from .spec import (
    ACCEPTED_FORMS,
    SAFE_HEADERS,
    Source,
    SourceOptions,
    not_gguf_message,
    raise_if_cancelled,
    status_hint,
    too_large,
)


def download(src: Source, opts: SourceOptions, pin: str | None) -> Path:
    """Fetch the ``hf://`` source ``src`` through the Hugging Face cache and return the file's path.

    ``pin`` is the sha256 the file must have, if any. Raises :class:`SourceError` (offline and not cached,
    invalid name), :class:`DownloadError`, :class:`ChecksumError` or :class:`DownloadCancelled`.
    """
    src.check_hf()  # a Source built by hand skipped parse
    # huggingface_hub reads these variables once at import time; read them per call so that a variable set
    # after import (tests, notebooks, a CLI flag) still takes effect.
    offline = any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
                  for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    kwargs: dict[str, Any] = dict(
        repo_id=src.repo_id, filename=src.filename, revision=src.revision, repo_type=src.repo_type,
        cache_dir=_hf_cache_dir(), endpoint=os.environ.get("HF_ENDPOINT", "").rstrip("/") or None,
        token=opts.token, headers=_hub_headers(opts) or None, etag_timeout=opts.timeout, library_name="loramux",
        tqdm_class=_hub_progress_class(src, opts))
    raise_if_cancelled(opts.cancel, str(src), 0)
    try:
        path = _fetch(src, opts, kwargs, offline)
    except (DownloadCancelled, DownloadRefused):
        raise
    except Exception as exc:
        if opts.cancel is not None and opts.cancel.cancelled:
            raise DownloadCancelled(str(src)) from exc
        raise _hub_error(src, exc, offline) from exc
    return _checked(src, _inside_cache(src, Path(str(path))), opts, pin)


def _fetch(src: Source, opts: SourceOptions, kwargs: dict[str, Any], offline: bool) -> str:
    """hf_hub_download as the policy says; a download is preceded by the size check when there is a cap."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if offline:
        return str(hf_hub_download(**kwargs, local_files_only=True))
    if opts.policy == "use":
        try:  # a cached file is used without touching the network, like loramux's own cache
            return str(hf_hub_download(**kwargs, local_files_only=True))
        except LocalEntryNotFoundError:
            pass
    if opts.max_bytes is not None:
        _check_announced_size(src, opts, kwargs)
    return str(hf_hub_download(**kwargs, force_download=opts.policy == "refresh"))


def _check_announced_size(src: Source, opts: SourceOptions, kwargs: dict[str, Any]) -> None:
    """Refuse a file whose size in the Hub's metadata is over ``max_bytes``, before downloading it."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    assert src.repo_id is not None and src.filename is not None and opts.max_bytes is not None
    url = hf_hub_url(src.repo_id, src.filename, repo_type=src.repo_type, revision=src.revision,
                     endpoint=kwargs["endpoint"])
    meta = get_hf_file_metadata(url, token=opts.token, timeout=opts.timeout, headers=kwargs["headers"],
                                library_name="loramux")
    if meta.size is not None and meta.size > opts.max_bytes:
        raise too_large(str(src), meta.size, opts.max_bytes, "the Hub announces")


def _inside_cache(src: Source, path: Path) -> Path:
    """``path`` if, symlinks resolved, it lies inside the Hugging Face cache; else a :class:`SourceError`."""
    from huggingface_hub import constants

    root = Path(os.path.realpath(_hf_cache_dir() or constants.HF_HUB_CACHE))
    if not Path(os.path.realpath(path)).is_relative_to(root):
        # Neither path is shown: where the link points is nobody's business but the cache owner's.
        raise SourceError(str(src), "the file huggingface_hub returned lies outside the Hugging Face cache "
                                    "(a symlink out of it); it is not read",
                          hint="delete the repo's folder in the Hugging Face cache and load again")
    return path


def _hub_headers(opts: SourceOptions) -> dict[str, str]:
    """The user's headers as huggingface_hub may carry them: credentials must not reach a storage host.

    When a Hub file redirects to another host (S3, a CDN), huggingface_hub drops the header it calls
    ``authorization`` (lower-case) and sends every other header on. So an ``Authorization`` header is passed
    under that name, and any other header that is not known to be credential-free is refused.
    """
    headers: dict[str, str] = {}
    for name, value in opts.headers.items():
        if name.lower() == "authorization":
            headers["authorization"] = value
        elif name.lower() in SAFE_HEADERS:
            headers[name] = value
        else:
            raise ParameterError(
                "headers", f"{name!r} cannot be sent with an hf:// source: huggingface_hub would send it on to "
                           "the storage host a Hub file redirects to",
                hint="pass the Hub's credentials as token= (or set HF_TOKEN); custom headers work for "
                     "http(s):// sources, where they stay with the URL's origin")
    return headers


def _checked(src: Source, result: Path, opts: SourceOptions, pin: str | None) -> Path:
    size = result.stat().st_size
    if opts.max_bytes is not None and size > opts.max_bytes:
        raise too_large(str(src), size, opts.max_bytes)
    with open(result, "rb") as f:
        head = f.read(16)
    if opts.expect_gguf and head[:4] != b"GGUF":
        raise DownloadError(str(src), not_gguf_message(head, "the repo file is"),
                            hint="name the .gguf file of the repo (convert PEFT safetensors first)")
    if pin:
        digest = sha256_file(result)
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
        return DownloadError(name, f"the Hub answered HTTP {status}", status=status, hint=status_hint(status))
    # Only a transport error's text is quoted: any other exception may quote a file huggingface_hub read.
    transport = type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2", "requests")
    detail = f"{type(exc).__name__}: {exc}" if transport else type(exc).__name__
    return DownloadError(name, f"download from the Hugging Face Hub failed ({detail})",
                         hint="check the network connection and HF_ENDPOINT, then retry")


def _hub_progress_class(src: Source, opts: SourceOptions) -> type | None:
    """A silent tqdm class that forwards huggingface_hub's byte counts to our callback and honours cancel."""
    if opts.progress is None and opts.cancel is None and opts.max_bytes is None:
        return None
    from tqdm import tqdm

    progress, cancel, cap, bars = opts.progress, opts.cancel, opts.max_bytes, []

    class _HubBar(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            super().__init__(*args, **{**kwargs, "disable": True})
            bars.append(self)

        def update(self, n: float | None = 1) -> bool | None:
            self.n += n or 0  # a disabled tqdm does not count
            # huggingface_hub counts a chunk before writing it: raising here keeps the file within the cap.
            if cap is not None and self is bars[0] and self.n > cap:
                raise too_large(str(src), int(self.n), cap, "the download reached")
            if progress is not None and self is bars[0]:  # xet opens a second (transfer) bar: report one
                progress(int(self.n), int(self.total) if self.total else None)
            raise_if_cancelled(cancel, str(src), int(self.n))
            return None

    return _HubBar


def _hf_cache_dir() -> str | None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.path.expanduser(os.path.expandvars(os.environ[var]))
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.path.expandvars(os.environ["HF_HOME"])), "hub")
    return None  # huggingface_hub's own default


__all__ = ["download"]
