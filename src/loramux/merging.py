"""Merge LoRA adapters into a base GGUF and write a new model, optionally re-quantized.

Each base tensor an adapter touches is dequantized (`gguf.quants`), gets `scale·alpha/r·B@A` added
(llama.cpp's own rule, so the merged model equals base+adapter at run time), and is written as F32
(or F16). Every other tensor and the whole metadata block are copied byte for byte: the key/value
section is copied raw, so types, the vocabulary and unknown keys survive exactly, and we never
materialise a 262k-entry vocabulary in Python. Re-quantization is llama.cpp's `llama_model_quantize`
(through `loramux._native`, imported only when needed).
"""

from __future__ import annotations

import math
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ._progress import progress_iter
from .errors import AdapterError, BackendError, ConversionError, ParameterError
from .ggml_types import ELEMENT_SIZE, F16, F32, STORAGE_DTYPE
from .gguf_io import (
    DEFAULT_ALIGNMENT,
    VALUE_ARRAY,
    VALUE_FORMATS,
    VALUE_STRING,
    VALUE_UINT32,
    GGUFFormatError,
    GGUFHeader,
    TensorInfo,
    atomic_path,
    read_adapter_factors,
    read_header,
    validate_adapter,
)

__all__ = ["MergeReport", "merge", "QUANT_TYPES", "quant_ftype"]


def _quant_types() -> dict[str, int]:
    import gguf

    out = {}
    for ft in gguf.LlamaFileType:
        if ft.name == "GUESSED":
            continue
        out[ft.name.removeprefix("MOSTLY_").removeprefix("ALL_")] = int(ft)
    return out


#: llama_ftype of every quantization name `merge(quant=...)` accepts ("Q4_K_M" → 15, "F16" → 1, ...).
QUANT_TYPES: dict[str, int] = _quant_types()


def quant_ftype(quant: str | int) -> int:
    """The llama_ftype number of a quantization name such as "Q4_K_M" (case-insensitive)."""
    if isinstance(quant, int):
        if quant not in QUANT_TYPES.values():
            raise ParameterError("quant", f"{quant} is not a llama_ftype")
        return quant
    key = quant.strip().upper()
    if key not in QUANT_TYPES:
        raise ParameterError("quant", f"unknown quantization {quant!r}",
                             hint="one of " + ", ".join(QUANT_TYPES))
    return QUANT_TYPES[key]


def _ftype_name(ftype: int | None) -> str:
    return next((n for n, v in QUANT_TYPES.items() if v == ftype), str(ftype))


@dataclass
class MergeReport:
    """What `merge` wrote."""

    base: str
    out: str
    loras: list[tuple[str, float]]
    touched: list[str] = field(default_factory=list)  # base tensors that received a delta
    ftype: int | None = None  # llama_ftype the output was quantized to (None: not re-quantized)
    seconds: float = 0.0
    size: int = 0

    @property
    def quant(self) -> str | None:
        return None if self.ftype is None else _ftype_name(self.ftype)

    def summary(self) -> str:
        loras = ", ".join(f"{p} ×{s:g}" for p, s in self.loras)
        q = self.quant or "not re-quantized (merged tensors F32)"
        return (f"wrote {self.out} ({self.size / 2**20:.1f} MiB) in {self.seconds:.1f} s\n"
                f"  base {self.base} + {loras}\n  {len(self.touched)} tensors merged; {q}")


# ---------------------------------------------------------------------------------------------
# raw GGUF plumbing
# ---------------------------------------------------------------------------------------------

_SCALAR_SIZE = {vtype: struct.calcsize(fmt) for vtype, fmt in VALUE_FORMATS.items()}


def _skip_value(f: BinaryIO, vtype: int) -> None:
    if vtype in _SCALAR_SIZE:
        f.seek(_SCALAR_SIZE[vtype], os.SEEK_CUR)
    elif vtype == VALUE_STRING:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, os.SEEK_CUR)
    elif vtype == VALUE_ARRAY:
        etype, n = struct.unpack("<IQ", f.read(12))
        if etype in _SCALAR_SIZE:
            f.seek(n * _SCALAR_SIZE[etype], os.SEEK_CUR)
        else:
            for _ in range(n):
                _skip_value(f, etype)
    else:
        raise ValueError(f"unknown GGUF value type {vtype}")


def _raw_kv(path: Path) -> list[tuple[str, bytes]]:
    """The key/value entries of a GGUF as (key, raw bytes incl. the key), in file order."""
    out = []
    with path.open("rb") as f:
        f.seek(16)  # magic, version, n_tensors
        (n_kv,) = struct.unpack("<Q", f.read(8))
        for _ in range(n_kv):
            start = f.tell()
            (n,) = struct.unpack("<Q", f.read(8))
            key = f.read(n).decode("utf-8", errors="replace")
            (vtype,) = struct.unpack("<I", f.read(4))
            _skip_value(f, vtype)
            end = f.tell()
            f.seek(start)
            out.append((key, f.read(end - start)))
    return out


