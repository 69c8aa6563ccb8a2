"""The bounded GGUF reader and the adapter pre-validator, one check at a time; and no swap between
the check and llama.cpp's load.

Each test crafts one bad field into an otherwise valid adapter (tests/gguf_fuzz.py writes the
bytes) and asserts the typed error that names it. A file claiming gigabytes is refused after
reading only its first bytes (os.pread is counted, not timed).
"""

from __future__ import annotations

import copy
import math
import os
import struct

import gguf
import numpy as np
import pytest
from conftest import PROMPT
from gguf_fuzz import KV, Tensor, apply_struct, parse, serialize
from tinymodel import random_factors, write_tiny_lora

from loramux import _native as N
from loramux.errors import AdapterError, GGUFFormatError
from loramux.gguf_io import (
    GGML_BLOCKS,
    PinnedFile,
    read_adapter_factors,
    read_header,
    validate_adapter,
    write_adapter,
)
from loramux.gguf_io import header as H

Q = "blk.0.attn_q.weight"


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    """A valid two-target F32 adapter as a gguf_fuzz Doc."""
    d = tmp_path_factory.mktemp("bounds")
    return parse(write_tiny_lora(d / "seed.gguf", rank=2, seed=1, targets=(Q, "blk.1.ffn_down.weight")))


def craft(tmp_path, doc, *mutations, fields=None, name="bad.gguf"):
    """Write `doc` after structural `mutations`, then overwrite header fields by label: {label: value}."""
    doc = copy.deepcopy(doc)
    for m in mutations:
        apply_struct(doc, m)
    data, spans = serialize(doc)
    data = bytearray(data)
    for label, value in (fields or {}).items():
        off, width = next((o, w) for o, w, lab in spans if lab == label)
        data[off:off + width] = (value % (1 << 8 * width)).to_bytes(width, "little")
    p = tmp_path / name
    p.write_bytes(bytes(data))
    return p


def format_error(path, field, match):
    with pytest.raises(GGUFFormatError) as ei:
        read_header(path)
    assert ei.value.field == field, str(ei.value)
    assert match in str(ei.value), str(ei.value)
    assert str(path) in str(ei.value)
    # validate_adapter turns it into an AdapterError naming the file and the same field
    with pytest.raises(AdapterError) as ai:
        validate_adapter(path, "llama")
    assert ai.value.field == field and ai.value.path == str(path) and field in str(ai.value), str(ai.value)


