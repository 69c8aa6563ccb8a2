"""Read and write GGUF files without llama.cpp: headers, adapter factors, control vectors.

The header reader is our own (`gguf_io.header`): `gguf.GGUFReader` materialises every metadata
array (a 262k-token vocabulary takes tens of seconds), while validating an adapter or reading a base
model's tensor shapes needs only the key/value table and the tensor directory; and ours checks every
size a header claims against the file before reading it. Writing goes through the `gguf` package,
llama.cpp's own writer, so files load anywhere llama.cpp does.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import ggml_types as G
from ..errors import AdapterError, ControlVectorError, GGUFFormatError
from .header import (
    ADAPTER_MAX_HEADER,
    DEFAULT_ALIGNMENT,
    DEFAULT_MAX_HEADER,
    GGML_BLOCKS,
    GGUF_MAGIC,
    VALUE_ARRAY,
    VALUE_FLOAT32,
    VALUE_FORMATS,
    VALUE_NAMES,
    VALUE_STRING,
    VALUE_UINT32,
    GGUFHeader,
    PinnedFile,
    TensorInfo,
    format_error,
    read_float_tensor,
    read_float_tensors,
    read_header,
    tensor_nbytes,
)

__all__ = [
    "ADAPTER_MAX_HEADER", "DEFAULT_ALIGNMENT", "DEFAULT_MAX_HEADER", "GGML_BLOCKS", "GGUF_MAGIC",
    "LORA_A", "LORA_B", "VALUE_ARRAY", "VALUE_FLOAT32", "VALUE_FORMATS", "VALUE_NAMES", "VALUE_STRING",
    "VALUE_UINT32", "AdapterFactors", "AdapterFileInfo", "GGUFFormatError", "GGUFHeader", "PinnedFile",
    "TensorInfo", "atomic_path", "format_error", "read_adapter_factors", "read_adapter_header",
    "read_control_vector", "read_float_tensor", "read_float_tensors", "read_header", "sha256_file",
    "tensor_nbytes", "validate_adapter", "write_adapter", "write_control_vector",
]

# The float types an adapter may carry, by ggml type id (the table is ggml_types'; inspect.py reads it here).


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


def read_adapter_header(path: str | os.PathLike[str], fd: int | None = None) -> GGUFHeader:
    """An adapter GGUF's header through the bounded reader (from `fd` if given); AdapterError if unreadable.

    Pass it to `validate_adapter` and `read_adapter_factors` to read the file's header once for both."""
    p = Path(path)
    if fd is None and not p.exists():
        raise AdapterError(str(p), "file not found", hint="check the path (relative paths are resolved "
                           f"from {Path.cwd()})")
    if fd is None and not p.is_file():
        raise AdapterError(str(p), "not a regular file")
    try:
        return read_header(p, fd=fd, max_header=ADAPTER_MAX_HEADER)
    except GGUFFormatError as e:
        raise _adapter_error(p, e.message.removeprefix(f"{e.path}: "), [(e.field or "header", "")],
                             hint=e.hint) from e


def validate_adapter(path: str | os.PathLike[str], base_arch: str | None = None,
                     base_shapes: Mapping[str, tuple[int, ...]] | None = None, *,
                     check_values: bool = False, fd: int | None = None,
                     header: GGUFHeader | None = None) -> AdapterFileInfo:
    """Check an adapter GGUF against a base model and return what it declares.

    Raises one AdapterError listing every problem found: an unreadable or implausible header (the
    bounded reader's checks, see `gguf_io.header`), not a LoRA, another architecture, metadata of a
    type llama.cpp would abort on, a non-finite `adapter.lora.alpha`, unpaired or non-float factors,
    targets missing from the base, incompatible shapes, and (with `check_values`) NaN/Inf factors.
    The error's `field` names the first bad field and `fields` all of them. With `fd` (see
    PinnedFile) everything is read from that open descriptor and `path` only names the file; with
    `header` (`read_adapter_header`'s) it is not read again.
    """
    p = Path(path)
    h = header if header is not None else read_adapter_header(p, fd)
    problems = _adapter_header_problems(h, base_arch)
    shapes, targets, dtypes = {}, [], []
    for name, info in h.tensors.items():
        if name.endswith(LORA_A):
            base = name[: -len(LORA_A)]
            b = h.tensors.get(base + LORA_B)
            if b is None:
                problems.append((f"tensor {name}", f"{name} has no matching {base + LORA_B}"))
                continue
            targets.append(base)
            problems += _pair_problems(base, info, b, base_shapes)
            shapes[base] = (info.shape, b.shape)
            dtypes.append(G.FLOAT_NAMES.get(info.ggml_type, str(info.ggml_type)))
        elif name.endswith(LORA_B):
            if name[: -len(LORA_B)] + LORA_A not in h.tensors:
                problems.append((f"tensor {name}", f"{name} has no matching {name[: -len(LORA_B)] + LORA_A}"))
        else:
            problems.append((f"tensor {name}", f"tensor {name} is not a LoRA factor (names must end in "
                                               ".lora_a/.lora_b)"))
    if not targets and not problems:
        problems.append(("tensors", "the file holds no LoRA factors"))
    if check_values and not problems:
        problems += _value_problems(h, targets, fd)
    if problems:
        raise _adapter_error(p, f"cannot be used{_against(base_arch)}", problems,
                             hint="is this the adapter for this base model? `loramux inspect` shows what it holds")
    alpha = float(h.metadata.get("adapter.lora.alpha", 0.0))
    inv = tuple(int(t) for t in (h.metadata.get("adapter.alora.invocation_tokens") or ()))
    rank = shapes[targets[0]][0][0]
    return AdapterFileInfo(p, h.architecture or "?", rank, alpha, tuple(targets), dtypes[0], inv,
                           h.file_size, shapes)


