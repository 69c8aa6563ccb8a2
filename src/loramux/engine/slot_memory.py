"""The slot bank's slots as memory to copy prepared slot blocks into (engine thread only).

What is *in* a slot, and which slot an adapter gets, is decided by the bank and the residency tiers
(bank.py, residency.py); this module only moves bytes: numpy copies into host memory (the CPU
backend) or two transfers per slot and target elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .. import _native as N
from .factor_stage import FactorTensors

# numpy gives the GIL away for a copy of more than 500 items (NPY_BEGIN_THREADS_THRESHOLDED). Taking it
# back beside a busy Python thread (a load's parse, the event loop) waits for that thread's switch
# interval (5 ms): a slot write of a few hundred such copies took 20-70 ms in a server loading cold
# adapters, 360 ms beside a busy loop, against 2.5 ms quiet. Copies of at most this many items keep it.
HELD_COPY_ITEMS = 500


class SlotMemory:
    """The bank's slots as memory to copy slot blocks into (engine thread only).

    The bank's A (width, in) and B (out, width) of each target; slot k is rows [k·r, k·r + r) of A and
    the same columns of B. On host memory (the CPU backend) blocks are copied in with numpy, and only
    the ranks that change: the block's, and zeros where the previous occupant was wider there. A's rows
    are copied as one item per row, B's column block as one item of r_t values per output row (about
    3× faster than a strided float copy), at most HELD_COPY_ITEMS items per copy so that no copy gives
    the GIL away. Elsewhere (a device buffer) the whole slot, padded with zeros, in two transfers.
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

    def on_host(self) -> bool:
        """Every target's factors are in host memory (numpy copies; no device transfers)."""
        return len(self._host) == len(self.targets)

    def _slot_views(self, t: str, k: int, rt: int) -> tuple[np.ndarray, np.ndarray]:
        key = (t, k, rt)
        got = self._views.get(key)
        if got is None:
            va, vb = self._host[t]
            r0, es = k * self.r, self.store.itemsize
            rows = va[r0:r0 + rt].view(np.uint8).view(np.dtype((np.void, va.shape[1] * es))).reshape(rt)
            col = vb.view(np.uint8)[:, r0 * es:(r0 + rt) * es]
            got = self._views[key] = (rows, col.view(np.dtype((np.void, rt * es))))
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
                np.copyto(sa, np.ascontiguousarray(block[0]).view(sa.dtype).reshape(rt))
                src = block[1].view(sb.dtype)
                for i in range(0, len(sb), HELD_COPY_ITEMS):
                    np.copyto(sb[i:i + HELD_COPY_ITEMS], src[i:i + HELD_COPY_ITEMS])
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


__all__ = ["SlotMemory"]