def _kv_uint32(key: str, value: int) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<II", VALUE_UINT32, value)


def _nbytes(ggml_type: int, n_elements: int) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    return n_elements // block * size


@dataclass
class _OutTensor:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    nbytes: int
    data: Callable[[], np.ndarray]  # produces the bytes (any dtype, C order) when written


def _write_gguf(dst: Path, version: int, kvs: Sequence[bytes], tensors: Sequence[_OutTensor], align: int,
                progress: bool | None) -> None:
    with dst.open("wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)))
        for kv in kvs:
            f.write(kv)
        offset = 0
        for t in tensors:
            name = t.name.encode()
            f.write(struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.shape)))
            f.write(struct.pack(f"<{len(t.shape)}Q", *reversed(t.shape)))
            f.write(struct.pack("<IQ", t.ggml_type, offset))
            offset += -(-t.nbytes // align) * align
        f.write(b"\0" * (-f.tell() % align))
        for t in progress_iter(tensors, total=len(tensors), desc="write", enabled=progress, unit="tensor"):
            data = np.ascontiguousarray(t.data())
            if data.nbytes != t.nbytes:  # never write a silently corrupt model
                raise ConversionError(str(dst), f"{t.name} has {data.nbytes} bytes, expected {t.nbytes}",
                                      hint="is the base model file truncated?")
            f.write(data.tobytes())
            f.write(b"\0" * (-t.nbytes % align))


# ---------------------------------------------------------------------------------------------
# merging
# ---------------------------------------------------------------------------------------------

@dataclass
class _Plan:
    header: GGUFHeader
    deltas: dict[str, list[tuple[np.ndarray, np.ndarray, float]]]  # target → [(A, B, multiplier)]
    ftype: int | None
    base_ftype: int | None


def merge(base: str | os.PathLike[str], loras: Sequence[tuple[str | os.PathLike[str], float] | str],
          out: str | os.PathLike[str], quant: str | int | None = "auto", *, dtype: str = "f32",
          progress: bool | None = None, nthread: int = 0) -> MergeReport:
    """Merge `loras` ([(adapter.gguf, scale), ...]) into `base` and write `out` atomically.

    `quant`: "auto" re-quantizes to the base's `general.file_type`; a name ("Q4_K_M", "Q8_0",
    "F16", "F32", ...) or llama_ftype number picks another; None writes the merged tensors as
    `dtype` ("f32" or "f16") and leaves every other tensor as it was. Raises one ConversionError
    listing every problem before anything is written.
    """
    t0 = time.monotonic()
    if dtype not in ("f32", "f16"):
        raise ParameterError("dtype", f"{dtype!r}: merged tensors are written as 'f32' or 'f16'")
    specs = [(str(x), 1.0) if isinstance(x, (str, os.PathLike)) else (str(x[0]), float(x[1])) for x in loras]
    plan = _plan(Path(base), specs, quant)
    dst = Path(out)
    with atomic_path(dst) as tmp:
        _produce(plan, tmp, dtype, progress, nthread)
    report = MergeReport(str(base), str(dst), specs, sorted(plan.deltas), plan.ftype,
                         time.monotonic() - t0, dst.stat().st_size)
    return report


def _plan(base: Path, specs: list[tuple[str, float]], quant: str | int | None) -> _Plan:
    """Validate everything and load the factors; raise one ConversionError with every problem."""
    problems: list[str] = []
    h = None
    try:
        h = read_header(base)
        if h.metadata.get("general.type") == "adapter":
            problems.append(f"{base} is an adapter, not a base model")
    except GGUFFormatError as e:
        problems.append(e.message)
    ftype = None
    try:
        ftype = _resolve_quant(quant, h)
    except ParameterError as e:
        problems.append(str(e))
    if not specs:
        problems.append("no adapters given (use --lora SRC[:SCALE])")
    deltas: dict[str, list[tuple[np.ndarray, np.ndarray, float]]] = {}
    for src, scale in specs:
        if not math.isfinite(scale):
            problems.append(f"{src}: scale {scale} is not a finite number")
        if h is not None:
            _add_adapter(src, scale, h, deltas, problems)
    if h is not None:
        problems += _dequant_problems(h, deltas)
    if problems or h is None:
        raise ConversionError(str(base), "cannot merge", problems=problems,
                              hint="`loramux inspect` shows what a file holds")
    base_ftype = h.metadata.get("general.file_type")
    return _Plan(h, deltas, ftype, None if base_ftype is None else int(base_ftype))


def _resolve_quant(quant: str | int | None, h: GGUFHeader | None) -> int | None:
    if quant is None:
        return None
    if isinstance(quant, str) and quant.lower() == "auto":
        if h is None:
            return None
        ft = h.metadata.get("general.file_type")
        return None if ft is None else quant_ftype(int(ft))
    return quant_ftype(quant)


def _add_adapter(src: str, scale: float, h: GGUFHeader,
                 deltas: dict[str, list[tuple[np.ndarray, np.ndarray, float]]], problems: list[str]) -> None:
    shapes = {n: t.shape for n, t in h.tensors.items()}
    try:
        info = validate_adapter(src, h.architecture, shapes)
    except AdapterError as e:
        problems.extend([f"{src}: {p}" for p in e.problems] or [e.message])
        return
    if info.invocation_tokens:
        problems.append(f"{src}: an aLoRA adapter (invocation tokens) acts only after its invocation; "
                        "merged into the weights it would act from the first token")
        return
    for target, (a, b) in read_adapter_factors(src).items():
        rank = a.shape[0]
        # llama.cpp's rule: scale·alpha/rank·B@A, or scale·B@A when the file's alpha is 0.
        mult = scale * (info.alpha / rank if info.alpha else 1.0)
        deltas.setdefault(target, []).append((a, b, mult))


def _dequant_problems(h: GGUFHeader, deltas: dict[str, Any]) -> list[str]:
    import gguf

    bad = {}
    for target in deltas:
        t = h.tensors[target].ggml_type
        try:
            qt = gguf.GGMLQuantizationType(t)
            gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qt][1]), np.uint8), qt)
        except (ValueError, NotImplementedError, KeyError):
            bad.setdefault(t, target)
    return [f"{n}: ggml type {t} cannot be dequantized by the gguf package" for t, n in bad.items()]


