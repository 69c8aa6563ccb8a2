"""`loramux inspect`: describe a GGUF (base model, LoRA adapter or control vector) from its header."""

from __future__ import annotations

import os
from typing import Any

from .ggml_types import FLOAT_NAMES
from .gguf_io import LORA_A, LORA_B, read_header, validate_adapter


def describe_file(path: str | os.PathLike[str], *, factors: bool = False) -> dict[str, Any]:
    """A plain dict of what the file declares; adapters are validated on their own (no base)."""
    h = read_header(path)
    info: dict[str, Any] = {"file": str(path), "size": h.file_size, "architecture": h.architecture}
    if h.architecture == "controlvector":
        layers = sorted(int(n.split(".", 1)[1]) for n in h.tensors if n.startswith("direction."))
        first = next(iter(h.tensors.values()), None)
        info.update(kind="control vector", model_hint=h.metadata.get("controlvector.model_hint"),
                    layer_count=h.metadata.get("controlvector.layer_count"), layers=layers,
                    n_embd=first.shape[0] if first else None)
        return info
    if h.file_type == "adapter" or any(n.endswith(LORA_A) for n in h.tensors):
        a = validate_adapter(path)
        info.update(kind=f"{h.metadata.get('adapter.type', '?')} adapter", rank=a.rank, alpha=a.alpha,
                    scaling=(a.alpha / a.rank if a.alpha else 1.0), dtype=a.dtype, n_targets=len(a.targets),
                    targets=sorted({t.split(".", 2)[-1].rsplit(".", 1)[0] for t in a.targets}),
                    invocation_tokens=list(a.invocation_tokens) or None,
                    base_model=h.metadata.get("adapter.base_model") or h.metadata.get("general.base_model.0.name"))
        if factors:
            info["factors"] = [{"name": t, "a": a.shapes[t][0], "b": a.shapes[t][1],
                                "dtype": FLOAT_NAMES.get(h.tensors[t + LORA_A].ggml_type, "?")}
                               for t in a.targets]
        return info
    arch = h.architecture
    info.update(kind="base model", name=h.metadata.get("general.name"),
                file_type=h.metadata.get("general.file_type"),
                n_layer=h.arch_value("block_count"), n_embd=h.arch_value("embedding_length"),
                n_ctx_train=h.arch_value("context_length"), n_tensors=len(h.tensors),
                vocab_size=h.array_lengths.get("tokenizer.ggml.tokens"),
                chat_template="yes" if h.metadata.get("tokenizer.chat_template") else "no (built-in fallback)")
    _ = (arch, LORA_B)
    return info


__all__ = ["describe_file"]
