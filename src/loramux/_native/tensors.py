"""ggml tensors seen from Python: the `struct ggml_tensor` mirror (checked against the library at
import), op lookup, the single-scalar graph-node reads eval callbacks use on every node, and tensor
get/set through ggml's backend API (host or device buffers).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np

from .. import ggml_types as G
from ..errors import BackendError
from .lib import libggml


class GgmlTensor(ctypes.Structure):
    """Mirror of `struct ggml_tensor` (ggml/include/ggml.h of the pinned llama.cpp)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


_TENSOR_SIZE = 336
if ctypes.sizeof(GgmlTensor) != _TENSOR_SIZE or libggml.ggml_tensor_overhead() < _TENSOR_SIZE:
    raise BackendError("ggml_tensor layout", None,
                       f"struct mirror is {ctypes.sizeof(GgmlTensor)} bytes, expected {_TENSOR_SIZE}",
                       hint="this platform or ggml build is not supported for in-place writes")


def _find_op(name: str) -> int:
    for i in range(200):
        op = libggml.ggml_op_name(i)
        if op is None:
            break
        if op.decode() == name:
            return i
    raise BackendError("ggml_op_name", None, f"op {name} not found")


OP_MUL_MAT = _find_op("MUL_MAT")
OP_SET_ROWS = _find_op("SET_ROWS")  # how llama.cpp writes each new token's K and V into the cache

EvalCallback = Callable[[int, bool], bool]  # (tensor pointer, ask) -> bool


def tensor_view(ptr: int) -> GgmlTensor:
    """The ggml_tensor at `ptr` (valid only while its owner lives)."""
    return GgmlTensor.from_address(ptr)


def tensor_name(ptr: int) -> str:
    return (libggml.ggml_get_name(ptr) or b"").decode("utf-8", errors="replace")


def tensor_nbytes(ptr: int) -> int:
    return int(libggml.ggml_nbytes(ptr))


# Graph-node reads for eval callbacks: they run for every node of every decode, so each is one
# ctypes scalar read at a fixed offset instead of a whole GgmlTensor mirror.
OFF_OP, OFF_SRC0, _OFF_NE1 = GgmlTensor.op.offset, GgmlTensor.src.offset, GgmlTensor.ne.offset + 8
_OFF_DATA, _OFF_BUFFER = GgmlTensor.data.offset, GgmlTensor.buffer.offset
void_at, int_at, _i64_at = ctypes.c_void_p.from_address, ctypes.c_int.from_address, ctypes.c_int64.from_address


def node_src0(ptr: int) -> int | None:
    """Address of a node's first source tensor (None when it has none)."""
    return void_at(ptr + OFF_SRC0).value


def node_op(ptr: int) -> int:
    return int_at(ptr + OFF_OP).value


def node_ne1(ptr: int) -> int:
    """A node's second dimension (the token count of a matmul output)."""
    return _i64_at(ptr + _OFF_NE1).value


def node_place(ptr: int) -> tuple[int | None, int | None]:
    """(data address, backend buffer) of a node: together they say which memory it was computed into."""
    return void_at(ptr + _OFF_DATA).value, void_at(ptr + _OFF_BUFFER).value


def host_f32_view(ptr: int, shape: tuple[int, int]) -> np.ndarray | None:
    """A numpy view of a contiguous F32 tensor that lives in host memory (None elsewhere, e.g. on a GPU)."""
    t = GgmlTensor.from_address(ptr)
    if not t.data or not t.buffer or t.type != G.F32 or not libggml.ggml_backend_buffer_is_host(t.buffer):
        return None
    n = shape[0] * shape[1]
    return np.frombuffer((ctypes.c_float * n).from_address(t.data), np.float32).reshape(shape)


def tensor_host_address(ptr: int) -> tuple[int, int] | None:
    """(data address, buffer) of a tensor in host memory; None on a device (GPU) buffer."""
    t = GgmlTensor.from_address(ptr)
    if not t.data or not t.buffer or not libggml.ggml_backend_buffer_is_host(t.buffer):
        return None
    return int(t.data), int(t.buffer)


def buffer_alignment(buffer: int) -> int:
    return int(libggml.ggml_backend_buffer_get_alignment(buffer))


