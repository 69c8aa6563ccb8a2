"""The server's adapter table: names, stable ids, default and global scales, source policy and safety.

Adapters come from `--lora` (loaded at start, pinned), runtime loads, and `--lora-dir` (registered cold:
an entry and the tier's `ColdAdapter` record, nothing loaded; server/lora_dirs.py). At most
`max_adapters` are known at once. Residency is not decided here: the engine's loaded tier (engine/residency.py, bounded by `--max-loaded`
through `EngineOptions.max_loaded`) evicts the least recently used adapter no request uses and loads it
again, in the same engine-thread step that queues a request naming it. So a request's adapters are
loaded *and in use* at once, with no window for another request's load to evict them. An entry's
`resident`, `pinned` and `inflight` are the tier's, read through it.

Ordering is what keeps requests from ever seeing a half-loaded or vanished adapter:

- the table changes only on the event loop, and a name enters it only after the engine finished
  loading (validate-then-commit) the adapter;
- an unload removes the name and queues the engine's removal in one synchronous step; the engine runs
  commands in the order they were queued and keeps a removed adapter alive (retired) until the requests
  using it finish; a request whose submit comes after the removal gets a 404.

A remote source (http(s)://, hf://) is downloaded before the pool lock is taken, so a slow download never
holds up other loads, unloads or reloads; loads of one source take turns (the second finds the file
cached), and a load's cancel token (its client left) stops its download. Sources are shown through
`Entry.display_source`: never with URL credentials or a query string, a local file's directories only to
the admin plane.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.residency import ColdAdapter, LoadedTier
from ..engine.runtime import Engine
from ..errors import AdapterCapacityError, DownloadRefused, SourceError
from ..sources import CancelToken, Source, SourceOptions, display, resolve
from .config import NAME_RE, NAME_RULE, ServerSettings
from .errors import APIError, model_not_found
from .lora_dirs import scan
from .schemas import LoraRef

log = logging.getLogger("loramux.server")
MAX_SCALE = 1000.0


@dataclass
class Entry:
    """One known adapter: the server's names, id, scales and source; its residency is the engine's tier."""

    name: str
    id: int
    source: str
    path: str
    scale: float  # scale when a request names it (model=..., or lora entry without a scale)
    global_scale: float  # scale in the global set that base-model requests without `lora` get
    tier: LoadedTier = field(repr=False, compare=False)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def resident(self) -> bool:
        """Loaded now (False after an eviction: loaded again by the next request that names it)."""
        return self.tier.is_loaded(self.name)

    @property
    def pinned(self) -> bool:
        """Never evicted (loaded at start, pinned on load, or written to: its factors are not its file's)."""
        return self.name in self.tier.pinned

    @pinned.setter
    def pinned(self, value: bool) -> None:
        if value:
            self.tier.pinned.add(self.name)
        else:
            self.tier.pinned.discard(self.name)

    @property
    def inflight(self) -> int:
        """Requests waiting or running on it in the engine."""
        return self.tier.users(self.name)

    def display_source(self, admin: bool = False) -> str:
        """The source as a client may see it: URLs without user:password and without their query (often a
        signature); a local path as its file name, in full only for the admin plane (``admin=True``)."""
        return display(self.source, full_paths=admin)

    def display_path(self, admin: bool = False) -> str:
        """The loaded file: its full path for the admin plane, else its file name."""
        return self.path if admin else Path(self.path).name


class AdapterPool:
    """Adapter table of one server. Only the event loop touches it."""

    def __init__(self, engine: Engine, settings: ServerSettings, base_name: str) -> None:
        self.engine = engine
        self.settings = settings
        self.base_name = base_name
        self.entries: dict[str, Entry] = {}
        self._next_id = 0
        self._globals: list[Entry] | None = None  # global_set(), rebuilt after a change
        self._lock: asyncio.Lock | None = None
        if settings.max_loaded is not None:  # the server's bound is the engine's loaded tier's
            engine.loaded.max_loaded = settings.max_loaded
        self.loads = {"ok": 0, "error": 0}
        self._fetch_locks: dict[str, asyncio.Lock] = {}
        self.fetching: dict[str, int] = {}  # remote source -> loads that want it (waiting or downloading)
        self.downloading: dict[str, int] = {}  # remote source -> downloads running (at most 1 each)
        start = {e.name: e for e in settings.loras}
        active = engine.active
        for name, a in engine.adapters.items():  # adapters loaded before serving are pinned
            e = start.get(name)
            scale = e.scale if e else (active.get(name) or 1.0)
            glob = e.apply if e else active.get(name, 0.0)
            self._add(name, str(a.source), str(a.path), scale, glob, pinned=True)
        self._register_dirs()

    def _register_dirs(self) -> None:
        """Register every adapter file of `--lora-dir` cold (AdapterDirError listing every problem)."""
        s = self.settings
        if not s.lora_dirs:
            return
        files = scan(s.lora_dirs, [self.base_name, *self.entries], s.max_adapters - len(self.entries))
        self.engine.call(lambda: self.engine.loaded.register_cold(ColdAdapter(f.name, Path(f.path), f.path)
                                                                  for f in files))
        for f in files:
            self._add(f.name, f.path, f.path, 1.0, 0.0, pinned=False)
        log.info("registered %d cold adapters from %s", len(files), ", ".join(s.lora_dirs))

    # ------------------------------------------------------------------ lookups
    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def ordered(self) -> list[Entry]:
        """Every entry by id (the table's own order: ids only grow, a replacement keeps its place)."""
        return list(self.entries.values())

    def resident(self) -> list[Entry]:
        """Loaded entries by id: from the loaded tier (at most --max-loaded), not a walk of every entry."""
        got = [e for e in map(self.entries.get, list(self.engine.loaded.registry.adapters)) if e is not None]
        return sorted(got, key=lambda e: e.id)

    def global_set(self) -> list[Entry]:
        """Entries with a nonzero global scale, by id (what a base-model request without `lora` gets)."""
        if self._globals is None:
            self._globals = [e for e in self.entries.values() if e.global_scale != 0.0]
        return self._globals

    @property
    def evictions(self) -> int:
        """Adapters the engine's loaded tier evicted (--max-loaded)."""
        return self.engine.loaded.stats["evictions"]

    def _add(self, name: str, source: str, path: str, scale: float, global_scale: float, *, pinned: bool) -> Entry:
        e = Entry(name, self._next_id, source, path, scale, global_scale, self.engine.loaded)
        if pinned:
            e.pinned = True
        self._next_id += 1
        self.entries[name] = e
        self._globals = None
        return e

    def _by_ref(self, ref: LoraRef, i: int) -> Entry:
        if ref.name is not None:
            e = self.entries.get(ref.name)
        else:
            e = next((x for x in self.entries.values() if x.id == ref.id), None)
        if e is None:
            what = repr(ref.name) if ref.name is not None else f"id {ref.id}"
            first = list(itertools.islice(self.entries.values(), 21))  # an error names a few, not 100,000
            known = (", ".join(f"{x.id}:{x.name}" for x in first[:20]) + (" …" if len(first) > 20 else "")) or "none"
            raise APIError(404, f"lora[{i}]: no adapter {what} (loaded: {known}); GET /lora-adapters lists them",
                           code="adapter_not_found", param=f"lora[{i}]")
        return e

    def requested_set(self, model: str | None, lora: Sequence[LoraRef] | None) -> dict[str, float]:
        """The adapter set (name → scale, in application order) a request asks for.

        model = base (or omitted): the global set, or exactly the `lora` list if one is given
        (llama-server: adapters not listed get scale 0). model = adapter: that adapter at its scale,
        plus the `lora` list. Unknown names and ids are 404s: never a silent fallback to the base.
        """
        if model is None or model == self.base_name:
            out = {} if lora is not None else {e.name: e.global_scale for e in self.global_set()}
        elif model in self.entries:
            out = {model: self.entries[model].scale}
        else:
            raise model_not_found(model, [self.base_name, *itertools.islice(self.entries, 20)])
        for i, ref in enumerate(lora or ()):
            e = self._by_ref(ref, i)
            s = e.scale if ref.scale is None else float(ref.scale)
            if not math.isfinite(s) or abs(s) > MAX_SCALE:
                raise APIError(400, f"lora[{i}].scale must be a finite number within ±{MAX_SCALE:g}",
                               code="invalid_scale", param=f"lora[{i}].scale")
            out[e.name] = s
        return {n: s for n, s in out.items() if s != 0.0}

    # ------------------------------------------------------------------ load / unload
    async def load(self, name: str, source: str, *, scale: float = 1.0, replace: bool = False,
                   pinned: bool = False, cancel: CancelToken | None = None, written_here: bool = False) -> Entry:
        """Validate, download (a remote source, outside the pool lock), load and only then publish an
        adapter (the engine evicts least recently used ones past max_loaded). `cancel` stops the download (the client left).
        `written_here`: a file the server wrote itself (a training job's result), not a client's path,
        so it is not held to --adapter-dir."""
        if not NAME_RE.match(name) or name == self.base_name:
            raise APIError(400, f"invalid adapter name {name!r}: names must be {NAME_RULE} and differ from "
                                f"the base model's name", code="invalid_name", param="lora_name")
        if not math.isfinite(scale) or abs(scale) > MAX_SCALE:
            raise APIError(400, f"scale must be finite and within ±{MAX_SCALE:g}", code="invalid_scale",
                           param="scale")
        local = source if written_here else self.check_source(source)
        if not written_here and Source.parse(source).kind != "path":
            local = str(await self.fetch(source, cancel))
        async with self.lock:
            old = self.entries.get(name)
            if old is None and len(self.entries) >= self.settings.max_adapters:
                raise APIError(400, f"the server knows {len(self.entries)} adapters, its bound (--max-adapters); "
                                    "unload one first", code="too_many_adapters", param="lora_name")
            if old is not None and not replace:
                raise APIError(400, f"an adapter named {name!r} is already loaded; unload it first, or send "
                                    "\"replace\": true to swap it atomically", code="adapter_exists",
                               param="lora_name")
            try:  # the engine evicts past --max-loaded (engine/residency.py)
                adapter = await asyncio.to_thread(self.engine.load_lora, local, name, pin=pinned)
            except AdapterCapacityError as e:
                self.loads["error"] += 1
                raise APIError(503, f"no room for another resident adapter: {e}", code="adapter_capacity") from None
            except BaseException:
                self.loads["error"] += 1
                raise
            self.loads["ok"] += 1
            if old is not None and self.entries.get(name) is old:
                old.source, old.path, old.scale = source, str(adapter.path), scale
                e = old
            else:
                e = self._add(name, source, str(adapter.path), scale, 0.0, pinned=pinned)
            return e

    async def unload(self, name: str, expect_id: int | None = None) -> Entry:
        """Forget an adapter. Requests already admitted with it finish; later ones get 404.

        `expect_id` (vLLM's `lora_int_id`): unload only if the adapter's id is that one, so a client
        that lost track (the name was unloaded and loaded again) does not remove the new adapter.
        """
        async with self.lock:
            e = self.entries.get(name)
            if e is None:
                raise APIError(404, f"no adapter named {name!r} is loaded", code="adapter_not_found",
                               param="lora_name")
            if expect_id is not None and e.id != expect_id:
                raise APIError(409, f"adapter {name!r} has id {e.id}, not lora_int_id {expect_id}: it was "
                                    "loaded again since; GET /v1/models lists each adapter's lora_id",
                               code="adapter_id_mismatch", param="lora_int_id")
            del self.entries[name]
            self._globals = None
            await asyncio.wrap_future(self._queue_removal(name))  # loaded or evicted: the engine forgets it
            return e

    def set_global_scales(self, pairs: Sequence[tuple[int, float]]) -> None:
        """llama-server's POST /lora-adapters: listed ids get their scale, every other adapter 0."""
        by_id = {e.id: e for e in self.entries.values()}
        bad = [i for i, _ in pairs if i not in by_id]
        if bad:
            raise APIError(400, f"invalid adapter id(s) {bad}; GET /lora-adapters lists the ids",
                           code="adapter_not_found", param="id")
        for i, s in pairs:
            if not math.isfinite(s) or abs(s) > MAX_SCALE:
                raise APIError(400, f"scale of id {i} must be finite and within ±{MAX_SCALE:g}", code="invalid_scale",
                               param="scale")
        for e in self.global_set():
            e.global_scale = 0.0
        for i, s in pairs:
            by_id[i].global_scale = float(s)
        self._globals = None

    # ------------------------------------------------------------------ remote sources
    def source_options(self, cancel: CancelToken | None = None) -> SourceOptions:
        """How a runtime load fetches a remote source: under --max-adapter-bytes and the private-network
        guard unless --allow-private-networks."""
        return SourceOptions(max_bytes=self.settings.max_adapter_bytes, cancel=cancel,
                             allow_private_networks=self.settings.allow_private_networks)

    async def fetch(self, source: str, cancel: CancelToken | None = None) -> Path:
        """Download `source` into its cache and return the local file, without the pool lock; one download
        of a source at a time (a second load of it waits, then finds the file cached). A refusal by a
        safety limit is a 403; a cancelled await (the request went away) cancels the download."""
        token = cancel or CancelToken()
        lock = self._fetch_locks.setdefault(source, asyncio.Lock())
        self.fetching[source] = self.fetching.get(source, 0) + 1
        try:
            async with lock:
                self.downloading[source] = self.downloading.get(source, 0) + 1
                try:
                    return await asyncio.to_thread(resolve, source, self.source_options(token))
                finally:
                    _decrement(self.downloading, source)
        except asyncio.CancelledError:
            token.cancel()  # the thread cannot be stopped from here: it stops at its next chunk
            raise
        except DownloadRefused as e:
            self.loads["error"] += 1
            raise APIError(403, str(e), code=e.code, param="lora_path") from None
        except BaseException:
            self.loads["error"] += 1
            raise
        finally:
            if _decrement(self.fetching, source) == 0:
                self._fetch_locks.pop(source, None)

    # ------------------------------------------------------------------ removal
    def _queue_removal(self, name: str) -> Any:
        eng = self.engine
        fut = eng.call_async(lambda: eng.remove_lora(name))
        fut.add_done_callback(lambda f: f.exception() and log.warning("removing %s: %s", name, f.exception()))
        return fut

    # ------------------------------------------------------------------ security
    def check_source(self, source: str) -> str:
        """What may be loaded at runtime: files inside --adapter-dir (symlinks resolved), remote sources
        only with --allow-remote-adapters. Returns what to hand to the engine."""
        try:
            src = Source.parse(source)
        except SourceError as e:
            raise APIError(400, str(e), code="invalid_source", param="lora_path") from None
        except RuntimeError:  # Path.expanduser: '~name' of a user this machine does not know
            raise APIError(400, f"lora_path {source!r}: no such user's home directory", code="invalid_source",
                           param="lora_path") from None
        if src.kind != "path":
            if not self.settings.allow_remote_adapters:
                raise APIError(403, f"loading adapters from {src.kind} sources is disabled; start the server "
                                    "with --allow-remote-adapters to allow it", code="remote_adapters_disabled",
                               param="lora_path")
            return source
        dirs = [Path(os.path.realpath(Path(d).expanduser())) for d in self.settings.adapter_dirs]
        if not dirs:
            raise APIError(403, "loading adapters by path at runtime is disabled; start the server with "
                                "--adapter-dir DIR and put the adapter file there", code="adapter_dir_required",
                           param="lora_path")
        assert src.path is not None
        if "\x00" in str(src.path):  # no file name holds one (os calls raise ValueError on it)
            raise APIError(400, f"lora_path {source!r}: a file name cannot contain a NUL character",
                           code="invalid_source", param="lora_path")
        cands = [src.path] if src.path.is_absolute() else [d / src.path for d in dirs]
        path = next((c for c in cands if os.path.lexists(c)), cands[0])
        real = Path(os.path.realpath(path))
        if not any(real.is_relative_to(d) for d in dirs):
            raise APIError(403, f"lora_path {source!r} resolves outside the adapter directories "
                                f"({', '.join(map(str, dirs))}); symlinks and '..' may not leave them",
                           code="path_not_allowed", param="lora_path")
        try:
            is_file = real.is_file()
        except OSError:  # a name too long for the file system, a component that is not a directory...
            is_file = False
        if not is_file:
            raise APIError(400, f"lora_path {source!r}: no such adapter file in the adapter directories",
                           code="adapter_file_not_found", param="lora_path")
        return str(real)


def _decrement(counts: dict[str, int], key: str) -> int:
    """Count one fewer for `key`, dropping it at zero (the dict lists only what is in use); the new count."""
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)
    return max(n, 0)


__all__ = ["AdapterPool", "Entry"]
