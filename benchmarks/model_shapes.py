"""The slot bank's cost against model size: base GGUFs with the shapes of Gemma 3 1B, 4B and 12B.

Every other benchmark runs the default 270M model, where the Python step and the graph dominate and
the bank's extra products are small. This one builds base models with the real shapes of larger
Gemma 3 models (hidden size, layers, heads, FFN width; the real 262,144-token vocabulary copied from
the default model), with random weights stored in Q4_K_M's tensor types (Q4_K, Q6_K for attn_v and
ffn_down in the layers llama-quantize gives more bits, Q6_K for the tied embedding/output, with
llama-quantize's fallbacks Q5_0/Q8_0 where a row is not a multiple of 256), so each matmul costs
what it costs in a real Q4_K_M file. Quality is irrelevant: the weights are random bytes with small
block scales. Models are written once into --work-dir (about 0.8, 2.5 and 7 GB) and reused.

On each shape it times one decode step of 1, 4 and 8 sequences (each at position --context):

- base:                       no adapter;
- native rank r:              one rank-r adapter over every projection, set on the context;
- bank K×rR:                  a slot bank of K slots of rank R (4 or 8 slots, rank 8 or 32), every
                              slot holding a rank-R adapter, sequence s on slot s mod K, per-token masks
                              (the general mixed-adapter step; loramux serve takes the native path
                              when every token of a decode uses one adapter set).

Each configuration is timed interleaved with the base step, one step of each per round, so the
ratio is measured side by side; only one bank is alive at a time (a 12B bank of 8 rank-32 slots
holds about 4 GB of F32 factors). Medians over --repeats rounds; ratios to the base step.
--bank-dtypes f32,f16 adds F16 banks (SlotBank(dtype="f16"); loramux serve builds F32 banks).

Then a bytes model: a decode step reads every weight once, so a configuration's ratio is predicted
as 1 + (its factor bytes, K·r·(in + out) values per projection) / (the model's weight bytes) + (a
fixed cost per projection node, fitted from the --fit-shapes rows) / (the base step), printed against
the measured ratio of every row, and carried to a Llama-style 70B, alone and split over RPC workers
(a round trip per worker per step, and at least one per bank node: the bank masks its nodes there
through ggml_backend_tensor_get/set). Run one shape per process (--json each) and report them
together with --from-json a.json,b.json --plot docs/img/model_shapes.png.

    python benchmarks/model_shapes.py --shapes 1b,4b,12b --repeats 9 --work-dir /var/tmp/loramux-shapes

Not shipped and not run in CI. With a GPU build of llama-cpp-python
(CMAKE_ARGS="-DGGML_CUDA=on") and --gpu-layers 999 it measures the same curve on the GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from _common import (
    common_args,
    copy_gguf_fields,
    dump_json,
    machine_info,
    median,
    model_path,
    print_machine,
    print_table,
    progress,
    projection_shapes,
    write_random_adapter,
)


@dataclass(frozen=True)
class Shape:
    """A Gemma 3 model's dimensions (from its published config)."""

    name: str
    embd: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int = 256

    def params(self, vocab: int) -> float:
        """Parameters, in billions (projections + tied embedding)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per = self.embd * (q + 2 * kv) + q * self.embd + 3 * self.embd * self.ffn
        return (self.layers * per + vocab * self.embd) / 1e9


SHAPES = {
    "1b": Shape("Gemma 3 1B", 1152, 26, 6912, 4, 1),
    "4b": Shape("Gemma 3 4B", 2560, 34, 10240, 8, 4),
    "12b": Shape("Gemma 3 12B", 3840, 48, 15360, 16, 8),
}

Q = gguf.GGMLQuantizationType
# block size in weights, bytes per block, and (byte offset, f16 value) of the block scales to set
BLOCKS: dict[Q, tuple[int, int, list[tuple[int, float]]]] = {
    Q.Q4_K: (256, 144, [(0, 1e-4), (2, 1e-4)]),
    Q.Q6_K: (256, 210, [(208, 3e-5)]),
    Q.Q5_0: (32, 22, [(0, 2e-3)]),
    Q.Q8_0: (32, 34, [(0, 2e-4)]),
}
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}  # llama-quantize's choice when a row is not a multiple of 256


def q4_k_m_type(kind: str, layer: int, n_layer: int, row: int) -> Q:
    """The tensor type llama-quantize's Q4_K_M gives (its use_more_bits rule for attn_v and ffn_down)."""
    more = layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2
    t = Q.Q6_K if kind in ("attn_v", "ffn_down") and more else Q.Q4_K
    return FALLBACK[t] if row % 256 else t


