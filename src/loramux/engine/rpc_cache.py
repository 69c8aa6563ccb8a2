"""The disk cache of `loramux rpc-worker --cache`: ggml-rpc's own cache, bounded and checked by loramux.

ggml-rpc's worker (C++, not changeable from here) writes an uploaded tensor to `DIR/<16 hex digits>`
whenever the client sets the upload's cache flag, the name being the FNV-1a hash of its bytes, and
later answers a client's "do you have hash H?" from that file. On its own it has no bound (any peer
may set the flag on any upload: one file per distinct upload, of any size), and its hash is not
cryptographic (a peer can craft bytes whose name is that of a real weight's).

`CacheKeeper` is a thread in the worker process that keeps that directory in check every `interval`
seconds:

- **bounded**: past `max_bytes` or `max_files`, the oldest entries are deleted (the overshoot is at
  most what peers upload within one interval); anything ggml-rpc does not name (not 16 hex digits, not
  a regular file) is deleted at once;
- **content-checked by sha256**: every entry, once it stopped changing, is recorded in the manifest
  (`MANIFEST` in the directory: name → sha256, size) and an entry whose bytes change afterwards (the
  same name written again with other bytes: a collision) is deleted, so a peer cannot replace an
  entry already there;
- **sealed** (`sealed=True`): only the manifest's entries are kept, each checked against its sha256;
  every new file is deleted at the next pass, and the directory and its files are made read-only (a
  worker not run as root then cannot write there at all). Fill the cache once from a trusted server,
  then run sealed.

What it cannot do: the first bytes written under a name win until they are evicted, so an unsealed
cache that an untrusted peer reached before your server may hold that peer's bytes under a real
weight's name. See docs/security.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("loramux.rpc")

MANIFEST = ".loramux-cache.json"  # ggml-rpc only ever reads and writes 16-hex-digit names
ENTRY_NAME = re.compile(r"^[0-9a-f]{16}$")
DEFAULT_MAX_BYTES = 64 << 30  # 64 GiB: the weights of a 70B model at 4-8 bits, split over a few workers
DEFAULT_MAX_FILES = 4096  # ggml-rpc caches only tensors over 10 MiB: a 405B model has about 1,100
DEFAULT_INTERVAL_S = 1.0


@dataclass
class _Entry:
    sha256: str
    size: int
    sig: tuple[int, int, int]  # (size, mtime_ns, inode) when it was recorded


def _sig(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class CacheKeeper:
    """Bounds and checks the ggml-rpc cache directory `path` (see the module's docstring)."""

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_files: int = DEFAULT_MAX_FILES, sealed: bool = False,
                 interval: float = DEFAULT_INTERVAL_S) -> None:
        from ..errors import ParameterError

        for name, value in (("--cache-max-bytes", max_bytes), ("--cache-max-files", max_files)):
            if type(value) is not int or value < 1:
                raise ParameterError(name, f"must be a positive integer, got {value!r}")
        self.path = Path(path)
        self.max_bytes, self.max_files, self.sealed, self.interval = max_bytes, max_files, sealed, interval
        self.entries: dict[str, _Entry] = self._read_manifest()
        self.pending: dict[str, tuple[int, int, int]] = {}  # seen changing: checked once it settles
        self.deleted = 0  # files removed so far (bounds, collisions, strangers)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the manifest -------------------------------------------------------------------------
    def _read_manifest(self) -> dict[str, _Entry]:
        try:
            raw = json.loads((self.path / MANIFEST).read_text(encoding="utf-8"))
            return {k: _Entry(v["sha256"], int(v["size"]), tuple(v["sig"])) for k, v in raw.items()
                    if ENTRY_NAME.match(k)}
        except (OSError, ValueError, KeyError, TypeError):
            return {}  # none yet, or unreadable: every entry is checked anew

    def _write_manifest(self) -> None:
        tmp = self.path / (MANIFEST + ".tmp")
        data = {k: {"sha256": e.sha256, "size": e.size, "sig": list(e.sig)} for k, e in sorted(self.entries.items())}
        tmp.write_text(json.dumps(data, indent=0), encoding="utf-8")
        os.replace(tmp, self.path / MANIFEST)

    # -- one pass -----------------------------------------------------------------------------
    def scan(self) -> None:
        """One pass over the directory: delete strangers and changed entries, record settled new
        ones (unsealed), then enforce the bounds."""
        before = dict(self.entries)
        present: dict[str, os.stat_result] = {}
        for item in os.scandir(self.path):
            if item.name in (MANIFEST, MANIFEST + ".tmp"):
                continue
            try:
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not ENTRY_NAME.match(item.name) or not stat.S_ISREG(st.st_mode):
                self._delete(item.name, "not an entry ggml-rpc writes")
            elif self._check(item.name, st):
                present[item.name] = st
        for gone in set(self.entries) - set(present):
            del self.entries[gone]
        self.pending = {k: v for k, v in self.pending.items() if k in present}
        self._bound(present)
        if self.entries != before and not self.sealed:  # sealed: the manifest is the trusted record
            self._write_manifest()

    def _check(self, name: str, st: os.stat_result) -> bool:
        """Whether entry `name` stays (it may still be pending); deletes it when it must go."""
        known, sig = self.entries.get(name), _sig(st)
        if known is not None and known.sig == sig:
            return True
        if self.sealed:  # nothing may be written to a sealed cache; a copied one keeps its bytes
            if known is not None and _sha256(self.path / name) == known.sha256:
                self.entries[name] = _Entry(known.sha256, known.size, sig)
                return True
            self._delete(name, "written to a sealed cache" if known is None else "changed in a sealed cache")
            return False
        settled = self.pending.get(name) == sig and time.time_ns() - st.st_mtime_ns > self.interval * 1e9
        if not settled:
            self.pending[name] = sig  # still being written, or just seen: look again next pass
            return True
        digest = _sha256(self.path / name)
        if known is not None and known.sha256 != digest:
            self._delete(name, "its bytes changed (another upload under the same FNV name: a collision)")
            return False
        self.entries[name] = _Entry(digest, st.st_size, sig)
        self.pending.pop(name, None)
        return True

    def _bound(self, present: dict[str, os.stat_result]) -> None:
        total = sum(st.st_size for st in present.values())
        for name in sorted(present, key=lambda n: present[n].st_mtime_ns):  # oldest first
            if total <= self.max_bytes and len(present) <= self.max_files:
                break
            total -= present.pop(name).st_size
            self.entries.pop(name, None)
            self.pending.pop(name, None)
            self._delete(name, "over the cache's bounds")

    def _delete(self, name: str, why: str) -> None:
        try:
            if (self.path / name).is_dir() and not (self.path / name).is_symlink():
                import shutil

                shutil.rmtree(self.path / name)
            else:
                (self.path / name).unlink()
        except FileNotFoundError:
            return
        except OSError as e:  # a sealed directory this process may not write either
            log.error("rpc cache: cannot delete %s (%s): %s", name, why, e)
            return
        self.deleted += 1
        log.warning("rpc cache: deleted %s (%s)", name, why)

    # -- the thread ---------------------------------------------------------------------------
    def start(self) -> CacheKeeper:
        """One pass now (before the worker accepts a client), then one every `interval` seconds."""
        if not self.sealed:  # a cache sealed before is written again: ggml-rpc must be able to
            os.chmod(self.path, stat.S_IMODE(os.stat(self.path).st_mode) | stat.S_IRWXU)
        self.scan()
        if self.sealed:
            self._seal()
        self._thread = threading.Thread(target=self._run, name="loramux-rpc-cache", daemon=True)
        self._thread.start()
        return self

    def _seal(self) -> None:
        for name in self.entries:
            os.chmod(self.path / name, 0o444)
        os.chmod(self.path, 0o555)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.scan()
            except Exception:  # noqa: BLE001 - keep guarding: one failed pass (a file raced away) is retried
                log.exception("rpc cache: a pass failed")

    def stop(self) -> None:
        """Stop the thread (tests; the worker's process simply ends)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_FILES", "MANIFEST", "CacheKeeper"]
