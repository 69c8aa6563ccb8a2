"""Adapter sources: turn what a user typed (a path, a URL, an ``hf://`` file) into a verified local file.

Accepted forms:

* a local path: ``adapters/x.gguf``, ``/abs/x.gguf``, ``~/x.gguf``, ``file:///abs/x.gguf``;
* an ``http://`` or ``https://`` URL, optionally pinned with ``#sha256=<64 hex>``;
* ``hf://owner/repo/path/in/repo.gguf[@revision]`` (``hf://datasets/owner/repo/...`` for a dataset repo).

URLs are downloaded into loramux's own cache (``$LORAMUX_CACHE``, else ``$XDG_CACHE_HOME/loramux``, else
``~/.cache/loramux``; files under ``downloads/``) with resume, retries, a file lock against concurrent
downloads, content checks and an optional sha256 pin. Nothing reaches the final name unless it passed every
check. Bodies are never content-decoded; ``max_bytes`` caps a download and ``allow_private_networks=False``
keeps it off loopback, link-local and private addresses (both for sources someone else chose: the server).
``hf://`` goes through ``huggingface_hub.hf_hub_download`` so the usual Hugging Face cache, ``HF_TOKEN``,
``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` behave as users expect.

The package, in dependency order: ``spec`` (forms, parsing, options, shared helpers) and ``guard`` (the
private-network check) <- ``http`` (URL downloads) and ``hub`` (``hf://``) <- this module, whose
:func:`resolve` is the one way in.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import ChecksumError, SourceError
from ..gguf_io import sha256_file
from . import http, hub
from .http import MAX_REDIRECTS, url_cache_path
from .spec import (
    ACCEPTED_FORMS,
    POLICIES,
    CancelToken,
    Source,
    SourceOptions,
    TqdmProgress,
    default_cache_dir,
    display,
    tqdm_progress,
)

__all__ = [
    "ACCEPTED_FORMS", "MAX_REDIRECTS", "POLICIES", "CancelToken", "Source", "SourceOptions", "TqdmProgress",
    "default_cache_dir", "display", "pull", "resolve", "tqdm_progress", "url_cache_path",
]


def resolve(source: str | os.PathLike[str] | Source, options: SourceOptions | None = None,
            **overrides: Any) -> Path:
    """Resolve ``source`` to an existing, verified local file and return its path.

    ``options`` and/or keyword overrides are the fields of :class:`SourceOptions`. Raises
    :class:`SourceError` (bad form, missing file), :class:`DownloadError` (HTTP status, timeout, truncated
    or wrong content), :class:`ChecksumError` (sha256 pin mismatch) or :class:`DownloadCancelled`.
    """
    src = source if isinstance(source, Source) else Source.parse(source)
    opts = replace(options or SourceOptions(), **overrides)
    opts.check()
    pin = src.pin(opts.sha256)
    if src.kind == "path":
        return _resolve_path(src, pin)
    if src.kind == "hf":
        return hub.download(src, opts, pin)
    return http.download(src, opts, pin)


pull = resolve  # the CLI verb; same behaviour


def _resolve_path(src: Source, pin: str | None) -> Path:
    assert src.path is not None
    path = src.path.absolute()
    if not path.exists():
        raise SourceError(str(path), "no such file",
                          hint=f"check the path (relative paths are taken from {Path.cwd()})")
    if not path.is_file():
        raise SourceError(str(path), "not a regular file (a directory?)", hint="name the .gguf file itself")
    if pin:
        digest = sha256_file(path)
        if digest != pin:
            raise ChecksumError(str(path), pin, digest)
    return path
