"""Malformed adapter GGUFs derived from valid ones, and a subprocess that loads them into llama.cpp.

Used by tests/test_fuzz_gguf.py (a fixed, derandomized run) and scripts/fuzz_adapters.py (long runs).

A valid adapter (written by `gguf_io.write_adapter`) is parsed into a `Doc`: its key/value pairs with
their GGUF types, its tensor directory and each tensor's data. Structural mutations edit the Doc
(value types and values, alignment, tensor types, shapes, names, offsets, counts, data); `serialize`
writes it back, recording where every header field lies so that byte mutations can then overwrite
a field with an extreme value, flip bytes, cut the file or insert bytes. `serialize(parse(f))` is
byte-identical to `f`, so an unmutated case is the valid adapter itself.

`Worker` keeps one child process that loads base + adapter with loramux (`python gguf_fuzz.py
worker BASE`, one path per stdin line, one JSON answer per line): a case that crashes llama.cpp
kills the child, not pytest, and is reported by name.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from loramux.gguf_io import GGML_BLOCKS, VALUE_ARRAY, VALUE_FORMATS, VALUE_STRING, read_header

#: Where failing cases are kept (pytest's own tmp dirs are rotated away after a few runs).
KEEP = Path(os.environ.get("LORAMUX_FUZZ_KEEP", Path(tempfile.gettempdir()) / "loramux-fuzz-failures"))
KEY_ALPHA, KEY_ALIGN, KEY_INV = "adapter.lora.alpha", "general.alignment", "adapter.alora.invocation_tokens"


@dataclass
class KV:
    key: bytes
    vtype: int
    value: Any  # scalar, bytes (string), or list (array; strings as bytes)
    etype: int | None = None


@dataclass
class Tensor:
    name: bytes
    ne: list[int]
    ttype: int
    data: bytes
    offset: int | None = None  # None: where the layout puts it


@dataclass
class Doc:
    version: int = 3
    kvs: list[KV] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    alignment: int = 32  # the layout's alignment (general.alignment may claim another)
    n_tensors: int | None = None  # None: len(tensors)
    n_kv: int | None = None


def parse(path: Path) -> Doc:
    """A valid GGUF as a Doc (trusted input: the seeds; checked by serialize(parse(f)) == f)."""
    h = read_header(path, keep_arrays=1 << 20)
    raw = path.read_bytes()
    doc = Doc(h.version, alignment=h.alignment)
    for key, val in h.metadata.items():
        vtype, etype = h.value_types[key]
        if vtype == VALUE_STRING:
            val = val.encode()
        elif vtype == VALUE_ARRAY and etype == VALUE_STRING:
            val = [v.encode() for v in val]
        doc.kvs.append(KV(key.encode(), vtype, val, etype))
    for t in h.tensors.values():
        start = h.data_offset + t.offset
        doc.tensors.append(Tensor(t.name.encode(), list(t.ne), t.ggml_type, raw[start:start + t.nbytes]))
    return doc


def _pack_scalar(vtype: int, v: Any) -> bytes:
    fmt = VALUE_FORMATS[vtype]
    if fmt[1] in "fd?":
        return struct.pack(fmt, v)
    bits = struct.calcsize(fmt) * 8
    return (int(v) % (1 << bits)).to_bytes(bits // 8, "little")  # any int fits: wrapped like C would


def nbytes(t: Tensor) -> int:
    """The byte size the tensor's type and shape declare (its data's length for an unknown type)."""
    if t.ttype not in GGML_BLOCKS:
        return len(t.data)
    block, size = GGML_BLOCKS[t.ttype]
    n = 1
    for d in t.ne:
        n *= max(d, 0)
    return n // block * size


class _Out:
    def __init__(self) -> None:
        self.buf = bytearray()
        self.spans: list[tuple[int, int, str]] = []  # (offset, width, label) of every numeric header field

    def num(self, fmt: str, v: int, label: str) -> None:
        self.spans.append((len(self.buf), struct.calcsize(fmt), label))
        bits = struct.calcsize(fmt) * 8
        self.buf += (int(v) % (1 << bits)).to_bytes(bits // 8, "little")

    def string(self, s: bytes, label: str) -> None:
        self.num("<Q", len(s), label + " length")
        self.buf += s


def _value(o: _Out, kv: KV, label: str) -> None:
    if kv.vtype == VALUE_STRING:
        o.string(kv.value, label)
    elif kv.vtype == VALUE_ARRAY:
        o.num("<I", kv.etype or 0, label + " element type")
        o.num("<Q", len(kv.value), label + " count")
        for v in kv.value:
            _value(o, KV(kv.key, kv.etype or 0, v), label + "[]")
    elif kv.vtype in VALUE_FORMATS:
        o.buf += _pack_scalar(kv.vtype, kv.value)


def serialize(doc: Doc) -> tuple[bytes, list[tuple[int, int, str]]]:
    """The file's bytes and the (offset, width, label) of each numeric header field."""
    o = _Out()
    o.buf += b"GGUF"
    o.num("<I", doc.version, "version")
    o.num("<Q", len(doc.tensors) if doc.n_tensors is None else doc.n_tensors, "n_tensors")
    o.num("<Q", len(doc.kvs) if doc.n_kv is None else doc.n_kv, "n_kv")
    for kv in doc.kvs:
        label = kv.key.decode(errors="replace")
        o.string(kv.key, f"key {label}")
        o.num("<I", kv.vtype, f"{label} type")
        _value(o, kv, label)
    a = doc.alignment
    pos = 0
    for t in doc.tensors:
        label = f"tensor {t.name.decode(errors='replace')}"
        o.string(t.name, label + " name")
        o.num("<I", len(t.ne), label + " n_dims")
        for j, d in enumerate(t.ne):
            o.num("<Q", d, f"{label} ne[{j}]")
        o.num("<I", t.ttype, label + " type")
        o.num("<Q", pos if t.offset is None else t.offset, label + " offset")
        pos += -(-len(t.data) // a) * a
    if doc.tensors:
        o.buf += b"\0" * (-len(o.buf) % a)
        for t in doc.tensors:
            o.buf += t.data + b"\0" * (-len(t.data) % a)
    return bytes(o.buf), o.spans


def write_seeds(d: Path) -> list[Path]:
    """Valid adapters for the tiny model (tests/tinymodel.py): each dtype, partial targets, per-layer
    ranks, alpha != rank, a negative alpha, aLoRA invocation tokens."""
    from tinymodel import random_factors, write_tiny_lora

    from loramux.gguf_io import write_adapter

    q, down = "blk.0.attn_q.weight", "blk.1.ffn_down.weight"
    mixed = {**random_factors(rank=4, seed=5, targets=(q,)), **random_factors(rank=8, seed=6, targets=(down,))}
    return [
        write_tiny_lora(d / "seed0.gguf", rank=2, seed=1),
        write_tiny_lora(d / "seed1.gguf", rank=4, alpha=8.0, dtype="f16", seed=2, targets=(q, down)),
        write_tiny_lora(d / "seed2.gguf", rank=2, dtype="bf16", seed=3, targets=(q,), invocation_tokens=[5, 6]),
        write_adapter(d / "seed3.gguf", "llama", mixed, 16.0),
        write_tiny_lora(d / "seed4.gguf", rank=2, alpha=-2.0, seed=4, targets=(down,)),
    ]


def seed_docs(paths: list[Path]) -> list[Doc]:
    """The seeds as Docs, plus one laid out with general.alignment = 64; each checked to round-trip."""
    docs = []
    for p in paths:
        doc = parse(p)
        if serialize(doc)[0] != p.read_bytes():
            raise AssertionError(f"serialize(parse({p.name})) is not the file: the fuzzer's writer is wrong")
        docs.append(doc)
    aligned = copy.deepcopy(docs[0])
    aligned.kvs.append(KV(KEY_ALIGN.encode(), 4, 64))
    aligned.alignment = 64
    return docs + [aligned]


# ---------------------------------------------------------------------------------------------
# mutations: each is a tuple (kind, params...) drawn by hypothesis and applied deterministically
# ---------------------------------------------------------------------------------------------

EXTREME = [0, 1, 2, 3, 31, 63, 64, 65, 255, 2**15, 2**16, 2**24, 2**30, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
           2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]
FLOATS = [float("nan"), float("inf"), -float("inf"), -1.0, 0.0, -0.0, 1e-45, 3e38, 1e30, -3e38, 2.0]
GGML_TYPES = [0, 1, 30, 8, 2, 4, 5, 12, 24, 28, 31, 42, 43, 99, 2**31, 2**32 - 1]

_kv_keys = st.sampled_from(["general.type", "general.architecture", "adapter.type", KEY_ALPHA, KEY_ALIGN,
                            KEY_INV, "general.name", "junk.key", ""])
_vtypes = st.sampled_from(list(range(13)) + [13, 99, 2**32 - 1])


def _any_value() -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(EXTREME), st.sampled_from(FLOATS), st.binary(max_size=80),
                     st.sampled_from([b"adapter", b"lora", b"model", b"llama", b"qwen2", b""]))