def dequantize_tensor(h: GGUFHeader, info: TensorInfo, mm: np.ndarray) -> np.ndarray:
    """One base tensor as float32, numpy shape, from a uint8 memmap of the file."""
    import gguf

    start = h.data_offset + info.offset
    raw = mm[start:start + _nbytes(info.ggml_type, info.n_elements)]
    rows = max(1, info.n_elements // info.shape[-1]) if info.shape else 1
    qt = gguf.GGMLQuantizationType(info.ggml_type)
    # copy: F32 "dequantization" is a read-only view of the memmap, and callers add deltas in place
    return np.array(gguf.quants.dequantize(raw.reshape(rows, -1), qt), dtype=np.float32).reshape(info.shape)


def _produce(plan: _Plan, dst: Path, dtype: str, progress: bool | None, nthread: int) -> None:
    """Write the merged model to `dst`, through llama.cpp's quantizer when a target type is set."""
    ftype = plan.ftype
    all_f32 = ftype == QUANT_TYPES["F32"]
    if ftype is None or all_f32:
        _write_merged(plan, dst, dtype, dequant_all=all_f32, progress=progress)
        return
    from . import _native  # llama.cpp only when re-quantizing

    # llama.cpp refuses to re-quantize an already quantized tensor (allow_requantize is off), so
    # untouched quantized tensors may stay raw only if the target mix is the base's own (then
    # llama.cpp picks the same type and copies them); otherwise they go through F32.
    keep_raw = ftype == plan.base_ftype
    inter = dst.with_name(dst.name + ".f32.gguf")
    try:
        _write_merged(plan, inter, "f32", dequant_all=not keep_raw, progress=progress)
        try:
            _native.model_quantize(str(inter), str(dst), ftype, nthread)
        except BackendError:
            if not keep_raw:
                raise
            _write_merged(plan, inter, "f32", dequant_all=True, progress=progress)
            _native.model_quantize(str(inter), str(dst), ftype, nthread)
    finally:
        if inter.exists():
            inter.unlink()


def _write_merged(plan: _Plan, dst: Path, dtype: str, *, dequant_all: bool, progress: bool | None) -> None:
    h = plan.header
    mm = np.memmap(h.path, dtype=np.uint8, mode="r")
    kvs = _raw_kv(h.path)
    if dequant_all:  # every tensor becomes F32: say so in the header
        kvs = [(k, _kv_uint32(k, QUANT_TYPES["F32"]) if k == "general.file_type" else raw) for k, raw in kvs]
    tensors = [_out_tensor(h, info, mm, plan.deltas.get(name), dtype, dequant_all)
               for name, info in h.tensors.items()]
    align = int(h.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    _write_gguf(dst, h.version, [raw for _, raw in kvs], tensors, align, progress)


def _out_tensor(h: GGUFHeader, info: TensorInfo, mm: np.ndarray,
                deltas: list[tuple[np.ndarray, np.ndarray, float]] | None, dtype: str, dequant_all: bool
                ) -> _OutTensor:
    if deltas is None and (not dequant_all or info.ggml_type == F32):
        start = h.data_offset + info.offset
        nb = _nbytes(info.ggml_type, info.n_elements)
        return _OutTensor(info.name, info.shape, info.ggml_type, nb, lambda: mm[start:start + nb])
    out_type = F16 if (deltas and dtype == "f16") else F32

    def data() -> np.ndarray:
        w = dequantize_tensor(h, info, mm)
        for a, b, mult in deltas or ():
            w += np.float32(mult) * (b @ a)
        return w.astype(STORAGE_DTYPE[out_type])

    return _OutTensor(info.name, info.shape, out_type, info.n_elements * ELEMENT_SIZE[out_type], data)

