"""PEFT ⇄ GGUF conversion and merging, checked against transformers + PEFT and llama.cpp itself.

Reference tests: a tiny HF model (llama, gemma3) is written to GGUF by tests/hf_tiny.py, a random
PEFT LoRA on it is converted, and llama.cpp's logits with the adapter must equal PEFT's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from tinymodel import base_shapes, write_tiny_lora, write_tiny_model

from loramux.convert import convert_peft, export_peft
from loramux.errors import ConversionError
from loramux.gguf_io import read_adapter_factors, read_header, validate_adapter, write_adapter
from loramux.merging import QUANT_TYPES, dequantize_tensor, merge

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

TOKENS = [1, 270, 271, 272, 5, 100, 200, 290, 17, 33, 64, 128, 260, 261, 262, 3]
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---------------------------------------------------------------------------------------------
# llama.cpp logits
# ---------------------------------------------------------------------------------------------

def cpp_logits(model: Path, tokens: list[int], lora: Path | None = None, scale: float = 1.0) -> np.ndarray:
    """All-position logits from llama.cpp through loramux's Engine, with an F32 KV cache: the default F16
    cache alone moves these tiny models' logits by ~5e-3, more than the tolerances below."""
    import loramux as lm

    eng = lm.Engine.load(str(model), n_ctx=256, n_threads=2, kv_type="f32")
    try:
        if lora is not None:
            eng.set_lora(str(lora), scale=scale, name="x")
        return np.asarray(eng.logits(tokens), dtype=np.float32)
    finally:
        eng.close()


# ---------------------------------------------------------------------------------------------
# fixtures: tiny HF models, their GGUFs and PEFT adapters
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ht():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    import hf_tiny

    return hf_tiny


def _reference(ht, tmp: Path, make, **lora) -> SimpleNamespace:
    model = make()
    base = ht.write_gguf(model, tmp / "base.gguf")
    base_ref = ht.hf_logits(model, TOKENS)
    pm = ht.add_lora(model, **lora)
    pm.save_pretrained(tmp / "peft")
    return SimpleNamespace(dir=tmp, base=base, peft=tmp / "peft", ref=ht.hf_logits(pm, TOKENS),
                           base_ref=base_ref, model=pm)


@pytest.fixture(scope="module")
def llama(ht, tmp_path_factory):
    return _reference(ht, tmp_path_factory.mktemp("llama"), ht.tiny_llama)


@pytest.fixture(scope="module")
def llama_gguf(llama):
    out = llama.dir / "adapter.gguf"
    convert_peft(llama.peft, llama.base, out)
    return out


# ---------------------------------------------------------------------------------------------
# PEFT → GGUF against the reference
# ---------------------------------------------------------------------------------------------

def test_llama_adapter_matches_peft(llama, llama_gguf):
    rep = convert_peft(llama.peft, llama.base, llama.dir / "again.gguf", dry_run=True)
    assert rep.ok and len(rep.targets) == 14 and rep.rank == 4 and rep.alpha == 8
    assert len(rep.permuted) == 4 and not rep.folded  # q/k of 2 blocks; alpha/r is uniform
    got = cpp_logits(llama.base, TOKENS, llama_gguf)
    diff = np.abs(got - llama.ref).max()
    effect = np.abs(llama.ref - llama.base_ref).max()
    print(f"llama: max|llama.cpp - PEFT| = {diff:.2e} (adapter effect {effect:.2f})")
    assert effect > 1.0  # the adapter really changes the output
    assert diff <= 1e-3


def test_gemma3_adapter_matches_peft(ht, tmp_path):
    ref = _reference(ht, tmp_path, ht.tiny_gemma3)
    convert_peft(ref.peft, ref.base, tmp_path / "adapter.gguf")
    got = cpp_logits(ref.base, TOKENS, tmp_path / "adapter.gguf")
    raw = np.abs(got - ref.ref).max()
    # ggml's GELU reads an F16 lookup table (input and output rounded to F16); the reference does
    # the same rounding so the comparison measures the conversion, not the activation table.
    for layer in ref.model.base_model.model.model.layers:
        layer.mlp.act_fn = _f16_rounded(layer.mlp.act_fn)
    diff = np.abs(got - ht.hf_logits(ref.model, TOKENS)).max()
    print(f"gemma3: max|llama.cpp - PEFT| = {diff:.2e} (without the GELU-table emulation {raw:.2e})")
    assert np.abs(ref.ref - ref.base_ref).max() > 1.0
    assert diff <= 1e-3


