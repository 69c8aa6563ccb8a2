"""loramux: many LoRA adapters around one GGUF base model on llama.cpp.

    import loramux as lm
    eng = lm.Engine.load(loras=[lm.LoraSpec("style.gguf", scale=0.5)])
    print(eng.generate("Once upon a time", max_tokens=32).text)
"""

from __future__ import annotations

from typing import Any

from .errors import (
    AdapterError,
    AdapterNotFoundError,
    BackendError,
    ChecksumError,
    ContextLengthError,
    ControlVectorError,
    ConversionError,
    DownloadCancelled,
    DownloadError,
    FactorError,
    LoramuxError,
    ModelError,
    ParameterError,
    SourceError,
    TrainingError,
)

__version__ = "0.1.0"

# The engine pulls in llama.cpp; conversion, sources and GGUF I/O do not. Import lazily so
# `loramux convert` and friends work (and start fast) without touching the native library.
_LAZY = {
    "Engine": "engine.runtime", "LoraSpec": "engine.runtime", "TextStream": "engine.runtime",
    "EngineOptions": "engine.options",
    "LoRAAdapter": "engine.adapters", "Model": "engine.model",
    "Completion": "engine.sampling", "SamplingParams": "engine.sampling",
    "ControlVector": "engine.control",
    "Source": "sources", "resolve": "sources", "CancelToken": "sources",
    "convert_peft": "convert", "export_peft": "convert", "merge": "merging",
    "probe": "probes", "drift": "drift_report", "train_zo": "train.zo",
    "default_model_path": "config",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'loramux' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{mod}", __name__), name)


__all__ = [
    "AdapterError", "AdapterNotFoundError", "BackendError", "ChecksumError", "ContextLengthError",
    "ControlVectorError", "ConversionError", "DownloadCancelled", "DownloadError", "FactorError",
    "LoramuxError", "ModelError", "ParameterError", "SourceError", "TrainingError", *_LAZY,
]
