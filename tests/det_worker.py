"""Run in a fresh process (ggml reads its kernel switches once per process): solo vs concurrent requests.

Prints one JSON line: how many texts and logit rows are identical between solo and batched runs, and
how many decode calls each took (with how many of the batched ones held several sequences).
Usage: python det_worker.py MODEL deterministic(0|1) slots ADAPTER...
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np

import loramux as lm
from loramux import _native as N
from loramux.engine.model import Context, ContextOptions


def main() -> None:
    model, det, slots, adapters = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4:]
    eng = lm.Engine.load(model, n_ctx=1024, n_parallel=8, n_batch=256, n_threads=2, deterministic=det,
                         slots=slots, slot_rank=8, loras=[lm.LoraSpec(a, 0.0) for a in adapters])
    names = list(eng.adapters)
    sets = [{}] + [{n: 1.0} for n in names] + ([{names[0]: 0.5, names[-1]: 0.5}] if names else [])
    long_text = "The history of the river valley is long and full of change. " * 12
    prompts = [f"Question {i}: tell me about {w}." for i, w in enumerate(
        ["cats", "rivers", "the moon", "bread", "music", "trains", "snow", "gardens", "maps", "clocks",
         "bees", "ships"])][:10] + [long_text + f" Part {i}." for i in range(2)]
    jobs = [(p, sets[i % len(sets)]) for i, p in enumerate(prompts)]
    s0 = eng.stats()
    solo = [eng.generate(p, loras=s, max_tokens=16, ignore_eos=True).text for p, s in jobs]
    s1 = eng.stats()
    out: list[str | None] = [None] * len(jobs)

    def run(i: int, delay: float) -> None:
        time.sleep(delay)
        out[i] = eng.generate(jobs[i][0], loras=jobs[i][1], max_tokens=16, ignore_eos=True).text
    threads = [threading.Thread(target=run, args=(i, 0.05 * (i % 5))) for i in range(len(jobs))]
    [t.start() for t in threads]
    [t.join(timeout=480) for t in threads]
    assert not any(t.is_alive() for t in threads), "a request did not finish within 600 s"
    s2 = eng.stats()
    same_text = sum(a == b for a, b in zip(solo, out))
    base_jobs = [i for i, (_, s) in enumerate(jobs) if not s]
    same_base = sum(solo[i] == out[i] for i in base_jobs)
    rows = logits_rows(eng, [p for p, _ in jobs[8:]] + [p for p, _ in jobs[:4]])
    eng.close()
    print(json.dumps({"texts": len(jobs), "same_text": same_text, "rows": rows[1], "same_rows": rows[0],
                      "base_texts": len(base_jobs), "same_base_text": same_base,
                      # decode calls for the requests one at a time vs all at once, and how many of the
                      # latter held tokens of several sequences (shared steps, not serialized ones)
                      "solo_steps": s1.decode_steps - s0.decode_steps,
                      "batched_steps": s2.decode_steps - s1.decode_steps,
                      "multi_seq_steps": s2.multi_seq_steps - s1.multi_seq_steps,
                      "llamafile": "LLAMAFILE = 1" in N.system_info()}))


def logits_rows(eng: lm.Engine, prompts: list[str]) -> tuple[int, int]:
    """Engine-level: per-sequence logits, 8 sequences alone vs batched, over a prefill and 6 steps."""
    toks = [eng.tokenize(p) for p in prompts]
    o = eng.ctx.opts

    def run(batched: bool) -> list[list[np.ndarray]]:
        ctx = Context(eng.model, ContextOptions(n_ctx=o.n_ctx, n_batch=2048, n_ubatch=o.n_ubatch,
                                                n_seq_max=8, n_threads=2, kv_unified=o.kv_unified))
        rows: list[list[np.ndarray]] = [[] for _ in toks]
        try:
            for group in ([list(range(len(toks)))] if batched else [[i] for i in range(len(toks))]):
                pending = {}
                for i in group:  # prompts are prefilled one at a time, as the deterministic scheduler does
                    ctx.batch.clear()
                    ctx.batch.add(toks[i], 0, i, [False] * (len(toks[i]) - 1) + [True])
                    ctx.handle.decode(ctx.batch)
                    rows[i].append(ctx.handle.logits_row(ctx.batch.n - 1))
                    pending[i] = ([int(np.argmax(rows[i][-1]))], len(toks[i]))
                for _ in range(5):
                    ctx.batch.clear()
                    for i, (t, pos) in pending.items():
                        ctx.batch.add(t, pos, i, [False] * (len(t) - 1) + [True])
                    ctx.handle.decode(ctx.batch)
                    idx = np.nonzero(ctx.batch.logits[: ctx.batch.n])[0]
                    for j, i in zip(idx, pending):
                        row = ctx.handle.logits_row(int(j))
                        rows[i].append(row)
                        pending[i] = ([int(np.argmax(row))], pending[i][1] + len(pending[i][0]))
        finally:
            ctx.close()
        return rows
    a, b = eng.call(lambda: run(False)), eng.call(lambda: run(True))
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(np.array_equal(x, y) for x, y in pairs), len(pairs)


if __name__ == "__main__":
    main()