Problem = tuple[str, str]  # (field, what is wrong with it)


def _adapter_error(p: Path, message: str, problems: list[Problem], *, hint: str | None) -> AdapterError:
    """One AdapterError naming the file; `field` is the first bad field, `fields` every one."""
    return AdapterError(str(p), message, problems=[text for _, text in problems if text], hint=hint,
                        fields=[f for f, _ in problems])


def _value_problems(h: GGUFHeader, targets: list[str], fd: int | None) -> list[Problem]:
    bad = []
    for t in targets:
        for suffix in (LORA_A, LORA_B):
            if not np.isfinite(read_float_tensor(h, t + suffix, fd=fd)).all():
                bad.append(t + suffix)
    if not bad:
        return []
    return [(f"tensor {bad[0]}", f"{len(bad)} factor tensors contain NaN or Inf, e.g. {', '.join(bad[:3])}")]


def _against(arch: str | None) -> str:
    return f" with this {arch} base model" if arch else ""


# Keys llama.cpp reads with gguf_get_val_str / gguf_get_val_f32, which abort the process (GGML_ASSERT)
# on a value of another type: such a file must never reach it.
_STRING_KEYS = ("general.type", "general.architecture", "adapter.type")
ALPHA_KEY, INVOCATION_KEY = "adapter.lora.alpha", "adapter.alora.invocation_tokens"
MAX_INVOCATION_TOKENS = 4096  # read_header's keep_arrays: a longer array is not kept


def _type_name(vt: tuple[int, int | None]) -> str:
    return VALUE_NAMES.get(vt[0], str(vt[0])) + (f"[{VALUE_NAMES.get(vt[1], vt[1])}]" if vt[1] is not None else "")


def _adapter_header_problems(h: GGUFHeader, base_arch: str | None) -> list[Problem]:
    problems: list[Problem] = []
    for key in _STRING_KEYS:
        vt = h.value_types.get(key)
        if vt is not None and vt != (VALUE_STRING, None):
            problems.append((key, f"{key} has type {_type_name(vt)}; it must be a STRING"))
    gtype = h.metadata.get("general.type")
    if gtype == "model" or (gtype is None and "adapter.type" not in h.metadata):
        problems.append(("general.type", f"general.type is {gtype!r}: this looks like a base model, not an adapter"))
    elif gtype != "adapter":
        problems.append(("general.type", f"general.type is {gtype!r}, expected 'adapter'"))
    atype = h.metadata.get("adapter.type")
    if gtype != "model" and atype != "lora":
        problems.append(("adapter.type", f"adapter.type is {atype!r}, expected 'lora'"))
    if base_arch and h.architecture != base_arch:
        problems.append(("general.architecture",
                         f"general.architecture is {h.architecture!r} but the base model is {base_arch!r}"))
    return problems + _alpha_problems(h) + _invocation_problems(h)


