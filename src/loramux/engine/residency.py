"""Residency: the one owner of where an adapter lives, and of the one eviction policy every tier uses.

An adapter a request names lives in one of these tiers (fastest first):

- **slot**: a slot of the bank (`bank.py`): its factors are in the bank's tensors, a request on it
  is admitted with no write at all. Which slot a new adapter gets is `LruPolicy`'s choice among the
  idle slots (empty ones first);
- **warm**: its *slot blocks* in host RAM, in `WarmCache`: every target's A and alpha/rank-scaled B
  in the bank's dtype, already checked (finite, within the delta bound). Writing them into a slot
  is a plain copy into the bank's host memory, no parsing, no reading back, no checks;
- **loaded**: registered with the engine (llama.cpp holds its tensors), in `LoadedTier`, bounded by
  `EngineOptions.max_loaded` (the server's `--max-loaded`). A load makes it warm from its parsed file;
  making it warm again later reads its live factors back;
- **cold**: evicted from the loaded tier, or registered without ever being loaded (`register_cold`: the
  server's `--lora-dir`); `LoadedTier` keeps its file. The request naming it loads it on its own thread
  (parse, checks, llama.cpp's load, tensor discovery, its warm blocks: `prepare`), and the engine thread
  only registers the result, in the same step that queues the request (so it is loaded *and in use* at
  once). A cold adapter costs its `ColdAdapter` record alone: nothing else in any tier grows with the
  number of cold adapters.

Every tier evicts with `LruPolicy` (least recently used first, among what the tier says may go). The
warm tier is bounded by bytes (`adapter_cache_bytes`, default `DEFAULT_CACHE_BYTES`); an entry is keyed
by the adapter's identity and content version, so an in-place write (a new version) is never served
from stale blocks. `Prefetcher` fills it off the engine thread for the adapters of queued requests, so
their slot load at admission is only the copy. `WarmCache` and `Prefetcher` are thread-safe;
`LoadedTier` runs on the engine thread (its `prepare` and read-only queries excepted).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import numpy as np

from ..errors import AdapterCapacityError, ParameterError
from .adapters import LoRAAdapter
from .model import Model
from .options import DEFAULT_ADAPTER_CACHE_BYTES
from .registry import Registry

log = logging.getLogger("loramux")

DEFAULT_CACHE_BYTES = DEFAULT_ADAPTER_CACHE_BYTES  # ~65 rank-8 F32 adapters of Gemma 3 270M (7.6 MB each)
PREFETCH_QUEUE_MAX = 256  # adapters waiting to be prepared; more are dropped (prepared at admission)
K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class LruPolicy(Generic[K]):
    """The eviction policy of every residency tier: the least recently used candidate goes first.

    The loaded tier keys it by adapter name, the warm tier by adapter uid, the bank's slot choice by
    slot index. What *may* go (not pinned, not in use, ...) is the tier's to say: it passes those
    `candidates`; a key never touched counts as older than every touched one (first given first).
    Not thread-safe: each tier uses it under its own lock or on its own thread.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()  # least recently used first

    def touch(self, key: K) -> None:
        """`key` was used now."""
        self._order[key] = None
        self._order.move_to_end(key)

    def forget(self, key: K) -> None:
        self._order.pop(key, None)

    def victims(self, candidates: Iterable[K], n: int) -> list[K]:
        """The `n` least recently used of `candidates` (fewer when there are fewer), oldest first."""
        rank = {k: i for i, k in enumerate(self._order)}
        return sorted(candidates, key=lambda k: rank.get(k, -1))[:max(n, 0)]

    def victim(self, candidates: Iterable[K]) -> K | None:
        """The least recently used of `candidates`, or None when there is none."""
        got = self.victims(candidates, 1)
        return got[0] if got else None

    def oldest(self) -> K | None:
        """The least recently used key of all."""
        return next(iter(self._order), None)

    def order(self) -> list[K]:
        """Every key, least recently used first."""
        return list(self._order)


