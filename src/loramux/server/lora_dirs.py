"""Adapters registered cold from directories (`--lora-dir DIR`): every `*.gguf` file of DIR, under its stem.

Registering costs the file's name and path only: nothing is loaded at start (without a slot rank given,
the headers of up to 32 files, spread over their names, size the bank's slots: config.py `dir_sample`). The first
request naming an adapter loads it through the engine's loaded tier like an evicted one (its file parsed
off the engine thread, then loaded in the engine-thread step that queues the request: engine/residency.py);
a file that turns out not to be a LoRA for this base fails that request alone.

What start does check, for every file at once (one `AdapterDirError` lists every problem): the name is a
valid adapter name, the file is a regular file inside DIR once symlinks are resolved, no name is used twice
(across directories, `--lora` adapters and the served model name), and the total stays within
`max_adapters`. Only DIR's own entries count (no subdirectories); names starting with '.' (editor and
download leftovers) are skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import AdapterDirError
from .config import NAME_RE, NAME_RULE

SUFFIX = ".gguf"
MAX_LISTED = 20  # problems of one kind named in the error; the rest are counted


@dataclass(frozen=True, slots=True)
class ColdFile:
    """One adapter file to register: its name (the file's stem) and the file, symlinks resolved."""

    name: str
    path: str


def scan(dirs: Iterable[str], taken: Iterable[str] = (), limit: int | None = None) -> list[ColdFile]:
    """The adapter files of `dirs`, in directory order then name order; `taken`: names already in use.

    Raises AdapterDirError listing every problem (bad names, files outside their directory or not regular,
    duplicate names, more than `limit` files) when there is any: nothing is registered then."""
    dirs = list(dirs)
    problems: dict[str, list[str]] = {}
    seen: dict[str, str] = {n: "already served" for n in taken}
    out: list[ColdFile] = []
    for d in dirs:
        for f in _files(d, problems):
            where = seen.get(f.name)
            if where is not None:
                problems.setdefault("duplicate", []).append(f"{f.name!r}: {f.path} (also {where})")
                continue
            seen[f.name] = f.path
            out.append(f)
    if limit is not None and len(out) > limit:
        problems.setdefault("limit", []).append(
            f"{len(out)} adapter files, more than the {limit} that may be registered (max_adapters, "
            f"--max-adapters)")
    if problems:
        raise AdapterDirError(dirs, _listed(problems),
                              hint="rename or remove the files named, or raise --max-adapters; nothing was "
                                   "registered")
    return out


def _files(d: str, problems: dict[str, list[str]]) -> list[ColdFile]:
    root = Path(d).expanduser()
    try:
        real_root = Path(os.path.realpath(root))
        entries = sorted(e.name for e in os.scandir(real_root) if e.name.endswith(SUFFIX))
    except OSError as e:
        problems.setdefault("dir", []).append(f"{d}: cannot list it: {e.strerror or e}")
        return []
    out = []
    for fname in entries:
        if fname.startswith("."):
            continue
        name, path = fname[: -len(SUFFIX)], real_root / fname
        if not NAME_RE.match(name):
            problems.setdefault("name", []).append(f"{path}: {name!r} is not an adapter name ({NAME_RULE})")
            continue
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(real_root):
            problems.setdefault("outside", []).append(f"{path}: resolves to {real}, outside {real_root}")
            continue
        if not real.is_file():
            problems.setdefault("not_file", []).append(f"{path}: not a regular file (or a broken symlink)")
            continue
        out.append(ColdFile(name, str(real)))
    return out


def _listed(problems: dict[str, list[str]]) -> list[str]:
    out = []
    for items in problems.values():
        out += items[:MAX_LISTED]
        if len(items) > MAX_LISTED:
            out.append(f"… and {len(items) - MAX_LISTED} more like the above")
    return out


__all__ = ["MAX_LISTED", "SUFFIX", "ColdFile", "scan"]
