"""Options shared by the commands that open an engine: the model, adapters, context, threads, control vectors.

The engine (and so llama.cpp) is imported only when a command opens one, so `loramux --help`, `inspect`,
`pull` and `convert` start fast and work without a loadable llama.cpp.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ..engine.options import EngineOptions

if TYPE_CHECKING:
    from ..engine.runtime import Engine


def add_model_args(p: argparse.ArgumentParser, *, loras: bool = True) -> None:
    """MODEL, --lora, --n-ctx, --threads, --gpu-layers: shared by run, serve, probe, train..."""
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="base GGUF model (default: the embedded Gemma 3 270M Q4_K_M)")
    if loras:
        p.add_argument("--lora", action="append", default=[], metavar="SRC[:SCALE]",
                       help="adapter to apply (repeatable; stacked in order). SRC: path, https:// URL or "
                            "hf://owner/repo/file.gguf[@rev]; optional :SCALE (default 1.0); NAME=SRC names it")
    p.add_argument("--n-ctx", type=int, default=2048, help="context length in tokens (default 2048)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all available)")
    p.add_argument("--gpu-layers", type=int, default=0, help="layers to offload to a GPU build (default 0)")
    p.add_argument("--no-mmap", action="store_true", help="read the model into memory instead of mapping it")


def options_from_args(args: argparse.Namespace, **extra: Any) -> EngineOptions:
    """The EngineOptions the shared flags ask for; `extra` names further EngineOptions fields."""
    return EngineOptions.from_keywords(n_ctx=args.n_ctx, n_threads=args.threads, n_gpu_layers=args.gpu_layers,
                                       use_mmap=not args.no_mmap, **extra)


def engine_from_args(args: argparse.Namespace, **extra: Any) -> Engine:
    """Load an Engine from the shared flags (and its --lora adapters); `extra`: more EngineOptions fields."""
    from ..engine.runtime import Engine
    from ..engine.specs import LoraSpec

    specs = [LoraSpec.parse(s) for s in getattr(args, "lora", [])]
    return Engine.load(args.model, loras=specs, options=options_from_args(args, **extra))


def add_control_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--control-vector", action="append", default=[], metavar="FILE[:STRENGTH]",
                   help="control vector GGUF to add to the residual stream (repeatable; summed)")
    p.add_argument("--control-vector-layers", default=None, metavar="A-B",
                   help="apply control vectors only to layers A..B (inclusive, 1-based)")


def apply_control_args(engine: Engine, args: argparse.Namespace) -> None:
    """Make the --control-vector flags the engine's default control setting."""
    if not getattr(args, "control_vector", None):
        return
    from ..engine.control import ControlSetting, ControlVector, parse_layers
    from ..engine.specs import LoraSpec

    pairs = []
    for text in args.control_vector:
        spec = LoraSpec.parse(text)
        pairs.append((ControlVector.load(spec.source), spec.scale))
    setting = ControlSetting.build(engine.model, pairs, parse_layers(args.control_vector_layers))
    engine.set_control_vector(setting)


__all__ = ["add_control_args", "add_model_args", "apply_control_args", "engine_from_args", "options_from_args"]
