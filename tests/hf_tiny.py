"""Tiny Hugging Face models (llama, gemma3) with random weights, and our own minimal HF → GGUF writer.

The writer does what llama.cpp's convert_hf_to_gguf.py does for these two architectures, and
nothing more: tensor names through the `gguf` package's name map, q/k row permutation for llama
(HF's rotate_half layout → GGML's interleaved rope pairs), +1 on Gemma's norm weights (HF's Gemma
RMSNorm computes x·(1 + w), llama.cpp's x·w), tied embeddings left out. The vocabulary is the one of
tests/tinymodel.py, so llama.cpp loads the files in milliseconds.

Needs torch, transformers and peft (the reference implementations the conversion is checked against).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tinymodel import vocab

from loramux.convert import permute_rows

E, F, N_LAYER, N_HEAD, N_HEAD_KV, HEAD_DIM = 64, 128, 2, 4, 2, 16
VOCAB = len(vocab()[0])
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_llama(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=E, intermediate_size=F, num_hidden_layers=N_LAYER,
                      num_attention_heads=N_HEAD, num_key_value_heads=N_HEAD_KV, max_position_embeddings=256,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="eager",
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _randomize(LlamaForCausalLM(cfg), seed, emb_std=1.0, norm_center=1.0)


def tiny_gemma3(seed: int = 0) -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=E, intermediate_size=F, num_hidden_layers=N_LAYER,
                           num_attention_heads=N_HEAD, num_key_value_heads=N_HEAD_KV, head_dim=HEAD_DIM,
                           query_pre_attn_scalar=HEAD_DIM, max_position_embeddings=256, sliding_window=512,
                           rms_norm_eps=1e-6, attn_implementation="eager",
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    # Gemma scales embeddings by sqrt(E) = 8; norm weights are offsets from 1.
    return _randomize(Gemma3ForCausalLM(cfg), seed, emb_std=0.15, norm_center=0.0)


def _randomize(model: Any, seed: int, emb_std: float, norm_center: float) -> Any:
    # HF's default init (std 0.02) gives near-zero logits, which would make any comparison vacuous.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(norm_center + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(emb_std * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def write_gguf(model: Any, path: str | Path, name: str = "hf-tiny") -> Path:
    """Write a tiny llama/gemma3 HF model as an F32 GGUF, the way llama.cpp's converter would."""
    cfg = model.config
    arch = {"llama": "llama", "gemma3_text": "gemma3"}[cfg.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    _write_hparams(w, cfg, arch, name)
    _write_vocab(w)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.GEMMA3,
                                    cfg.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if arch == "gemma3" and hf_name == "lm_head.weight":
            continue  # tied to the embedding; llama.cpp reuses token_embd
        data = t.detach().float().numpy().copy()
        gname = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gname, hf_name
        if arch == "llama" and ".q_proj." in hf_name:
            data = permute_rows(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            data = permute_rows(data, cfg.num_key_value_heads)
        elif arch == "gemma3" and gname.endswith("norm.weight"):
            data = data + 1.0
        w.add_tensor(gname, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _rope_theta(cfg: Any, kind: str = "full_attention") -> float:
    rp = getattr(cfg, "rope_parameters", None) or {}
    if kind in rp:
        rp = rp[kind]
    return float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def _write_hparams(w: Any, cfg: Any, arch: str, name: str) -> None:
    w.add_name(name)
    w.add_context_length(256)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(_rope_theta(cfg))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "llama":
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    else:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)


def _write_vocab(w: Any) -> None:
    tokens, scores, types = vocab()
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


def add_lora(model: Any, seed: int = 1, std: float = 0.15, **config: Any) -> Any:
    """Wrap `model` in a PEFT LoRA (defaults: rank 4, alpha 8, all projections) with random A and B
    (PEFT initialises B to zero, which would make every test pass trivially)."""
    from peft import LoraConfig, get_peft_model

    kw: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": PROJ, "lora_dropout": 0.0}
    kw.update(config)
    pm = get_peft_model(model, LoraConfig(**kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return pm.eval()


@torch.no_grad()
def hf_logits(model: Any, tokens: list[int]) -> np.ndarray:
    """All-position logits of a HF (or PEFT) causal LM, float32, shape (len(tokens), vocab)."""
    return model(torch.tensor([tokens])).logits[0].float().numpy()
