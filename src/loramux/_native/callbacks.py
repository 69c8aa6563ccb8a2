"""Selective eval callbacks: `MatmulStops`, the slot bank's per-token masks, which stops the graph only
at MUL_MAT nodes over chosen weights, and the lean trampoline a context uses for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .lib import log
from .tensors import OFF_OP, OFF_SRC0, OP_MUL_MAT, OP_SET_ROWS, int_at, void_at

# --------------------------------------------------------------------------------------------
# Selective eval callbacks (the slot bank's per-token masks)
# --------------------------------------------------------------------------------------------

class MatmulStops:
    """An eval callback that stops only at MUL_MAT nodes whose first source is one of `src0`.

    ggml asks the callback about every node of every graph (about 1,500 per decode of Gemma 3
    270M), so the ask answer is what the eval callback costs per step. A context created with a
    `MatmulStops` answers it in one Python frame with two scalar reads (see `stops_trampoline`)
    instead of going through a generic callback; `on_node(t)` runs for each selected node after it
    was computed and must not raise (an error there would cut the graph short: it is logged and the
    node is left as computed, so the caller must check its own bookkeeping after the decode).
    Calling the object directly behaves like any `EvalCallback` (for tests and other contexts).
    `src0` may be replaced between decodes (an empty set: no stops at all, the graph runs in one go).
    `guard`, when set (between decodes), also stops at every SET_ROWS node, the KV cache writes, and
    is called with each after it was computed, before any attention reads the cells it wrote.
    """

    __slots__ = ("guard", "on_node", "src0")

    def __init__(self, src0: Iterable[int], on_node: Callable[[int], None]) -> None:
        self.src0 = frozenset(src0)
        self.on_node = on_node
        self.guard: Callable[[int], None] | None = None

    def __call__(self, t: int, ask: bool) -> bool:
        if ask:
            if void_at(t + OFF_SRC0).value in self.src0:
                return int_at(t + OFF_OP).value == OP_MUL_MAT
            return self.guard is not None and int_at(t + OFF_OP).value == OP_SET_ROWS
        self.after(t)
        return True

    def after(self, t: int) -> None:
        """Run the handler of a node this callback stopped at (a bank matmul or a KV write)."""
        if self.guard is not None and int_at(t + OFF_OP).value == OP_SET_ROWS:
            self.guard(t)
        else:
            self.on_node(t)


def stops_trampoline(stops: MatmulStops) -> Callable[[int, bool, Any], bool]:
    """The ctypes-side eval callback body for a `MatmulStops` (one frame per node ask)."""
    after, mul_mat, set_rows = stops.after, OP_MUL_MAT, OP_SET_ROWS
    # closure locals: the ask path runs for every graph node, so no global lookups there
    at_void, at_int, off_src0, off_op = void_at, int_at, OFF_SRC0, OFF_OP

    def trampoline(t: int, ask: bool, _user: Any) -> bool:
        try:
            if ask:  # the common case: one set lookup; the op is read only for a selected source
                if at_void(t + off_src0).value in stops.src0:
                    return at_int(t + off_op).value == mul_mat
                return stops.guard is not None and at_int(t + off_op).value == set_rows
            after(t)
        except Exception:  # noqa: BLE001 - never truncate the graph (see MatmulStops)
            log.exception("eval callback failed")
        return not ask  # after a node: go on; a failed ask: do not stop there
    return trampoline


__all__ = ["MatmulStops", "stops_trampoline"]