STRUCT_MUTATIONS = st.one_of(
    st.tuples(st.just("kv_set"), _kv_keys, _vtypes, _any_value(), st.sampled_from([None, 0, 4, 5, 6, 8, 9])),
    # the keys llama.cpp reads with type-asserting getters, retyped (an abort if one got through)
    st.tuples(st.just("kv_set"), st.sampled_from([KEY_ALPHA, "general.type", "adapter.type", "general.architecture"]),
              _vtypes, _any_value(), st.sampled_from([None, 4, 6, 8])),
    st.tuples(st.just("kv_drop"), _kv_keys),
    st.tuples(st.just("kv_dup"), _kv_keys),
    st.tuples(st.just("alpha"), st.sampled_from(FLOATS)),
    st.tuples(st.just("align"), st.sampled_from([0, 1, 3, 8, 48, 64, 256, 2**31, 2**32 - 1]), st.booleans()),
    st.tuples(st.just("invocation"), st.sampled_from([4, 5, 8, 6]), st.lists(st.sampled_from(EXTREME), max_size=6)),
    st.tuples(st.just("ttype"), st.integers(0, 63), st.sampled_from(GGML_TYPES), st.booleans()),
    st.tuples(st.just("shape"), st.integers(0, 63), st.integers(0, 5), st.sampled_from(EXTREME), st.booleans()),
    st.tuples(st.just("ndims"), st.integers(0, 63), st.sampled_from([0, 1, 3, 4, 5, 2**32 - 1])),
    st.tuples(st.just("transpose"), st.integers(0, 63)),
    st.tuples(st.just("rename"), st.integers(0, 63), st.sampled_from(
        ["drop_suffix", "other_suffix", "layer7", "long", "empty", "norm", "swap_ab", "dup_prev"])),
    st.tuples(st.just("drop_tensor"), st.integers(0, 63)),
    st.tuples(st.just("dup_tensor"), st.integers(0, 63)),
    st.tuples(st.just("swap_tensors"), st.integers(0, 63), st.integers(0, 63)),
    st.tuples(st.just("offset"), st.integers(0, 63), st.sampled_from([-64, -32, -4, -1, 1, 4, 32, 2**40])),
    st.tuples(st.just("counts"), st.sampled_from(["n_tensors", "n_kv"]), st.sampled_from([-2, -1, 1, 2, 2**20])),
    st.tuples(st.just("values"), st.integers(0, 63), st.sampled_from(FLOATS), st.integers(0, 2**16)),
    st.tuples(st.just("version"), st.sampled_from([0, 1, 2, 4, 2**16, 2**32 - 1])),
)
BYTE_MUTATIONS = st.one_of(
    st.tuples(st.just("field"), st.integers(0, 2**16), st.sampled_from(EXTREME)),
    st.tuples(st.just("field_add"), st.integers(0, 2**16), st.sampled_from([-2, -1, 1, 2, 8])),
    st.tuples(st.just("truncate"), st.floats(0.0, 1.0)),
    st.tuples(st.just("flip"), st.floats(0.0, 1.0), st.integers(0, 255), st.booleans()),
    st.tuples(st.just("insert"), st.floats(0.0, 1.0), st.binary(min_size=1, max_size=12), st.booleans()),
    st.tuples(st.just("delete"), st.floats(0.0, 1.0), st.integers(1, 12), st.booleans()),
)


