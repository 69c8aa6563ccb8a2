"""safetensors: a bounded parser of a request body and a writer for the client (in memory), and the
streaming file reader and writer of PEFT conversion (numpy has no bfloat16, and loramux must not need torch).

The format is an 8-byte little-endian header length, a JSON header (name → dtype, shape,
data_offsets; optional ``__metadata__``) and the data. Factor pushes travel in it. The parser checks
everything before it returns (header size and JSON, dtypes, shapes against byte ranges, ranges
inside the body, no overlap) and raises one ParameterError naming the body and every problem.
F32 tensors come back as zero-copy views of the body; F16, BF16 and F64 as float32 copies.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ParameterError
from ..ggml_types import from_bf16_bits
from . import atomic_path

MAX_HEADER_BYTES = 16 << 20
MAX_TENSORS = 65536
_DTYPES: dict[str, Any] = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def parse_safetensors(body: bytes | bytearray | memoryview, what: str = "body") -> dict[str, np.ndarray]:
    """The float tensors of a safetensors file held in memory (name → float32 array), fully checked."""
    buf = memoryview(body).cast("B")
    if len(buf) < 8:
        raise ParameterError(what, f"{len(buf)} bytes is shorter than a safetensors header (8 bytes)")
    n = int.from_bytes(buf[:8], "little")
    if n > min(MAX_HEADER_BYTES, len(buf) - 8):
        raise ParameterError(what, f"the safetensors header claims {n} bytes; the body has {len(buf) - 8} "
                                   f"after the length (at most {MAX_HEADER_BYTES} are read)")
    try:
        index = json.loads(bytes(buf[8:8 + n]))
    except (ValueError, UnicodeDecodeError) as e:
        raise ParameterError(what, f"the safetensors header is not JSON: {e}") from None
    if not isinstance(index, dict):
        raise ParameterError(what, "the safetensors header is not a JSON object")
    index.pop("__metadata__", None)
    if len(index) > MAX_TENSORS:
        raise ParameterError(what, f"{len(index)} tensors; at most {MAX_TENSORS} are read")
    data = buf[8 + n:]
    problems: list[str] = []
    out: dict[str, np.ndarray] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in index.items():
        arr = _tensor(name, entry, data, problems)
        if arr is not None:
            out[name] = arr
            spans.append((entry["data_offsets"][0], entry["data_offsets"][1], name))
    spans.sort()
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            problems.append(f"{n0} and {n1} overlap in the data section")
    if problems:
        raise ParameterError(what, "not a usable safetensors file:\n  - " + "\n  - ".join(problems[:8]))
    return out


def _tensor(name: str, entry: Any, data: memoryview, problems: list[str]) -> np.ndarray | None:
    if not isinstance(entry, dict):
        problems.append(f"{name}: its header entry is not an object")
        return None
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _DTYPES:
        problems.append(f"{name}: dtype {dtype!r}; factors must be F32, F16, BF16 or F64")
        return None
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        problems.append(f"{name}: shape {shape!r} is not a list of sizes")
        return None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        problems.append(f"{name}: data_offsets {offsets!r} is not [begin, end]")
        return None
    begin, end = offsets
    size = np.dtype(_DTYPES[dtype]).itemsize * math.prod(shape)
    if not 0 <= begin <= end <= len(data) or end - begin != size:
        problems.append(f"{name}: bytes [{begin}, {end}) do not hold a {dtype} tensor of shape {shape} "
                        f"inside the {len(data)}-byte data section")
        return None
    arr = np.frombuffer(data[begin:end], dtype=_DTYPES[dtype]).reshape(shape)
    if dtype == "BF16":
        return from_bf16_bits(arr).reshape(shape)
    return arr if dtype == "F32" else arr.astype(np.float32)


def dump_safetensors(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> bytes:
    """`tensors` (name → array; numpy or torch, any float dtype) as a safetensors file of F32 tensors."""
    arrays = {}
    for name, t in tensors.items():
        if hasattr(t, "detach"):  # torch
            t = t.detach().float().cpu().numpy()
        arrays[name] = np.ascontiguousarray(np.asarray(t, dtype=np.float32))
    head = _header({n: ("F32", a) for n, a in arrays.items()}, metadata or {})
    return b"".join([head, *(a.tobytes() for a in arrays.values())])


def _header(tensors: Mapping[str, tuple[str, np.ndarray]], metadata: Mapping[str, str]) -> bytes:
    """The length prefix and JSON header of a file holding `tensors` ({name: (dtype, raw array)}) in order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, (dtype, arr) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format asks for an 8-byte aligned data section
    return len(blob).to_bytes(8, "little") + blob


def read_safetensors_index(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """The tensor directory of a safetensors file (without ``__metadata__``) and its data section's offset."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("file is shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        if n > 100 << 20:
            raise ValueError(f"implausible header length {n}")
        index = json.loads(f.read(n))
    index.pop("__metadata__", None)
    return index, 8 + n


def read_safetensors_tensor(path: Path, entry: Mapping[str, Any], data_start: int) -> np.ndarray:
    """One tensor of an index entry, read from the file alone, as float32."""
    begin, end = entry["data_offsets"]
    raw = np.fromfile(path, dtype=np.uint8, count=end - begin, offset=data_start + begin)
    arr = raw.view(_DTYPES[entry["dtype"]])
    if entry["dtype"] == "BF16":
        arr = from_bf16_bits(arr)
    return arr.astype(np.float32).reshape(entry["shape"])


def write_safetensors_file(path: Path, tensors: Mapping[str, tuple[str, np.ndarray]], metadata: Mapping[str, str]) -> None:
    """Write {name: (dtype, raw array)} as a safetensors file, atomically; `raw` already holds the dtype's bytes."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(_header(tensors, metadata))
        for _, arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


__all__ = ["MAX_HEADER_BYTES", "MAX_TENSORS", "dump_safetensors", "parse_safetensors", "read_safetensors_index",
           "read_safetensors_tensor", "write_safetensors_file"]
