"""Bad adapter files and names: typed errors naming the problem, and the previous state keeps serving."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PROMPT, max_diff
from tinymodel import random_factors, write_tiny_lora

import loramux as lm
from loramux.gguf_io import write_adapter


def _truncated(path, tmp_path):
    data = path.read_bytes()
    out = tmp_path / "trunc.gguf"
    out.write_bytes(data[: len(data) // 2])
    return out


def _transposed_a(tmp_path):
    f = random_factors(rank=2, seed=9)
    name = "blk.0.attn_q.weight"
    a, b = f[name]
    f[name] = (a.T.copy(), b)
    return write_adapter(tmp_path / "transposed.gguf", "llama", f, 2.0)


def _unpaired(tmp_path):
    import gguf

    p = tmp_path / "unpaired.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 2.0)
    w.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((2, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


def _nan(tmp_path):
    f = random_factors(rank=2, seed=9)
    a, b = f["blk.1.ffn_up.weight"]
    a[0, 0] = np.nan
    return write_adapter(tmp_path / "nan.gguf", "llama", f, 2.0)


CASES = {
    "missing file": (lambda d, t: d / "nope.gguf", lm.SourceError, "no such file"),
    "not a GGUF": (lambda d, t: (t / "x.gguf").write_text("<html>hello</html>") and t / "x.gguf",
                   lm.AdapterError, "not a GGUF"),
    "truncated": (lambda d, t: _truncated(d / "a.gguf", t), lm.AdapterError, "truncated"),
    "base as adapter": (lambda d, t: d / "tiny.gguf", lm.AdapterError, "base model, not an adapter"),
    "other architecture": (lambda d, t: write_tiny_lora(t / "qwen.gguf", arch="qwen2"), lm.AdapterError,
                           "'qwen2' but the base model is 'llama'"),
    "target missing": (lambda d, t: write_adapter(t / "m.gguf", "llama",
                                                  {"blk.7.attn_q.weight": random_factors()["blk.0.attn_q.weight"]}, 2.0),
                       lm.AdapterError, "blk.7.attn_q.weight does not exist in the base model"),
    "transposed A": (lambda d, t: _transposed_a(t), lm.AdapterError, "rank of lora_a"),
    "unpaired": (lambda d, t: _unpaired(t), lm.AdapterError, "has no matching blk.0.attn_q.weight.lora_b"),
    "NaN factors": (lambda d, t: _nan(t), lm.AdapterError, "NaN"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_adapter_is_refused_and_state_kept(engine, tiny_dir, tmp_path, case):
    make, err, text = CASES[case]
    engine.set_lora(tiny_dir / "a.gguf", scale=0.5)
    before = engine.logits(PROMPT)
    gen_before = engine.generate(PROMPT, max_tokens=8).tokens
    path = make(tiny_dir, tmp_path)
    with pytest.raises(err) as ei:
        engine.set_lora(path, name="a")  # would replace "a": must not
    msg = str(ei.value)
    assert text in msg, msg
    assert str(path) in msg or path.name in msg
    assert engine.active == {"a": 0.5}
    assert max_diff(engine.logits(PROMPT), before) == 0.0
    assert engine.generate(PROMPT, max_tokens=8).tokens == gen_before


def test_all_problems_listed_at_once(engine, tmp_path):
    f = random_factors(rank=2, seed=9)
    f["blk.9.attn_q.weight"] = f["blk.0.attn_q.weight"]
    a, b = f["blk.0.ffn_down.weight"]
    f["blk.0.ffn_down.weight"] = (a, b[:10])
    path = write_adapter(tmp_path / "many.gguf", "llama", f, 2.0)
    with pytest.raises(lm.AdapterError) as ei:
        engine.load_lora(path)
    assert len(ei.value.problems) >= 2
    assert ei.value.path == str(path)


def test_unknown_names(engine, tiny_dir):
    engine.set_lora(tiny_dir / "a.gguf")
    with pytest.raises(lm.AdapterNotFoundError) as ei:
        engine.remove_lora("nope")
    assert ei.value.name == "nope" and "a" in str(ei.value)
    with pytest.raises(lm.ParameterError):
        engine.generate(PROMPT, max_tokens=4, temperature=float("nan"))
    with pytest.raises(lm.LoramuxError):
        engine.set_lora("a", scale=float("inf"))
    assert engine.active == {"a": 1.0}
    assert engine.generate(PROMPT, max_tokens=4).finish_reason in ("stop", "length")


def test_prompt_too_long(engine):
    with pytest.raises(lm.ContextLengthError) as ei:
        engine.generate("the cat " * 400, max_tokens=4)
    assert ei.value.n_ctx == 256


def test_bad_base_model(tmp_path, tiny_dir):
    with pytest.raises(lm.ModelError, match="file not found"):
        lm.Engine.load(tmp_path / "none.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 10)
    with pytest.raises(lm.ModelError, match="truncated|implausible"):
        lm.Engine.load(tmp_path / "junk.gguf")
    with pytest.raises(lm.ModelError, match="adapter, not a base model"):
        lm.Engine.load(tiny_dir / "a.gguf")
