"""One decode step of 8 sequences on 4 adapters: slot bank vs group rotation vs the base model.

What the serving benchmark's aggregate tokens/s is made of, measured side by side in one process
on the same llama.cpp build, so the bank's gain and its ceiling on this machine can be read off:

- base:          8 sequences, 1 token each, no adapter (no bank can be cheaper than this);
- one adapter:   the same step with every sequence on one native rank-r adapter;
- slot bank:     the 8 sequences spread over 4 adapters in a K=4 bank (per-token masks);
- masks by row transfer: the same, with the masks moved through ggml_backend_tensor_get/set of the
                 rows they change (the path for node outputs off the host: a GPU, RPC), forced on the CPU;
- masks + KV guard: the same, with the KV guard on (the graph also stops at every K/V cache write
                 to check it; loramux arms it only for decodes with an adapter set whose bound could
                 overflow the cache, see docs/server.md, "Numeric safety": this row is its cost);
- bank, no masks: the bank in the graph without the eval callback (output wrong; it splits the
                 bank's cost into its wider factors and its masks);
- one adapter on the bank's context: the one-adapter step natively on a context created with the
                 bank's eval callback (what loramux serve does when every token of a decode uses one
                 adapter set): as served (the callback taken off llama.cpp's scheduler for the decode)
                 and with the callback left on (ggml then asks it about every graph node);
- rotation:      what llama-server does with 4 adapter sets: 4 steps of 2 sequences, switching the
                 context's adapter before each (the switch is part of the cost).

- no switch:     the same four 2-sequence steps on one adapter (a rotation that serves each group
                 in long runs and so almost never pays a switch; llama-server drifts towards this
                 by letting some requests wait).

A second part times the prefill of 8 prompts over the 4 adapters: one shared batch through the
bank (masked; what loramux serve does), the same prompts in 4 batches grouped by adapter through
the bank, rotation with native adapters, and the base model in one batch.

Rotation / base is the most any bank can gain over group rotation here: it is the speed-up of a
bank that costs nothing. The ratio depends on how well the CPU batches tokens (an 8-token step
costs 8 times a 1-token step's arithmetic in the output head and every projection).

    python benchmarks/bank_step.py --repeats 40
    python benchmarks/bank_step.py --callback-only --repeats 60   # the eval callback's cost alone
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import (
    common_args,
    dump_json,
    machine_info,
    median,
    model_path,
    print_machine,
    print_table,
    projection_shapes,
    write_random_adapter,
)

N_SEQ, N_ADAPTERS = 8, 4
PROMPT = "Write a short story about a lighthouse keeper who lived alone by the sea for forty years"


class System:
    """One context and the way it runs a decode step of every sequence at position `pos`."""

    def __init__(self, label: str, ctx: Any, step: Callable[[Any, int, int], None]) -> None:
        self.label, self.ctx, self._step = label, ctx, step
        self.times: list[float] = []

    def run(self, pos: int, it: int) -> None:
        t0 = time.perf_counter()
        self._step(self.ctx, pos, it)
        self.times.append(time.perf_counter() - t0)


def build(args: argparse.Namespace, work: Path) -> tuple[list[System], list[System], Any]:
    from loramux.engine.adapters import LoRAAdapter
    from loramux.engine.bank import SlotBank, token_scales
    from loramux.engine.bank_masks import plan_ubatches
    from loramux.engine.kv_guard import KvGuard
    from loramux.engine.model import Context, ContextOptions, Model
    from loramux.gguf_io import read_header

    path = model_path(args.model)
    model = Model(path)
    shapes = projection_shapes(path)
    arch = read_header(path).architecture or "?"
    adapters = [LoRAAdapter(model, write_random_adapter(work / f"a{k}.gguf", arch, shapes, args.rank, 100 + k),
                            f"a{k}") for k in range(N_ADAPTERS)]
    bank = SlotBank(model, N_ADAPTERS, args.slot_rank or args.rank)
    slot = [bank.take_slot(a) for a in adapters]
    prompt = model.tokenize(PROMPT)
    opts = ContextOptions(n_ctx=args.n_ctx * N_SEQ, n_batch=512, n_ubatch=512, n_seq_max=N_SEQ,
                          n_threads=args.threads, kv_unified=True, flash_attn=args.flash_attn)

    every = [list(range(N_SEQ))]
    by_adapter = [[s for s in range(N_SEQ) if s % N_ADAPTERS == k] for k in range(N_ADAPTERS)]

    guard = KvGuard(model, bank.callback, "f16")
    guarded = [False]
    asks = [True]  # False: the decode runs without the context's eval callback (ContextHandle.decode)

    def decode(ctx: Any, seqs: list[int], n_tok: int, mask: bool) -> None:
        """Decode the filled batch (n_tok tokens for each of `seqs`), masked through the bank if asked."""
        b = ctx.batch
        if mask:
            scales = token_scales(bank, [(n_tok, [(slot[s % N_ADAPTERS], 1.0)])
                                         for s in seqs])
            bank.set_plan(scales, b.logits[: b.n] != 0, plan_ubatches(b.seq[: b.n], b.capacity, True))
        if guarded[0]:
            guard.arm(b.n)
        try:
            ctx.handle.decode(b, eval_callback=asks[0])
        finally:
            if guarded[0] and len(guard.disarm()):
                raise SystemExit("error: the KV guard zeroed tokens of ordinary adapters")
        if mask:
            bank.check()

    def run(ctx: Any, groups: list[list[int]], mask: bool, switch: bool, fill: Callable[[Any, list[int]], int]
            ) -> None:
        """One decode per group of sequences (switching to group k's adapter first if asked)."""
        for k, seqs in enumerate(groups):
            if switch:
                ctx.handle.set_adapters([adapters[k].handle], [1.0])
            ctx.batch.clear()
            decode(ctx, seqs, fill(ctx, seqs), mask)

    def step(groups: list[list[int]], mask: bool = False, switch: bool = False) -> Callable[[Any, int, int], None]:
        def one_token_each(ctx: Any, pos: int, it: int) -> None:
            def fill(c: Any, seqs: list[int]) -> int:
                for s in seqs:
                    c.batch.add([prompt[(it + s) % len(prompt)]], pos, s, True)
                return 1
            run(ctx, groups, mask, switch, fill)
        return one_token_each

    def by_transfer(fn: Callable[[Any, int, int], None]) -> Callable[[Any, int, int], None]:
        """The same step with the masks applied the way a GPU or RPC node needs (tensor get/set of the rows)."""
        def device(ctx: Any, pos: int, it: int) -> None:
            bank.node_access = "device"
            try:
                fn(ctx, pos, it)
            finally:
                bank.node_access = "auto"
        return device

    def with_guard(fn: Callable[[Any, int, int], None]) -> Callable[[Any, int, int], None]:
        """The same step with the KV guard checking every K/V write."""
        def checked(ctx: Any, pos: int, it: int) -> None:
            guarded[0] = True
            try:
                fn(ctx, pos, it)
            finally:
                guarded[0] = False
        return checked

    def without_callback(fn: Callable[[Any, int, int], None]) -> Callable[[Any, int, int], None]:
        """The same step with the eval callback off llama.cpp's scheduler (a native decode as served)."""
        def lean(ctx: Any, pos: int, it: int) -> None:
            asks[0] = False
            try:
                fn(ctx, pos, it)
            finally:
                asks[0] = True
        return lean

    systems = []
    for label, cb, loras, fn in [
        ("base (no adapter)", None, [], step(every)),
        (f"one adapter (native rank {args.rank})", None, [adapters[0]], step(every)),
        (f"slot bank K={N_ADAPTERS}×r{bank.r}, masks", bank.callback, [bank.adapter], step(every, mask=True)),
        ("slot bank, masks by row transfer", bank.callback, [bank.adapter], by_transfer(step(every, mask=True))),
        ("slot bank, masks + KV guard", bank.callback, [bank.adapter], with_guard(step(every, mask=True))),
        ("slot bank, no masks (cost split only)", None, [bank.adapter], step(every)),
        ("rotation: 4 sets × 2 sequences", None, [adapters[0]], step(by_adapter, switch=True)),
        ("4 × 2 sequences, no adapter switch", None, [adapters[0]], step(by_adapter)),
        ("one adapter on the bank's context, callback on", bank.callback, [adapters[0]], step(every)),
        ("one adapter on the bank's context, as served", bank.callback, [adapters[0]],
         without_callback(step(every))),
    ]:
        ctx = Context(model, opts, callback=cb)
        ctx.handle.set_adapters([a.handle for a in loras], [1.0] * len(loras))
        systems.append(System(label, ctx, fn))

    # Prefill of N_SEQ prompts (run after the decode steps: it clears the contexts' KV caches)
    ptoks = (prompt * (args.prompt_len // len(prompt) + 1))[: args.prompt_len]

    def prompts(ctx: Any, seqs: list[int]) -> int:
        for s in seqs:
            ctx.batch.add(ptoks, 0, s, [False] * (len(ptoks) - 1) + [True])
        return len(ptoks)

    def prefill_with(groups: list[list[int]], mask: bool, switch: bool) -> Callable[[Any, int, int], None]:
        def all_prompts(ctx: Any, _pos: int, _it: int) -> None:
            ctx.clear()
            run(ctx, groups, mask, switch, prompts)
        return all_prompts

    base_ctx, bank_ctx, rot_ctx = systems[0].ctx, systems[2].ctx, systems[6].ctx
    fills = [System("base, one shared batch", base_ctx, prefill_with(every, False, False)),
             System("slot bank, one shared batch (masked)", bank_ctx, prefill_with(every, True, False)),
             System(f"slot bank, {N_ADAPTERS} batches grouped by adapter", bank_ctx,
                    prefill_with(by_adapter, True, False)),
             System(f"rotation: {N_ADAPTERS} batches, switching adapters", rot_ctx,
                    prefill_with(by_adapter, False, True))]
    return systems, fills, (model, bank, adapters)


def prefill(systems: list[System], n: int) -> None:
    """Fill every context's KV cache with n positions per sequence (the step is then measured at n, n+1, …)."""
    for sys_ in systems:
        for pos in range(n):
            sys_.run(pos, pos)
        sys_.times.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, repeats=40)  # --repeats N: N interleaved decode steps per system
    ap.add_argument("--rank", type=int, default=8, help="adapter rank and bank slot rank (default 8)")
    ap.add_argument("--slot-rank", type=int, default=None,
                    help="bank slot rank (default: --rank; loramux serve's default is 16)")
    ap.add_argument("--n-ctx", type=int, default=512, help="KV cells per sequence (default 512)")
    ap.add_argument("--context", type=int, default=16, help="positions decoded before timing (default 16)")
    ap.add_argument("--flash-attn", action="store_true", help="flash attention on in every context")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence in the prefill part "
                    "(default 32; at most 64)")
    ap.add_argument("--callback-only", action="store_true",
                    help="only the native one-adapter step on the bank's context, eval callback on vs as served")
    ap.add_argument("--prefill-repeats", type=int, default=10, help="interleaved prefills per system (default 10)")
    args = ap.parse_args()
    if not 1 <= args.prompt_len <= 512 // N_SEQ:
        raise SystemExit(f"error: --prompt-len must be 1–{512 // N_SEQ} (8 prompts share one 512-token batch)")
    if args.context + args.repeats + 1 > args.n_ctx:
        raise SystemExit(f"error: --context + --repeats must stay below --n-ctx ({args.n_ctx})")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="loramux-bank-step-"))
    work.mkdir(parents=True, exist_ok=True)
    info = machine_info(args.threads)
    print_machine(info)
    systems, fills, keep = build(args, work)
    if args.callback_only:  # the two eval-callback rows alone (no prefill part)
        systems, fills = [s for s in systems if "bank's context" in s.label], []
    prefill(systems, args.context)
    for it in range(args.repeats):  # interleaved: each round runs one step of every system
        for s in systems:
            s.run(args.context + it, it)
        print(f"\rstep {it + 1}/{args.repeats}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for it in range(args.prefill_repeats + 1 if fills else 0):  # the first round only warms up (graph reserve)
        for f in fills:
            f.run(0, it)
            if it == 0:
                f.times.clear()
    if args.callback_only:
        report_callback(systems, args)
    else:
        report(systems, args)
        report_prefill(fills, args)
    dump_json(args.json, {"machine": info, "args": vars(args),
                          "steps_s": {s.label: s.times for s in systems},
                          "prefill_s": {f.label: f.times for f in fills}})
    del keep


def report(systems: list[System], args: argparse.Namespace) -> None:
    med = {s.label: median(s.times) for s in systems}
    base, one, bank, transfer, guarded, unmasked, rot, groups, asked, lean = (med[s.label] for s in systems)
    rows = [[s.label, f"{med[s.label] * 1e3:.1f}", f"{N_SEQ / med[s.label]:.0f}",
             f"{rot / med[s.label]:.2f}×", f"{one / med[s.label]:.2f}×"] for s in systems]
    print_table(f"one decode step of {N_SEQ} sequences ({N_ADAPTERS} adapters of rank {args.rank}, "
                f"{args.threads} threads, median of {args.repeats} interleaved steps)",
                ["system", "step ms", "tokens/s", "speed vs rotation", "speed vs one adapter"], rows)
    print(f"\nslot bank vs rotation: {rot / bank:.2f}×; bank keeps {one / bank:.2f} of one-adapter speed")
    print(f"ceiling for any bank (a bank that costs nothing = the base step): {rot / base:.2f}× a rotation that "
          f"switches every step, {groups / base:.2f}× one that never pays a switch (groups served in long runs)")
    print(f"bank overhead over the base step: {(bank - base) * 1e3:.1f} ms (wider factors "
          f"{(unmasked - base) * 1e3:.1f} ms, masks {(bank - unmasked) * 1e3:.1f} ms); "
          f"native rank {args.rank}: {(one - base) * 1e3:.1f} ms")
    print(f"masks by row transfer (the GPU/RPC path, forced here): {bank / transfer:.2f}× the speed of masking "
          f"in place ({(transfer - bank) * 1e3:+.2f} ms a step)")
    print(f"KV guard (stops at every K/V write; only for decodes with a risky adapter set): {bank / guarded:.2f}× "
          f"the speed of the bank without it ({(guarded - bank) * 1e3:+.2f} ms a step)")
    print(f"one adapter natively on the bank's context: as served (no eval callback) {asked / lean:.3f}× the "
          f"speed of the callback left on ({(asked - lean) * 1e3:+.2f} ms a step); {one / lean:.3f}× the "
          f"speed of a context without one")


def report_callback(systems: list[System], args: argparse.Namespace) -> None:
    """--callback-only: a native one-adapter step on the bank's context, callback left on vs as served."""
    asked, lean = (median(s.times) for s in systems)
    print_table(f"one decode step of {N_SEQ} sequences on one native adapter, on a context with the bank's eval "
                f"callback ({args.threads} threads, median of {args.repeats} interleaved steps)",
                ["system", "step ms", "tokens/s"],
                [[s.label, f"{median(s.times) * 1e3:.2f}", f"{N_SEQ / median(s.times):.1f}"] for s in systems])
    print(f"\nas served (callback off the scheduler): {asked / lean:.3f}× the speed of the callback left on "
          f"({(asked - lean) * 1e3:+.2f} ms a step)")


def report_prefill(fills: list[System], args: argparse.Namespace) -> None:
    med = {f.label: median(f.times) for f in fills}
    shared, grouped, rot = (med[f.label] for f in fills[1:])
    n_tok = N_SEQ * args.prompt_len
    rows = [[f.label, f"{med[f.label] * 1e3:.0f}", f"{n_tok / med[f.label]:.0f}", f"{rot / med[f.label]:.2f}×"]
            for f in fills]
    print_table(f"prefill of {N_SEQ} prompts × {args.prompt_len} tokens over {N_ADAPTERS} adapters "
                f"(median of {args.prefill_repeats})", ["system", "ms", "tokens/s", "speed vs rotation"], rows)
    print(f"\nprefill policy: one shared masked batch is {grouped / shared:.2f}× as fast as the same prompts "
          f"grouped by adapter through the bank, {rot / shared:.2f}× rotation")


if __name__ == "__main__":
    main()
