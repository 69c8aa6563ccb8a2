"""A bounded GGUF header reader: what a file claims is checked against the file before it is read.

Every count (tensors, keys, array elements), every string length, every tensor dimension and data
range, the data offset and `general.alignment` are checked against the bytes the file really has
(and against sane maxima) *before* anything is allocated or read, so the cost of reading a header
is bounded by the header's real size, never by the sizes it claims. The rules are llama.cpp's own
(ggml/src/gguf.cpp of the pinned llama-cpp-python): a header this reader accepts is one llama.cpp's
parser accepts too, and anything else is a `GGUFFormatError` whose `field` names what was wrong.

`PinnedFile` opens a file once, so that the checks and llama.cpp's load read the same bytes.
"""

from __future__ import annotations

import math
import os
import stat
import struct
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from .. import ggml_types as G
from ..errors import AdapterError, GGUFFormatError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SUPPORTED_VERSIONS = (2, 3)  # llama.cpp refuses v1 (32-bit counts) and anything newer than GGUF_VERSION 3

#: GGUF metadata value types (gguf spec, `gguf_type`): the struct format of each scalar type.
VALUE_FORMATS: dict[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                                 10: "<Q", 11: "<q", 12: "<d"}
VALUE_STRING, VALUE_ARRAY = 8, 9  # no fixed size: (length, bytes) and (element type, count, elements)
VALUE_UINT32 = 4  # the type of general.file_type and general.alignment
VALUE_FLOAT32 = 6  # the type of adapter.lora.alpha
VALUE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32",
               7: "BOOL", 8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}

#: (elements per block, bytes per block) of every ggml type a GGUF may hold, by id (ggml.c type_traits;
#: ids 4, 5 and 31-33, 36-38 were removed from ggml and are refused, as llama.cpp refuses them).
GGML_BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
    34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18), 42: (64, 18),
}

# Limits. The first four are llama.cpp's; the others are far above any real file and only keep a
# crafted header from costing more than its own bytes.
MAX_STRING = 1 << 30  # GGUF_MAX_STRING_LENGTH
MAX_ARRAY = 1 << 30  # GGUF_MAX_ARRAY_ELEMENTS
MAX_NAME = 63  # GGML_MAX_NAME - 1: a tensor name must fit ggml_tensor.name with its NUL
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY = 65535  # the gguf spec's limit on a key's length
MAX_COUNT = 1 << 24  # tensors or keys in one file
INT64_MAX = (1 << 63) - 1
#: Most bytes a header (everything before the tensor data) may take. A 262k-token vocabulary with its
#: merges is about 10 MiB; an adapter's header a few KiB (validate_adapter uses ADAPTER_MAX_HEADER).
DEFAULT_MAX_HEADER = 256 << 20
ADAPTER_MAX_HEADER = 16 << 20
# The fewest bytes one entry can take: a key-value pair (key length, a 1-byte key, value type, a 1-byte
# value) and a tensor entry (name length, n_dims, type, offset).
MIN_KV_BYTES, MIN_TENSOR_BYTES = 8 + 1 + 4 + 1, 8 + 4 + 4 + 8
_CHUNK = 1 << 20
_U64 = struct.Struct("<Q")


def format_error(path: str, field: str, problem: str) -> GGUFFormatError:
    """A GGUFFormatError about one field of the header; `err.field` names it."""
    return GGUFFormatError(path, f"{field}: {problem}", field=field)


