"""An adapter file's parse on the load path: its factors read and converted in one pass (views of one array)
hold exactly what reading each tensor gives, in every float type and layout; the one-pass check clears only
what the per-tensor checks clear, and refuses nothing they accept (the bytes between tensors are not
factors); the KV guard's gains match their definitions. Real GGUF files, real llama.cpp (the suite's tiny
model)."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
from tinymodel import random_factors

import loramux as lm
from loramux import _native as N
from loramux import ggml_types as G
from loramux.engine.adapters import CheckedAdapter
from loramux.engine.kv_guard import folded_gain, target_gain
from loramux.errors import AdapterError
from loramux.gguf_io import (
    LORA_A,
    LORA_B,
    read_adapter_factors,
    read_float_tensor,
    read_header,
    write_adapter,
)


def _padded(path: Path, factors: dict[str, tuple[np.ndarray, np.ndarray]], gap_value: float | None) -> Path:
    """An F16 adapter aligned to 256 bytes, so every tensor is followed by padding; `gap_value`: written into
    the first gap (the bytes no tensor owns), as F16."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(256)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 2.0)
    for base, (a, b) in factors.items():
        for suffix, arr in ((LORA_A, a), (LORA_B, b)):
            data = arr.astype(np.float16)
            w.add_tensor(base + suffix, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if gap_value is not None:
        h = read_header(path)
        first = min(h.tensors.values(), key=lambda t: t.offset)
        end = h.data_offset + first.offset + first.nbytes
        assert end % 256 != 0, "the test needs a gap after the first tensor"
        with open(path, "r+b") as f:
            f.seek(end)
            f.write(np.full(4, gap_value, np.float16).tobytes())
    return path


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_one_pass_read_equals_reading_each_tensor(tmp_path, dtype):
    f = random_factors(rank=3, seed=11)
    f["blk.0.attn_q.weight"][0][0, :3] = (np.inf, -0.0, 6e-8)  # the parse keeps what the file says
    path = write_adapter(tmp_path / f"{dtype}.gguf", "llama", f, 3.0, dtype=dtype)
    h = read_header(path)
    for decode in (G.decode, N.decode_floats):
        got = read_adapter_factors(path, decode=decode)
        assert got.flat is not None and got.flat.dtype == np.float32
        assert list(got) == list(f)
        for t, (a, b) in got.items():
            for arr, suffix in ((a, LORA_A), (b, LORA_B)):
                want = read_float_tensor(h, t + suffix)
                assert arr.dtype == np.float32 and arr.shape == want.shape
                assert arr.tobytes() == want.tobytes(), (t, suffix)
                assert np.shares_memory(arr, got.flat)


def test_ggml_converts_f16_exactly_as_numpy_does():
    bits = np.arange(0, 1 << 16, dtype=np.uint16)  # every F16 value: zeros, subnormals, Inf, NaN
    raw = bits.view(np.float16)[1:]  # an odd length: the converter's tail too
    want = G.decode(raw, G.F16)
    got = N.decode_floats(raw, G.F16)
    finite = np.isfinite(want)
    assert got.tobytes() != b"" and got.shape == want.shape
    assert np.array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))
    assert N.decode_floats(raw[:0], G.F16).shape == (0,)