def _f16_rounded(fn):
    """`fn` (an activation module) with input and output rounded to float16, like ggml's table."""
    import torch

    class F16Rounded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fn = fn

        def forward(self, x):
            return self.fn(x.half().float()).half().float()

    return F16Rounded()


def test_rslora_rank_and_alpha_patterns(ht, tmp_path):
    ref = _reference(ht, tmp_path, ht.tiny_llama, use_rslora=True,
                     rank_pattern={"q_proj": 8, "model.layers.1.mlp.down_proj": 2},
                     alpha_pattern={"v_proj": 3.0, "up_proj": 20.0})
    rep = convert_peft(ref.peft, ref.base, tmp_path / "adapter.gguf")
    assert rep.ranks["blk.0.attn_q.weight"] == 8 and rep.ranks["blk.1.ffn_down.weight"] == 2
    assert rep.alpha == pytest.approx(8 * math.sqrt(4))  # alpha·sqrt(r) of the plain modules
    assert "blk.0.attn_v.weight" in rep.folded and "blk.0.ffn_gate.weight" not in rep.folded
    got = cpp_logits(ref.base, TOKENS, tmp_path / "adapter.gguf")
    diff = np.abs(got - ref.ref).max()
    print(f"rsLoRA + rank/alpha patterns: max|llama.cpp - PEFT| = {diff:.2e}")
    assert diff <= 1e-3