def random_blocks(qtype: Q, n_weights: int, rng: np.random.Generator) -> np.ndarray:
    """Random quantized bytes for n_weights weights, with every block's scales set small and finite."""
    size, nbytes, scales = BLOCKS[qtype]
    n_blocks = n_weights // size
    pool = rng.integers(0, 256, (min(n_blocks, 4096), nbytes), dtype=np.uint8)
    for off, value in scales:
        pool[:, off:off + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    reps = -(-n_blocks // len(pool))
    return np.tile(pool, (reps, 1))[:n_blocks].reshape(-1)


def tensor_plan(shape: Shape, vocab: int) -> Iterator[tuple[str, tuple[int, ...], Q | None]]:
    """(name, numpy shape, type or None for F32) of every tensor of a Gemma 3 model of this shape."""
    q, kv, e = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.embd
    yield "token_embd.weight", (vocab, e), FALLBACK[Q.Q6_K] if e % 256 else Q.Q6_K
    yield "output_norm.weight", (e,), None
    for i in range(shape.layers):
        for kind, out_dim, in_dim in [("attn_q", q, e), ("attn_k", kv, e), ("attn_v", kv, e),
                                      ("attn_output", e, q), ("ffn_gate", shape.ffn, e),
                                      ("ffn_up", shape.ffn, e), ("ffn_down", e, shape.ffn)]:
            yield f"blk.{i}.{kind}.weight", (out_dim, in_dim), q4_k_m_type(kind, i, shape.layers, in_dim)
        for norm, n in [("attn_norm", e), ("attn_q_norm", shape.head_dim), ("attn_k_norm", shape.head_dim),
                        ("post_attention_norm", e), ("ffn_norm", e), ("post_ffw_norm", e)]:
            yield f"blk.{i}.{norm}.weight", (n,), None


SHAPE_KEYS = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "attention.key_length", "attention.value_length")


def copy_metadata(w: gguf.GGUFWriter, ref: gguf.GGUFReader, arch: str) -> None:
    """Copy the reference model's tokenizer and hyperparameters (all but its dimensions)."""
    copy_gguf_fields(w, ref, skip={f"{arch}.{k}" for k in SHAPE_KEYS} | {
        "general.name", "general.basename", "general.size_label", "general.file_type"})


def build_model(shape: Shape, ref_path: Path, out: Path) -> Path:
    """Write a random-weight Q4_K_M-typed Gemma 3 GGUF of `shape` (skipped when `out` exists)."""
    if out.exists():
        return out
    ref = gguf.GGUFReader(ref_path)
    arch = "gemma3"
    vocab = len(ref.fields["tokenizer.ggml.tokens"].data)
    tmp = out.with_suffix(".partial")
    w = gguf.GGUFWriter(tmp, arch)
    w.add_name(f"random {shape.name} shape")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    copy_metadata(w, ref, arch)
    w.add_embedding_length(shape.embd)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    plan = list(tensor_plan(shape, vocab))
    for name, shp, qtype in plan:
        if qtype is None:
            w.add_tensor_info(name, shp, np.dtype(np.float32), 4 * int(np.prod(shp)))
        else:
            size, nbytes, _ = BLOCKS[qtype]
            n = int(np.prod(shp))
            w.add_tensor_info(name, (shp[0], shp[1] // size * nbytes), np.dtype(np.uint8), n // size * nbytes,
                              raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _name, shp, qtype in progress(plan, f"writing {out.name}"):
        n = int(np.prod(shp))
        w.write_tensor_data(np.ones(n, dtype=np.float32) if qtype is None else random_blocks(qtype, n, rng))
    w.close()
    tmp.rename(out)
    return out


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

SEQS = (1, 4, 8)
#: configuration name -> (slots, rank, bytes per factor value): what its factors add to a step's reads
SPECS: dict[str, tuple[int, int, int]] = {}


def bank_name(slots: int, rank: int, dtype: str) -> str:
    """A bank configuration's name in the tables ("bank 8×r8", "bank 8×r8 F16")."""
    return f"bank {slots}×r{rank}" + ("" if dtype == "f32" else f" {dtype.upper()}")


def factor_bytes(name: str, shapes: dict[str, tuple[int, int]]) -> int:
    """Bytes of factors configuration `name` reads per step: K·r·(in + out) values per projection."""
    k, r, size = SPECS[name]
    return sum(k * r * (o + i) * size for o, i in shapes.values())
TOKENS = list(range(1000, 1064))  # any ids of the real vocabulary


class Stepper:
    """A context decoding one token for each of n sequences per step, natively or through a bank."""

    def __init__(self, model: Any, n_seq: int, args: argparse.Namespace, *, loras: Sequence[Any] = (),
                 bank: Any = None, slots: list[int] | None = None) -> None:
        from loramux.engine.model import Context, ContextOptions

        self.n_seq, self.bank, self.slots = n_seq, bank, slots
        opts = ContextOptions(n_ctx=args.n_ctx * n_seq, n_batch=512, n_ubatch=512, n_seq_max=n_seq,
                              n_threads=args.threads, kv_unified=True)
        self.ctx = Context(model, opts, callback=bank.callback if bank is not None else None)
        handles = [bank.adapter] if bank is not None else list(loras)
        self.ctx.handle.set_adapters([getattr(h, "handle", h) for h in handles], [1.0] * len(handles))
        self.pos = 0
        self.times: list[float] = []

    def prefill(self, n_tok: int) -> None:
        """Positions 0..n_tok-1 of every sequence in one batch (untimed), so steps start at n_tok."""
        b = self.ctx.batch
        b.clear()
        for s in range(self.n_seq):
            b.add(TOKENS[:n_tok], 0, s, [False] * (n_tok - 1) + [True])
        self._decode(n_tok)
        self.pos = n_tok

    def step(self) -> None:
        """One timed decode of one token for each sequence."""
        b = self.ctx.batch
        b.clear()
        for s in range(self.n_seq):
            b.add([TOKENS[(self.pos + s) % len(TOKENS)]], self.pos, s, True)
        t0 = time.perf_counter()
        self._decode(1)
        self.times.append(time.perf_counter() - t0)
        self.pos += 1

    def _decode(self, n_tok: int) -> None:
        from loramux.engine.bank import token_scales
        from loramux.engine.bank_masks import plan_ubatches

        b = self.ctx.batch
        if self.bank is not None:
            assert self.slots is not None
            scales = token_scales(self.bank, [(n_tok, [(self.slots[s % len(self.slots)], 1.0)])
                                              for s in range(self.n_seq)])
            self.bank.set_plan(scales, b.logits[: b.n] != 0, plan_ubatches(b.seq[: b.n], b.capacity, True))
        self.ctx.handle.decode(b)
        if self.bank is not None:
            self.bank.check()

    def close(self) -> None:
        self.ctx.close()


def side_by_side(base: Stepper, other: Stepper, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Step times (s) of interleaved steps of two fresh steppers at the same positions (--context onwards),
    round by round: base.times[i] and other.times[i] ran one after the other."""
    for s in (base, other):
        s.prefill(args.context)
        s.step()  # warm-up (graph reserve for one-token batches)
        s.times.clear()
    for _ in range(args.repeats):
        base.step()
        other.step()
    return base.times, other.times


def ratios(base: list[float], other: list[float]) -> dict[str, float]:
    """The configuration against the base step three ways: medians (`ratio`), the median of each round's
    own ratio (`ratio_paired`: a slow stretch of the host slows both steps of a round), and the fastest
    steps (`ratio_min`: a disturbance only ever adds time, so the minima are each step undisturbed)."""
    return {"base_ms": median(base) * 1e3, "ms": median(other) * 1e3, "ratio": median(other) / median(base),
            "ratio_paired": median(o / b for b, o in zip(base, other)), "ratio_min": min(other) / min(base),
            "base_min_ms": min(base) * 1e3, "min_ms": min(other) * 1e3}


def measure_shape(label: str, path: Path, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Every configuration on one model, each against the base step, at 1, 4 and 8 sequences."""
    from loramux.engine.adapters import LoRAAdapter
    from loramux.engine.bank import SlotBank
    from loramux.engine.model import Model
    from loramux.gguf_io import read_header

    model = Model(path, n_gpu_layers=args.gpu_layers)
    shapes = projection_shapes(path)
    header = read_header(path)
    base_bytes = sum(t.nbytes for t in header.tensors.values())  # the tied embedding is read as the output
    params_b = sum(t.n_elements for t in header.tensors.values()) / 1e9
    rows: list[dict[str, Any]] = []
    configs: list[tuple[str, Callable[[int], Stepper]]] = []
    adapters: dict[int, list[Any]] = {}

    def adapter_set(rank: int, n: int) -> list[Any]:
        have = adapters.setdefault(rank, [])
        while len(have) < n:
            k = len(have)
            f = work / f"{path.stem}-r{rank}-{k}.gguf"
            if not f.exists():  # random factors from a fixed seed: a file already written is the same
                write_random_adapter(f, "gemma3", shapes, rank, 100 + k)
            have.append(LoRAAdapter(model, f, f"r{rank}-{k}"))
        return have[:n]

    for rank in args.native_ranks:
        configs.append((f"native rank {rank}", lambda n, rank=rank: Stepper(
            model, n, args, loras=adapter_set(rank, 1))))
        SPECS[f"native rank {rank}"] = (1, rank, 4)  # the adapters are F32 files
    for dtype in args.bank_dtypes:
        for k_slots in args.slots:
            for rank in args.bank_ranks:
                def make(n: int, k_slots: int = k_slots, rank: int = rank, dtype: str = dtype) -> Stepper:
                    bank = SlotBank(model, k_slots, rank, dtype=dtype)
                    slots = [bank.take_slot(a) for a in adapter_set(rank, k_slots)]
                    return Stepper(model, n, args, bank=bank, slots=slots)
                configs.append((bank_name(k_slots, rank, dtype), make))
                SPECS[bank_name(k_slots, rank, dtype)] = (k_slots, rank, 4 if dtype == "f32" else 2)
    for n in args.seqs:
        for name, make in configs:
            base, other = Stepper(model, n, args), make(n)
            r = ratios(*side_by_side(base, other, args))
            rows.append({"model": label, "config": name, "seqs": n, "threads": args.threads,
                         "repeats": args.repeats, **r, "params_b": params_b, "base_bytes": base_bytes,
                         "extra_bytes": factor_bytes(name, shapes), "targets": len(shapes)})
            print(f"{label} {name} n={n}: {r['ms']:.1f} ms vs base {r['base_ms']:.1f} ms ({r['ratio']:.3f}×; "
                  f"paired {r['ratio_paired']:.3f}×, fastest {r['ratio_min']:.3f}×)", file=sys.stderr, flush=True)
            for s in (base, other):
                s.close()
                if s.bank is not None:
                    s.bank.close()
            del base, other
            gc.collect()
    for have in adapters.values():
        for a in have:
            a.close()
    model.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, repeats=9)  # --repeats N: N interleaved steps of base and configuration each
    ap.add_argument("--shapes", default="1b,4b,12b", help="comma-separated: 270m (the default model itself), "
                    "1b, 4b, 12b (default 1b,4b,12b)")
    ap.add_argument("--slots", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8],
                    help="bank sizes (default 4,8)")
    ap.add_argument("--bank-ranks", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32],
                    help="slot ranks (default 8,32)")
    ap.add_argument("--native-ranks", type=lambda s: [int(x) for x in s.split(",")], default=[8],
                    help="ranks of the native one-adapter step (default 8)")
    ap.add_argument("--bank-dtypes", type=lambda s: s.split(","), default=["f32"],
                    help="bank factor types, f32 and/or f16 (default f32, what loramux serve uses)")
    ap.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=list(SEQS),
                    help="sequences per step (default 1,4,8)")
    ap.add_argument("--from-json", default=None, help="no measuring: report (and plot) the rows of "
                    "earlier --json files, comma-separated")
    ap.add_argument("--plot", default=None, help="write the overhead-against-size plot (PNG) here")
    ap.add_argument("--fit-shapes", default="Gemma 3 270M (real),Gemma 3 1B shape",
                    help="models whose rows fit the bytes model's per-node cost (comma-separated labels)")
    ap.add_argument("--rpc-rtt-ms", type=float, default=0.1,
                    help="network round trip assumed for the 70B-over-RPC prediction (default 0.1 ms)")
    ap.add_argument("--rpc-workers", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4],
                    help="worker counts of the 70B-over-RPC prediction (default 2,4)")
    ap.add_argument("--worker-gbs", type=float, default=100.0,
                    help="memory bandwidth of an RPC worker for the 70B prediction (default 100 GB/s)")
    ap.add_argument("--gpu-layers", type=int, default=0,
                    help="layers offloaded on a GPU build (default 0; 999: every layer)")
    ap.add_argument("--n-ctx", type=int, default=128, help="KV cells per sequence (default 128)")
    ap.add_argument("--context", type=int, default=16, help="positions decoded before timing (default 16)")
    args = ap.parse_args()
    if not 1 <= args.context <= len(TOKENS) or args.context + args.repeats + 2 > args.n_ctx:
        raise SystemExit(f"error: --context must be 1–{len(TOKENS)} and --context + --repeats stay below "
                         f"--n-ctx ({args.n_ctx})")
    if bad := [d for d in args.bank_dtypes if d not in ("f32", "f16")]:
        raise SystemExit(f"error: --bank-dtypes takes f32 and f16 (got {', '.join(bad)})")
    if args.from_json:
        runs = [json.loads(Path(f).read_text()) for f in args.from_json.split(",")]
        rows = [{"threads": run["args"]["threads"], "repeats": run["args"]["repeats"], **r}
                for run in runs for r in run["rows"]]
    else:
        rows = measure_all(args)
    report(rows)
    fits = bytes_model(rows, set(args.fit_shapes.split(",")))
    predict_70b(rows, fits, args)
    if args.plot:
        plot(rows, Path(args.plot), max(r["seqs"] for r in rows))


