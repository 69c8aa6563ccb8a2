"""Where the time of one zeroth-order update goes: factor writes vs forward passes, in place vs reload.

Runs the same SPSA training loop (same seed, same batches, same z) twice on one engine, in lockstep
(one update of each in turn, so a change in machine load hits both alike):

- in place: every factor write is `LoRAAdapter.set_factors_multi` into the live tensors;
- reload:   every factor write rewrites the adapter GGUF and re-loads it under the same name
            (`Engine.load_lora`: validate, llama_adapter_lora_init, tensor discovery, swap).

Each update does three writes (θ+εz, θ−εz, θ−lr·g·z) and two batch losses. Prints the median
per-update split, the write share and the reload/in-place ratio, and checks that both paths give
the same loss sequence to the last digit (an in-place write is bit-identical to a fresh load).

    python benchmarks/zo_step.py                       # Gemma 3 270M Q4_K_M, the captain data
    python benchmarks/zo_step.py --steps 12 --batch 2 --threads 2 --rank 8 --targets attn_q,attn_v
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "examples" / "data" / "captain_train.jsonl"


def make_reload_trainer(base: type, tmpdir: Path) -> type:
    """A ZOTrainer whose writes go through a GGUF rewrite + reload instead of in-place writes."""
    from loramux.gguf_io import write_adapter

    class ReloadTrainer(base):  # type: ignore[misc, valid-type]
        parts: list[tuple[float, float]] = []  # (GGUF write, load_lora) seconds of every write

        def _write(self, factors: dict) -> None:
            t0 = time.perf_counter()
            path = tmpdir / f"{self.name}.gguf"
            write_adapter(path, self.engine.model.architecture, factors, self.cfg.alpha, dtype="f32",
                          name=self.name)
            t1 = time.perf_counter()
            self.adapter = self.engine.load_lora(path, name=self.name)  # same name: replaces it
            t2 = time.perf_counter()
            self.parts.append((t1 - t0, t2 - t1))
            self.timing["write"] += t2 - t0

    return ReloadTrainer


def run_both(engine, examples, cfg, trainers: dict[str, type], steps: int, warmup: int) -> dict[str, list[dict]]:
    """Step the trainers in lockstep (one update each, in turn), so load changes hit both alike."""
    from loramux.train.zo import init_factors, target_shapes

    runs = {}
    for name, cls in trainers.items():
        tr = cls(engine, examples, [], Path(f"/nonexistent/{name}.gguf"), cfg, name)
        tr.start(init_factors(target_shapes(engine.model, cfg.targets), cfg.rank, cfg.seed))
        runs[name] = tr
    rows: dict[str, list[dict]] = {name: [] for name in runs}
    for _ in range(warmup + steps):
        for name, tr in runs.items():
            rows[name].append(tr.do_step())
    for name in runs:
        engine.remove_lora(name)
    return {name: r[warmup:] for name, r in rows.items()}


def median_ms(rows: list[dict], key: str) -> float:
    return 1e3 * statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="base GGUF (default: embedded Gemma 3 270M Q4_K_M)")
    ap.add_argument("--data", default=str(DATA), help="JSONL training data (default: the captain example)")
    ap.add_argument("--steps", type=int, default=10, help="measured updates per path (default 10)")
    ap.add_argument("--warmup", type=int, default=1, help="updates run first and not measured (default 1)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="attn_q,attn_v")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=512)
    args = ap.parse_args(argv)

    import loramux as lm
    from loramux.train.data import load_examples
    from loramux.train.zo import ZOConfig, ZOTrainer

    cfg = ZOConfig(rank=args.rank, targets=tuple(args.targets.split(",")), batch=args.batch, seed=0).validate()
    eng = lm.Engine.load(args.model, n_ctx=args.n_ctx, n_threads=args.threads)
    try:
        examples = load_examples(eng, args.data)
        n_tok = sum(len(e.tokens) for e in examples) / len(examples)
        n_params = sum(a * b for a, b in _param_shapes(cfg, eng))
        with tempfile.TemporaryDirectory(prefix="zo-bench-") as tmp:
            t0 = time.perf_counter()
            reload_cls = make_reload_trainer(ZOTrainer, Path(tmp))
            rows = run_both(eng, examples, cfg, {"bench_inplace": ZOTrainer, "bench_reload": reload_cls},
                            args.steps, args.warmup)
            wall = time.perf_counter() - t0
        inplace, reload = rows["bench_inplace"], rows["bench_reload"]
        parts = reload_cls.parts[3 * args.warmup:]
    finally:
        eng.close()

    same = [r["loss_plus"] for r in inplace] == [r["loss_plus"] for r in reload] and \
        [r["loss_minus"] for r in inplace] == [r["loss_minus"] for r in reload]
    print(f"model {eng.model.name}, {args.threads} threads; rank {cfg.rank} on {','.join(cfg.targets)} "
          f"({n_params:,} parameters); batch {cfg.batch} × {n_tok:.0f} tokens on average; "
          f"{args.steps} measured updates per path (medians, ms per update: 3 writes + 2 batch losses)")
    print(f"{'':<22}{'in place':>12}{'reload':>12}{'reload / in place':>20}")
    for label, key in (("factor writes (3)", "write_s"), ("forward passes (2)", "forward_s"),
                       ("noise + arithmetic", "other_s"), ("whole update", "step_s")):
        a, b = median_ms(inplace, key), median_ms(reload, key)
        print(f"{label:<22}{a:>12.2f}{b:>12.2f}{b / a:>19.1f}×")
    for label, rows in (("in place", inplace), ("reload", reload)):
        share = statistics.median(r["write_s"] / r["step_s"] for r in rows)
        print(f"write share of the update, {label}: {100 * share:.2f} %")
    gguf = 1e3 * statistics.median(p[0] for p in parts)
    load = 1e3 * statistics.median(p[1] for p in parts)
    print(f"one reload write: GGUF rewrite {gguf:.2f} ms + load_lora {load:.2f} ms (medians); one in-place write: "
          f"{median_ms(inplace, 'write_s') / 3:.2f} ms")
    print(f"wall {wall:.1f} s (both paths in lockstep); identical loss sequences on both paths: "
          f"{'yes' if same else 'NO'}")
    return 0 if same else 1


def _param_shapes(cfg, eng) -> list[tuple[int, int]]:
    from loramux.train.zo import target_shapes

    out = []
    for o, i in target_shapes(eng.model, cfg.targets).values():
        out += [(cfg.rank, i), (o, cfg.rank)]
    return out


if __name__ == "__main__":
    sys.exit(main())