def host_bytes(address: int, nbytes: int) -> np.ndarray:
    """A writable uint8 view of `nbytes` of host memory at `address` (valid while its owner lives)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def tensor_set_raw(ptr: int, address: int, nbytes: int) -> None:
    """ggml_backend_tensor_set from a pre-computed host address (no numpy attribute lookups)."""
    libggml.ggml_backend_tensor_set(ptr, address, 0, nbytes)


def tensor_set(ptr: int, data: np.ndarray, offset: int = 0) -> None:
    """Copy a contiguous array into a backend tensor (any backend: CPU, GPU)."""
    libggml.ggml_backend_tensor_set(ptr, data.ctypes.data, offset, data.nbytes)


def tensor_get(ptr: int, out: np.ndarray, offset: int = 0) -> np.ndarray:
    """Copy a backend tensor's bytes into the contiguous array `out` and return it."""
    libggml.ggml_backend_tensor_get(ptr, out.ctypes.data, offset, out.nbytes)
    return out


def tensor_set_2d(ptr: int, data: np.ndarray, offset: int, row_bytes: int, n_rows: int,
                  stride_tensor: int) -> None:
    """Copy `n_rows` runs of `row_bytes` from contiguous `data` into a tensor, `stride_tensor` apart.

    One call writes a column block of a row-major matrix (a slot of a LoRA bank's B factor).
    """
    libggml.ggml_backend_tensor_set_2d(ptr, data.ctypes.data, offset, row_bytes, n_rows, stride_tensor, row_bytes)



def set_rows_parts(ptr: int) -> tuple[np.ndarray, np.ndarray, int, int] | None:
    """What a SET_ROWS node wrote: (values as (rows, row_len) float32, destination row of each, the
    destination's ggml type, its row stride in bytes); None when the values are not contiguous F32
    or the indices are not a host I64/I32 vector. Values on a device are copied to the host."""
    t = GgmlTensor.from_address(ptr)
    src, idx = GgmlTensor.from_address(t.src[0]), GgmlTensor.from_address(t.src[1])  # ggml_set_rows(a, b, c): b, c
    rows, row_len = src.ne[1] * src.ne[2] * src.ne[3], src.ne[0]
    if src.type != G.F32 or src.nb[0] != 4 or src.nb[1] != 4 * row_len or src.nb[2] != src.nb[1] * src.ne[1]:
        return None
    itype = {G.I64: np.int64, G.I32: np.int32}.get(idx.type)
    if itype is None or not idx.data or not libggml.ggml_backend_buffer_is_host(idx.buffer):
        return None
    n_idx = idx.ne[0] * idx.ne[1] * idx.ne[2] * idx.ne[3]
    where = np.frombuffer((ctypes.c_char * (n_idx * np.dtype(itype).itemsize)).from_address(idx.data), itype)
    if src.data and src.buffer and libggml.ggml_backend_buffer_is_host(src.buffer):
        values = np.frombuffer((ctypes.c_float * (rows * row_len)).from_address(src.data), np.float32)
    else:
        values = tensor_get(t.src[0], np.empty(rows * row_len, np.float32))
    return values.reshape(rows, row_len), where, int(t.type), int(t.nb[1])


def zero_rows(ptr: int, rows: np.ndarray, row_bytes: int) -> None:
    """Write zeros over rows `rows` (each `row_bytes` long) of a tensor, host or device. Zero bytes are
    0.0 in every float and block type (a zero scale)."""
    t = GgmlTensor.from_address(ptr)
    if t.data and t.buffer and libggml.ggml_backend_buffer_is_host(t.buffer):
        mem = host_bytes(int(t.data), int(libggml.ggml_nbytes(ptr))).reshape(-1, row_bytes)
        mem[np.asarray(rows, np.int64)] = 0
        return
    zeros = np.zeros(row_bytes, np.uint8)
    for r in np.asarray(rows, np.int64):
        tensor_set(ptr, zeros, offset=int(r) * row_bytes)


__all__ = ["OP_MUL_MAT", "OP_SET_ROWS", "EvalCallback", "GgmlTensor", "buffer_alignment", "host_bytes",
           "host_f32_view", "node_ne1", "node_op", "node_place", "node_src0", "set_rows_parts", "tensor_get",
           "tensor_host_address", "tensor_name", "tensor_nbytes", "tensor_set", "tensor_set_2d", "tensor_set_raw",
           "tensor_view", "zero_rows"]