def measure_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Build (once) and time every shape in --shapes, one after the other; rows also go to --json."""
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="loramux-shapes-"))
    work.mkdir(parents=True, exist_ok=True)
    info = machine_info(args.threads)
    print_machine(info)
    ref = model_path(args.model)
    rows: list[dict[str, Any]] = []
    for key in args.shapes.split(","):
        if key == "270m":
            label, path = "Gemma 3 270M (real)", ref
        elif key in SHAPES:
            label = f"{SHAPES[key].name} shape"
            path = build_model(SHAPES[key], ref, work / f"gemma3-{key}-random-q4_k_m.gguf")
        else:
            raise SystemExit(f"error: unknown shape {key!r}; choose from 270m, {', '.join(SHAPES)}")
        rows += measure_shape(label, path, args, work)
    dump_json(args.json, {"machine": info, "args": vars(args), "rows": rows})
    return rows


def report(rows: list[dict[str, Any]]) -> None:
    """Every row: the configuration's step and the base step beside it."""
    def opt(r: dict[str, Any], key: str) -> str:  # rows of --json files written before these columns: "–"
        return f"{r[key]:.3f}×" if key in r else "–"

    table = [[r["model"], r["config"], str(r["seqs"]), str(r["threads"]), str(r["repeats"]), f"{r['base_ms']:.1f}",
              f"{r['ms']:.1f}", f"{r['ratio']:.3f}×", opt(r, "ratio_paired"), opt(r, "ratio_min")] for r in rows]
    print_table("one decode step against the base step (interleaved steps: medians, the median of each "
                "round's ratio, the fastest of each)",
                ["model", "configuration", "sequences", "threads", "repeats", "base ms", "ms", "vs base",
                 "paired", "fastest"], table)


