"""The slot bank: one resident LoRA of rank K·r that lets sequences on different adapters share a decode.

The bank is an ordinary llama.cpp adapter over every projection, created with zero factors and
applied at scale 1 (alpha 0, so llama.cpp applies no alpha/rank factor) to every decode whose tokens
use different adapter sets (the scheduler applies a decode with one set for all tokens natively). Each user adapter
lives in a slot k: rows [k·r, k·r + r) of every A and the same columns of every B, written in place.
Each target is written at its own rank r_t ≤ r (zeros fill the rest of the slot, and the targets the
adapter lacks) with its own llama.cpp scaling baked into B: alpha / r_t (1 when alpha is 0), exactly
the factor `llama_adapter_lora_weight::get_scale` applies natively. So the mask carries only the
request's scale. During a decode, `cb_eval` stops at each bank `A·x` product (ne = [K·r, n_tokens])
and keeps the row block of slot k for token t, times its request scale, only if token t's sequence
uses that slot; every other block is set to exactly 0 (selected, not multiplied by 0, so not even an
Inf or NaN can pass from one slot to another sequence). `B · (selected A·x)` then adds each sequence's
own delta and exactly +0.0 for the others (B is always finite: every write is checked first), so one
decode serves every sequence whatever its adapters, with no change of the context's adapter set and
no graph re-reserve.

The bank owns slot admission: `take_slots()` decides whether a request goes through the bank (every adapter
fits a slot, and they fit the bank together), takes its slots (all or none) and returns the mask
values of each phase; `decode()` plans the masks, runs the decode and checks that every bank node was
masked. A slot write is all-or-nothing: it is marked empty before the first byte changes and claims
its adapter only once every tensor is written, so a failed write leaves it empty and free.

Facts this relies on (see the mixed-batching notes): the context must use `kv_unified=true` and
n_ubatch == n_batch so the node's token columns follow the batch order; in the last block only the
tokens that request logits remain, so those nodes get the output rows of the mask. After every decode
`check()` verifies that every bank node was masked with a planned shape; otherwise it raises instead
of silently serving unmasked output. A node the plan does not cover is zeroed (no adapter for anyone).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import _native as N
from ..errors import AdapterError, BackendError, LoramuxError, SlotsBusyError
from ..ggml_types import ELEMENT_SIZE
from ..gguf_io import write_adapter
from .adapters import LoRAAdapter
from .bank_masks import Mask, MaskPlan, plan_ubatches
from .factor_stage import FactorTensors, delta_bound_problems
from .model import Context, Model
from .options import BANK_NODE_ACCESS
from .phases import BatchEntry
from .registry import AdapterSet
from .residency import DEFAULT_CACHE_BYTES, LruPolicy, Prefetcher, SlotBlocks, WarmCache
from .slot_copier import SlotCopier
from .slot_memory import SlotMemory

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
VIEW_CACHE_MAX = 4096  # cached node views (a few per graph shape); cleared when exceeded
# Every value of B in the bank stays below this: finite at every instant of a background write (slot_copier.py)
B_LIMIT = np.float32(2.0**127)
SLOT_WAIT_STEPS = 32  # decode steps a request may wait for bank slots before no later request passes it


@dataclass
class _Slot:
    adapter: LoRAAdapter | None = None
    version: int = -1
    refs: int = 0
    pinned: bool = False
    writing: bool = False  # being written on the copier's thread (slot_copier.py): nobody may take it


@dataclass(frozen=True)
class Admission:
    """What `SlotBank.take_slots` decided for one request.

    banked: the request goes through the bank (per-token masks); False: it is served natively, with
    its adapter set in the graph, and `reason` says why. `slots`: the slots it holds (give each back
    with `return_slot` when it finishes). `scales`: per phase, the (slot, mask value) pairs its tokens use.
    """

    banked: bool
    slots: tuple[int, ...] = ()
    scales: tuple[tuple[tuple[int, float], ...], ...] = ()
    reason: str | None = None


class SlotBank:
    """K slots of rank r over every projection of the base model. Engine-thread only."""

    def __init__(self, model: Model, slots: int, rank: int, *, dtype: str = "f32",
                 node_access: str = "auto", cache_bytes: int = DEFAULT_CACHE_BYTES,
                 run: Callable[[Callable[[], None]], None] | None = None, background_writes: bool = False) -> None:
        """`node_access`: how the bank nodes' outputs are masked. "auto": in place when the node's
        buffer is host memory, else by reading and writing only the rows the mask changes
        (ggml_backend_tensor_get/set, e.g. on a GPU or over RPC). "device": always the transfer path
        (to check it on a CPU; it gives the same bits). `cache_bytes` bounds the warm tier
        (engine/residency.py); `run(fn)` runs fn on the engine thread (prefetched blocks are kept
        there; default: at once, on the caller's). `background_writes`: a slot on host memory may be written
        beside running decodes (take_slots' `background`; slot_copier.py)."""
        if slots < 1 or rank < 1:
            raise LoramuxError(f"a slot bank needs slots ≥ 1 and slot_rank ≥ 1 (got {slots}, {rank})")
        if node_access not in BANK_NODE_ACCESS:
            raise LoramuxError(f"bank node_access must be one of {', '.join(BANK_NODE_ACCESS)} (got {node_access!r})")
        self.node_access = node_access
        self.transfers = {"gets": 0, "sets": 0, "rows_read": 0, "rows_written": 0}  # device path only
        self.model, self.K, self.r = model, slots, rank
        self.width = slots * rank
        self.targets = [f"blk.{i}.{p}.weight" for i in range(model.n_layer) for p in PROJECTIONS
                        if f"blk.{i}.{p}.weight" in model.tensor_shapes]
        zeros = {t: (np.zeros((self.width, model.tensor_shapes[t][1]), np.float32),
                     np.zeros((model.tensor_shapes[t][0], self.width), np.float32)) for t in self.targets}
        self._dir = tempfile.TemporaryDirectory(prefix="loramux-bank-")
        path = write_adapter(Path(self._dir.name) / "bank.gguf", model.architecture, zeros, 0.0, dtype=dtype)
        self.adapter = LoRAAdapter(model, path, "__bank__")
        self._facs: dict[str, FactorTensors] = dict(self.adapter.factor_tensors())
        self._a_ptrs = {self._facs[t].a: t for t in self.targets}
        # cb_eval: stop at bank A·x nodes only (the ask test runs for every node of every decode, so
        # it is answered in _native's one-frame trampoline) and mask them in place.
        self.callback = N.MatmulStops(self._a_ptrs, self._on_node)
        self._target_set = frozenset(self.targets)
        self._esize = ELEMENT_SIZE[self._facs[self.targets[0]].type]
        self._store = np.float32 if self._esize == 4 else np.float16
        self.slots = [_Slot() for _ in range(slots)]
        self.recency: LruPolicy[int] = LruPolicy()  # which idle slot a new adapter takes (residency.py)
        self.plan: MaskPlan | None = None
        self._views: dict[tuple[int | None, int | None, int], np.ndarray | None] = {}
        self.writes = 0
        self.memory = SlotMemory(self._facs, self.targets, slots, rank, self._store)
        # host memory: while sequences decode, slot writes run on a thread of their own (slot_copier.py)
        self.copier = SlotCopier(self.memory) if background_writes and self.memory.on_host() else None
        self._failed: dict[int, BackendError] = {}  # adapter uid → its background write's error
        self._pending: dict[int, LoRAAdapter] = {}  # slot → the adapter being written into it
        self.warm = WarmCache(cache_bytes)
        self._run = run or (lambda fn: fn())
        self.prefetcher = Prefetcher(self.warm, self.prepare, self._keep_warm)
        self.unplanned = 0  # bank nodes met with no plan (zeroed); a decode outside decode() did that

    # -- admission -----------------------------------------------------------------------------
    def refusal(self, adapter: LoRAAdapter) -> str | None:
        """Why this adapter cannot live in a slot (it is then served natively), or None if it can."""
        if adapter.max_rank > self.r:
            return f"rank {adapter.max_rank} > slot rank {self.r}"
        outside = [t for t in adapter.targets if t not in self._target_set]
        if outside:
            return f"{len(outside)} targets outside the bank's projections, e.g. {outside[0]}"
        return None

    def eligible(self, adapter: LoRAAdapter) -> bool:
        """Can this adapter live in a slot (every rank ≤ r, every target a bank projection)?"""
        return self.refusal(adapter) is None

    def take_slots(self, sets: Sequence[AdapterSet], *, background: bool = False) -> Admission | None:
        """Decide how a request whose phases use `sets` is served, and take its slots.

        Banked when every adapter fits a slot and there are at most K of them: then every slot is
        taken (written now if needed) or none is, and None means "wait, the slots are busy".
        `background` (sequences are decoding): a slot that needs writing is written on the copier's
        thread instead, and this request waits (None) until it is in; on a device, always now.
        Otherwise an unbanked Admission with the reason. A failed slot write raises (AdapterError when
        the factors do not fit, BackendError when writing failed; both name the adapter); the slots
        taken so far are given back and the failed slot is left empty.
        """
        uniq: dict[int, LoRAAdapter] = {a.uid: a for s in sets for a, _ in s.items}
        if len(uniq) > self.K:
            return Admission(False, reason=f"{len(uniq)} adapters > {self.K} slots")
        for a in uniq.values():
            why = self.refusal(a)
            if why is not None:
                return Admission(False, reason=f"{a.name}: {why}")
        got: dict[int, int] = {}
        try:
            for uid, a in uniq.items():
                k = self.take_slot(a, background=background)
                if k is None:
                    break
                got[uid] = k
        except BaseException:
            for k in got.values():
                self.return_slot(k)
            raise
        if len(got) < len(uniq):
            for k in got.values():
                self.return_slot(k)
            return None
        scales = tuple(tuple((got[a.uid], float(s)) for a, s in st.items) for st in sets)
        return Admission(True, tuple(got.values()), scales)

    # -- slots ---------------------------------------------------------------------------------
    def slot_of(self, adapter: LoRAAdapter) -> int | None:
        for k, s in enumerate(self.slots):
            if s.adapter is adapter and s.version == adapter.version:
                return k
        return None

    def take_slot(self, adapter: LoRAAdapter, *, background: bool = False) -> int | None:
        """A slot holding this adapter's current factors, now in use by one more request (written now if
        needed: an empty idle slot, else the least recently used idle one); None if all are busy, or
        (`background`) while its slot is being written on the copier's thread. Raises the typed error of
        a background write that failed for this adapter."""
        self.collect_writes(wait=not background)
        if (err := self._failed.pop(adapter.uid, None)) is not None:
            raise err
        k = self.slot_of(adapter)
        if k is None:
            if any(s.writing for s in self.slots) and self._writing(adapter):
                return None  # its copy is under way
            idle = [i for i, s in enumerate(self.slots) if s.refs == 0 and not s.pinned and not s.writing]
            empty = [i for i in idle if self.slots[i].adapter is None]
            k = self.recency.victim(empty or idle)
            if k is None:
                return None
            if background and self.copier is not None:
                self._write_behind(k, adapter)
                return None
            self._write(k, adapter)
        self.slots[k].refs += 1
        self.recency.touch(k)
        return k

    def return_slot(self, k: int) -> None:
        """A request that took slot k (`take_slot`) is done with it."""
        self.slots[k].refs = max(0, self.slots[k].refs - 1)

    def pin_slot(self, adapter: LoRAAdapter) -> int:
        """Keep an adapter in a slot for good (never evicted); raises SlotsBusyError when no slot can take it."""
        k = self.take_slot(adapter)
        if k is None:
            raise SlotsBusyError(f"every one of the {self.K} slots is in use; cannot pin {adapter.name!r}",
                                 hint="raise --max-loaded / slots, or unpin an adapter")
        self.slots[k].pinned = True
        self.return_slot(k)
        return k

    def forget(self, adapter: LoRAAdapter) -> None:
        """Drop an unloaded adapter's slots (their contents stay until overwritten; never used again)."""
        for s in self.slots:
            if s.adapter is adapter:
                s.adapter, s.version, s.pinned = None, -1, False
        self._failed.pop(adapter.uid, None)
        self.warm.discard(adapter)

    def in_slots(self) -> list[str]:
        """Names of the adapters a slot holds."""
        return [s.adapter.name for s in self.slots if s.adapter is not None]

    def _blocks(self, adapter: LoRAAdapter) -> SlotBlocks:
        blocks = self.warm.get(adapter)
        if blocks is None:
            blocks = self.prepare(adapter)  # raises before anything changed
            self.warm.put(blocks)
        return blocks

    def _write_behind(self, k: int, adapter: LoRAAdapter) -> None:
        """Start writing `adapter` into slot k on the copier's thread (checked first, here: a bad adapter
        raises now); the slot is empty and taken by nobody until `collect_writes` finds it done."""
        blocks = self._blocks(adapter)
        s = self.slots[k]
        s.adapter, s.version, s.pinned, s.writing = None, -1, False, True
        self._pending[k] = adapter
        self.copier.submit(k, adapter, adapter.version, blocks)  # type: ignore[union-attr]

    def _writing(self, adapter: LoRAAdapter) -> bool:
        return any(a is adapter for a in self._pending.values())

    def collect_writes(self, wait: bool = False) -> None:
        """Take in the background writes that finished (engine thread); `wait`: first wait for all of them.
        A slot whose adapter was unloaded or written in place meanwhile stays empty."""
        if self.copier is None:
            return
        if wait:
            self.copier.wait()
        for done in self.copier.finished():
            s = self.slots[done.k]
            s.writing = False
            self._pending.pop(done.k, None)
            if done.error is not None:
                self._failed[done.adapter.uid] = done.error
            elif not done.adapter.handle.closed and done.adapter.version == done.version:
                s.adapter, s.version = done.adapter, done.version
                self.writes += 1

    def _write(self, k: int, adapter: LoRAAdapter) -> None:
        """Write `adapter` into slot k, all or nothing: checked completely first (or warm: checked when it
        was prepared), then copied in."""
        version = adapter.version
        blocks = self._blocks(adapter)
        s = self.slots[k]
        s.adapter, s.version, s.pinned = None, -1, False  # empty from here until the last tensor is in
        try:
            for t in self.targets:
                self.memory.put(k, t, blocks.blocks.get(t))
        except Exception as e:
            self._clear(k)
            raise BackendError("slot bank write", None, f"writing adapter {adapter.name!r} into slot {k} "
                               f"failed: {e}", hint="the slot was left empty; the request was not served") from e
        s.adapter, s.version = adapter, version
        self.writes += 1

    def prepare(self, adapter: LoRAAdapter, factors: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None
                ) -> SlotBlocks:
        """The adapter's slot blocks (A (r_t, in), B (out, r_t) scaled by the target's alpha/rank), checked.

        Any thread: the live factors are read on the engine thread (between decodes), the rest here.
        `factors`: the adapter's file as parsed, for an adapter as loaded (version 0), so that nothing at
        all runs on the engine thread. Raises AdapterError naming every problem when they cannot go into a slot.
        """
        version = adapter.version
        if factors is not None and version != 0:
            raise LoramuxError(f"adapter {adapter.name!r} was written in place: its file is not its factors")
        facs = factors if factors is not None else adapter.all_factors()  # live: on the engine thread, inline
        problems: list[str] = []
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        with np.errstate(over="ignore", invalid="ignore"):
            for t, (fa, fb) in facs.items():
                if t not in self._target_set:
                    continue
                f = self._facs[t]
                out_dim, in_dim = f.b_shape[0], f.a_shape[1]
                rt = fa.shape[0]
                if rt > self.r or fa.shape != (rt, in_dim) or fb.shape != (out_dim, rt):
                    problems.append(f"{t}: A{fa.shape} B{fb.shape} do not fit a slot of rank {self.r} "
                                    f"(A ({self.r}, {in_dim}) at most)")
                    continue
                a = np.ascontiguousarray(fa, self._store)
                b = np.ascontiguousarray(fb * np.float32(adapter.tensor_scaling(t)), self._store)
                if not (np.isfinite(a).all() and (np.abs(b) < B_LIMIT).all()):
                    problems.append(f"{t}: not finite (or B not below 2^127) in the bank's {np.dtype(self._store).name} "
                                    f"after scaling B by alpha/rank = {adapter.tensor_scaling(t):g}")
                out[t] = (a, b)
        missing = [t for t in facs if t not in self._target_set]
        if missing:
            problems.append(f"{len(missing)} targets outside the bank, e.g. {missing[0]}")
        if factors is None:  # in-place writes may have changed them (a file's were checked at its load)
            problems += delta_bound_problems(facs, adapter.alpha)
        if problems:
            raise AdapterError(str(adapter.path), "cannot be written into a slot of the bank",
                               problems=problems[:5], name=adapter.name,
                               hint="the slot was left empty; serve this adapter without slots")
        return SlotBlocks(adapter.uid, version, adapter.name, out)

    def _clear(self, k: int) -> None:
        """Zero slot k everywhere (best effort, after a failed write: it must hold only finite values)."""
        self.memory.clear(k)

    def _keep_warm(self, adapter: LoRAAdapter, blocks: SlotBlocks) -> None:
        """Keep prefetched blocks, on the engine thread, unless the adapter was unloaded meanwhile (its
        forget() already ran there: nothing would ever drop them)."""
        self._run(lambda: None if adapter.handle.closed else self.warm.put(blocks))

    def warm_from_file(self, adapter: LoRAAdapter, factors: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Make an adapter just loaded (and not yet served) warm from its parsed file, on this thread.
        Nothing happens for an adapter that cannot live in a slot (it is served natively)."""
        if self.refusal(adapter) is None:
            self.warm.put(self.prepare(adapter, factors))

    def prefetch(self, adapters: Sequence[LoRAAdapter]) -> None:
        """Make these adapters warm in the background unless they are in a slot or warm already."""
        for a in adapters:
            if self.slot_of(a) is None and self.refusal(a) is None:
                self.prefetcher.submit(a)

    def _unique(self, sets: Sequence[AdapterSet]) -> list[LoRAAdapter] | None:
        """The distinct adapters of these sets if take_slots() would bank them, else None (served natively)."""
        uniq = list({a.uid: a for s in sets for a, _ in s.items}.values())
        if len(uniq) > self.K or any(self.refusal(a) is not None for a in uniq):
            return None
        return uniq

    def holds_back(self, head: Sequence[AdapterSet], waited_steps: int, sets: Sequence[AdapterSet]) -> bool:
        """No adapter starves: behind a request (`head`, its phases' sets) that waits for slots, a later one
        (`sets`) may not take an idle slot (it could be the one the head needs); once the head waited
        SLOT_WAIT_STEPS decode steps, nothing passes it until it is in (running requests free their slots).
        So it waits at most SLOT_WAIT_STEPS + the longest any request holds its slots (docs/scaling.md)."""
        if not self._can_ever_take(head):
            return False  # it will be refused or served natively: nobody should wait for it
        if waited_steps >= SLOT_WAIT_STEPS:
            return True
        return self._would_write_slots(sets)

    def _would_write_slots(self, sets: Sequence[AdapterSet]) -> bool:
        """Would admitting these sets write at least one slot (take a slot no one holds for them)?"""
        uniq = self._unique(sets)
        return uniq is not None and any(self.slot_of(a) is None for a in uniq)

    def _can_ever_take(self, sets: Sequence[AdapterSet]) -> bool:
        """Banked sets that fit once every running request released its slots (pinned slots stay)."""
        uniq = self._unique(sets)
        if uniq is None:
            return False
        free = sum(1 for s in self.slots if not s.pinned or any(s.adapter is a for a in uniq))
        return len(uniq) <= free

    # -- masks ---------------------------------------------------------------------------------
    def decode(self, ctx: Context, entries: Sequence[BatchEntry]) -> None:
        """Decode ctx's filled batch through the bank: plan the masks, decode, check every node.

        `entries` are the batch's runs of tokens and their (slot, mask value) pairs, in batch order.
        Raises BackendError (after the decode) when a bank node was not masked as planned.
        """
        b, o = ctx.batch, ctx.opts
        scales = token_scales(self, entries)
        ubs = plan_ubatches(b.seq[: b.n], o.n_ubatch, o.kv_unified)
        self.set_plan(scales, b.logits[: b.n] != 0, ubs)
        try:
            ctx.handle.decode(b)
        except BaseException:
            self.plan = None
            raise
        self.check()

    def set_plan(self, token_scales: np.ndarray, out_flags: np.ndarray,
                 ubatches: list[np.ndarray] | None = None) -> None:
        """Masks for the next decode: token_scales (n_tokens, K) in batch order → blocks of width r.

        `out_flags[i]` says batch token i requests logits; `ubatches` (batch indices per ubatch, from
        plan_ubatches) says how llama.cpp will split the batch (default: one ubatch in batch order).
        """
        full = np.repeat(np.asarray(token_scales, np.float32), self.r, axis=1)
        flags = np.asarray(out_flags, bool)
        ubs = ubatches if ubatches is not None else [np.arange(len(full))]
        self.plan = MaskPlan([(Mask(full[u]), Mask(full[u[flags[u]]])) for u in ubs], len(self.targets))

    def _on_node(self, t: int) -> None:
        """After a bank A·x node was computed: mask it in place; never raise (see N.MatmulStops)."""
        try:
            self._mask_node(t)
        except Exception as e:  # noqa: BLE001 - raising here would silently skip the rest of the graph
            if self.plan is not None:
                self.plan.problems.append(f"mask callback failed: {type(e).__name__}: {e}")
            try:
                self._zero_node(t)
            except Exception:  # noqa: BLE001 - check() fails this decode's requests either way
                pass

    def _mask_node(self, t: int) -> None:
        n_tok = N.node_ne1(t)
        plan = self.plan
        if plan is None:  # nobody planned this decode: no adapter for anyone
            self.unplanned += 1
            self._zero_node(t)
            return
        u = plan.masked // plan.per_ubatch
        plan.masked += 1
        if u >= len(plan.ubatches):
            plan.problems.append("more bank nodes than planned ubatches")
            self._zero_node(t)
            return
        full, out = plan.ubatches[u]
        mask = full if n_tok == full.values.shape[0] else out if n_tok == out.values.shape[0] else None
        if mask is None:
            plan.problems.append(f"node with {n_tok} tokens matches neither {full.values.shape[0]} "
                                 f"nor {out.values.shape[0]}")
            self._zero_node(t)
            return
        view = self._node_view(t, n_tok)
        if view is not None:
            mask.apply(view)  # CPU: mask the node's output where it lies, no copies
        else:
            self._mask_by_transfer(t, mask)

    def _mask_by_transfer(self, t: int, mask: Mask) -> None:
        """Mask a node that is not host-visible: move only the rows the mask changes, a run per call."""
        row_bytes = self.width * 4  # a matmul output: contiguous F32 rows of K·r values, one per token
        for r0, r1, read in mask.segments():
            if read:
                data = N.tensor_get(t, np.empty((r1 - r0, self.width), np.float32), offset=r0 * row_bytes)
                mask.apply_rows(data, r0, r1)
                self.transfers["gets"] += 1
                self.transfers["rows_read"] += r1 - r0
            else:
                data = np.zeros((r1 - r0, self.width), np.float32)
            N.tensor_set(t, data, offset=r0 * row_bytes)
            self.transfers["sets"] += 1
            self.transfers["rows_written"] += r1 - r0

    def _zero_node(self, t: int) -> None:
        n_tok = N.node_ne1(t)
        view = self._node_view(t, n_tok)
        if view is not None:
            view.fill(0.0)
        else:
            N.tensor_set(t, np.zeros((n_tok, self.width), np.float32))

    def _node_view(self, t: int, n_tok: int) -> np.ndarray | None:
        """The node's host memory as (n_tok, width) floats; None off the host. Cached per memory place:
        llama.cpp reuses the same compute-buffer addresses for every decode of a graph shape, and
        the key (data address, buffer, n_tok) names memory the node occupies right now."""
        if self.node_access == "device":
            return None
        key = (*N.node_place(t), n_tok)
        try:
            return self._views[key]
        except KeyError:
            if len(self._views) >= VIEW_CACHE_MAX:
                self._views.clear()
            view = self._views[key] = N.host_f32_view(t, (n_tok, self.width))
            return view

    def check(self) -> None:
        """After a decode: every bank node was masked with a planned shape, or raise."""
        plan, self.plan = self.plan, None
        if plan is None:
            return
        want = plan.per_ubatch * len(plan.ubatches)
        if plan.problems or plan.masked != want:
            raise BackendError("slot bank masks", None,
                               f"masked {plan.masked} of {want} bank nodes; "
                               + "; ".join(plan.problems[:3]),
                               hint="llama.cpp's graph no longer matches the bank plan; serve without slots")

    def close(self) -> None:
        if self.copier is not None:
            self.copier.close()
        self.prefetcher.close()
        self.memory.close()
        self.adapter.close()
        self._dir.cleanup()


def bank_info(bank: SlotBank | None, adapter: LoRAAdapter | None) -> dict[str, bool | str | None]:
    """What an adapter listing shows about the bank: {"banked": whether the adapter fits a slot,
    "bank_reason": why not (it is then served natively, by adapter-set groups)}; {} without an adapter."""
    if adapter is None:
        return {}
    if bank is None:
        return {"banked": False, "bank_reason": "no slot bank (slots = 0)"}
    why = bank.refusal(adapter)
    return {"banked": why is None, "bank_reason": why}


def token_scales(bank: SlotBank, entries: Sequence[BatchEntry]) -> np.ndarray:
    """Rows of per-slot mask values, one per token, from the batch's entries in batch order."""
    rows = []
    for n, pairs in entries:
        row = np.zeros(bank.K, np.float32)
        for k, s in pairs:
            row[k] += s
        rows.append(np.broadcast_to(row, (n, bank.K)))
    return np.concatenate(rows) if rows else np.zeros((0, bank.K), np.float32)


__all__ = ["B_LIMIT", "SLOT_WAIT_STEPS", "Admission", "SlotBank", "bank_info", "token_scales"]
