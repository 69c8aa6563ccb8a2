"""Residency tiers for the slot bank: what makes a slot load cheap, and who prepares it ahead of time.

An adapter a request names lives in one of these tiers (fastest first):

- **hot**: a slot of the bank (`bank.py`): its factors are in the bank's tensors, a request on it
  is admitted with no write at all;
- **warm**: its *slot blocks* in host RAM, in `WarmCache`: every target's A and alpha/rank-scaled B
  in the bank's dtype, already checked (finite, within the delta bound). Writing them into a slot
  is a plain copy into the bank's host memory, no parsing, no reading back, no checks;
- **loaded**: registered with the engine (llama.cpp holds its tensors; the server's `--max-loaded`
  bounds how many). Making it warm reads its live factors back and prepares the blocks;
- **cold**: a file or the download cache; the server reloads it on demand (`server/pool.py`).

The warm tier is an LRU bounded by bytes (`adapter_cache_bytes`, default `DEFAULT_CACHE_BYTES`); an
entry is keyed by the adapter's identity and content version, so an in-place write (a new version)
is never served from stale blocks. `Prefetcher` fills it off the engine thread for the adapters of
queued requests, so their slot load at admission is only the copy. Both are thread-safe.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .. import _native as N
from ..errors import ParameterError
from .adapters import LoRAAdapter
from .factor_stage import FactorTensors
from .options import DEFAULT_ADAPTER_CACHE_BYTES

log = logging.getLogger("loramux")

DEFAULT_CACHE_BYTES = DEFAULT_ADAPTER_CACHE_BYTES  # ~65 rank-8 F32 adapters of Gemma 3 270M (7.6 MB each)
PREFETCH_QUEUE_MAX = 256  # adapters waiting to be prepared; more are dropped (prepared at admission)


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
        self._entries: OrderedDict[int, SlotBlocks] = OrderedDict()  # uid -> blocks, least recent first
        self.bytes = 0
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "too_large": 0}

    def get(self, adapter: LoRAAdapter) -> SlotBlocks | None:
        """The adapter's blocks if its current version is warm (and mark them recently used)."""
        with self._lock:
            e = self._entries.get(adapter.uid)
            if e is None or e.version != adapter.version:
                self.stats["misses"] += 1
                return None
            self._entries.move_to_end(adapter.uid)
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
            old = self._entries.pop(blocks.uid, None)
            if old is not None:
                self.bytes -= old.nbytes
                if old.version > blocks.version:  # a prefetch finished after a newer write: keep the newer
                    self._entries[old.uid] = old
                    self.bytes += old.nbytes
                    return
            if n > self.max_bytes:
                self.stats["too_large"] += int(self.max_bytes > 0)
                return
            while self._entries and self.bytes + n > self.max_bytes:
                _, victim = self._entries.popitem(last=False)
                self.bytes -= victim.nbytes
                self.stats["evictions"] += 1
            self._entries[blocks.uid] = blocks
            self.bytes += n

    def discard(self, adapter: LoRAAdapter) -> None:
        """Forget an adapter (unloaded or replaced)."""
        with self._lock:
            e = self._entries.pop(adapter.uid, None)
            if e is not None:
                self.bytes -= e.nbytes

    def names(self) -> list[str]:
        """Warm adapters, least recently used first."""
        with self._lock:
            return [e.name for e in self._entries.values()]

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


class SlotMemory:
    """The bank's slots as memory to copy slot blocks into (engine thread only).

    The bank's A (width, in) and B (out, width) of each target; slot k is rows [k·r, k·r + r) of A and
    the same columns of B. On host memory (the CPU backend) blocks are copied in with numpy, and only
    the ranks that change: the block's, and zeros where the previous occupant was wider there. B's
    column block is copied as one item of r_t values per output row (about 3× faster than a strided
    float copy). Elsewhere (a device buffer) the whole slot, padded with zeros, in two transfers.
    """

    def __init__(self, facs: Mapping[str, FactorTensors], targets: Sequence[str], slots: int, rank: int,
                 store: type[np.floating]) -> None:
        self.facs, self.targets, self.K, self.r = facs, list(targets), slots, rank
        self.width = slots * rank
        self.store = np.dtype(store)
        self.ranks: list[dict[str, int]] = [{} for _ in range(slots)]  # ranks that may be nonzero
        self._host = self._host_views()
        self._views: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray]] = {}  # ≤ targets × K × r

    def _host_views(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        views = {}
        es = self.store.itemsize
        for t in self.targets:
            f = self.facs[t]
            pa, pb = N.tensor_host_address(f.a), N.tensor_host_address(f.b)
            if pa is None or pb is None:
                continue
            n_in, n_out = f.a_shape[1], f.b_shape[0]
            views[t] = (N.host_bytes(pa[0], self.width * n_in * es).view(self.store).reshape(self.width, n_in),
                        N.host_bytes(pb[0], n_out * self.width * es).view(self.store).reshape(n_out, self.width))
        return views

    def _slot_views(self, t: str, k: int, rt: int) -> tuple[np.ndarray, np.ndarray]:
        key = (t, k, rt)
        got = self._views.get(key)
        if got is None:
            va, vb = self._host[t]
            r0, es = k * self.r, self.store.itemsize
            row = vb.view(np.uint8)[:, r0 * es:(r0 + rt) * es]
            got = self._views[key] = (va[r0:r0 + rt], row.view(np.dtype((np.void, rt * es))))
        return got

    def put(self, k: int, t: str, block: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Slot k of target t := block (A (r_t, in), B (out, r_t) in the bank's dtype; None: zeros)."""
        old, r0 = self.ranks[k].get(t, 0), k * self.r
        rt = 0 if block is None else block[0].shape[0]
        if rt == 0 and old == 0:
            return
        self.ranks[k][t] = self.r  # unknown until the copy is complete (a failed write zeroes all)
        views = self._host.get(t)
        if views is not None:
            va, vb = views
            if block is not None and rt:
                sa, sb = self._slot_views(t, k, rt)
                np.copyto(sa, block[0])
                np.copyto(sb, block[1].view(sb.dtype))
            if old > rt:
                va[r0 + rt:r0 + old] = 0
                vb[:, r0 + rt:r0 + old] = 0
        else:
            f = self.facs[t]
            a = np.zeros((self.r, f.a_shape[1]), self.store)
            b = np.zeros((f.b_shape[0], self.r), self.store)
            if block is not None and rt:
                a[:rt], b[:, :rt] = block
            es = self.store.itemsize
            N.tensor_set(f.a, a, offset=r0 * a.shape[1] * es)
            N.tensor_set_2d(f.b, b, offset=r0 * es, row_bytes=self.r * es, n_rows=b.shape[0],
                            stride_tensor=self.width * es)
        if rt:
            self.ranks[k][t] = rt
        else:
            self.ranks[k].pop(t, None)

    def clear(self, k: int) -> None:
        """Zero slot k everywhere (best effort: a target that fails stays marked possibly nonzero)."""
        self.ranks[k] = {t: self.r for t in self.targets}
        for t in self.targets:
            try:
                self.put(k, t, None)
            except Exception:  # noqa: BLE001 - the slot stays marked empty: its rows are never selected
                pass

    def close(self) -> None:
        self._host, self._views = {}, {}


__all__ = ["DEFAULT_CACHE_BYTES", "PREFETCH_QUEUE_MAX", "Prefetcher", "SlotBlocks", "SlotMemory", "WarmCache"]