# ----------------------------------------------------------------------------------------------
# The bytes model: a step reads every weight once; the factors add their bytes, each node a fixed cost
# ----------------------------------------------------------------------------------------------

def kind_of(config: str) -> str:
    """The kernel family of a configuration: its factor reads cost alike per byte."""
    return "native" if config.startswith("native") else "bank F16" if config.endswith("F16") else "bank F32"


def fit_excess(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Least squares (β ≥ 0, c ≥ 0) of excess ms = β · bytes term · base ms + c · projections."""
    x = np.array([[r["extra_bytes"] / r["base_bytes"] * r["base_ms"], r["targets"]] for r in rows])
    y = np.array([(r["ratio"] - 1) * r["base_ms"] for r in rows])
    (beta, c_ms), *_ = np.linalg.lstsq(x, y, rcond=None)
    if min(beta, c_ms) < 0:  # one term alone, the one that fits better
        b1 = max(0.0, float(x[:, 0] @ y / (x[:, 0] @ x[:, 0])))
        c1 = max(0.0, float(x[:, 1] @ y / (x[:, 1] @ x[:, 1])))
        e_b, e_c = np.sum((y - b1 * x[:, 0]) ** 2), np.sum((y - c1 * x[:, 1]) ** 2)
        beta, c_ms = (b1, 0.0) if e_b <= e_c else (0.0, c1)
    return float(beta), float(c_ms) / 1e3


def bytes_model(rows: list[dict[str, Any]], fit: set[str]) -> dict[str, tuple[float, float]]:
    """Excess time over the base step = β · factor bytes / (weight bytes / base step) + c · projections:
    β (a factor byte's cost against a weight byte's; 1 when both stream at memory bandwidth) and c (s per
    projection node: graph nodes, the mask callback) fitted by least squares per (kind, sequences) over
    the rows of the `fit` models. Prints the bandwidth bound (1 + bytes term) and the fitted prediction
    against every measured ratio."""
    fits: dict[str, tuple[float, float]] = {}
    for kind in sorted({kind_of(r["config"]) for r in rows}):
        sel = [r for r in rows if r["model"] in fit and kind_of(r["config"]) == kind]
        if sel:  # pooled over sequence counts: one run's noise (±5-10 %) is too large for a fit per cell
            fits[kind] = fit_excess(sel)
    if not fits:  # e.g. one large shape alone: report it with the others through --from-json
        print("\nno rows of the --fit-shapes models: the bytes model assumes β = 1, c = 0")
    else:
        print_table("bytes model fits (from " + ", ".join(sorted(fit)) + ")", ["kind", "β", "c µs/projection"],
                    [[k, f"{b:.2f}", f"{c * 1e6:.1f}"] for k, (b, c) in fits.items()])
    table = []
    for r in rows:
        frac = r["extra_bytes"] / r["base_bytes"]
        beta, c = fits.get(kind_of(r["config"]), (1.0, 0.0))
        pred = 1 + beta * frac + r["targets"] * c / (r["base_ms"] / 1e3)
        table.append([r["model"], r["config"], str(r["seqs"]), f"{r['extra_bytes'] / 2**20:.0f}",
                      f"{r['base_bytes'] / 2**20:.0f}", f"{1 + frac:.3f}×", f"{pred:.3f}×", f"{r['ratio']:.3f}×",
                      "fit" if r["model"] in fit else ""])
    print_table("bytes model against the measured ratio",
                ["model", "configuration", "sequences", "factor MiB", "weight MiB", "bandwidth bound",
                 "fitted", "measured", ""], table)
    return fits


LLAMA_70B = Shape("Llama-style 70B", 8192, 80, 28672, 64, 8, head_dim=128)
LLAMA_VOCAB = 128256


def q4_k_m_bytes(shape: Shape, vocab: int) -> tuple[int, dict[str, tuple[int, int]]]:
    """(bytes one decode step reads: projections in Q4_K_M's types + a Q6_K output matrix, projection shapes)."""
    total = vocab * shape.embd // 256 * BLOCKS[Q.Q6_K][1]
    shapes: dict[str, tuple[int, int]] = {}
    for name, shp, qtype in tensor_plan(shape, vocab):
        if qtype is not None and name.startswith("blk."):
            size, nbytes, _ = BLOCKS[qtype]
            total += shp[0] * shp[1] // size * nbytes
            shapes[name] = (shp[0], shp[1])
    return total, shapes


def predict_70b(rows: list[dict[str, Any]], fits: dict[str, tuple[float, float]],
                args: argparse.Namespace) -> None:
    """The bytes model at a Llama-style 70B. On this machine: the step time scaled by weight bytes from
    the largest model measured. Over RPC with W workers, each holding a layer range (run one after
    another): weight bytes at --worker-gbs plus a round trip per worker; the bank adds its factor bytes
    at the same rate and a round trip per bank node (its masks move through ggml_backend_tensor_get/set
    on the worker; the get waits for the node) plus the fitted per-node cost."""
    big = max(rows, key=lambda r: r["base_bytes"])["model"]
    base_bytes, shapes = q4_k_m_bytes(LLAMA_70B, LLAMA_VOCAB)
    targets, rtt, bw = len(shapes), args.rpc_rtt_ms / 1e3, args.worker_gbs * 1e9
    table = []
    for r in (r for r in rows if r["model"] == big):
        SPECS.setdefault(r["config"], spec_of(r["config"]))
        beta, c = fits.get(kind_of(r["config"]), (1.0, 0.0))
        extra = factor_bytes(r["config"], shapes)
        t_base = r["base_ms"] / 1e3 * base_bytes / r["base_bytes"]
        local = 1 + beta * extra / base_bytes + targets * c / t_base
        trips = targets * rtt if r["config"].startswith("bank") else 0.0
        t_rpc = base_bytes / bw
        cells = [f"{1 + (extra / bw + targets * c + trips) / (t_rpc + w * rtt):.2f}×" for w in args.rpc_workers]
        table.append([r["config"], str(r["seqs"]), f"{extra / 2**30:.2f}",
                      f"{extra / 2**20 / max(args.rpc_workers):.0f}", f"{local:.3f}×", *cells])
    print_table(f"predicted at {LLAMA_70B.name} ({base_bytes / 2**30:.1f} GiB of Q4_K_M weights read per step, "
                f"{targets} projections; β and c of the fits; this machine: step scaled from {big}; RPC: "
                f"{args.worker_gbs:g} GB/s per worker, {args.rpc_rtt_ms:g} ms round trip)",
                ["configuration", "sequences", "factor GiB", f"MiB per worker of {max(args.rpc_workers)}",
                 "this machine", *[f"{w} RPC workers" for w in args.rpc_workers]], table)


def spec_of(name: str) -> tuple[int, int, int]:
    """SPECS entry from a configuration's name (for rows read back with --from-json)."""
    words = name.split()
    if words[0] == "native":
        return 1, int(words[2]), 4
    k, r = words[1].split("×r")
    return int(k), int(r), 2 if words[-1] == "F16" else 4


def plot(rows: list[dict[str, Any]], path: Path, seqs: int) -> None:
    """Overhead ratio against parameters (log scale) per configuration at `seqs` sequences."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    for config in dict.fromkeys(r["config"] for r in rows):
        pts = sorted((r["params_b"], r["ratio"]) for r in rows if r["config"] == config and r["seqs"] == seqs)
        if pts:
            style = "--s" if config.startswith("native") else "-.^" if config.endswith("F16") else "-o"
            ax.plot(*zip(*pts), style, label=config)
    ax.axhline(1.05, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:.2g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(sorted({r["params_b"] for r in rows}))
    ax.set_xlabel("model parameters (billions)")
    ax.set_ylabel(f"decode step / base step, {seqs} sequences")
    ax.set_title("slot bank and native adapter against the base step (CPU)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot written to {path}")


if __name__ == "__main__":
    main()
