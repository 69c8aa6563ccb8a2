"""Tiny GGUF models written from scratch, so tests run real llama.cpp in milliseconds.

A llama-architecture model with a SentencePiece-style vocabulary: the 256 byte tokens plus some
word pieces, random F32 weights from a fixed seed. Also random LoRA adapters that fit it.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from loramux.gguf_io import write_adapter

ARCH = "llama"
E, F, N_LAYER, N_HEAD, N_HEAD_KV = 64, 128, 2, 4, 2
HEAD_DIM = E // N_HEAD
PIECES = ["▁the", "▁a", "▁cat", "▁dog", "▁sat", "▁on", "▁mat", "▁hello", "▁world", "▁is", "▁and",
          "▁of", "▁to", "▁in", "▁it", "▁was", "▁he", "▁she", "▁we", "▁you", "▁ran", "▁big", "▁red",
          "<start_of_turn>", "<end_of_turn>", "▁user", "▁model", "▁", "▁t", "▁th", "▁c", "▁ca", "▁d", "▁do",
          "▁s", "▁sa", "▁o", "▁m", "▁ma", "▁h", "▁he", "▁hel", "▁hell", "▁w", "▁wo", "▁wor", "▁worl", "▁i",
          ] + list("abcdefghijklmnopqrstuvwxyz.,!?")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [2, 3, 3] + [6] * 256
    seen = set(tokens)
    for p in PIECES:
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(3 if p.startswith("<start") or p.startswith("<end") or p == "<escape>" else 1)
    scores = [0.0] * 259 + [-float(i) / 10 for i in range(len(tokens) - 259)]
    # longer pieces get higher scores so merges prefer them
    for i in range(259, len(tokens)):
        scores[i] = len(tokens[i]) * 1.0 - i * 1e-3
    return tokens, scores, types


def base_shapes() -> dict[str, tuple[int, int]]:
    """numpy shapes (out, in) of every projection of the tiny model."""
    kv = N_HEAD_KV * HEAD_DIM
    per = {"attn_q": (E, E), "attn_k": (kv, E), "attn_v": (kv, E), "attn_output": (E, E),
           "ffn_gate": (F, E), "ffn_up": (F, E), "ffn_down": (E, F)}
    return {f"blk.{i}.{p}.weight": s for i in range(N_LAYER) for p, s in per.items()}


FIM_TOKENS = {"pre": 4, "suf": 5, "mid": 6}  # with fim=True: three byte tokens marked as the FIM tokens


def write_tiny_model(path: str | Path, seed: int = 0, chat_template: bool = True, fim: bool = False) -> Path:
    """Write the tiny llama model (about 0.5 MB) and return its path. fim: mark FIM_TOKENS as the vocabulary's
    fill-in-the-middle prefix, suffix and middle tokens."""
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocab()
    V = len(tokens)
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name("loramux-tiny")
    w.add_context_length(256)
    w.add_embedding_length(E)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(F)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if chat_template:
        w.add_chat_template(CHAT_TEMPLATE)
    if fim:
        for name, tok in FIM_TOKENS.items():
            w.add_uint32(f"tokenizer.ggml.fim_{name}_token_id", tok)

    def t(name: str, shape: tuple[int, ...], scale: float = 0.2) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    t("token_embd.weight", (V, E), 1.0)
    w.add_tensor("output_norm.weight", np.ones(E, dtype=np.float32))
    t("output.weight", (V, E), 0.3)
    for name, shape in base_shapes().items():
        t(name, shape)
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(E, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(E, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def random_factors(rank: int = 2, seed: int = 1, scale: float = 0.3, targets: tuple[str, ...] | None = None,
                   shapes: dict[str, tuple[int, int]] | None = None, zero: bool = False
                   ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Random (or zero) PEFT-layout factors A (r, in), B (out, r) for the given targets."""
    rng = np.random.default_rng(seed)
    shapes = shapes or base_shapes()
    names = targets or tuple(shapes)
    out = {}
    for n in names:
        o, i = shapes[n]
        a = rng.standard_normal((rank, i)).astype(np.float32) * scale
        b = rng.standard_normal((o, rank)).astype(np.float32) * scale
        out[n] = (a * 0, b * 0) if zero else (a, b)
    return out


def write_tiny_lora(path: str | Path, rank: int = 2, seed: int = 1, alpha: float | None = None,
                    dtype: str = "f32", zero: bool = False, scale: float = 0.3,
                    targets: tuple[str, ...] | None = None, invocation_tokens: list[int] | None = None,
                    arch: str = ARCH) -> Path:
    """Write a random LoRA adapter for the tiny model (alpha defaults to rank, i.e. factor 1)."""
    f = random_factors(rank, seed, scale, targets, zero=zero)
    return write_adapter(path, arch, f, float(rank if alpha is None else alpha), dtype=dtype,
                         invocation_tokens=invocation_tokens)