def test_mixed_types_are_read_one_by_one(tmp_path):
    f = random_factors(rank=2, seed=12)
    p32 = write_adapter(tmp_path / "a.gguf", "llama", f, 2.0, dtype="f32")
    p16 = write_adapter(tmp_path / "b.gguf", "llama", f, 2.0, dtype="f16")
    w = gguf.GGUFWriter(str(tmp_path / "mixed.gguf"), "llama")  # A in F32, B in F16
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 2.0)
    for base, (a, b) in f.items():
        w.add_tensor(base + LORA_A, a.astype(np.float32))
        w.add_tensor(base + LORA_B, b.astype(np.float16), raw_shape=b.shape, raw_dtype=gguf.GGMLQuantizationType.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = read_adapter_factors(tmp_path / "mixed.gguf", decode=N.decode_floats)
    assert got.flat is None
    a32, b16 = read_adapter_factors(p32), read_adapter_factors(p16)
    for t, (a, b) in got.items():
        assert np.array_equal(a, a32[t][0]) and np.array_equal(b, b16[t][1])


def test_what_lies_between_tensors_refuses_nothing(tiny_model, tmp_path):
    """A NaN in the padding after a tensor fails the one-pass check; the per-tensor checks then clear the file,
    which loads and serves as the same factors without the NaN do."""
    f = random_factors(rank=3, seed=13)
    clean = _padded(tmp_path / "clean.gguf", f, None)
    dirty = _padded(tmp_path / "dirty.gguf", f, float("nan"))
    assert clean.read_bytes() != dirty.read_bytes()
    flat = read_adapter_factors(dirty, decode=N.decode_floats).flat
    assert flat is not None and np.isnan(flat).any()
    with lm.Engine.load(tiny_model, n_ctx=128, n_threads=1) as eng:
        checked = CheckedAdapter(eng.model, dirty)
        checked.close()
        eng.load_lora(clean, "clean")
        eng.load_lora(dirty, "dirty")
        want = eng.generate("the cat sat", loras={"clean": 1.0}, max_tokens=6).tokens
        assert eng.generate("the cat sat", loras={"dirty": 1.0}, max_tokens=6).tokens == want


@pytest.mark.parametrize("bad", ["nan", "inf", "huge"])
def test_a_bad_value_in_a_tensor_is_refused_with_its_target(tiny_model, tmp_path, bad):
    f = random_factors(rank=2, seed=14)
    target = "blk.1.ffn_down.weight"
    value = {"nan": np.nan, "inf": np.inf, "huge": 1e30}[bad]
    f[target][1][5, 1] = value
    path = write_adapter(tmp_path / f"{bad}.gguf", "llama", f, 2.0)
    with lm.Engine.load(tiny_model, n_ctx=128, n_threads=1) as eng, pytest.raises(AdapterError) as e:
        CheckedAdapter(eng.model, path)
    text = str(e.value)
    assert target in text
    assert ("NaN or Inf" in text) if bad != "huge" else ("overflow F32" in text and "max|A|·in" in text)


def _target_gain_by_definition(a: np.ndarray, b: np.ndarray, s: float) -> float:
    rows_a = [math.sqrt(sum(float(x) ** 2 for x in row)) for row in a]
    rows_b = [sum(abs(float(x)) for x in row) for row in b]
    return abs(s) * max(rows_b) * max(rows_a)


def _folded_gain_by_definition(a, b, s, w, bias, n) -> float:  # noqa: ANN001
    reach = [math.sqrt(sum((float(x) * float(y)) ** 2 for x, y in zip(row, w))) * math.sqrt(n)
             + abs(sum(float(x) * float(y) for x, y in zip(row, bias))) for row in a]
    return abs(s) * max(sum(abs(float(x)) * r for x, r in zip(row, reach)) for row in b)


def test_gains_match_their_definitions():
    rng = np.random.default_rng(5)
    for r, n_in, n_out in ((1, 7, 3), (4, 16, 33), (8, 40, 24)):
        a = rng.standard_normal((r, n_in)).astype(np.float32)
        b = rng.standard_normal((n_out, r)).astype(np.float32)
        b[n_out // 2] *= 9  # one row of B far wider than the rest: the max must find it
        w = np.abs(rng.standard_normal(n_in)).astype(np.float32)
        bias = rng.standard_normal(n_in).astype(np.float32)
        s = -0.75
        assert target_gain(a, b, s) == pytest.approx(_target_gain_by_definition(a, b, s), rel=1e-12)
        assert folded_gain(a, b, s, w, bias, n_in) == pytest.approx(
            _folded_gain_by_definition(a, b, s, w, bias, n_in), rel=1e-12)
        x = rng.standard_normal((64, n_in))  # the bound holds for inputs the norm can give
        x = x / np.linalg.norm(x, axis=1, keepdims=True) * math.sqrt(n_in) * w + bias
        delta = np.abs(s * (x @ a.T.astype(np.float64)) @ b.T.astype(np.float64)).max()
        assert delta <= folded_gain(a, b, s, w, bias, n_in)
    assert target_gain(np.full((2, 3), np.inf, np.float32), np.ones((4, 2), np.float32), 1.0) == math.inf