@dataclass(frozen=True)
class TensorInfo:
    """One entry of a GGUF tensor directory. `shape` is numpy order (ggml `ne` reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # relative to the start of the data section
    nbytes: int = 0  # bytes of data, from the shape and the type's block size

    @property
    def ne(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass
class GGUFHeader:
    """Metadata and tensor directory of a GGUF file (checked: see the module docstring)."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int
    file_size: int
    array_lengths: dict[str, int] = field(default_factory=dict)
    #: key -> (value type, element type or None): the GGUF types of each value, as stored
    value_types: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    alignment: int = DEFAULT_ALIGNMENT

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    @property
    def file_type(self) -> str | None:
        return self.metadata.get("general.type")

    def arch_value(self, key: str, default: Any = None) -> Any:
        """Value of `<architecture>.<key>` (e.g. ``block_count``)."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Cursor:
    """Reads a header front to back from a descriptor; a length is checked before it is read."""

    def __init__(self, fd: int, path: str, size: int, limit: int) -> None:
        self.fd, self.path, self.size, self.limit = fd, path, size, limit
        self.pos, self.at, self.buf = 0, 0, b""

    def fail(self, field: str, problem: str) -> NoReturn:
        raise format_error(self.path, field, problem)

    def room(self) -> int:
        """Bytes the rest of the header may still take: up to the end of the file, or to the limit."""
        return min(self.size, self.limit) - self.pos

    def need(self, n: int, field: str) -> None:
        if n > self.size - self.pos:
            self.fail(field, f"needs {n} bytes at offset {self.pos} but only {self.size - self.pos} remain "
                             "(truncated or corrupt header)")
        if self.pos + n > self.limit:
            self.fail(field, f"takes the header past {self.limit} bytes, more than any real GGUF has "
                             "(corrupt header)")

    def take(self, n: int, field: str) -> bytes:
        self.need(n, field)
        off = self.pos - self.at
        if off < 0 or off + n > len(self.buf):
            # never past the end or the limit: u64()'s fast path reads the buffer unchecked
            self.buf = os.pread(self.fd, max(n, min(_CHUNK, self.size - self.pos, self.limit - self.pos)), self.pos)
            self.at, off = self.pos, 0
            if len(self.buf) < n:
                self.fail(field, "the file got shorter while it was being read")
        self.pos += n
        return self.buf[off:off + n]

    def skip(self, n: int, field: str) -> None:
        self.need(n, field)
        self.pos += n

    def scalar(self, fmt: str, field: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), field))[0]

    def u64(self, field: str) -> int:
        off = self.pos - self.at
        if 0 <= off and off + 8 <= len(self.buf):  # the common case, inlined: vocabularies have 10^5 strings
            self.pos += 8
            return _U64.unpack_from(self.buf, off)[0]
        return self.scalar("<Q", field)

    def string(self, field: str, limit: int = MAX_STRING, keep: bool = True) -> str | None:
        n = self.u64(field)
        if n > limit or n > self.room():
            self.fail(field, f"{n} bytes is implausible: at most {min(limit, max(self.room(), 0))} "
                             "can follow here (corrupt header)")
        if not keep:
            self.skip(n, field)
            return None
        return self.take(n, field).decode("utf-8", errors="replace")


def read_header(path: str | os.PathLike[str], *, keep_arrays: int = 4096, fd: int | None = None,
                max_header: int = DEFAULT_MAX_HEADER) -> GGUFHeader:
    """Read and check a GGUF's metadata and tensor directory; raise GGUFFormatError naming the bad field.

    Arrays longer than `keep_arrays` elements (vocabularies) are skipped: their length is kept in
    `array_lengths` and their value is None. With `fd`, the header is read from that open descriptor
    (see PinnedFile) and `path` only names the file in errors. A header longer than `max_header`
    bytes is refused before it is read.
    """
    p = Path(path)
    if fd is not None:
        return _read(fd, p, os.fstat(fd).st_size, keep_arrays, max_header)
    try:
        own = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block us here
    except OSError as e:
        raise format_error(str(p), "file", f"cannot open: {e.strerror or e}") from e
    try:
        st = os.fstat(own)
        if not stat.S_ISREG(st.st_mode):
            raise format_error(str(p), "file", "not a regular file")
        return _read(own, p, st.st_size, keep_arrays, max_header)
    finally:
        os.close(own)


def _read(fd: int, p: Path, size: int, keep_arrays: int, max_header: int) -> GGUFHeader:
    cur = _Cursor(fd, str(p), size, max_header)
    magic = os.pread(fd, 4, 0)
    if magic != GGUF_MAGIC:
        cur.fail("magic", f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    cur.pos = 4
    version = cur.scalar("<I", "version")
    if version not in SUPPORTED_VERSIONS:
        cur.fail("version", f"GGUF version {version} is not supported (llama.cpp reads versions 2 and 3)")
    n_tensors = cur.u64("n_tensors")
    if n_tensors > MAX_COUNT or n_tensors * MIN_TENSOR_BYTES > cur.room():
        cur.fail("n_tensors", f"{n_tensors} tensors is implausible: the file has room for at most "
                              f"{max(cur.room(), 0) // MIN_TENSOR_BYTES} (corrupt or truncated header)")
    n_kv = cur.u64("n_kv")
    if n_kv > MAX_COUNT or n_kv * MIN_KV_BYTES > cur.room() - n_tensors * MIN_TENSOR_BYTES:
        room = max(cur.room() - n_tensors * MIN_TENSOR_BYTES, 0)
        cur.fail("n_kv", f"{n_kv} key-value pairs is implausible: the file has room for at most "
                         f"{room // MIN_KV_BYTES} (corrupt or truncated header)")
    h = GGUFHeader(p, version, {}, {}, 0, size)
    for i in range(n_kv):
        _read_kv(cur, h, i, keep_arrays)
    h.alignment = _alignment(cur, h)
    for i in range(n_tensors):
        info = _read_tensor_info(cur, i)
        if info.name in h.tensors:
            cur.fail(f"tensor {info.name}", "the name appears twice in the tensor directory")
        h.tensors[info.name] = info
    h.data_offset = -(-cur.pos // h.alignment) * h.alignment
    _check_data(cur, h)
    return h


def _read_kv(cur: _Cursor, h: GGUFHeader, i: int, keep_arrays: int) -> None:
    key = cur.string(f"key #{i} length", MAX_KEY)
    assert key is not None
    if not key:
        cur.fail(f"key #{i}", "the key is empty")
    if key in h.metadata:
        cur.fail(key, "the key appears twice")
    vtype = cur.scalar("<I", f"{key}: value type")
    h.value_types[key] = (vtype, None)
    if vtype in VALUE_FORMATS:
        h.metadata[key] = cur.scalar(VALUE_FORMATS[vtype], key)
    elif vtype == VALUE_STRING:
        h.metadata[key] = cur.string(f"{key}: string length")
    elif vtype == VALUE_ARRAY:
        etype = cur.scalar("<I", f"{key}: array element type")
        n = cur.u64(f"{key}: array count")
        h.metadata[key] = _read_array(cur, key, etype, n, n <= keep_arrays)
        h.array_lengths[key], h.value_types[key] = n, (vtype, etype)
    else:
        cur.fail(f"{key}: value type", f"unknown GGUF value type {vtype} (known: 0-12)")


def _read_array(cur: _Cursor, key: str, etype: int, n: int, keep: bool) -> list[Any] | None:
    if etype in VALUE_FORMATS:
        width = struct.calcsize(VALUE_FORMATS[etype])
    elif etype == VALUE_STRING:
        width = 8  # each string is at least its length field
    else:
        cur.fail(f"{key}: array element type", f"element type {etype} is not a scalar or string type"
                 + (" (arrays of arrays are not allowed)" if etype == VALUE_ARRAY else ""))
    if n > MAX_ARRAY or n * width > cur.room():
        cur.fail(f"{key}: array count", f"{n} elements of {width}+ bytes is implausible: at most "
                                        f"{max(cur.room(), 0) // width} fit in the rest of the file (corrupt header)")
    if etype == VALUE_STRING:
        return _read_strings(cur, key, n, keep)
    if not keep:
        cur.skip(n * width, key)
        return None
    return np.frombuffer(cur.take(n * width, key), dtype=np.dtype(VALUE_FORMATS[etype])).tolist()


def _read_strings(cur: _Cursor, key: str, n: int, keep: bool) -> list[str] | None:
    """A string array; the loop is inlined (vocabularies have 10^5 entries), with cur.string's checks."""
    items: list[str] = []
    end = min(cur.size, cur.limit)
    for j in range(n):
        ln = cur.u64(key)
        if ln > MAX_STRING or cur.pos + ln > end:
            cur.fail(f"{key}[{j}] length", f"{ln} bytes is implausible: at most {min(MAX_STRING, max(end - cur.pos, 0))} "
                                           "can follow here (corrupt header)")
        if keep:
            items.append(cur.take(ln, key).decode("utf-8", errors="replace"))
        else:
            cur.pos += ln  # checked just above against the file and the limit
    return items if keep else None


