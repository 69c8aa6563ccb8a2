"""The engine invariants on the real default model (Gemma 3 270M Q4_K_M)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import max_diff

import loramux as lm
from loramux.gguf_io import write_adapter

pytestmark = pytest.mark.gemma
PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
PROMPT = "The quick brown fox jumps over the lazy dog because"


def _factors(model, rank, seed, scale=0.02, zero=False):
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(model.n_layer):
        for p in PROJ:
            o, n_in = model.tensor_shapes[f"blk.{i}.{p}.weight"]
            a = rng.standard_normal((rank, n_in)).astype(np.float32) * scale
            b = rng.standard_normal((o, rank)).astype(np.float32) * scale
            out[f"blk.{i}.{p}.weight"] = (a * 0, b * 0) if zero else (a, b)
    return out


@pytest.fixture()
def gem(gemma):
    yield gemma
    gemma.clear_loras()


def test_zero_adapter_scale0_and_remove_are_base(gem, tmp_path):
    base = gem.logits(PROMPT)
    write_adapter(tmp_path / "z.gguf", "gemma3", _factors(gem.model, 2, 0, zero=True), 2.0)
    write_adapter(tmp_path / "r.gguf", "gemma3", _factors(gem.model, 2, 1), 2.0)
    gem.set_lora(tmp_path / "z.gguf")
    assert max_diff(gem.logits(PROMPT), base) == 0.0
    gem.set_lora(tmp_path / "r.gguf", scale=1.0)
    assert max_diff(gem.logits(PROMPT), base) > 1e-3
    gem.set_lora("r", scale=0.0)
    assert max_diff(gem.logits(PROMPT), base) == 0.0
    gem.clear_loras()
    assert max_diff(gem.logits(PROMPT), base) == 0.0


def test_in_place_write_equals_fresh_load(gem, tmp_path):
    write_adapter(tmp_path / "x.gguf", "gemma3", _factors(gem.model, 2, 2), 2.0)
    a = gem.set_lora(tmp_path / "x.gguf")
    new = _factors(gem.model, 2, 3)
    a.set_factors_multi(new)
    (tmp_path / "x.gguf").unlink()
    written = gem.logits(PROMPT)
    gem.clear_loras()
    write_adapter(tmp_path / "y.gguf", "gemma3", new, 2.0)
    gem.set_lora(tmp_path / "y.gguf")
    assert max_diff(gem.logits(PROMPT), written) == 0.0


def test_generate_and_chat(gem):
    c = gem.generate("The capital of France is", max_tokens=8)
    assert "France" in c.text and c.completion_tokens == 8
    chat = gem.chat([{"role": "user", "content": "Say hello."}], max_tokens=16)
    assert chat.completion_tokens > 0 and chat.text.strip()
    assert "".join(gem.stream("The capital of France is", max_tokens=8)) == c.text


def test_alora_on_gemma(gem, tmp_path):
    inv = gem.tokenize("<start_of_turn>model", add_bos=False)
    write_adapter(tmp_path / "al.gguf", "gemma3", _factors(gem.model, 2, 4, scale=0.05), 2.0, invocation_tokens=inv)
    a = gem.load_lora(tmp_path / "al.gguf")
    assert list(a.invocation_tokens) == inv
    with_inv = gem.chat([{"role": "user", "content": "Hi"}], max_tokens=4, loras={"al": 1.0})
    assert with_inv.alora == {"al": True}
    plain = gem.generate("Hello there", max_tokens=6, loras={"al": 1.0})
    assert plain.alora == {"al": False}
    assert plain.tokens == gem.generate("Hello there", max_tokens=6, loras={}).tokens
    with pytest.raises(lm.AdapterNotFoundError):
        gem.generate("x", loras={"missing": 1.0})
