"""Cost of updating an adapter's factors: in place vs rewrite-the-file-and-reload.

    python benchmarks/inplace.py [--repeats 15] [--ranks 2,16,64] [--banks 1,4,13] [--threads 2]

Part 1, one adapter of rank r over all 7 projections of every block of the model, new random
factors every update:

- in-place API: `LoRAAdapter.set_factors_multi` over every factor: each array copied into the
  adapter's staging mirror, one finiteness check, one `engine.call` hop to the engine thread, one
  memcpy of the mirror into the adapter's host buffer (per-tensor `ggml_backend_tensor_set` on a GPU);
- in-place API, just computed: the same call with factors computed right before it (a step
  along a random direction, as a trainer or an editor makes them); the plain "in-place API"
  column writes arrays made long before, after a decode has flushed the caches;
- edit(): `with adapter.edit() as views:` with the new factors computed straight into the views
  (theta + step * direction, `np.add(..., out=view)`); timed: entering the block plus leaving it
  (one finiteness check over the staging copy, one memcpy into the adapter's buffer). The
  computation inside the block is the caller's own work and is not timed;
- per-tensor set: the `_native.tensor_set` calls alone, from pre-encoded arrays (what writing
  tensor by tensor costs before any validation: the floor of a per-tensor design);
- hop: an empty `engine.call` (what the thread hop alone costs);
- reload: `write_adapter` (GGUF to disk) + `Engine.load_lora` under the same name (validates the
  file, `llama_adapter_lora_init`, finds the tensors, replaces and frees the old adapter);
- raw reload: `write_adapter` + bare `llama_adapter_lora_init` (+ free), what a plain llama.cpp
  program pays at least, without loramux's validation and tensor discovery;
- next-decode extra: a 1-token request (`Engine.generate`, max_tokens 1) right after the update
  minus one without update (a reloaded adapter is a new set: llama.cpp re-reserves its graph).

Part 2, a bank of K rank-2 stages where only the newest changes per update:

- in place: K separate rank-2 adapters applied together; an update writes only the newest one;
- reload: one adapter file holding all stages rank-concatenated (rank 2K, the realistic bank
  file); every update rewrites and reloads the whole file.

Medians over `--repeats`; all timings in milliseconds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402 - benchmarks/ is not a package

Factors = dict[str, tuple[np.ndarray, np.ndarray]]


class Bench:
    """One engine on the base model and the operations being timed."""

    def __init__(self, model: Path, args: argparse.Namespace, work: Path) -> None:
        from loramux import Engine
        from loramux.gguf_io import read_header

        self.eng = Engine.load(model, n_ctx=args.n_ctx, n_threads=args.threads)
        self.arch = read_header(model).architecture or "llama"
        self.shapes = C.projection_shapes(model)
        self.work = work
        self.bos = self.eng.model.handle.bos

    # -- operations ----------------------------------------------------------------------------
    def decode_ms(self, loras: Mapping[str, float]) -> float:
        """Wall time of a 1-token request under `loras` (prompt: BOS; one decode, one sample)."""
        return 1e3 * C.timed(lambda: self.eng.generate([self.bos], loras=dict(loras), max_tokens=1,
                                                         temperature=0.0, ignore_eos=True))

    def steady_decode_ms(self, loras: Mapping[str, float]) -> float:
        """A 1-token decode after one under the same set (so no graph re-reserve is included)."""
        self.decode_ms(loras)
        return self.decode_ms(loras)

    def load(self, name: str, factors: Factors, rank: int) -> Any:
        path = self.write(name, factors, rank)
        return self.eng.load_lora(path, name=name)

    def write(self, name: str, factors: Factors, rank: int) -> Path:
        from loramux.gguf_io import write_adapter

        return write_adapter(self.work / f"{name}.gguf", self.arch, factors, float(rank), dtype="f32")

    def raw_writer(self, adapter: Any, factors: Factors) -> Callable[[], None]:
        """The bare tensor_set calls for `factors` (pre-encoded float32), run on the caller thread.

        Uses the adapter's discovered tensor pointers (private `_factors`): the floor of a design
        that writes tensor by tensor, before validation or a thread hop. The engine is idle meanwhile.
        """
        from loramux import _native as N

        jobs = []
        for name, (a, b) in factors.items():
            f = adapter._factors[name]
            jobs.append((f.a, np.ascontiguousarray(a, np.float32), f.b, np.ascontiguousarray(b, np.float32)))

        def run() -> None:
            for pa, ea, pb, eb in jobs:
                N.tensor_set(pa, ea)
                N.tensor_set(pb, eb)
        return run

    def native_reload_ms(self, path: Path) -> float:
        """llama_adapter_lora_init + free of an adapter file, nothing else."""
        from loramux import _native as N

        def run() -> None:
            h = N.AdapterHandle.load(self.eng.model.handle, str(path))
            h.close()
        return 1e3 * C.timed(lambda: self.eng.call(run))

    def close(self) -> None:
        self.eng.close()


# ----------------------------------------------------------------------------------------------
# Part 1: one adapter, every factor rewritten
# ----------------------------------------------------------------------------------------------

def bench_rank(b: Bench, rank: int, repeats: int) -> dict[str, list[float]]:
    """Samples (ms) of every per-update cost for one rank; in-place and reload interleaved."""
    sets = [C.random_factors(b.shapes, rank, seed=100 * rank + k) for k in range(2)]
    ip = b.load(f"ip{rank}", sets[0], rank)
    b.load(f"rl{rank}", sets[0], rank)
    raw = [b.raw_writer(ip, s) for s in sets]
    ip.set_factors_multi(sets[0])  # the first write creates the staging mirror: not a per-update cost
    # edit() on its own adapter: above the mirror threshold, set_factors_multi writes directly and
    # would leave edit()'s staging copy to be re-read at every update
    ed = b.load(f"ed{rank}", sets[0], rank)
    with ed.edit():
        pass
    on_ip, on_rl = {f"ip{rank}": 1.0}, {f"rl{rank}": 1.0}
    out: dict[str, list[float]] = {k: [] for k in ("api", "raw", "hop", "ip_extra", "write", "load_lora",
                                                 "rl_extra", "native_init", "decode", "api_fresh",
                                                 "edit")}
    direction = C.random_factors(b.shapes, rank, seed=100 * rank + 99)
    for i in C.progress(range(repeats), f"rank {rank}"):
        new = sets[(i + 1) % 2]
        base = b.steady_decode_ms(on_ip)
        out["api"].append(1e3 * C.timed(lambda: ip.set_factors_multi(new)))  # noqa: B023
        out["ip_extra"].append(b.decode_ms(on_ip) - base)
        out["api_fresh"].append(fresh_update_ms(ip, new, direction, 1e-3 * (i + 1)))
        b.steady_decode_ms({f"ed{rank}": 1.0})
        out["edit"].append(edit_update_ms(ed, new, direction, 1e-3 * (i + 1)))
        out["raw"].append(1e3 * C.timed(raw[(i + 1) % 2]))
        out["hop"].append(1e3 * C.timed(lambda: b.eng.call(lambda: None)))
        out["decode"].append(base)
        base = b.steady_decode_ms(on_rl)
        path: list[Path] = []
        out["write"].append(1e3 * C.timed(lambda: path.append(b.write(f"rl{rank}", new, rank))))  # noqa: B023
        out["load_lora"].append(1e3 * C.timed(lambda: b.eng.load_lora(path[0], name=f"rl{rank}")))  # noqa: B023
        out["rl_extra"].append(b.decode_ms(on_rl) - base)
        out["native_init"].append(b.native_reload_ms(path[0]))
    b.eng.remove_lora(f"ip{rank}")
    b.eng.remove_lora(f"ed{rank}")
    b.eng.remove_lora(f"rl{rank}")
    return out


def fresh_update_ms(adapter: Any, theta: Factors, direction: Factors, step: float) -> float:
    """set_factors_multi with factors computed just before the call (theta + step * direction)."""
    new = {n: (a + step * direction[n][0], b + step * direction[n][1]) for n, (a, b) in theta.items()}
    return 1e3 * C.timed(lambda: adapter.set_factors_multi(new))


def edit_update_ms(adapter: Any, theta: Factors, direction: Factors, step: float) -> float:
    """API cost of `adapter.edit()`: enter + exit, the factors computed into the views in between (untimed)."""
    import time

    cm = adapter.edit()
    t0 = time.perf_counter()
    views = cm.__enter__()
    t1 = time.perf_counter()
    for n, (va, vb) in views.items():
        np.add(theta[n][0], step * direction[n][0], out=va)
        np.add(theta[n][1], step * direction[n][1], out=vb)
    t2 = time.perf_counter()
    cm.__exit__(None, None, None)
    return 1e3 * ((t1 - t0) + (time.perf_counter() - t2))


def rank_rows(results: dict[int, dict[str, list[float]]]) -> list[list[str]]:
    rows = []
    for rank, s in results.items():
        m = {k: C.median(v) for k, v in s.items()}
        reload_total = m["write"] + m["load_lora"] + m["rl_extra"]
        raw_reload = m["write"] + m["native_init"]
        ip_total = m["api"] + max(m["ip_extra"], 0.0)
        rows.append([str(rank), C.fmt(m["api"], 3), C.fmt(m["api_fresh"], 3), C.fmt(m["edit"], 3),
                     C.fmt(m["raw"], 3), C.fmt(m["hop"], 3),
                     C.fmt(m["ip_extra"], 2), C.fmt(m["write"], 1), C.fmt(m["load_lora"], 1),
                     C.fmt(m["rl_extra"], 2), C.fmt(reload_total, 1), C.fmt(raw_reload, 1),
                     C.fmt(C.ratio(reload_total, ip_total), 0, "×"), C.fmt(C.ratio(raw_reload, m["api"]), 0, "×"),
                     C.fmt(m["decode"], 1)])
    return rows


RANK_HEADERS = ["rank", "in-place API", "in-place API, just computed", "edit()", "per-tensor set", "call hop", "decode extra (in-place)",
                "reload: write GGUF", "reload: load_lora", "decode extra (reload)", "reload total",
                "raw reload (write + lora_init)", "reload total / in-place", "raw reload / in-place API",
                "1-token decode"]


# ----------------------------------------------------------------------------------------------
# Part 2: a bank of K rank-2 stages, only the newest changes
# ----------------------------------------------------------------------------------------------

def bench_bank(b: Bench, k: int, repeats: int, stage_rank: int = 2) -> dict[str, list[float]]:
    """In place: K stacked rank-2 adapters, update the newest. Reload: one rank-2K file, rewritten whole."""
    stages = [C.random_factors(b.shapes, stage_rank, seed=7000 + j) for j in range(k)]
    newest = [C.random_factors(b.shapes, stage_rank, seed=9000 + j) for j in range(2)]
    names = [f"bank{k}-s{j}" for j in range(k)]
    adapters = [b.load(n, s, stage_rank) for n, s in zip(names, stages)]
    file_name = f"bankfile{k}"
    b.load(file_name, C.concat_stages(stages), stage_rank * k)
    bank_bytes = (b.work / f"{file_name}.gguf").stat().st_size
    on_ip, on_rl = dict.fromkeys(names, 1.0), {file_name: 1.0}
    raw = [b.raw_writer(adapters[-1], s) for s in newest]
    adapters[-1].set_factors_multi(stages[-1])  # creates the staging mirror
    out: dict[str, list[float]] = {key: [] for key in ("api", "raw", "ip_extra", "write", "load_lora", "rl_extra",
                                                       "decode_stacked", "decode_file", "api_fresh",
                                                       "edit")}
    direction = C.random_factors(b.shapes, stage_rank, seed=9999)
    for i in C.progress(range(repeats), f"bank K={k}"):
        new = newest[(i + 1) % 2]
        base = b.steady_decode_ms(on_ip)
        out["decode_stacked"].append(base)
        out["api"].append(1e3 * C.timed(lambda: adapters[-1].set_factors_multi(new)))  # noqa: B023
        out["ip_extra"].append(b.decode_ms(on_ip) - base)
        out["api_fresh"].append(fresh_update_ms(adapters[-1], new, direction, 1e-3 * (i + 1)))
        b.steady_decode_ms(on_ip)
        out["edit"].append(edit_update_ms(adapters[-1], new, direction, 1e-3 * (i + 1)))
        out["raw"].append(1e3 * C.timed(raw[(i + 1) % 2]))
        base = b.steady_decode_ms(on_rl)
        out["decode_file"].append(base)
        path: list[Path] = []

        def rewrite() -> None:
            path.append(b.write(file_name, C.concat_stages([*stages[:-1], new]), stage_rank * k))  # noqa: B023
        out["write"].append(1e3 * C.timed(rewrite))
        out["load_lora"].append(1e3 * C.timed(lambda: b.eng.load_lora(path[0], name=file_name)))  # noqa: B023
        out["rl_extra"].append(b.decode_ms(on_rl) - base)
    for n in [*names, file_name]:
        b.eng.remove_lora(n)
    out["bank_mb"] = [bank_bytes / 2**20]
    return out


def bank_rows(results: dict[int, dict[str, list[float]]]) -> list[list[str]]:
    rows = []
    for k, s in results.items():
        m = {key: C.median(v) for key, v in s.items()}
        reload_total = m["write"] + m["load_lora"] + m["rl_extra"]
        ip_total = m["api"] + max(m["ip_extra"], 0.0)
        rows.append([str(k), str(2 * k), C.fmt(m["bank_mb"], 1), C.fmt(m["api"], 3), C.fmt(m["api_fresh"], 3),
                     C.fmt(m["edit"], 3), C.fmt(m["raw"], 3),
                     C.fmt(m["ip_extra"], 2), C.fmt(m["write"], 1), C.fmt(m["load_lora"], 1),
                     C.fmt(m["rl_extra"], 2), C.fmt(reload_total, 1), C.fmt(C.ratio(reload_total, ip_total), 0, "×"),
                     C.fmt(m["decode_stacked"], 1), C.fmt(m["decode_file"], 1)])
    return rows


BANK_HEADERS = ["K", "bank rank", "bank file MiB", "in-place API (newest)", "in-place API, just computed",
                "edit()", "per-tensor set", "decode extra (in-place)",
                "reload: write bank", "reload: load_lora", "decode extra (reload)", "reload total",
                "reload / in-place", "1-token decode, K stacked", "1-token decode, one rank-2K"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.common_args(p, repeats=15)
    p.add_argument("--ranks", default="2,16,64", help="part 1 ranks (comma-separated; '' to skip)")
    p.add_argument("--banks", default="1,4,13", help="part 2 stage counts K (comma-separated; '' to skip)")
    p.add_argument("--n-ctx", type=int, default=512)
    args = p.parse_args(argv)
    model = C.model_path(args.model)
    info = C.machine_info(args.threads)
    C.print_machine(info)
    ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    banks = [int(x) for x in args.banks.split(",") if x.strip()]
    with tempfile.TemporaryDirectory(prefix="loramux-inplace-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        b = Bench(model, args, work)
        try:
            b.steady_decode_ms({})
            per_rank = {r: bench_rank(b, r, args.repeats) for r in ranks}
            per_bank = {k: bench_bank(b, k, args.repeats) for k in banks}
            n_proj = len(b.shapes)
        finally:
            b.close()
    print(f"\nmodel: {model.name}; {n_proj} projections (7 per block); F32 factors; threads {args.threads}; "
          f"medians of {args.repeats}; all times in ms")
    if per_rank:
        C.print_table("Part 1: per-update cost, every factor of one adapter rewritten (ms, median)",
                      RANK_HEADERS, rank_rows(per_rank))
    if per_bank:
        C.print_table("Part 2: bank of K rank-2 stages, only the newest stage changes (ms, median)",
                      BANK_HEADERS, bank_rows(per_bank))
    spread = [[f"rank {r}", key, str(len(v)), C.fmt(min(v), 3), *(C.fmt(q, 3) for q in C.quartiles(v)),
               C.fmt(max(v), 3)] for r, s in per_rank.items() for key, v in s.items() if key in ("api", "api_fresh", "edit", "raw")]
    spread += [[f"K={k}", key, str(len(v)), C.fmt(min(v), 3), *(C.fmt(q, 3) for q in C.quartiles(v)),
                C.fmt(max(v), 3)] for k, s in per_bank.items() for key, v in s.items()
                if key in ("api", "api_fresh", "edit", "raw")]
    C.print_table("spread of the in-place timings (ms)", ["case", "path", "n", "min", "p25", "p75", "max"], spread)
    C.dump_json(args.json, {"machine": info, "args": vars(args), "ranks": per_rank, "banks": per_bank})
    return 0


if __name__ == "__main__":
    sys.exit(main())