T = "tensor blk.0.attn_q.weight.lora_a"
HEADER_CASES = {
    "magic": ((), {}, "magic", "not a GGUF"),
    "version 1": ((("version", 1),), {}, "version", "version 1"),
    "version 4": ((("version", 4),), {}, "version", "not supported"),
    "n_tensors huge": ((), {"n_tensors": 2**40}, "n_tensors", "implausible"),
    "n_tensors 2^64-1": ((), {"n_tensors": 2**64 - 1}, "n_tensors", "implausible"),
    "n_kv huge": ((), {"n_kv": 2**31}, "n_kv", "implausible"),
    "key length 1 GiB": ((), {"key general.architecture length": 2**30}, "key #0 length", "implausible"),
    "empty key": ((("kv_set", "", 4, 1, None),), {}, "key #4", "empty"),
    "duplicate key": ((("kv_dup", "adapter.type"),), {}, "adapter.type", "twice"),
    "unknown value type": ((), {"general.type type": 13}, "general.type: value type", "unknown GGUF value type 13"),
    "string claims 1 GiB": ((), {"general.type length": 2**30}, "general.type: string length", "implausible"),
    "array count huge": ((("invocation", 4, [1, 2]),), {"adapter.alora.invocation_tokens count": 2**61},
                         "adapter.alora.invocation_tokens: array count", "implausible"),
    "array of arrays": ((("invocation", 4, [1]),), {"adapter.alora.invocation_tokens element type": 9},
                        "adapter.alora.invocation_tokens: array element type", "arrays of arrays"),
    "string in array claims 1 GiB": ((("invocation", 8, [1, 2]),),
                                     {"adapter.alora.invocation_tokens[] length": 2**30},
                                     "adapter.alora.invocation_tokens[0] length", "implausible"),
    "alignment 0": ((("align", 0, False),), {}, "general.alignment", "not a power of two"),
    "alignment 48": ((("align", 48, False),), {}, "general.alignment", "not a power of two"),
    "alignment not UINT32": ((("kv_set", "general.alignment", 10, 32, None),), {}, "general.alignment",
                             "requires UINT32"),
    "tensor name too long": ((("rename", 0, "long"),), {}, "tensor #0 name", "longer than"),
    "duplicate tensor": ((("dup_tensor", 0),), {}, T, "twice"),
    "n_dims 5": ((("ndims", 0, 5),), {}, f"{T}: n_dims", "at most 4"),
    "negative dimension": ((), {f"{T} ne[1]": -3}, f"{T}: ne[1]", "negative"),
    "shape overflows int64": ((("ndims", 0, 4),), {f"{T} ne[2]": 2**40, f"{T} ne[3]": 2**40}, f"{T}: shape",
                              "int64 overflow"),
    "unknown ggml type": ((("ttype", 0, 99, False),), {}, f"{T}: type", "unknown or removed ggml type 99"),
    "removed ggml type": ((("ttype", 0, 4, False),), {}, f"{T}: type", "ggml type 4"),
    "row not a block multiple": ((("ttype", 0, 8, False),), {f"{T} ne[0]": 33}, f"{T}: ne[0]", "block size 32"),
    "misaligned offset": ((("offset", 1, 4),), {}, "tensor blk.0.attn_q.weight.lora_b: offset", "multiple of"),
    "overlapping data": ((("offset", 1, -32),), {}, "tensor blk.0.attn_q.weight.lora_b: offset", "overlaps"),
    "gap in data": ((("offset", 1, 32),), {}, "tensor blk.0.attn_q.weight.lora_b: offset", "gap"),
    "data past the end": ((), {f"{T} ne[1]": 2**20}, f"{T}: data", "truncated"),
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_each_header_check_names_its_field(tmp_path, seed, case):
    mutations, fields, field, match = HEADER_CASES[case]
    p = craft(tmp_path, seed, *mutations, fields=fields)
    if case == "magic":
        p.write_bytes(b"GGUX" + p.read_bytes()[4:])
    format_error(p, field, match)


def test_data_section_past_the_end(tmp_path, seed):
    # a valid alignment so large that the data section would start past the end of the file
    format_error(craft(tmp_path, seed, ("align", 1 << 20, False)), "data offset", "past the end")


def test_truncated_anywhere_is_a_typed_error(tmp_path, seed):
    data, _ = serialize(seed)
    for n in range(0, len(data), 7):
        p = tmp_path / "cut.gguf"
        p.write_bytes(data[:n])
        with pytest.raises(GGUFFormatError):
            read_header(p)


def _counted_pread(monkeypatch):
    read = []
    real = os.pread

    def pread(fd, n, off):
        out = real(fd, n, off)
        read.append(len(out))
        return out

    monkeypatch.setattr(H.os, "pread", pread)
    return read


def test_claimed_sizes_are_not_read(tmp_path, seed, monkeypatch):
    """A 64 MiB file whose first string claims all of it: refused after reading at most the reader's
    1 MiB chunk, by validate_adapter (16 MiB header limit) and read_header alike; and a small file
    claiming a 1 GiB string, or 2^40 tensors, costs no more than the file."""
    big = craft(tmp_path, seed, fields={"general.architecture length": 64 << 20}, name="big.gguf")
    with open(big, "r+b") as f:
        f.truncate(65 << 20)  # sparse: the claimed string is really there
    read = _counted_pread(monkeypatch)
    with pytest.raises(AdapterError) as ei:
        validate_adapter(big, "llama")
    chunk = (1 << 20) + 4  # the magic, then one buffer of the reader
    assert ei.value.field == "general.architecture: string length" and sum(read) <= chunk, sum(read)
    read.clear()
    with pytest.raises(GGUFFormatError):
        read_header(big, max_header=32 << 20)
    assert sum(read) <= chunk
    for fields in ({"general.architecture length": 2**30}, {"n_tensors": 2**40}, {"n_kv": 2**40}):
        p = craft(tmp_path, seed, fields=fields)
        read.clear()
        with pytest.raises(GGUFFormatError):
            read_header(p)
        assert sum(read) <= p.stat().st_size


def test_valid_files_read_as_llamas_own_python_reader_reads_them(tiny_model, tmp_path):
    """Offsets, shapes, types and the data offset agree with gguf.GGUFReader (llama.cpp's gguf-py)."""
    lora = write_tiny_lora(tmp_path / "l.gguf", rank=3, dtype="bf16", invocation_tokens=[3, 4])
    for p in (tiny_model, lora):
        h = read_header(p)
        r = gguf.GGUFReader(p)
        assert [t.name for t in r.tensors] == list(h.tensors)
        for t in r.tensors:
            mine = h.tensors[t.name]
            assert (mine.ne, mine.ggml_type, mine.nbytes) == (tuple(int(x) for x in t.shape), int(t.tensor_type),
                                                              int(t.n_bytes))
            assert h.data_offset + mine.offset == t.data_offset
        assert h.metadata["general.architecture"] == "llama"


def test_ggml_block_table_matches_gguf_py():
    for qtype, (block, size) in gguf.GGML_QUANT_SIZES.items():
        assert GGML_BLOCKS[int(qtype)] == (block, size), qtype
    assert 4 not in GGML_BLOCKS and 31 not in GGML_BLOCKS  # removed from ggml


def test_a_fifo_or_a_folder_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    for p in (fifo, tmp_path):
        with pytest.raises(GGUFFormatError, match="not a regular file"):
            read_header(p)
        with pytest.raises(AdapterError, match="not a regular file"):
            PinnedFile(p)


# ---------------------------------------------------------------------------------------------
# validate_adapter: metadata llama.cpp would abort on, alpha, ranks
# ---------------------------------------------------------------------------------------------

ADAPTER_CASES = {
    "alpha NaN": (("alpha", float("nan")), "adapter.lora.alpha", "finite"),
    "alpha +Inf": (("alpha", float("inf")), "adapter.lora.alpha", "finite"),
    "alpha -Inf": (("alpha", -float("inf")), "adapter.lora.alpha", "finite"),
    "alpha UINT32": (("kv_set", "adapter.lora.alpha", 4, 2, None), "adapter.lora.alpha", "FLOAT32"),
    "alpha FLOAT64": (("kv_set", "adapter.lora.alpha", 12, 2.0, None), "adapter.lora.alpha", "FLOAT32"),
    "alpha a string": (("kv_set", "adapter.lora.alpha", 8, b"2", None), "adapter.lora.alpha", "FLOAT32"),
    "general.type UINT32": (("kv_set", "general.type", 4, 1, None), "general.type", "must be a STRING"),
    "adapter.type an array": (("kv_set", "adapter.type", 9, b"lora", 8), "adapter.type", "must be a STRING"),
    "architecture INT32": (("kv_set", "general.architecture", 5, 1, None), "general.architecture", "STRING"),
    "invocation INT32": (("invocation", 5, [1, 2]), "adapter.alora.invocation_tokens", "UINT32"),
    "invocation strings": (("invocation", 8, [1, 2]), "adapter.alora.invocation_tokens", "UINT32"),
    "invocation too long": (("invocation", 4, [1] * 5000), "adapter.alora.invocation_tokens", "at most 4096"),
    "rank 0": (("shape", 0, 1, 0, True), "tensor blk.0.attn_q.weight.lora_a: shape", "rank"),
    "A and B of two types": (("ttype", 1, 30, True), "tensor blk.0.attn_q.weight.lora_b: type", "one type"),
}


@pytest.mark.parametrize("case", list(ADAPTER_CASES))
def test_each_adapter_check_names_its_field(tmp_path, seed, case, engine):
    mutation, field, match = ADAPTER_CASES[case]
    if case == "rank 0":
        p = craft(tmp_path, seed, mutation, ("shape", 1, 0, 0, True))
    else:
        p = craft(tmp_path, seed, mutation)
    with pytest.raises(AdapterError) as ei:
        validate_adapter(p, "llama", engine.model.tensor_shapes)
    assert field in ei.value.fields and match in str(ei.value) and str(p) in str(ei.value), str(ei.value)
    # through the engine too: refused before llama.cpp sees it (several of these abort llama.cpp)
    before = engine.logits(PROMPT)
    with pytest.raises(AdapterError):
        engine.load_lora(p)
    assert np.array_equal(engine.logits(PROMPT), before)


def test_zero_and_negative_alpha_load_as_llama_cpp_defines_them(engine, tmp_path):
    """llama.cpp scales by scale·alpha/rank, or by scale alone when alpha is 0: a negative alpha flips the
    delta's sign exactly as negating B does, and alpha 0 is the same as alpha = rank."""
    f = random_factors(rank=2, seed=7, targets=(Q,))
    neg = write_adapter(tmp_path / "neg.gguf", "llama", f, -2.0)
    flipped = write_adapter(tmp_path / "flip.gguf", "llama", {Q: (f[Q][0], -f[Q][1])}, 2.0)
    zero = write_adapter(tmp_path / "zero.gguf", "llama", f, 0.0)
    unit = write_adapter(tmp_path / "unit.gguf", "llama", f, 2.0)
    logits = {}
    for p in (neg, flipped, zero, unit):
        engine.load_lora(p, name=p.stem)
        logits[p.stem] = engine.logits(PROMPT, loras={p.stem: 1.0})
    assert engine.adapters["neg"].alpha == -2.0
    assert np.array_equal(logits["neg"], logits["flip"])
    assert np.array_equal(logits["zero"], logits["unit"])
    assert not np.array_equal(logits["neg"], logits["unit"])


# ---------------------------------------------------------------------------------------------
# no swap between the check and llama.cpp's load
# ---------------------------------------------------------------------------------------------

def _between_check_and_load(monkeypatch, action):
    """Run `action()` after loramux has checked the file, just before llama.cpp opens it."""
    real = N.AdapterHandle.load.__func__

    def load(cls, model, path):
        action()
        return real(cls, model, path)

    monkeypatch.setattr(N.AdapterHandle, "load", classmethod(load))


def _other_alpha(src, dst, alpha):
    """The same factors under another alpha: a swap the discovery self-check cannot see."""
    write_adapter(dst, "llama", read_adapter_factors(src), alpha)


def test_a_file_swapped_after_the_check_is_not_the_one_loaded(engine, tmp_path, monkeypatch):
    good = write_tiny_lora(tmp_path / "good.gguf", rank=2, seed=11)
    engine.load_lora(good, name="ref")
    want = engine.logits(PROMPT, loras={"ref": 1.0})
    target = tmp_path / "target.gguf"
    target.write_bytes(good.read_bytes())
    evil = tmp_path / "evil.gguf"
    _other_alpha(good, evil, 50.0)
    _between_check_and_load(monkeypatch, lambda: os.replace(evil, target))
    if not PinnedFile.use_proc:  # no /proc/self/fd here: the swap is refused instead (next test)
        with pytest.raises(AdapterError, match="another file"):
            engine.load_lora(target, name="swapped")
        return
    a = engine.load_lora(target, name="swapped")
    assert a.alpha == 2.0 and np.array_equal(engine.logits(PROMPT, loras={"swapped": 1.0}), want)


def test_without_proc_a_swap_is_refused(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(PinnedFile, "use_proc", False)
    good = write_tiny_lora(tmp_path / "good.gguf", rank=2, seed=11)
    engine.set_lora(good, name="kept", scale=0.5)
    before = engine.logits(PROMPT)
    evil = tmp_path / "evil.gguf"
    _other_alpha(good, evil, 50.0)
    _between_check_and_load(monkeypatch, lambda: os.replace(evil, good))
    with pytest.raises(AdapterError) as ei:
        engine.load_lora(good, name="kept")
    assert ei.value.field == "file" and "another file" in str(ei.value)
    assert engine.active == {"kept": 0.5} and np.array_equal(engine.logits(PROMPT), before)


@pytest.mark.parametrize("use_proc", [True, False])
def test_a_rewrite_in_place_during_the_load_is_refused(engine, tmp_path, monkeypatch, use_proc):
    monkeypatch.setattr(PinnedFile, "use_proc", use_proc)
    p = write_tiny_lora(tmp_path / "inplace.gguf", rank=2, seed=12)
    alpha_at = p.read_bytes().index(b"adapter.lora.alpha") + len("adapter.lora.alpha") + 4

    def rewrite():
        st = os.stat(p)
        with open(p, "r+b") as f:  # same inode, same size: only the alpha's bytes and the mtime change
            f.seek(alpha_at)
            f.write(struct.pack("<f", 50.0))
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    _between_check_and_load(monkeypatch, rewrite)
    with pytest.raises(AdapterError, match="rewritten in place") as ei:
        engine.load_lora(p, name="inplace")
    assert ei.value.field == "file" and "inplace" not in engine.adapters


def test_pinned_file_closes_its_descriptor(tmp_path):
    p = write_tiny_lora(tmp_path / "x.gguf")
    pin = PinnedFile(p)
    fd = pin.fd
    pin.close(check=True)
    with pytest.raises(OSError):
        os.fstat(fd)
    assert math.isfinite(validate_adapter(p).alpha)


def test_header_kv_helpers_round_trip(seed):
    """The crafting helper writes what it is told (guards the tests above against a silent no-op)."""
    doc = copy.deepcopy(seed)
    apply_struct(doc, ("alpha", -3.5))
    doc.kvs.append(KV(b"x.y", 8, b"hello"))
    doc.tensors.append(Tensor(b"t.lora_a", [4], 0, b"\0" * 16))
    data, _ = serialize(doc)
    assert b"hello" in data and struct.pack("<f", -3.5) in data


def test_header_limit_is_exact(tmp_path, seed):
    """A header one byte longer than max_header is refused; one that fits is read."""
    data, spans = serialize(seed)
    end = max(o + w for o, w, _ in spans)  # the end of the tensor directory
    p = craft(tmp_path, seed)
    assert len(read_header(p, max_header=end).tensors) == 4
    with pytest.raises(GGUFFormatError, match="takes the header past"):
        read_header(p, max_header=end - 1)