@dataclass(frozen=True)
class SlotBlocks:
    """One adapter version's factors as a bank slot holds them.

    `blocks[target]` = (A (r_t, in), B (out, r_t) times the target's alpha/r_t), in the bank's dtype,
    C-contiguous; targets the adapter lacks are absent (the slot holds zeros there).
    """

    uid: int
    version: int
    name: str
    blocks: Mapping[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.blocks.values())


class WarmCache:
    """The warm tier: an LRU of `SlotBlocks`, at most `max_bytes` in all. Thread-safe.

    An entry larger than the whole budget is not kept (the slot write still uses it once).
    `max_bytes = 0` keeps nothing: every slot load prepares its blocks from the loaded adapter.
    """

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ParameterError("adapter_cache_bytes", f"must be ≥ 0 (0 = no warm tier; got {max_bytes})")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: dict[int, SlotBlocks] = {}  # uid -> blocks
        self._lru: LruPolicy[int] = LruPolicy()
        self.bytes = 0
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "too_large": 0}

    def get(self, adapter: LoRAAdapter) -> SlotBlocks | None:
        """The adapter's blocks if its current version is warm (and mark them recently used)."""
        with self._lock:
            e = self._entries.get(adapter.uid)
            if e is None or e.version != adapter.version:
                self.stats["misses"] += 1
                return None
            self._lru.touch(adapter.uid)
            self.stats["hits"] += 1
            return e

    def has(self, adapter: LoRAAdapter) -> bool:
        """Is the adapter's current version warm? (Does not count as a use.)"""
        with self._lock:
            e = self._entries.get(adapter.uid)
            return e is not None and e.version == adapter.version

    def put(self, blocks: SlotBlocks) -> None:
        """Keep `blocks` (replacing older versions of the adapter), evicting least recently used ones."""
        n = blocks.nbytes
        with self._lock:
            old = self._entries.get(blocks.uid)
            if old is not None and old.version > blocks.version:  # a prefetch finished after a newer write
                return
            self._drop(blocks.uid)
            if n > self.max_bytes:
                self.stats["too_large"] += int(self.max_bytes > 0)
                return
            while self._entries and self.bytes + n > self.max_bytes:
                victim = self._lru.oldest()
                assert victim is not None
                self._drop(victim)
                self.stats["evictions"] += 1
            self._entries[blocks.uid] = blocks
            self._lru.touch(blocks.uid)
            self.bytes += n

    def _drop(self, uid: int) -> None:
        e = self._entries.pop(uid, None)
        self._lru.forget(uid)
        if e is not None:
            self.bytes -= e.nbytes

    def discard(self, adapter: LoRAAdapter) -> None:
        """Forget an adapter (unloaded or replaced)."""
        with self._lock:
            self._drop(adapter.uid)

    def names(self) -> list[str]:
        """Warm adapters, least recently used first."""
        with self._lock:
            return [self._entries[uid].name for uid in self._lru.order()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class Prefetcher:
    """Prepares adapters' slot blocks into a `WarmCache` on a worker thread of its own.

    `prepare(adapter)` builds the blocks (reading the adapter's live factors goes through the
    engine thread between decodes; the padding, scaling and checks run here). A failure is only
    logged: the same adapter fails again, with its typed error, when a request is admitted with it.
    At most `PREFETCH_QUEUE_MAX` adapters wait; `submit` never blocks.
    """

    def __init__(self, cache: WarmCache, prepare: Callable[[LoRAAdapter], SlotBlocks],
                 commit: Callable[[LoRAAdapter, SlotBlocks], None] | None = None) -> None:
        """`commit(adapter, blocks)` keeps prepared blocks (default: `cache.put`); the bank's runs on the
        engine thread and drops blocks of an adapter unloaded meanwhile, which nothing would free."""
        self.cache, self.prepare = cache, prepare
        self.commit = commit or (lambda _a, blocks: cache.put(blocks))
        self._queue: queue.Queue[LoRAAdapter | None] = queue.Queue(PREFETCH_QUEUE_MAX)
        self._pending: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.stats = {"prefetched": 0, "failed": 0, "dropped": 0}

    def submit(self, adapter: LoRAAdapter) -> bool:
        """Queue an adapter to be made warm; False when it is warm or queued already, or the queue is full."""
        if self.cache.max_bytes == 0 or self.cache.has(adapter):
            return False
        key = (adapter.uid, adapter.version)
        with self._lock:
            if self._closed or key in self._pending:
                return False
            try:
                self._queue.put_nowait(adapter)
            except queue.Full:
                self.stats["dropped"] += 1
                return False
            self._pending.add(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="loramux-prefetch", daemon=True)
                self._thread.start()
        return True

    def _work(self) -> None:
        while True:
            adapter = self._queue.get()
            if adapter is None:
                return
            key = (adapter.uid, adapter.version)
            try:
                if not self.cache.has(adapter):
                    self.commit(adapter, self.prepare(adapter))
                    self.stats["prefetched"] += 1
            except Exception as e:  # noqa: BLE001 - admission raises the typed error for this adapter
                self.stats["failed"] += 1
                log.debug("prefetching adapter %s failed: %s", adapter.name, e)
            finally:
                with self._lock:
                    self._pending.discard(key)

    def idle(self) -> bool:
        """Nothing queued or being prepared."""
        with self._lock:
            return not self._pending

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker (after the adapter it is preparing; queued ones are dropped)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        while True:  # make room for the stop marker
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        thread.join(timeout)


@dataclass(frozen=True, slots=True)
class ColdAdapter:
    """An adapter the loaded tier evicted, or registered cold: what loading it (again) takes."""

    name: str
    path: Path  # the local file it was loaded from (a download: its cached copy)
    source: str


Build = Callable[["ColdAdapter"], LoRAAdapter]


@dataclass
class _Waiting:
    """A request's submit waiting for room in the loaded tier."""

    names: list[str]
    build: Callable[[], object]
    future: Future[object]


class LoadedTier:
    """The loaded tier: the adapters llama.cpp holds, at most `max_loaded` (None: no bound). Engine thread.

    `enter(names, build, future)` makes a request's adapters loaded *and in use* in one step: the evicted
    ones it names are registered again (loaded beforehand, off the engine thread, by `prepare`),
    the least recently used adapters nothing uses make room, and `build()` queues the request, all in one
    engine-thread command, so no other load can come between this request's residency and its use.
    In use means a request waiting or running on it (`users`). Never evicted: pinned adapters, the
    default active set, adapters in use or written in place, and the request's own. When no room can be made now, the
    submit waits here, in order, until requests finish (`settle`, after every step); a set that can never
    fit (pinned and active adapters fill the bound) is refused with AdapterCapacityError. An explicit load
    (`loaded`) never waits: it evicts what it can, and else leaves the tier over its bound until the
    adapters in use are free.
    """

    def __init__(self, model: Model, registry: Registry, max_loaded: int | None, *,
                 users: Callable[[LoRAAdapter], int], build: Build, register: Callable[[LoRAAdapter], None],
                 unload: Callable[[str], None], discard: Callable[[LoRAAdapter], None],
                 decoding: Callable[[], bool] = lambda: False) -> None:
        """`build(cold)` parses, checks and loads a file into llama.cpp, unregistered (any thread); `register`
        publishes one and `discard` frees one never registered (engine thread); `unload(name)` takes one out
        of the registry (freed once unused); `decoding()`: do sequences run now? While they do, at most one
        submit whose load must run on the engine thread gets it between two steps (`settle(stepped=True)`
        starts the next turn): such a load costs tens of ms, several at once would stop every sequence."""
        if max_loaded is not None and max_loaded < 1:
            raise ParameterError("max_loaded", f"must be ≥ 1, or None for no bound (got {max_loaded})")
        self.model, self.registry, self.max_loaded = model, registry, max_loaded
        self._users, self._build, self._register, self._unload = users, build, register, unload
        self._discard, self._decoding = discard, decoding
        self._loaded_this_step = False  # a submit's load ran since the last decode step (one per step)
        self.lru: LruPolicy[str] = LruPolicy()
        self.pinned: set[str] = set()  # set from any thread (one set operation each)
        self.cold: dict[str, ColdAdapter] = {}
        # cold adapters loaded off the engine thread, waiting to be registered: at most one per name, each
        # for a submit on its way (bounded by the queue); the lock is for the submitting threads
        self._prepared: dict[str, Future[LoRAAdapter]] = {}
        self._preparing = threading.Lock()
        self.waiting: deque[_Waiting] = deque()
        # peak: the most adapters loaded at once (past max_loaded only by explicit loads while all are in use)
        self.stats = {"reloads": 0, "evictions": 0, "waited": 0, "parsed_on_engine_thread": 0, "peak": 0,
                      "deferred": 0,  # deferred: submits whose engine-thread load waited for the next step
                      "loaded_off_thread": 0}

    # -- queries (any thread) ----------------------------------------------------------------------
    def needs_load(self, names: Iterable[str]) -> bool:
        """Does any of `names` have to be loaded again (evicted)?"""
        return any(n in self.cold for n in names)

    def is_loaded(self, name: str) -> bool:
        return name in self.registry.adapters

    def users(self, name: str) -> int:
        """Requests waiting or running on the loaded adapter `name` (0 when it is not loaded)."""
        a = self.registry.adapters.get(name)
        return 0 if a is None else self._users(a)

    def prepare(self, names: Iterable[str]) -> None:
        """Load the evicted adapters among `names` here, on the submitting thread: parse and check the file,
        load it into llama.cpp, find its tensors and make it warm, all off the engine thread, which then
        only registers it. Submits naming the same cold adapter share one load. A file that cannot be used
        raises its AdapterError, naming the adapter (`name`): this request fails, the adapter stays cold
        (its file is read again by the next request naming it)."""
        for n in dict.fromkeys(names):
            cold = self.cold.get(n)
            if cold is None:
                continue
            with self._preparing:
                fut, mine = self._prepared.get(n), n not in self._prepared
                if fut is None:
                    fut = self._prepared[n] = Future()
            if not mine:
                fut.result()  # the other submit's load; its error is this request's too
                continue
            try:
                fut.set_result(self._build(cold))
            except BaseException as e:
                with self._preparing:
                    self._prepared.pop(n, None)
                fut.set_exception(e)
                raise

    def register_cold(self, adapters: Iterable[ColdAdapter]) -> int:
        """Know adapters without loading them (engine thread): each is loaded by the first request naming it,
        like an evicted one. Names loaded or known already are refused (ParameterError), none registered then.
        Returns how many are cold now."""
        new = list(adapters)
        clash = sorted({a.name for a in new if a.name in self.registry.adapters or a.name in self.cold})
        if clash or len({a.name for a in new}) != len(new):
            raise ParameterError("adapters", f"names known already or given twice: {', '.join(clash) or '(repeated)'}")
        for a in new:
            self.cold[a.name] = a
        return len(self.cold)

    # -- the engine thread -------------------------------------------------------------------------
    def enter(self, names: list[str], build: Callable[[], T], future: Future[T], *, wait: bool = True) -> None:
        """Make `names` loaded and run `build()` (which puts them in use) in this one step, its result
        (or error) into `future`; or, if no room can be made now, wait (`wait=False`: raise
        AdapterCapacityError instead). Loads wait behind loads: first come, first loaded."""
        item = _Waiting(list(names), build, future)  # type: ignore[arg-type]
        if wait and self.needs_load(names) and (self.waiting or self._engine_load_deferred(names)):
            self.waiting.append(item)
            return
        if not self._run(item):
            if not wait:
                raise AdapterCapacityError(self._cold_of(names), self.max_loaded or 0,
                                           kept=self._protected(set(names)))
            self.waiting.append(item)
            self.stats["waited"] += 1

    def use_now(self, names: list[str]) -> None:
        """Make `names` loaded for work that runs now, on the engine thread (an evaluation): evicted ones are
        loaded again; AdapterCapacityError when no room can be made at once."""
        if not self._make_resident(names):
            raise AdapterCapacityError(self._cold_of(names), self.max_loaded or 0, kept=self._protected(set(names)))

    def loaded(self, adapter: LoRAAdapter, pin: bool = False) -> None:
        """An explicit load (or replacement) committed `adapter`: count it used, evict past the bound."""
        self.cold.pop(adapter.name, None)
        self._drop_prepared(adapter.name)
        if pin:
            self.pinned.add(adapter.name)
        self.lru.touch(adapter.name)
        self._trim(keep={adapter.name})
        self.stats["peak"] = max(self.stats["peak"], len(self.registry.adapters))

    def check_room(self, name: str) -> None:
        """Refuse an explicit load of `name` when the bound is full of adapters that may never be evicted."""
        loaded = self.registry.adapters
        if self.max_loaded is None or name in loaded or len(loaded) < self.max_loaded:
            return
        kept = [n for n, a in loaded.items() if n in self.pinned or self._active(n) or a.version > 0]
        if len(kept) >= self.max_loaded:
            raise AdapterCapacityError([name], self.max_loaded, kept)

    def forget(self, name: str) -> None:
        """An adapter was unloaded on purpose: nothing of it stays (not even cold)."""
        self.cold.pop(name, None)
        self.pinned.discard(name)
        self.lru.forget(name)
        self._drop_prepared(name)

    def settle(self, stepped: bool = False) -> None:
        """After requests finished: evict past the bound what is free now, then let waiting submits in.
        `stepped`: a decode step just ran, so the next submit that needs a load may have it."""
        if stepped:
            self._loaded_this_step = False
        self._drop_stale_prepared()
        if self.max_loaded is not None and len(self.registry.adapters) > self.max_loaded:
            self._trim(keep=set())
        if not self.waiting:
            return
        still: deque[_Waiting] = deque()
        for w in self.waiting:  # loads in order: once one finds no room, later loads wait without looking
            if (still and self.needs_load(w.names)) or self._engine_load_deferred(w.names) or not self._run(w):
                still.append(w)
        self.waiting = still

    def _engine_load_deferred(self, names: Iterable[str]) -> bool:
        """One of `names` must be loaded on the engine thread (nothing loaded it beforehand) and such a load
        already ran since the last step while sequences decode: this one waits for the next step."""
        if self._loaded_this_step and self._decoding() and any(self._ready(n) is None for n in self._cold_of(names)):
            self.stats["deferred"] += 1
            return True
        return False

    def _ready(self, name: str) -> LoRAAdapter | None:  # what `prepare` loaded for `name`, done and good
        fut = self._prepared.get(name)
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return None
        return fut.result()

    def close(self, error: Exception) -> None:
        """Fail the submits still waiting with `error` and drop the parsed files."""
        for w in self.waiting:
            if w.future.set_running_or_notify_cancel():
                w.future.set_exception(error)
        self.waiting.clear()
        for n in list(self._prepared):
            self._drop_prepared(n)

    def _drop_stale_prepared(self) -> None:
        """Free what `prepare` loaded for names that are not cold any more (loaded by another path meanwhile)."""
        with self._preparing:  # submitting threads add entries meanwhile
            stale = [n for n in self._prepared if n not in self.cold]
        for n in stale:
            self._drop_prepared(n)

    # -- inside ------------------------------------------------------------------------------------
    def _run(self, item: _Waiting) -> bool:
        """True when `item` is done (queued, failed or cancelled); False: no room for it yet."""
        if item.future.cancelled():
            return True
        try:
            if not self._make_resident(item.names):
                return False
            result = item.build()
        except BaseException as e:  # noqa: BLE001 - handed to the submitter
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(e)
            return True
        if item.future.set_running_or_notify_cancel():
            item.future.set_result(result)
        return True

    def _make_resident(self, names: list[str]) -> bool:
        loaded = self.registry.adapters
        for n in names:
            if n in loaded:
                self.lru.touch(n)
        cold = self._cold_of(names)
        if not cold:
            return True
        if self.max_loaded is not None:
            want = set(names)
            kept = self._protected(want, in_use=False)
            if len(kept) + len([n for n in want if n in loaded or n in self.cold]) > self.max_loaded:
                raise AdapterCapacityError(cold, self.max_loaded, kept)
            need = len(loaded) + len(cold) - self.max_loaded
            cands = self._evictable(want)
            if len(cands) < need:
                return False
            for victim in self.lru.victims(cands, need):
                self._evict(victim)
        for n in cold:
            self._loaded_this_step |= self._reload(n)
        return True

    def _cold_of(self, names: Iterable[str]) -> list[str]:
        loaded = self.registry.adapters
        return [n for n in dict.fromkeys(names) if n not in loaded and n in self.cold]

    def _protected(self, keep: set[str], in_use: bool = True) -> list[str]:
        """Loaded adapters outside `keep` that may not be evicted now (in_use=False: never). Written in place
        (version > 0) counts as never: its factors are not its file's any more, a reload would lose them."""
        return [n for n, a in self.registry.adapters.items() if n not in keep and
                (n in self.pinned or self._active(n) or a.version > 0 or (in_use and self._users(a) > 0))]

    def _active(self, name: str) -> bool:
        """In the default set at a nonzero scale (every request without its own set uses it)."""
        return self.registry.active.get(name, 0.0) != 0.0

    def _evictable(self, keep: set[str]) -> list[str]:
        protected = set(self._protected(keep))
        return [n for n in self.registry.adapters if n not in keep and n not in protected]

    def _trim(self, keep: set[str]) -> None:
        if self.max_loaded is None:
            return
        over = len(self.registry.adapters) - self.max_loaded
        if over > 0:
            for victim in self.lru.victims(self._evictable(keep), over):
                self._evict(victim)

    def _evict(self, name: str) -> None:
        a = self.registry.adapters[name]
        self.cold[name] = ColdAdapter(name, Path(a.path), str(a.source))
        self.lru.forget(name)
        self._unload(name)
        self.stats["evictions"] += 1
        log.info("evicting adapter %s (least recently used, max_loaded=%s)", name, self.max_loaded)

    def _reload(self, name: str) -> bool:
        """Register `name` again; True when its load had to run here, on the engine thread."""
        cold = self.cold[name]
        adapter = self._ready(name)
        here = adapter is None
        if not here:
            with self._preparing:
                self._prepared.pop(name, None)
            self.stats["loaded_off_thread"] += 1
        else:  # nothing loaded it beforehand (an evaluation, or evicted after its submit looked): here
            self.stats["parsed_on_engine_thread"] += 1
            adapter = self._build(cold)
        try:
            self._register(adapter)
        except BaseException:
            self._discard(adapter)
            raise
        del self.cold[name]
        self.lru.touch(name)
        self.stats["reloads"] += 1
        self.stats["peak"] = max(self.stats["peak"], len(self.registry.adapters))
        return here

    def _drop_prepared(self, name: str) -> None:
        """Free what `prepare` loaded for `name` (a load still running is left for a later step)."""
        fut = self._prepared.get(name)
        if fut is None or not fut.done():
            return
        with self._preparing:
            self._prepared.pop(name, None)
        if not fut.cancelled() and fut.exception() is None:
            self._discard(fut.result())


__all__ = ["DEFAULT_CACHE_BYTES", "PREFETCH_QUEUE_MAX", "ColdAdapter", "LoadedTier", "LruPolicy", "Prefetcher", "SlotBlocks",
           "WarmCache"]
