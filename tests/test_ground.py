"""The ground modules every layer shares: ggml type ids and bf16 bits, GGUF value types, progress bars.

References are independent of loramux: the `gguf` package (llama.cpp's own Python side) for the type
ids, element sizes and bf16 rounding, and files written by its GGUFWriter for the value types.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from loramux import _progress
from loramux import ggml_types as G
from loramux.cli.convert import parse_lora_arg
from loramux.errors import ParameterError
from loramux.gguf_io import VALUE_FORMATS, read_header


def test_type_ids_and_sizes_are_ggmls() -> None:
    Q = gguf.GGMLQuantizationType
    assert (G.F32, G.F16, G.BF16, G.Q8_0) == (Q.F32, Q.F16, Q.BF16, Q.Q8_0)
    for t, name in G.FLOAT_NAMES.items():
        assert Q(t).name == name
        block, size = gguf.GGML_QUANT_SIZES[Q(t)]
        assert block == 1 and G.ELEMENT_SIZE[t] == size == np.dtype(G.STORAGE_DTYPE[t]).itemsize


def test_bf16_rounds_like_gguf() -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32)
    # ties (low half exactly 0x8000) with an even and an odd kept half, and their neighbours
    ties = np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF818000, 0x7F7F8000], np.uint32)
    x = np.concatenate([bits, ties]).view(np.float32)
    x = x[np.isfinite(x)]
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16).view(np.uint16)
    assert np.array_equal(G.to_bf16_bits(x), ref)
    assert [hex(v) for v in G.to_bf16_bits(ties.view(np.float32))] == [
        "0x3f80", "0x3f82", "0x3f80", "0x3f81", "0xbf82", "0x7f80"]


def test_bf16_bits_round_trip_every_pattern() -> None:
    u = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    f = G.from_bf16_bits(u)
    assert f.dtype == np.float32 and np.array_equal(f.view(np.uint32) & 0xFFFF, np.zeros(1 << 16, np.uint32))
    assert np.array_equal(G.to_bf16_bits(f), u)
    assert np.array_equal(G.decode(u, G.BF16).view(np.uint32), f.view(np.uint32))
    h = np.array([1.5, -2.0, 65504.0], np.float16)
    assert G.decode(h, G.F16).tolist() == [1.5, -2.0, 65504.0]


def test_value_formats_read_every_scalar_type(tmp_path: Path) -> None:
    path = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    values = {"u8": 250, "i8": -100, "u16": 65000, "i16": -32000, "u32": 4_000_000_000, "i32": -2_000_000_000,
              "f32": 1.5, "bool": True, "u64": 1 << 60, "i64": -(1 << 60), "f64": 0.1}
    for key, v in values.items():
        add = {"bool": w.add_bool, "f32": w.add_float32, "f64": w.add_float64}.get(key)
        if add is None:
            add = getattr(w, f"add_{'uint' if key[0] == 'u' else 'int'}{key[1:]}")
        add(f"t.{key}", v)
    w.add_array("t.arr_int", [-1, 2, -3])
    w.add_array("t.arr_str", ["a", "bc"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    h = read_header(path)
    assert {k: h.metadata[f"t.{k}"] for k in values} == values
    assert h.metadata["t.arr_str"] == ["a", "bc"] and h.metadata["t.arr_int"] == [-1, 2, -3]
    assert set(VALUE_FORMATS) == {int(t) for t in gguf.GGUFValueType} - {8, 9}  # all but STRING, ARRAY


def test_bar_off_on_and_by_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    off = _progress.bar(3, "quiet", False)
    assert isinstance(off, _progress.NoBar)
    off.update(1)
    off.set_postfix({"loss": "1.0"}, refresh=False)
    off.close()
    assert isinstance(_progress.bar(3, "auto", None), _progress.NoBar)  # captured stderr is no terminal
    assert list(_progress.progress_iter(iter("abc"), desc="quiet")) == ["a", "b", "c"]
    assert capsys.readouterr().err == ""

    on = _progress.bar(4, "shown", True, unit="row", initial=1, leave=True)  # leave: the end state is printed
    on.set_postfix({"loss": "0.5"}, refresh=False)
    on.update(1)
    on.close()
    assert list(_progress.progress_iter(iter("abc"), total=3, desc="iterated", enabled=True)) == ["a", "b", "c"]
    err = capsys.readouterr().err
    assert "shown" in err and "2/4" in err and "loss=0.5" in err and "iterated" in err and "0/3" in err


def test_merge_lora_arg_refuses_a_name() -> None:
    assert parse_lora_arg("./x=y.gguf:0.5") == ("./x=y.gguf", 0.5)
    with pytest.raises(ParameterError) as e:
        parse_lora_arg("style=a.gguf:0.5")
    assert e.value.parameter == "--lora" and "./style=a.gguf:0.5" in (e.value.hint or "")


def test_bf16_keeps_every_nan_a_nan():
    """A NaN must never round into a finite value or Inf (a later finiteness check relies on it)."""
    from loramux.ggml_types import from_bf16_bits, to_bf16_bits

    rng = np.random.default_rng(0)
    mant = np.concatenate([rng.integers(1, 1 << 23, 4096, dtype=np.uint32),
                           np.array([1, 0x7FFF, 0x7F8000, 0x7FFFFF, 0x400000], np.uint32)])
    for sign in (0, 0x80000000):
        bits = (np.uint32(sign) | np.uint32(0x7F800000) | mant).astype(np.uint32)
        out = from_bf16_bits(to_bf16_bits(bits.view(np.float32)))
        assert np.isnan(out).all()
        assert (np.signbit(out) == bool(sign)).all()