@st.composite
def cases(draw: st.DrawFn, n_seeds: int) -> tuple[int, list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """(seed index, structural mutations, byte mutations); at most four in all, sometimes none."""
    seed = draw(st.integers(0, n_seeds - 1))
    structural = draw(st.lists(STRUCT_MUTATIONS, max_size=2))
    raw = draw(st.lists(BYTE_MUTATIONS, max_size=2))
    return seed, structural, raw


def _pick(doc: Doc, i: int) -> Tensor | None:
    return doc.tensors[i % len(doc.tensors)] if doc.tensors else None


def _find(doc: Doc, key: str) -> KV | None:
    return next((kv for kv in doc.kvs if kv.key == key.encode()), None)


def _coerce(vtype: int, etype: int | None, v: Any) -> tuple[Any, int | None]:
    """A value of the drawn type made from the drawn value (so every type gets exercised)."""
    if vtype == VALUE_STRING:
        return (v if isinstance(v, bytes) else str(v).encode()), None
    if vtype == VALUE_ARRAY:
        e = etype if etype is not None else 4
        inner, _ = _coerce(e, None, v) if e != VALUE_ARRAY else (b"", None)
        return [inner] * (1 + (len(v) if isinstance(v, bytes) else 2) % 5), e
    if vtype in VALUE_FORMATS:
        fmt = VALUE_FORMATS[vtype][1]
        if isinstance(v, bytes):
            v = int.from_bytes(v[:8].ljust(8, b"\0"), "little")
        if fmt in "fd":
            return float(v) if not isinstance(v, int) or abs(v) < 2**60 else float(2**60), None
        if fmt == "?":
            return bool(v == v and v), None
        return (int(v) if v == v and abs(v) != float("inf") else 7), None
    return 0, None  # an unknown type: no value bytes follow (the reader must stop at the type)


def _resize(t: Tensor) -> None:
    want = nbytes(t)
    if want <= 1 << 20:
        t.data = (t.data * (want // max(len(t.data), 1) + 1))[:want] if t.data else b"\0" * want


def apply_struct(doc: Doc, m: tuple[Any, ...]) -> None:
    kind = m[0]
    if kind == "kv_set":
        _, key, vtype, v, etype = m
        val, e = _coerce(vtype, etype, v)
        kv = _find(doc, key)
        if kv is None:
            doc.kvs.append(KV(key.encode(), vtype, val, e))
        else:
            kv.vtype, kv.value, kv.etype = vtype, val, e
    elif kind == "kv_drop":
        doc.kvs = [kv for kv in doc.kvs if kv.key != m[1].encode()]
    elif kind == "kv_dup":
        kv = _find(doc, m[1])
        if kv is not None:
            doc.kvs.append(copy.deepcopy(kv))
    elif kind == "alpha":
        kv = _find(doc, KEY_ALPHA)
        if kv is not None:
            kv.value = m[1]
    elif kind == "align":
        _, align, relayout = m
        kv = _find(doc, KEY_ALIGN)
        if kv is None:
            doc.kvs.append(KV(KEY_ALIGN.encode(), 4, align))
        else:
            kv.value = align
        if relayout and 0 < align <= 4096 and not align & (align - 1):
            doc.alignment = align
    elif kind == "invocation":
        _, etype, toks = m
        kv = _find(doc, KEY_INV)
        vals = [t % (1 << 32) for t in toks] if etype != 8 else [str(t).encode() for t in toks]
        if etype == 6:
            vals = [float(t) for t in toks]
        if kv is None:
            doc.kvs.append(KV(KEY_INV.encode(), VALUE_ARRAY, vals, etype))
        else:
            kv.value, kv.etype = vals, etype
    elif kind in ("ttype", "shape", "ndims", "transpose", "values", "offset"):
        _tensor_field(doc, m)
    else:
        _tensor_list(doc, m)


def _tensor_field(doc: Doc, m: tuple[Any, ...]) -> None:
    t = _pick(doc, m[1])
    if t is None:
        return
    kind = m[0]
    if kind == "ttype":
        t.ttype = m[2]
        if m[3]:
            _resize(t)
    elif kind == "shape":
        _, _, dim, value, consistent = m
        if t.ne:
            t.ne[dim % len(t.ne)] = value
            if consistent:
                _resize(t)
    elif kind == "ndims":
        n = m[2]
        t.ne = (t.ne + [1] * 8)[:n] if n <= 8 else t.ne + [1] * 3
    elif kind == "transpose":
        t.ne = t.ne[::-1]
    elif kind == "values" and t.ttype == 0 and len(t.data) >= 4:
        at = (m[3] * 4) % len(t.data)
        t.data = t.data[:at] + struct.pack("<f", m[2]) + t.data[at + 4:]
    elif kind == "offset":
        base = sum(-(-len(x.data) // doc.alignment) * doc.alignment for x in doc.tensors[:doc.tensors.index(t)])
        t.offset = max(base + m[2], 0)


def _tensor_list(doc: Doc, m: tuple[Any, ...]) -> None:
    kind = m[0]
    if kind == "counts":
        attr = m[1]
        n = len(doc.tensors) if attr == "n_tensors" else len(doc.kvs)
        setattr(doc, attr, max(n + m[2], 0))
    elif kind == "version":
        doc.version = m[1]
    elif not doc.tensors:
        return
    elif kind == "rename":
        _rename(doc, m[1] % len(doc.tensors), m[2])
    elif kind == "drop_tensor":
        del doc.tensors[m[1] % len(doc.tensors)]
    elif kind == "dup_tensor":
        doc.tensors.append(copy.deepcopy(doc.tensors[m[1] % len(doc.tensors)]))
    elif kind == "swap_tensors":
        i, j = m[1] % len(doc.tensors), m[2] % len(doc.tensors)
        doc.tensors[i], doc.tensors[j] = doc.tensors[j], doc.tensors[i]


def _rename(doc: Doc, i: int, how: str) -> None:
    t = doc.tensors[i]
    n = t.name
    t.name = {
        "drop_suffix": n.rsplit(b".", 1)[0],
        "other_suffix": n.rsplit(b".", 1)[0] + b".lora_c",
        "layer7": n.replace(b"blk.0.", b"blk.7.").replace(b"blk.1.", b"blk.7."),
        "long": b"blk.0." + b"x" * 60 + b".weight.lora_a",
        "empty": b"",
        "norm": b"blk.0.attn_norm.weight",
        "swap_ab": n[:-1] + (b"b" if n.endswith(b"a") else b"a"),
        "dup_prev": doc.tensors[i - 1].name if i else n,
    }[how]


def apply_bytes(data: bytes, spans: list[tuple[int, int, str]], m: tuple[Any, ...]) -> bytes:
    kind = m[0]
    header_end = max((o + w for o, w, _ in spans), default=len(data))
    if kind in ("field", "field_add") and spans:
        off, width, _ = spans[((m[1] + 1) * 2654435761) % len(spans)]  # small draws spread over every field
        if off + width > len(data):
            return data
        old = int.from_bytes(data[off:off + width], "little")
        new = m[2] if kind == "field" else old + m[2]
        return data[:off] + (new % (1 << (8 * width))).to_bytes(width, "little") + data[off + width:]
    # positions start after magic and version: hypothesis favours 0.0, and each has its own mutation
    if kind == "truncate":
        return data[:8 + int(m[1] * (len(data) - 8))]
    limit = header_end if m[-1] else len(data)  # header-only, or anywhere
    at = min(8 + int(m[1] * (limit - 8)), max(len(data) - 1, 0))
    if kind == "flip" and data:
        return data[:at] + bytes([data[at] ^ (m[2] or 0x80)]) + data[at + 1:]
    if kind == "insert":
        return data[:at] + m[2] + data[at:]
    if kind == "delete":
        return data[:at] + data[at + m[2]:]
    return data


def build(seeds: list[Doc], case: tuple[int, list[tuple[Any, ...]], list[tuple[Any, ...]]]) -> bytes:
    """The bytes of one case: the seed, its structural mutations, then its byte mutations."""
    seed, structural, raw = case
    doc = copy.deepcopy(seeds[seed])
    for m in structural:
        apply_struct(doc, m)
    data, spans = serialize(doc)
    for m in raw:
        data = apply_bytes(data, spans, m)
    return data


def describe(case: tuple[int, list[tuple[Any, ...]], list[tuple[Any, ...]]]) -> str:
    seed, structural, raw = case
    return f"seed {seed}: " + (", ".join(repr(m) for m in structural + raw) or "unmutated")


# ---------------------------------------------------------------------------------------------
# one case, end to end
# ---------------------------------------------------------------------------------------------

@dataclass
class Result:
    outcome: str  # "refused" (by the pre-validator), "refused by load" (a typed error later), "loaded"
    detail: str
    failure: str | None = None  # what went wrong, if anything: a crash, a hang, an untyped error, moved logits


def prevalidate(path: Path, arch: str, shapes: Any) -> Exception | None:
    """The checks LoRAAdapter makes before llama.cpp sees the file; the typed error, or None if they pass."""
    from loramux.engine.factor_stage import delta_bound_problems
    from loramux.errors import AdapterError, LoramuxError
    from loramux.gguf_io import read_adapter_factors, validate_adapter

    try:
        info = validate_adapter(path, arch, shapes, check_values=True)
        huge = delta_bound_problems(read_adapter_factors(path), info.alpha)
    except LoramuxError as e:
        return e
    if not huge:
        return None
    err = AdapterError(str(path), "its delta could overflow F32", problems=huge)
    err.field = "delta bound"  # type: ignore[attr-defined]
    return err


class Fuzzer:
    """Runs cases against one engine (in this process) and one Worker (llama.cpp in a child process)."""

    def __init__(self, engine: Any, worker: Worker, workdir: Path, prompt: str) -> None:
        import numpy as np

        self.engine, self.worker, self.workdir, self.prompt = engine, worker, workdir, prompt
        self.arch, self.shapes = engine.model.architecture, engine.model.tensor_shapes
        self.before = np.array(engine.logits(prompt), copy=True)
        self.n = 0
        self.keep_outcomes: set[str] = set()  # also keep cases with these outcomes (e.g. "refused by load")

    def run(self, data: bytes, name: str) -> Result:
        """Write the case, pre-validate it, load it in the child if it passed, then through the engine."""
        self.n += 1
        path = self.workdir / "case.gguf"
        path.write_bytes(data)
        res = self._run(path)
        if res.outcome in self.keep_outcomes:
            KEEP.mkdir(parents=True, exist_ok=True)
            slug = res.outcome.replace(" ", "-").replace(",", "")
            (KEEP / f"{slug}-{hashlib.sha256(data).hexdigest()[:16]}.gguf").write_bytes(data)
        if res.failure:
            KEEP.mkdir(parents=True, exist_ok=True)
            keep = KEEP / f"failing-{hashlib.sha256(data).hexdigest()[:16]}.gguf"
            keep.write_bytes(data)
            res.failure = f"{name}: {res.failure} (file kept: {keep})"
        return res

    def _run(self, path: Path) -> Result:
        import numpy as np

        from loramux.errors import LoramuxError

        try:
            err = prevalidate(path, self.arch, self.shapes)
        except Exception as e:  # noqa: BLE001 - an untyped error is the finding
            return Result("refused", "", f"untyped {type(e).__name__} in pre-validation: {e}")
        res = Result("refused", f"{type(err).__name__}: {getattr(err, 'field', '')}") if err else None
        if err is None:
            child = self.worker.load(path)
            if child["outcome"] in ("signal", "hang", "untyped"):
                return Result("loaded", "", f"llama.cpp load in a child process: {child}")
            res = Result("loaded" if child["outcome"] == "ok" else "refused by load", child.get("detail", ""))
        try:
            self.engine.load_lora(path, name="fuzz", scale=1.0)
        except LoramuxError:
            pass
        except Exception as e:  # noqa: BLE001
            return Result(res.outcome, res.detail, f"untyped {type(e).__name__} from Engine.load_lora: {e}")
        else:
            try:
                # Not a failure of the load path: extreme but finite factors (the delta bound's business)
                # can still overflow downstream F16 steps (the KV cache) for this adapter's requests.
                if not np.isfinite(self.engine.logits(self.prompt, loras={"fuzz": 1.0})).all():
                    res.outcome = "loaded, non-finite logits"
            finally:
                self.engine.remove_lora("fuzz")
        if not np.array_equal(self.engine.logits(self.prompt), self.before):
            res.failure = "the base model's logits changed after the case"
        return res


# ---------------------------------------------------------------------------------------------
# the loader subprocess
# ---------------------------------------------------------------------------------------------

class Worker:
    """One child process that loads adapters into llama.cpp with loramux; restarted after a crash."""

    def __init__(self, base: Path, log: Path | None = None) -> None:
        self.base, self.log = base, log
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        err = open(self.log, "a") if self.log else subprocess.DEVNULL  # noqa: SIM115 - lives with the child
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        self.proc = subprocess.Popen([sys.executable, __file__, "worker", str(self.base)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        if err is not subprocess.DEVNULL:
            err.close()
        return self.proc

    def load(self, path: Path, timeout: float = 60.0) -> dict[str, Any]:
        """{"outcome": "ok" | "typed" | "untyped" | "signal" | "hang", ...} for loading `path`."""
        proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(str(path) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            proc.kill()
            proc.wait()
            self.proc = None
            return {"outcome": "hang", "detail": f"no answer in {timeout:.0f} s"}
        if box and box[0].strip():
            return json.loads(box[0])
        rc = proc.wait()
        self.proc = None
        return {"outcome": "signal" if rc < 0 else "untyped", "detail": f"worker exited with {rc}"}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def _worker(base: str) -> None:
    from loramux.engine.adapters import LoRAAdapter
    from loramux.engine.model import Model
    from loramux.errors import LoramuxError

    # answers go to a private copy of stdout; fd 1 becomes stderr, so whatever native code prints
    # (ggml's abort handler runs gdb for a backtrace) cannot be taken for an answer
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    model = Model(base)
    for line in sys.stdin:
        try:
            LoRAAdapter(model, line.strip(), "fuzz").close()
            out = {"outcome": "ok"}
        except LoramuxError as e:
            out = {"outcome": "typed", "error": type(e).__name__, "field": getattr(e, "field", None),
                   "detail": str(e).splitlines()[0][:300]}
        except Exception as e:  # noqa: BLE001 - exactly what the fuzz test looks for
            out = {"outcome": "untyped", "error": type(e).__name__, "detail": str(e)[:300]}
        print(json.dumps(out), file=answers, flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(sys.argv[2])
