"""ggml tensor types: the ids loramux handles, their numpy storage, and bfloat16 bit conversion.

Ground module: imported by `_native`, `gguf_io`, the engine, `convert` and `merging`; it imports
nothing of loramux. The ids are values of ggml.h's `enum ggml_type`: GGUF files store them, so
they are fixed across llama.cpp releases and need no ctypes to read.

Adapter factors are F32, F16 or BF16. numpy has no bfloat16, so BF16 elements are held as their
uint16 bit patterns (`STORAGE_DTYPE[BF16]`) and converted with `to_bf16_bits` / `from_bf16_bits`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

F32, F16, Q8_0, BF16 = 0, 1, 8, 30  # enum ggml_type
I32, I64 = 26, 27

#: Name of each float type an adapter's factors may have (ggml's spelling).
FLOAT_NAMES: dict[int, str] = {F32: "F32", F16: "F16", BF16: "BF16"}

#: numpy dtype that holds a float type's elements as stored (BF16: its bit patterns).
STORAGE_DTYPE: dict[int, type[np.generic]] = {F32: np.float32, F16: np.float16, BF16: np.uint16}

#: Bytes per element of each float type.
ELEMENT_SIZE: dict[int, int] = {t: np.dtype(d).itemsize for t, d in STORAGE_DTYPE.items()}


def to_bf16_bits(x: Any) -> np.ndarray:
    """float32 → bfloat16 bit patterns as uint16, rounded to nearest even (as torch and ggml round).

    Every NaN stays a NaN: its top half is kept (sign and payload, so bf16 NaNs round-trip), with the
    quiet bit set if that half alone would read as Inf. Rounding alone would carry a NaN whose
    mantissa starts with eight set bits (e.g. 0x7FFF8000) into the exponent and sign and turn it
    into ±0.0, so a finiteness check after the conversion would pass it as a harmless number.
    ±Inf convert to themselves.
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        top = (bits >> 16).astype(np.uint16)
        top = np.where(top & 0x7F, top, top | np.uint16(0x40))
        rounded = np.where(nan, top, rounded)
    return rounded


def from_bf16_bits(u: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) → float32, exactly (bfloat16 is the top half of a float32)."""
    return (u.astype(np.uint32) << 16).view(np.float32)


def decode(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """Stored elements of a float type (`STORAGE_DTYPE[ggml_type]`) → a new float32 array."""
    if ggml_type == BF16:
        return from_bf16_bits(raw)
    return raw.astype(np.float32)


__all__ = ["F32", "F16", "Q8_0", "BF16", "FLOAT_NAMES", "STORAGE_DTYPE", "ELEMENT_SIZE", "to_bf16_bits",
           "from_bf16_bits", "decode"]