def _alignment(cur: _Cursor, h: GGUFHeader) -> int:
    key = "general.alignment"
    if key not in h.metadata:
        return DEFAULT_ALIGNMENT
    vtype, _ = h.value_types[key]
    if vtype != VALUE_UINT32:
        cur.fail(key, f"has type {VALUE_NAMES[vtype]}; llama.cpp requires UINT32")
    align = int(h.metadata[key])
    if align <= 0 or align & (align - 1):
        cur.fail(key, f"{align} is not a power of two")
    return align


def _read_tensor_info(cur: _Cursor, i: int) -> TensorInfo:
    name = cur.string(f"tensor #{i} name length")
    assert name is not None
    if len(name.encode()) > MAX_NAME:
        cur.fail(f"tensor #{i} name", f"{name[:80]!r} is longer than ggml's {MAX_NAME} bytes")
    n_dims = cur.scalar("<I", f"tensor {name}: n_dims")
    if n_dims > MAX_DIMS:
        cur.fail(f"tensor {name}: n_dims", f"{n_dims} dimensions; ggml has at most {MAX_DIMS}")
    ne = [cur.scalar("<q", f"tensor {name}: ne[{j}]") for j in range(n_dims)]
    count = 1
    for j, d in enumerate(ne):
        if d < 0:
            cur.fail(f"tensor {name}: ne[{j}]", f"negative dimension {d}")
        count *= d
        if count > INT64_MAX:
            cur.fail(f"tensor {name}: shape", f"{tuple(ne)} has more than 2^63-1 elements (int64 overflow)")
    ttype = cur.scalar("<I", f"tensor {name}: type")
    if ttype not in GGML_BLOCKS:
        cur.fail(f"tensor {name}: type", f"unknown or removed ggml type {ttype}")
    block, size = GGML_BLOCKS[ttype]
    if (ne[0] if ne else 1) % block:
        cur.fail(f"tensor {name}: ne[0]", f"{ne[0] if ne else 1} elements per row is not a multiple of the type's block "
                                          f"size {block}")
    offset = cur.u64(f"tensor {name}: offset")
    return TensorInfo(name, tuple(reversed(ne)), ttype, offset, count // block * size)


def _check_data(cur: _Cursor, h: GGUFHeader) -> None:
    """Each tensor's data: aligned, packed in directory order (as llama.cpp requires), inside the file."""
    if not h.tensors:
        return
    if h.data_offset > h.file_size:
        cur.fail("data offset", f"the data section would start at {h.data_offset}, past the end of the "
                                f"{h.file_size}-byte file (truncated)")
    expected, prev = 0, None
    for t in h.tensors.values():
        where = f"tensor {t.name}: offset"
        if t.offset % h.alignment:
            cur.fail(where, f"{t.offset} is not a multiple of the alignment {h.alignment}")
        if t.offset < expected:
            cur.fail(where, f"{t.offset}: its data overlaps tensor {prev}'s (which ends at {expected})")
        if t.offset > expected:
            cur.fail(where, f"{t.offset}: leaves a gap after " + (f"tensor {prev}" if prev else "the header")
                     + f" (expected {expected}; llama.cpp requires the data packed in directory order)")
        if h.data_offset + t.offset + t.nbytes > h.file_size:
            cur.fail(f"tensor {t.name}: data", f"{t.nbytes} bytes at {h.data_offset + t.offset} run past the end "
                                               f"of the {h.file_size}-byte file (truncated)")
        expected = t.offset + -(-t.nbytes // h.alignment) * h.alignment
        prev = t.name


def tensor_nbytes(info: TensorInfo) -> int | None:
    """Byte size of a float tensor (None for quantized types, which we never read here)."""
    size = G.ELEMENT_SIZE.get(info.ggml_type)
    return None if size is None else size * info.n_elements


def _read_data(header: GGUFHeader, offset: int, nbytes: int, fd: int | None, what: str) -> bytes:
    """`nbytes` of the data section from `offset` (from `fd` when given: see PinnedFile); `what` names them."""
    start = header.data_offset + offset
    if start + nbytes > header.file_size:
        raise format_error(str(header.path), what, "runs past the end of the file (truncated)")
    if fd is None:
        with open(header.path, "rb") as f:
            f.seek(start)
            raw = f.read(nbytes)
    else:
        raw = os.pread(fd, nbytes, start)
    if len(raw) != nbytes:
        raise format_error(str(header.path), what, "the file got shorter while it was read")
    return raw


def read_float_tensor(header: GGUFHeader, name: str, *, fd: int | None = None) -> np.ndarray:
    """Read one F32/F16/BF16 tensor as float32, numpy layout (from `fd` when given: see PinnedFile)."""
    info = header.tensors[name]
    nbytes = tensor_nbytes(info)
    if nbytes is None:
        raise format_error(str(header.path), f"tensor {name}: type", "is not F32/F16/BF16")
    raw = _read_data(header, info.offset, nbytes, fd, f"tensor {name}: data")
    return G.decode(np.frombuffer(raw, dtype=G.STORAGE_DTYPE[info.ggml_type]), info.ggml_type).reshape(info.shape)


def read_float_tensors(header: GGUFHeader, names: list[str], *, fd: int | None = None,
                       decode: Callable[[np.ndarray, int], np.ndarray] = G.decode
                       ) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """Read F32/F16/BF16 tensors as float32 (numpy layout): ({name: array}, flat). When they share one type
    and start on whole elements, one read and one conversion cover them all (the bytes between them
    too): every array is then a view of `flat`. Otherwise they are read one by one and flat is None.
    `decode`: stored elements and their type → float32, `ggml_types.decode` or the same values faster.

    An adapter has hundreds of small tensors, and a cold load used to pay one read and one conversion
    for each: the numpy calls, not the bytes, were most of that time."""
    infos = [header.tensors[n] for n in names]
    types = {i.ggml_type for i in infos}
    size = G.ELEMENT_SIZE.get(next(iter(types))) if len(types) == 1 else None
    if not infos or size is None or any(i.offset % size for i in infos):
        return {n: read_float_tensor(header, n, fd=fd) for n in names}, None
    (gtype,) = types
    lo = min(i.offset for i in infos)
    hi = max(i.offset + size * i.n_elements for i in infos)
    raw = _read_data(header, lo, hi - lo, fd, "tensor data")
    flat = decode(np.frombuffer(raw, dtype=G.STORAGE_DTYPE[gtype]), gtype)
    out = {}
    for n, i in zip(names, infos):
        first = (i.offset - lo) // size
        out[n] = flat[first:first + i.n_elements].reshape(i.shape)
    return out, flat


class PinnedFile:
    """A file opened once, so that every reader of it, llama.cpp included, reads the bytes that were checked.

    Check the file through `fd` and hand llama.cpp `native_path`. On Linux that is /proc/self/fd/N:
    opening it opens this very file, whatever the path names by then, so a file swapped in after the
    check (a rename over it) is never the one loaded. Elsewhere it is the path itself, and
    `close(check=True)` after the load refuses a file whose path or identity (device, inode, size,
    mtime) changed since it was opened. Both refuse a file rewritten in place during the load.
    """

    #: Hand llama.cpp /proc/self/fd/N (Linux); False: the path, checked after the load (tests force this)
    use_proc: bool = sys.platform.startswith("linux")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError as e:
            raise AdapterError(str(self.path), "file not found", hint="check the path (relative paths are "
                               f"resolved from {Path.cwd()})") from e
        except OSError as e:
            raise AdapterError(str(self.path), f"cannot open: {e.strerror or e}") from e
        self._finalizer = weakref.finalize(self, os.close, self.fd)  # an early error must not leak it
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode):
            self._finalizer()
            raise AdapterError(str(self.path), "not a regular file")
        self.identity = _identity(st)
        proc = f"/proc/self/fd/{self.fd}"
        self.via_proc = self.use_proc and _path_identity(proc) == self.identity
        self.native_path = proc if self.via_proc else str(self.path)

    def changes(self) -> list[str]:
        """What changed since the file was opened (empty: nothing)."""
        out = []
        if _identity(os.fstat(self.fd)) != self.identity:
            out.append("the file was rewritten in place (size or modification time changed)")
        if not self.via_proc and _path_identity(str(self.path)) != self.identity:
            out.append("the path now names another file (it was replaced or removed)")
        return out

    def close(self, check: bool = False) -> None:
        """Close the descriptor; with `check`, first raise AdapterError if the file changed (field 'file')."""
        try:
            problems = self.changes() if check and self._finalizer.alive else []
        finally:
            self._finalizer()
        if problems:
            raise AdapterError(str(self.path), "the file changed while it was being loaded", problems=problems,
                               hint="load it again once whatever writes it has finished", fields=["file"])


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _path_identity(path: str) -> tuple[int, int, int, int] | None:
    try:
        return _identity(os.stat(path))
    except OSError:
        return None


__all__ = ["ADAPTER_MAX_HEADER", "DEFAULT_ALIGNMENT", "DEFAULT_MAX_HEADER", "GGML_BLOCKS", "GGUF_MAGIC", "INT64_MAX",
           "MAX_ARRAY", "MAX_COUNT", "MAX_DIMS", "MAX_KEY", "MAX_NAME", "MAX_STRING", "SUPPORTED_VERSIONS",
           "VALUE_FLOAT32", "VALUE_FORMATS", "VALUE_NAMES", "VALUE_UINT32", "GGUFHeader", "PinnedFile", "TensorInfo",
           "format_error", "read_float_tensor", "read_float_tensors", "read_header", "tensor_nbytes"]