def test_fan_in_fan_out_conv1d(ht, tmp_path):
    """GPT-2's Conv1D stores weights (in, out); PEFT still saves A (r, in), B (out, r), and the
    GGUF converter transposed the base weight, so the factors apply as they are. A checkpoint
    written with transposed factors (and the flag) must convert to the very same factors."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=ht.VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                                bos_token_id=1, eos_token_id=2))
    pm = ht.add_lora(model, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    pm.save_pretrained(tmp_path / "peft")
    base = _header_only_gguf(tmp_path / "gpt2.gguf", "gpt2", {
        f"blk.{i}.{n}.weight": s for i in range(2)
        for n, s in (("attn_qkv", (192, 64)), ("attn_output", (64, 64)), ("ffn_up", (256, 64)), ("ffn_down", (64, 256)))})
    convert_peft(tmp_path / "peft", base, tmp_path / "a.gguf")
    factors = read_adapter_factors(tmp_path / "a.gguf")
    assert len(factors) == 8
    for target, (a, b) in factors.items():
        i, kind = target.split(".")[1], target.split(".")[2]
        hf = {"attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_up": "mlp.c_fc",
              "ffn_down": "mlp.c_proj"}[kind]
        layer = pm.get_submodule(f"base_model.model.transformer.h.{i}.{hf}")
        delta = layer.get_delta_weight("default").detach().numpy().T  # Conv1D (in, out) → (out, in)
        np.testing.assert_allclose(2.0 * b @ a, delta, rtol=1e-5, atol=1e-6)
    # the same checkpoint with every factor transposed
    sd = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    (tmp_path / "t").mkdir()
    save_file({k: np.ascontiguousarray(v.T) for k, v in sd.items()}, tmp_path / "t" / "adapter_model.safetensors")
    (tmp_path / "t" / "adapter_config.json").write_text((tmp_path / "peft" / "adapter_config.json").read_text())
    convert_peft(tmp_path / "t", base, tmp_path / "b.gguf")
    for t, (a, b) in read_adapter_factors(tmp_path / "b.gguf").items():
        assert np.array_equal(a, factors[t][0]) and np.array_equal(b, factors[t][1])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma2", "phi3"])
def test_other_architectures_map_every_module(ht, tmp_path, arch):
    """Name mapping (incl. Phi-3's fused qkv_proj / gate_up_proj) and no permutation: the factors
    arrive unchanged on the GGUF tensor of the right shape."""
    import transformers
    from peft import get_peft_model_state_dict

    cls, model_cls = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                      "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "phi3": ("Phi3Config", "Phi3ForCausalLM")}[arch]
    cfg = getattr(transformers, cls)(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = getattr(transformers, model_cls)(cfg)
    tmap = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), 2)
    shapes = {tmap.get_name(n, try_suffixes=(".weight",)): tuple(p.shape) for n, p in model.named_parameters()
              if p.ndim == 2 and "embed" not in n and tmap.get_name(n, try_suffixes=(".weight",))}
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if arch == "phi3" else PROJ
    pm = ht.add_lora(model, target_modules=targets)
    pm.save_pretrained(tmp_path / "peft")
    base = _header_only_gguf(tmp_path / "base.gguf", arch, shapes)
    rep = convert_peft(tmp_path / "peft", base, tmp_path / "a.gguf")
    assert len(rep.targets) == 2 * len(targets) and not rep.permuted and not rep.folded
    sd = get_peft_model_state_dict(pm)
    factors = read_adapter_factors(tmp_path / "a.gguf")
    for target, module in rep.hf_modules.items():
        a = sd[f"base_model.model.{module}.lora_A.weight"].numpy()
        b = sd[f"base_model.model.{module}.lora_B.weight"].numpy()
        assert np.array_equal(factors[target][0], a) and np.array_equal(factors[target][1], b)
    if arch == "phi3":
        assert set(rep.targets) >= {"blk.0.attn_qkv.weight", "blk.1.ffn_up.weight"}
        assert shapes["blk.0.attn_qkv.weight"] == (128, 64) and shapes["blk.0.ffn_up.weight"] == (256, 64)


def _header_only_gguf(path: Path, arch: str, shapes: dict[str, tuple[int, ...]], **meta) -> Path:
    """A GGUF whose tensors are zeros: enough for the converter, which reads only the header."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_name(f"tiny-{arch}")
    for k, v in meta.items():
        w.add_uint32(f"{arch}.{k}", v)
    for name, shape in shapes.items():
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_alora_invocation_tokens_are_carried(llama, tmp_path):
    d = tmp_path / "alora"
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes((llama.peft / "adapter_model.safetensors").read_bytes())
    cfg = json.loads((llama.peft / "adapter_config.json").read_text())
    cfg["alora_invocation_tokens"] = [270, 271]
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    convert_peft(d, llama.base, tmp_path / "a.gguf")
    assert validate_adapter(tmp_path / "a.gguf").invocation_tokens == (270, 271)


# ---------------------------------------------------------------------------------------------
# GGUF → PEFT
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16"])
def test_round_trip_is_bit_exact(llama, tmp_path, outtype):
    first = tmp_path / "first.gguf"
    convert_peft(llama.peft, llama.base, first, outtype=outtype)
    export_peft(first, tmp_path / "peft", "tiny/llama", base=llama.base)
    again = convert_peft(tmp_path / "peft", llama.base, tmp_path / "again.gguf", outtype=outtype)
    h1, h2 = read_header(first), read_header(tmp_path / "again.gguf")
    assert again.alpha == h1.metadata["adapter.lora.alpha"] == h2.metadata["adapter.lora.alpha"]
    assert list(h1.tensors) == list(h2.tensors)
    for name, t in h1.tensors.items():
        assert h2.tensors[name].ggml_type == t.ggml_type
        size = h1.tensors[name].n_elements * (4 if outtype == "f32" else 2)
        raw1 = first.read_bytes()[h1.data_offset + t.offset:][:size]
        raw2 = (tmp_path / "again.gguf").read_bytes()[h2.data_offset + h2.tensors[name].offset:][:size]
        assert raw1 == raw2, name


def test_export_loads_in_peft(ht, llama, llama_gguf, tmp_path):
    from peft import PeftModel

    export_peft(llama_gguf, tmp_path / "peft", base=llama.base)
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and sorted(cfg["target_modules"]) == sorted(PROJ)
    pm = PeftModel.from_pretrained(ht.tiny_llama(), tmp_path / "peft")
    diff = np.abs(ht.hf_logits(pm, TOKENS) - llama.ref).max()
    assert diff <= 1e-5


def test_export_mixed_ranks_round_trip(ht, tmp_path):
    ref = _reference(ht, tmp_path, ht.tiny_llama, rank_pattern={"k_proj": 2}, alpha_pattern={"o_proj": 2.0},
                     target_modules=["q_proj", "k_proj", "o_proj"])
    convert_peft(ref.peft, ref.base, tmp_path / "a.gguf")
    export_peft(tmp_path / "a.gguf", tmp_path / "out", base=ref.base)
    cfg = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert set(cfg["rank_pattern"].values()) == {2}
    convert_peft(tmp_path / "out", ref.base, tmp_path / "b.gguf")
    fa, fb = read_adapter_factors(tmp_path / "a.gguf"), read_adapter_factors(tmp_path / "b.gguf")
    assert all(np.array_equal(fa[k][i], fb[k][i]) for k in fa for i in (0, 1))
    from peft import PeftModel

    pm = PeftModel.from_pretrained(ht.tiny_llama(), tmp_path / "out")
    assert np.abs(ht.hf_logits(pm, TOKENS) - ref.ref).max() <= 1e-5


def test_export_alpha_zero_keeps_the_scaling(tmp_path):
    """llama.cpp reads alpha 0 as "no scaling"; PEFT says that with lora_alpha == r."""
    base = write_tiny_model(tmp_path / "base.gguf")
    src = write_tiny_lora(tmp_path / "a.gguf", rank=2, alpha=0.0, seed=5)
    export_peft(src, tmp_path / "peft", base=base)
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["lora_alpha"] == 2
    rep = convert_peft(tmp_path / "peft", base, tmp_path / "b.gguf")
    assert rep.alpha / rep.rank == 1.0 and not rep.folded
    fa, fb = read_adapter_factors(src), read_adapter_factors(tmp_path / "b.gguf")
    assert all(np.array_equal(fa[k][i], fb[k][i]) for k in fa for i in (0, 1))


def test_export_llama_needs_the_base(llama_gguf, tmp_path):
    with pytest.raises(ConversionError, match="pass base="):
        export_peft(llama_gguf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# merge
# ---------------------------------------------------------------------------------------------

def test_merge_f32_equals_runtime_adapter(llama, llama_gguf, tmp_path):
    out = tmp_path / "merged.gguf"
    rep = merge(llama.base, [(llama_gguf, 0.7)], out, quant=None)
    assert len(rep.touched) == 14 and rep.ftype is None
    runtime = cpp_logits(llama.base, TOKENS, llama_gguf, scale=0.7)
    diff = np.abs(cpp_logits(out, TOKENS) - runtime).max()
    print(f"merge F32: max|merged - base+adapter at run time| = {diff:.2e}")
    assert diff <= 1e-4
    # metadata and untouched tensors are copied as they were
    hb, hm = read_header(llama.base, keep_arrays=10**6), read_header(out, keep_arrays=10**6)
    assert hb.metadata == hm.metadata
    raw_b, raw_m = llama.base.read_bytes(), out.read_bytes()
    for name in ("token_embd.weight", "output.weight", "blk.1.ffn_norm.weight"):
        tb, tm = hb.tensors[name], hm.tensors[name]
        n = tb.n_elements * 4
        assert raw_b[hb.data_offset + tb.offset:][:n] == raw_m[hm.data_offset + tm.offset:][:n]


def test_merge_two_adapters_math(tmp_path):
    base = write_tiny_model(tmp_path / "base.gguf")
    a1 = write_tiny_lora(tmp_path / "a1.gguf", rank=2, alpha=4.0, seed=3)
    a2 = write_tiny_lora(tmp_path / "a2.gguf", rank=3, alpha=0.0, seed=4, dtype="f16",
                         targets=("blk.0.attn_q.weight", "blk.1.ffn_down.weight"))
    merge(base, [(a1, 0.5), (a2, -1.5)], tmp_path / "m.gguf", quant="F32")
    hb, hm = read_header(base), read_header(tmp_path / "m.gguf")
    mm_b = np.memmap(base, dtype=np.uint8, mode="r")
    mm_m = np.memmap(tmp_path / "m.gguf", dtype=np.uint8, mode="r")
    f1, f2 = read_adapter_factors(a1), read_adapter_factors(a2)
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "blk.0.attn_k.weight"):
        want = dequantize_tensor(hb, hb.tensors[name], mm_b)
        want += np.float32(0.5 * 4.0 / 2) * (f1[name][1] @ f1[name][0])
        if name in f2:  # alpha 0: llama.cpp applies B·A unscaled
            want += np.float32(-1.5) * (f2[name][1] @ f2[name][0])
        np.testing.assert_allclose(dequantize_tensor(hm, hm.tensors[name], mm_m), want, rtol=0, atol=1e-6)


def test_merge_requantized_q8_0(llama, llama_gguf, tmp_path):
    from loramux import _native

    merged = tmp_path / "merged-q8.gguf"
    rep = merge(llama.base, [(llama_gguf, 0.5)], merged, quant="Q8_0")
    assert rep.quant == "Q8_0"
    assert {t.ggml_type for t in read_header(merged).tensors.values() if len(t.shape) == 2} == {8}
    _native.model_quantize(str(llama.base), str(tmp_path / "base-q8.gguf"), QUANT_TYPES["Q8_0"])
    runtime = cpp_logits(llama.base, TOKENS, llama_gguf, scale=0.5)
    f32_base = cpp_logits(llama.base, TOKENS)
    merge_err = cpp_logits(merged, TOKENS) - runtime
    quant_err = cpp_logits(tmp_path / "base-q8.gguf", TOKENS) - f32_base

    def rms(x):
        return float(np.sqrt(np.mean(x ** 2)))
    print(f"merge Q8_0: |merged-Q8_0 - runtime| max {np.abs(merge_err).max():.3f} rms {rms(merge_err):.4f}; "
          f"|Q8_0 base - F32 base| max {np.abs(quant_err).max():.3f} rms {rms(quant_err):.4f}")
    assert rms(merge_err) <= 2 * rms(quant_err)


def test_merge_keeps_quantized_base_type(llama, llama_gguf, tmp_path):
    from loramux import _native

    q8 = tmp_path / "base-q8.gguf"
    _native.model_quantize(str(llama.base), str(q8), QUANT_TYPES["Q8_0"])
    rep = merge(q8, [(llama_gguf, 1.0)], tmp_path / "m.gguf")  # quant="auto": the base's own type
    assert rep.quant == "Q8_0"
    hq, hm = read_header(q8), read_header(tmp_path / "m.gguf")
    assert {n: t.ggml_type for n, t in hq.tensors.items()} == {n: t.ggml_type for n, t in hm.tensors.items()}


def test_quant_names_match_llama_cpp():
    from loramux import _native

    want = {"Q4_K_M": 15, "F16": 1, "F32": 0, "Q8_0": 7, "Q4_0": 2, "Q5_K_M": 17, "Q6_K": 18, "BF16": 32}
    for name, value in want.items():
        assert QUANT_TYPES[name] == value == _native.FTYPES[name]


# ---------------------------------------------------------------------------------------------
# bad input: one ConversionError listing every problem, nothing written
# ---------------------------------------------------------------------------------------------

def _peft_dir(path: Path, config: dict | None, tensors: dict[str, np.ndarray] | None) -> Path:
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "bias": "none"}
        cfg.update(config)
        (path / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def _ab(module: str, n_in: int = 64, n_out: int = 64, r: int = 2, dtype=np.float32) -> dict[str, np.ndarray]:
    p = f"base_model.model.model.layers.{module}"
    return {f"{p}.lora_A.weight": np.ones((r, n_in), dtype), f"{p}.lora_B.weight": np.ones((n_out, r), dtype)}


BAD = {
    "missing config": (None, _ab("0.self_attn.q_proj"), ["adapter_config.json is missing"]),
    "missing weights": ({}, None, ["adapter_model.safetensors is missing"]),
    "partner, unknown module, extra tensor": (
        {}, {**{k: v for k, v in _ab("0.self_attn.q_proj").items() if "lora_A" in k},
             **_ab("0.self_attn.foo_proj"), "base_model.model.lm_head.weight": np.ones((3, 3), np.float32)},
        ["lora_B.weight is missing", "model.layers.0.self_attn.foo_proj: no llama GGUF tensor",
         "lm_head.weight is not a LoRA factor"]),
    "dora": ({"use_dora": True}, {**_ab("0.self_attn.q_proj"),
                                  "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
                                  np.ones(64, np.float32)}, ["DoRA (use_dora=true)", "DoRA magnitude vector"]),
    "bias and modules_to_save": ({"bias": "lora_only", "modules_to_save": ["lm_head"]}, _ab("0.self_attn.q_proj"),
                                 ["bias='lora_only'", "modules_to_save"]),
    "wrong shapes": ({}, {**_ab("0.self_attn.q_proj", n_in=96), **_ab("1.mlp.down_proj", n_in=64, n_out=128)},
                     ["q_proj: factors A (2, 96)", "down_proj: factors A (2, 64), B (128, 2) do not fit"]),
    "int8": ({}, {**_ab("0.self_attn.q_proj", dtype=np.int8)}, ["dtype I8"]),
    "rank mismatch": ({"r": 8}, _ab("0.self_attn.q_proj"), ["config says rank 8 but the factors have rank 2"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_peft_input(tmp_path, case):
    config, tensors, expected = BAD[case]
    base = write_tiny_model(tmp_path / "base.gguf")
    src = _peft_dir(tmp_path / "peft", config, tensors)
    out = tmp_path / "out.gguf"
    with pytest.raises(ConversionError) as ei:
        convert_peft(src, base, out)
    text = "\n".join(ei.value.problems)
    for e in expected:
        assert e in text, (e, text)
    assert len(ei.value.problems) >= len(expected)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["base.gguf", "peft"]
    rep = convert_peft(src, base, out, dry_run=True)  # a dry run reports the same, without raising
    assert rep.problems == ei.value.problems and not out.exists()


def test_wrong_base_architecture(tmp_path):
    src = _peft_dir(tmp_path / "peft", {}, _ab("0.self_attn.q_proj"))
    phi3 = _header_only_gguf(tmp_path / "phi3.gguf", "phi3", {"blk.0.attn_qkv.weight": (192, 64)})
    bert = _header_only_gguf(tmp_path / "bert.gguf", "bert", {"blk.0.attn_q.weight": (64, 64)})
    with pytest.raises(ConversionError, match="does not have"):
        convert_peft(src, phi3, tmp_path / "a.gguf")
    with pytest.raises(ConversionError, match="'bert' is not supported"):
        convert_peft(src, bert, tmp_path / "b.gguf")
    assert not (tmp_path / "a.gguf").exists() and not (tmp_path / "b.gguf").exists()


def test_dry_run_writes_nothing(tmp_path):
    base = write_tiny_model(tmp_path / "base.gguf")
    src = _peft_dir(tmp_path / "peft", {"target_modules": ["q_proj", "down_proj"]},
                    {**_ab("0.self_attn.q_proj"), **_ab("1.mlp.down_proj", n_in=128)})
    rep = convert_peft(src, base, tmp_path / "out.gguf", dry_run=True)
    assert rep.ok and rep.targets == ["blk.0.attn_q.weight", "blk.1.ffn_down.weight"] and rep.alpha == 4
    assert not (tmp_path / "out.gguf").exists()
    assert "would write" in rep.summary()


def test_bad_merge_input(tmp_path):
    base = write_tiny_model(tmp_path / "base.gguf")
    wrong = write_adapter(tmp_path / "wrong.gguf", "llama",
                          {"blk.0.attn_q.weight": (np.ones((2, 96), np.float32), np.ones((64, 2), np.float32))}, 2.0)
    alora = write_tiny_lora(tmp_path / "alora.gguf", invocation_tokens=[5, 6])
    ok = write_tiny_lora(tmp_path / "ok.gguf")
    out = tmp_path / "m.gguf"
    with pytest.raises(ConversionError) as ei:
        merge(base, [(wrong, 1.0), (alora, 1.0), (tmp_path / "missing.gguf", 1.0), (ok, float("nan"))], out,
              quant="Q9_X")
    text = "\n".join(ei.value.problems)
    for e in ("blk.0.attn_q.weight: factors give", "aLoRA", "file not found", "not a finite number",
              "unknown quantization 'Q9_X'"):
        assert e in text, (e, text)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def _cli(argv: list[str]) -> int:
    import argparse

    from loramux.cli.convert import add_parsers

    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_lora_argument():
    from loramux.cli.convert import parse_lora_arg

    assert parse_lora_arg("a.gguf") == ("a.gguf", 1.0)
    assert parse_lora_arg("a.gguf:0.5") == ("a.gguf", 0.5)
    assert parse_lora_arg("dir:with:colons/a.gguf:-2") == ("dir:with:colons/a.gguf", -2.0)
    assert parse_lora_arg("hf://o/r/a.gguf@main") == ("hf://o/r/a.gguf@main", 1.0)
    assert parse_lora_arg("C:/x/a.gguf") == ("C:/x/a.gguf", 1.0)


def test_cli_commands(tmp_path, capsys):
    base = write_tiny_model(tmp_path / "base.gguf")
    src = _peft_dir(tmp_path / "peft", {}, _ab("0.self_attn.q_proj"))
    assert _cli(["convert", str(src), "--base", str(base), "-o", str(tmp_path / "a.gguf"), "--dry-run"]) == 0
    assert "would write" in capsys.readouterr().out and not (tmp_path / "a.gguf").exists()
    assert _cli(["convert", str(src), "--base", str(base), "-o", str(tmp_path / "a.gguf"), "--outtype", "f16"]) == 0
    assert validate_adapter(tmp_path / "a.gguf", "llama", base_shapes()).dtype == "F16"
    assert _cli(["export-peft", str(tmp_path / "a.gguf"), str(tmp_path / "exp"), "--base", str(base)]) == 0
    assert (tmp_path / "exp" / "adapter_model.safetensors").exists()
    assert _cli(["merge", str(base), "--lora", f"{tmp_path / 'a.gguf'}:0.5", "-o", str(tmp_path / "m.gguf"),
                 "--quant", "none"]) == 0
    assert "1 tensors merged" in capsys.readouterr().out
