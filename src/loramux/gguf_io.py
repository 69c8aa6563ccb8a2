"""Read and write GGUF files without llama.cpp: headers, adapter factors, control vectors.

The header reader is our own: `gguf.GGUFReader` materialises every metadata array (a 262k-token
vocabulary takes tens of seconds), while validating an adapter or reading a base model's tensor
shapes needs only the key/value table and the tensor directory. Writing goes through the `gguf`
package, llama.cpp's own writer, so files load anywhere llama.cpp does.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from . import ggml_types as G
from .errors import AdapterError, ControlVectorError, LoramuxError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# The float types an adapter may carry, by ggml type id (the table is ggml_types'; inspect.py reads it here).
FLOAT_TYPES = G.FLOAT_NAMES

#: GGUF metadata value types (gguf spec, `gguf_type`): the struct format of each scalar type.
VALUE_FORMATS: dict[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                                 10: "<Q", 11: "<q", 12: "<d"}
VALUE_STRING, VALUE_ARRAY = 8, 9  # no fixed size: (length, bytes) and (element type, count, elements)
VALUE_UINT32 = 4  # the type of general.file_type


class GGUFFormatError(LoramuxError):
    """The file is not a readable GGUF (bad magic, truncated header, unknown type)."""

    code = "invalid_gguf"

    def __init__(self, path: str, message: str):
        self.path = str(path)
        super().__init__(f"{path}: {message}",
                         hint="check that the file is a complete GGUF (re-download or re-convert it)")


@dataclass(frozen=True)
class TensorInfo:
    """One entry of a GGUF tensor directory. `shape` is numpy order (ggml `ne` reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # relative to the start of the data section

    @property
    def ne(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass
class GGUFHeader:
    """Metadata and tensor directory of a GGUF file."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int
    file_size: int
    array_lengths: dict[str, int] = field(default_factory=dict)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    @property
    def file_type(self) -> str | None:
        return self.metadata.get("general.type")

    def arch_value(self, key: str, default: Any = None) -> Any:
        """Value of `<architecture>.<key>` (e.g. ``block_count``)."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Reader:
    def __init__(self, f: BinaryIO, path: str):
        self.f, self.path = f, path

    def read(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise GGUFFormatError(self.path, "file ends inside the GGUF header (truncated)")
        return b

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > 1 << 30:
            raise GGUFFormatError(self.path, f"implausible string length {n} (corrupt header)")
        return self.read(n).decode("utf-8", errors="replace")

    def value(self, vtype: int, keep_arrays: bool) -> tuple[Any, int | None]:
        if vtype in VALUE_FORMATS:
            return self.scalar(VALUE_FORMATS[vtype]), None
        if vtype == VALUE_STRING:
            return self.string(), None
        if vtype != VALUE_ARRAY:
            raise GGUFFormatError(self.path, f"unknown metadata value type {vtype}")
        etype, n = self.scalar("<I"), self.scalar("<Q")
        if etype in VALUE_FORMATS:
            size = struct.calcsize(VALUE_FORMATS[etype])
            raw = self.read(size * n)
            if not keep_arrays:
                return None, n
            return list(np.frombuffer(raw, dtype=np.dtype(VALUE_FORMATS[etype])).tolist()), n
        if etype == VALUE_STRING:
            items = []
            for _ in range(n):
                ln = self.scalar("<Q")
                s = self.read(ln)
                if keep_arrays:
                    items.append(s.decode("utf-8", errors="replace"))
            return (items if keep_arrays else None), n
        raise GGUFFormatError(self.path, f"unsupported array element type {etype}")


def read_header(path: str | os.PathLike[str], *, keep_arrays: int = 4096) -> GGUFHeader:
    """Read a GGUF's metadata and tensor directory.

    Arrays longer than `keep_arrays` elements (vocabularies) are skipped: their length is kept in
    `array_lengths` and their value is None.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        f = p.open("rb")
    except OSError as e:
        raise GGUFFormatError(str(p), f"cannot open: {e.strerror or e}") from e
    with f:
        r = _Reader(f, str(p))
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            got = magic[:4]
            raise GGUFFormatError(str(p), f"not a GGUF file (starts with {got!r}, expected b'GGUF')")
        version = r.scalar("<I")
        n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
        if n_tensors > 1 << 24 or n_kv > 1 << 24:
            raise GGUFFormatError(str(p), "implausible tensor/key counts (corrupt header)")
        metadata: dict[str, Any] = {}
        lengths: dict[str, int] = {}
        for _ in range(n_kv):
            key = r.string()
            vtype = r.scalar("<I")
            if vtype == VALUE_ARRAY:
                pos = f.tell()
                etype, n = r.scalar("<I"), r.scalar("<Q")
                f.seek(pos)
                val, n = r.value(vtype, keep_arrays=n <= keep_arrays)
                lengths[key] = n
                _ = etype
            else:
                val, _n = r.value(vtype, True)
            metadata[key] = val
        tensors: dict[str, TensorInfo] = {}
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.scalar("<I")
            ne = tuple(r.scalar("<Q") for _ in range(n_dims))
            ttype, off = r.scalar("<I"), r.scalar("<Q")
            tensors[name] = TensorInfo(name, tuple(reversed(ne)), ttype, off)
        align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_offset = -(-f.tell() // align) * align
    return GGUFHeader(p, version, metadata, tensors, data_offset, size, lengths)


def tensor_nbytes(info: TensorInfo) -> int | None:
    """Byte size of a float tensor (None for quantized types, which we never read here)."""
    size = G.ELEMENT_SIZE.get(info.ggml_type)
    return None if size is None else size * info.n_elements


def read_float_tensor(header: GGUFHeader, name: str) -> np.ndarray:
    """Read one F32/F16/BF16 tensor as float32, numpy layout."""
    info = header.tensors[name]
    nbytes = tensor_nbytes(info)
    if nbytes is None:
        raise GGUFFormatError(str(header.path), f"tensor {name} is not F32/F16/BF16")
    start = header.data_offset + info.offset
    if start + nbytes > header.file_size:
        raise GGUFFormatError(str(header.path), f"tensor {name} runs past the end of the file (truncated)")
    with open(header.path, "rb") as f:
        f.seek(start)
        raw = f.read(nbytes)
    return G.decode(np.frombuffer(raw, dtype=G.STORAGE_DTYPE[info.ggml_type]), info.ggml_type).reshape(info.shape)


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# LoRA adapters
# ---------------------------------------------------------------------------------------------

LORA_A, LORA_B = ".lora_a", ".lora_b"


@dataclass(frozen=True)
class AdapterFileInfo:
    """What an adapter GGUF declares, after validation against a base model."""

    path: Path
    architecture: str
    rank: int
    alpha: float
    targets: tuple[str, ...]  # base tensor names, in file order
    dtype: str  # F32 / F16 / BF16 (the factors' type; mixed files report the first)
    invocation_tokens: tuple[int, ...]
    size: int
    shapes: Mapping[str, tuple[tuple[int, int], tuple[int, int]]]  # name -> (A shape, B shape)


def validate_adapter(path: str | os.PathLike[str], base_arch: str | None = None,
                     base_shapes: Mapping[str, tuple[int, ...]] | None = None, *,
                     check_values: bool = False) -> AdapterFileInfo:
    """Check an adapter GGUF against a base model and return what it declares.

    Raises one AdapterError listing every problem found: not a LoRA, another architecture,
    unpaired or non-float factors, targets missing from the base, incompatible shapes, and (with
    `check_values`) NaN/Inf factors.
    """
    p = Path(path)
    if not p.exists():
        raise AdapterError(str(p), "file not found", hint="check the path (relative paths are resolved "
                           f"from {Path.cwd()})")
    if not p.is_file():
        raise AdapterError(str(p), "not a regular file")
    try:
        h = read_header(p)
    except GGUFFormatError as e:
        raise AdapterError(str(p), e.message.split(": ", 1)[-1], hint=e.hint) from e
    problems = _adapter_header_problems(h, base_arch)
    shapes, targets, dtypes = {}, [], []
    for name, info in h.tensors.items():
        if name.endswith(LORA_A):
            base = name[: -len(LORA_A)]
            b = h.tensors.get(base + LORA_B)
            if b is None:
                problems.append(f"{name} has no matching {base + LORA_B}")
                continue
            targets.append(base)
            problems += _pair_problems(base, info, b, base_shapes, h.file_size, h.data_offset)
            shapes[base] = (info.shape, b.shape)
            dtypes.append(FLOAT_TYPES.get(info.ggml_type, str(info.ggml_type)))
        elif name.endswith(LORA_B):
            if name[: -len(LORA_B)] + LORA_A not in h.tensors:
                problems.append(f"{name} has no matching {name[: -len(LORA_B)] + LORA_A}")
        else:
            problems.append(f"tensor {name} is not a LoRA factor (names must end in .lora_a/.lora_b)")
    if not targets and not problems:
        problems.append("the file holds no LoRA factors")
    if check_values and not problems:
        problems += _value_problems(h, targets)
    if problems:
        raise AdapterError(str(p), f"cannot be used{_against(base_arch)}", problems=problems,
                           hint="is this the adapter for this base model? `loramux inspect` shows what it holds")
    alpha = float(h.metadata.get("adapter.lora.alpha", 0.0) or 0.0)
    inv = tuple(int(t) for t in (h.metadata.get("adapter.alora.invocation_tokens") or ()))
    rank = shapes[targets[0]][0][0]
    return AdapterFileInfo(p, h.architecture or "?", rank, alpha, tuple(targets), dtypes[0], inv,
                           h.file_size, shapes)


def _value_problems(h: GGUFHeader, targets: list[str]) -> list[str]:
    bad = []
    for t in targets:
        for suffix in (LORA_A, LORA_B):
            if not np.isfinite(read_float_tensor(h, t + suffix)).all():
                bad.append(t + suffix)
    if not bad:
        return []
    return [f"{len(bad)} factor tensors contain NaN or Inf, e.g. {', '.join(bad[:3])}"]


def _against(arch: str | None) -> str:
    return f" with this {arch} base model" if arch else ""


def _adapter_header_problems(h: GGUFHeader, base_arch: str | None) -> list[str]:
    problems = []
    gtype = h.metadata.get("general.type")
    if gtype == "model" or (gtype is None and "adapter.type" not in h.metadata):
        problems.append(f"general.type is {gtype!r}: this looks like a base model, not an adapter")
    elif gtype != "adapter":
        problems.append(f"general.type is {gtype!r}, expected 'adapter'")
    atype = h.metadata.get("adapter.type")
    if gtype != "model" and atype != "lora":
        problems.append(f"adapter.type is {atype!r}, expected 'lora'")
    if base_arch and h.architecture != base_arch:
        problems.append(f"general.architecture is {h.architecture!r} but the base model is {base_arch!r}")
    inv = h.metadata.get("adapter.alora.invocation_tokens")
    if inv is not None and not isinstance(inv, list):
        problems.append("adapter.alora.invocation_tokens must be an array of token ids")
    return problems


def _pair_problems(base: str, a: TensorInfo, b: TensorInfo, base_shapes: Mapping[str, tuple[int, ...]] | None,
                   file_size: int, data_offset: int) -> list[str]:
    out = []
    for t in (a, b):
        if t.ggml_type not in FLOAT_TYPES:
            out.append(f"{t.name} has ggml type {t.ggml_type}; factors must be F32, F16 or BF16")
        if len(t.shape) != 2:
            out.append(f"{t.name} has shape {t.shape}; factors are 2-D")
            return out
        nb = tensor_nbytes(t)
        if nb is not None and data_offset + t.offset + nb > file_size:
            out.append(f"{t.name} runs past the end of the file (truncated download?)")
    (r, n_in), (n_out, rb) = a.shape, b.shape
    if r != rb:
        out.append(f"{base}: rank of lora_a ({r}) != rank of lora_b ({rb}); A must be (r, in), B (out, r)")
    if base_shapes is not None:
        bs = base_shapes.get(base)
        if bs is None:
            out.append(f"target {base} does not exist in the base model")
        elif len(bs) != 2 or (bs[1], bs[0]) != (n_in, n_out):
            hint = " (transposed factors?)" if len(bs) == 2 and (bs[0], bs[1]) == (n_in, n_out) else ""
            out.append(f"{base}: factors give a ({n_out}, {n_in}) delta but the base tensor is {tuple(bs)}{hint}")
    return out


def read_adapter_factors(path: str | os.PathLike[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """All factors of an adapter GGUF as float32 (A (r, in), B (out, r)), in file order."""
    h = read_header(path)
    out = {}
    for name in h.tensors:
        if name.endswith(LORA_A):
            base = name[: -len(LORA_A)]
            out[base] = (read_float_tensor(h, name), read_float_tensor(h, base + LORA_B))
    return out


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it into place only if the block succeeds."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp creates 0600 files; give the result the mode any new file would get (umask).
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _gguf_raw(arr: np.ndarray, dtype: str) -> tuple[np.ndarray, Any]:
    import gguf

    a = np.ascontiguousarray(arr, dtype=np.float32)
    if dtype == "f32":
        return a, None
    if dtype == "f16":
        return a.astype(np.float16), None
    if dtype == "bf16":
        return G.to_bf16_bits(a), gguf.GGMLQuantizationType.BF16
    raise ValueError(f"unknown dtype {dtype!r}; use f32, f16 or bf16")


def write_adapter(path: str | os.PathLike[str], architecture: str,
                  factors: Mapping[str, tuple[np.ndarray, np.ndarray]], alpha: float, *,
                  dtype: str = "f32", invocation_tokens: list[int] | tuple[int, ...] | None = None,
                  name: str | None = None, extra: Mapping[str, Any] | None = None) -> Path:
    """Write a llama.cpp LoRA adapter GGUF atomically. Factors in PEFT layout: A (r, in), B (out, r)."""
    import gguf

    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(str(tmp), architecture)
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", float(alpha))
        if name:
            w.add_name(name)
        if invocation_tokens:
            # llama.cpp rejects INT32 arrays here: the element type must be UINT32.
            w.add_array("adapter.alora.invocation_tokens",
                        np.asarray(invocation_tokens, dtype=np.uint32).tolist())
            _force_uint32_array(w, "adapter.alora.invocation_tokens")
        for k, v in (extra or {}).items():
            _add_kv(w, k, v)
        for base, (a, b) in factors.items():
            for suffix, arr in ((LORA_A, a), (LORA_B, b)):
                data, raw = _gguf_raw(arr, dtype)
                if raw is None:
                    w.add_tensor(base + suffix, data)
                else:
                    w.add_tensor(base + suffix, data, raw_shape=data.shape, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return Path(path)


def _force_uint32_array(w: Any, key: str) -> None:
    import gguf

    for kv in w.kv_data:
        if key in kv:
            old = kv[key]
            kv[key] = gguf.GGUFValue(value=old.value, type=gguf.GGUFValueType.ARRAY,
                                     sub_type=gguf.GGUFValueType.UINT32)


def _add_kv(w: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))


# ---------------------------------------------------------------------------------------------
# Control vectors (llama.cpp's format: architecture "controlvector", F32 tensors direction.N)
# ---------------------------------------------------------------------------------------------

def read_control_vector(path: str | os.PathLike[str]) -> tuple[str | None, dict[int, np.ndarray]]:
    """Read a control-vector GGUF: (model_hint, {layer: direction}). Layers are 1-based as in the file."""
    try:
        h = read_header(path)
    except GGUFFormatError as e:
        raise ControlVectorError(str(path), e.message.split(": ", 1)[-1]) from e
    problems = []
    if h.architecture != "controlvector":
        problems.append(f"general.architecture is {h.architecture!r}, expected 'controlvector'")
    dirs: dict[int, np.ndarray] = {}
    for name, info in h.tensors.items():
        if not name.startswith("direction."):
            continue
        try:
            layer = int(name.split(".", 1)[1])
        except ValueError:
            problems.append(f"tensor {name}: layer index is not an integer")
            continue
        if info.ggml_type != G.F32 or len(info.shape) != 1:
            problems.append(f"tensor {name} must be a 1-D F32 vector")
            continue
        dirs[layer] = read_float_tensor(h, name)
    if not dirs and not problems:
        problems.append("no direction.N tensors found")
    if problems:
        raise ControlVectorError(str(path), "not a usable control vector", problems=problems)
    return h.metadata.get("controlvector.model_hint"), dirs


def write_control_vector(path: str | os.PathLike[str], directions: Mapping[int, np.ndarray],
                         model_hint: str, layer_count: int | None = None) -> Path:
    """Write a control vector in llama.cpp's format (layers 1-based, like `cvector-generator`)."""
    import gguf

    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(str(tmp), "controlvector")
        w.add_string("controlvector.model_hint", model_hint)
        w.add_int32("controlvector.layer_count", int(layer_count or len(directions)))
        for layer in sorted(directions):
            w.add_tensor(f"direction.{layer}", np.ascontiguousarray(directions[layer], dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return Path(path)
