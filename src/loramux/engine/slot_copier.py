"""Slot writes off the engine thread: prepared slot blocks copied into a free slot while decodes run.

A slot write on the engine thread stops every decoding sequence for its duration: 2.5 ms quiet for a
rank-8 adapter of Gemma 3 270M, but 10-40 ms in a server loading cold adapters, where the copy's
few milliseconds of CPU wait for the GIL and the cores that the loads and the HTTP threads hold. With
`slot_writes="background"` (`loramux serve --slot-writes background`), while sequences decode the bank
hands the copy to `SlotCopier`'s thread and the request waits for its slot (a decode step) instead of
every other sequence waiting for the copy. That is not the default: a request that waits a step leaves
its sequence idle for that step, which cost more throughput and time to first token than the copies
between steps where nearly every request needs a write (BENCHMARKS.md, "Slot writes beside the decodes").

Why the copy may overlap a decode through the bank: the slot being written holds no adapter and no
request (it is marked writing, so no admission takes it and no token is planned on it), so every token's
mask selects exactly 0 for its rows of each A·x node (a select, not a product: whatever A holds
mid-copy, even a value torn between two writes, cannot pass), and B's columns of the slot multiply those
zeros. That gives exactly ±0 as long as every value B holds is finite at every instant. The blocks are
checked finite before they are written (`SlotBank.prepare`), and a value torn between two finite values
stays finite: an F16 keeps one value's exponent byte, and an F32 one below 2^127 in magnitude (checked
with the rest) has no exponent byte that can become all ones. Only host memory (the CPU backend) is
copied this way: a device's transfers are not ordered against its running graph.

The engine thread submits (`submit`) and later collects what finished (`finished`); everything the
bank decides about slots stays on the engine thread. A copy that fails zeroes the slot before it is
reported, so the slot holds only finite values whatever happened.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from ..errors import BackendError
from .adapters import LoRAAdapter
from .residency import SlotBlocks
from .slot_memory import SlotMemory

log = logging.getLogger("loramux.engine")


@dataclass(frozen=True)
class Copied:
    """One finished slot copy: slot `k` now holds `adapter` at `version`, unless `error` says why not
    (the slot was zeroed then)."""

    k: int
    adapter: LoRAAdapter
    version: int
    error: BackendError | None = None


class SlotCopier:
    """Copies slot blocks into slots on a worker thread of its own, one slot at a time, in submit order."""

    def __init__(self, memory: SlotMemory) -> None:
        self.memory = memory
        self._jobs: queue.SimpleQueue[tuple[int, LoRAAdapter, int, SlotBlocks] | None] = queue.SimpleQueue()
        self._done: list[Copied] = []
        self._lock = threading.Lock()
        self._busy = 0  # submitted and not yet finished
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, k: int, adapter: LoRAAdapter, version: int, blocks: SlotBlocks) -> None:
        """Copy `blocks` (checked, `adapter` at `version`) into slot k, which nobody uses until it is collected."""
        with self._lock:
            if self._closed:
                raise BackendError("slot bank write", None, "the slot bank is closed")
            self._busy += 1
            self._idle.clear()
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="loramux-slot-copy", daemon=True)
                self._thread.start()
        self._jobs.put((k, adapter, version, blocks))

    def finished(self) -> list[Copied]:
        """The copies finished since the last call (engine thread)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def busy(self) -> bool:
        """A copy is queued or running."""
        return not self._idle.is_set()

    def wait(self) -> None:
        """Until every submitted copy finished (their results wait for `finished`)."""
        self._idle.wait()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            k, adapter, version, blocks = job
            error = None
            try:
                for t in self.memory.targets:
                    self.memory.put(k, t, blocks.blocks.get(t))
            except Exception as e:  # noqa: BLE001 - reported to the request that waits for this slot
                self.memory.clear(k)
                error = BackendError("slot bank write", None, f"writing adapter {adapter.name!r} into slot {k} "
                                     f"failed: {e}", hint="the slot was left empty; the request was not served")
                log.warning("%s", error)
            with self._lock:
                self._done.append(Copied(k, adapter, version, error))
                self._busy -= 1
                if self._busy == 0:
                    self._idle.set()

    def close(self) -> None:
        """Finish the copies submitted, then stop the thread."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._jobs.put(None)
            thread.join()


__all__ = ["Copied", "SlotCopier"]