def _alpha_problems(h: GGUFHeader) -> list[Problem]:
    """alpha: absent (llama.cpp reads 0: no scaling) or one finite FLOAT32.

    Negative and zero alphas are accepted, as llama.cpp accepts them: it scales each delta by
    scale·alpha/rank, or by scale alone when alpha is 0, so a negative alpha is a well-defined sign
    flip of the delta (the same as negating B), not a corruption.
    """
    vt = h.value_types.get(ALPHA_KEY)
    if vt is None:
        return []
    if vt != (VALUE_FLOAT32, None):
        return [(ALPHA_KEY, f"{ALPHA_KEY} has type {_type_name(vt)}; it must be a FLOAT32")]
    alpha = h.metadata[ALPHA_KEY]
    if not np.isfinite(alpha):
        return [(ALPHA_KEY, f"{ALPHA_KEY} is {alpha}; it must be a finite number")]
    return []


def _invocation_problems(h: GGUFHeader) -> list[Problem]:
    vt = h.value_types.get(INVOCATION_KEY)
    if vt is None:
        return []
    if vt != (VALUE_ARRAY, VALUE_UINT32):
        return [(INVOCATION_KEY, f"{INVOCATION_KEY} has type {_type_name(vt)}; it must be an array of UINT32 "
                                 "token ids")]
    if h.metadata[INVOCATION_KEY] is None:
        return [(INVOCATION_KEY, f"{INVOCATION_KEY} has {h.array_lengths[INVOCATION_KEY]} tokens; at most "
                                 f"{MAX_INVOCATION_TOKENS} are supported")]
    return []


def _pair_problems(base: str, a: TensorInfo, b: TensorInfo,
                   base_shapes: Mapping[str, tuple[int, ...]] | None) -> list[Problem]:
    out: list[Problem] = []
    for t in (a, b):
        if t.ggml_type not in G.FLOAT_NAMES:
            out.append((f"tensor {t.name}: type",
                        f"{t.name} has ggml type {t.ggml_type}; factors must be F32, F16 or BF16"))
        if len(t.shape) != 2:
            out.append((f"tensor {t.name}: shape", f"{t.name} has shape {t.shape}; factors are 2-D"))
            return out
    if a.ggml_type != b.ggml_type and not out:  # llama.cpp takes it; in-place access needs one type per pair
        out.append((f"tensor {b.name}: type", f"{base}: lora_a is {G.FLOAT_NAMES[a.ggml_type]} but lora_b is "
                                              f"{G.FLOAT_NAMES[b.ggml_type]}; both factors of a target must have one type"))
    (r, n_in), (n_out, rb) = a.shape, b.shape
    if r != rb:
        out.append((f"tensor {a.name}: shape",
                    f"{base}: rank of lora_a ({r}) != rank of lora_b ({rb}); A must be (r, in), B (out, r)"))
    elif r < 1:
        out.append((f"tensor {a.name}: shape", f"{base}: rank 0 (empty factors)"))
    if base_shapes is not None:
        bs = base_shapes.get(base)
        if bs is None:
            out.append((f"tensor {a.name}", f"target {base} does not exist in the base model"))
        elif len(bs) != 2 or (bs[1], bs[0]) != (n_in, n_out):
            hint = " (transposed factors?)" if len(bs) == 2 and (bs[0], bs[1]) == (n_in, n_out) else ""
            out.append((f"tensor {a.name}: shape",
                        f"{base}: factors give a ({n_out}, {n_in}) delta but the base tensor is {tuple(bs)}{hint}"))
    return out


class AdapterFactors(dict[str, tuple[np.ndarray, np.ndarray]]):
    """An adapter file's factor pairs as float32, {target: (A (r, in), B (out, r))}. `flat`: the one array
    they are all views of (read and converted in one pass; the bytes between tensors are in it too), for
    checks that can look at every value at once; None when they were read one by one."""

    flat: np.ndarray | None = None


def read_adapter_factors(path: str | os.PathLike[str], *, fd: int | None = None, header: GGUFHeader | None = None,
                         decode: Callable[[np.ndarray, int], np.ndarray] = G.decode) -> AdapterFactors:
    """All factors of an adapter GGUF as float32 (A (r, in), B (out, r)), in file order (from `fd` if given;
    `header`: its header, read already; `decode`: see `read_float_tensors`)."""
    h = header if header is not None else read_header(path, fd=fd, max_header=ADAPTER_MAX_HEADER)
    bases = [name[: -len(LORA_A)] for name in h.tensors if name.endswith(LORA_A)]
    arrays, flat = read_float_tensors(h, [b + s for b in bases for s in (LORA_A, LORA_B)], fd=fd, decode=decode)
    out = AdapterFactors((b, (arrays[b + LORA_A], arrays[b + LORA_B])) for b in bases)
    out.flat = flat
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
