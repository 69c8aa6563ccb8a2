"""``hf://`` sources through ``huggingface_hub.hf_hub_download``.

The usual Hugging Face cache, ``HF_TOKEN``, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` behave as users expect;
huggingface_hub is imported lazily so that ``import loramux`` stays fast.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import ChecksumError, DownloadCancelled, DownloadError, ParameterError, SourceError
from ..gguf_io import sha256_file
from .spec import (
    ACCEPTED_FORMS,
    SAFE_HEADERS,
    Source,
    SourceOptions,
    not_gguf_message,
    raise_if_cancelled,
    status_hint,
)


def download(src: Source, opts: SourceOptions, pin: str | None) -> Path:
    """Fetch the ``hf://`` source ``src`` through the Hugging Face cache and return the file's path.

    ``pin`` is the sha256 the file must have, if any. Raises :class:`SourceError` (offline and not cached,
    invalid name), :class:`DownloadError`, :class:`ChecksumError` or :class:`DownloadCancelled`.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

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
    return _checked(src, Path(str(path)), opts, pin)


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
