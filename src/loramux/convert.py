"""PEFT LoRA checkpoints ⇄ llama.cpp adapter GGUFs.

`convert_peft` reads `adapter_config.json` + `adapter_model.safetensors`, maps Hugging Face module
names to the base GGUF's tensor names, re-applies what llama.cpp's HF→GGUF conversion did to the
base weights (q/k row permutation on llama), folds PEFT's per-module scaling (rank/alpha patterns,
rsLoRA) into B so llama.cpp's single `alpha / rank` rule reproduces it, checks every factor against
the base model's shapes, and writes the adapter atomically. `export_peft` goes back.

No llama.cpp here: only numpy, the `gguf` package (tensor-name maps) and our GGUF header reader.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._progress import progress_iter
from .errors import ConversionError, ParameterError
from .ggml_types import BF16, F16, to_bf16_bits
from .gguf_io import (
    GGUFFormatError,
    GGUFHeader,
    atomic_path,
    read_adapter_factors,
    read_header,
    write_adapter,
)
from .gguf_io.safetensors import read_safetensors_index, read_safetensors_tensor, write_safetensors_file

__all__ = ["ConversionReport", "convert_peft", "export_peft", "peft_factors", "SUPPORTED_ARCHITECTURES"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
OUTTYPES = ("f32", "f16", "bf16")

_LLAMA_LIKE = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


@dataclass(frozen=True)
class _Arch:
    """What the converter must know about one GGUF architecture."""

    enum: str  # gguf.MODEL_ARCH member
    modules: Mapping[str, str]  # GGUF projection → HF module suffix inside a block (for export)
    permute_qk: bool = False  # llama.cpp's HF converter permuted q/k rows (rotary pairs interleaved)
    block: str = "model.layers.{bid}."
    fan_in_fan_out: bool = False  # HF stores the base weight (in, out) (GPT-2 Conv1D)


_ARCHS: dict[str, _Arch] = {
    # Mistral and other Llama-family models are written with GGUF architecture "llama".
    "llama": _Arch("LLAMA", _LLAMA_LIKE, permute_qk=True),
    "qwen2": _Arch("QWEN2", _LLAMA_LIKE),
    "qwen3": _Arch("QWEN3", _LLAMA_LIKE),
    "gemma": _Arch("GEMMA", _LLAMA_LIKE),
    "gemma2": _Arch("GEMMA2", _LLAMA_LIKE),
    "gemma3": _Arch("GEMMA3", _LLAMA_LIKE),
    # Phi-3 keeps HF's fused projections: qkv_proj → attn_qkv, gate_up_proj → ffn_up (split at run time).
    "phi3": _Arch("PHI3", {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                           "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}),
    "gpt2": _Arch("GPT2", {"attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_up": "mlp.c_fc",
                           "ffn_down": "mlp.c_proj"}, block="transformer.h.{bid}.", fan_in_fan_out=True),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHS)

# Config switches PEFT can train with that a llama.cpp LoRA (B·A on a linear weight) cannot express.
_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA (use_dora=true): llama.cpp has no magnitude vectors; merge it in PEFT "
                "(model.merge_and_unload()) and convert the merged model instead",
    "lora_bias": "lora_bias=true: llama.cpp adapters carry no bias on lora_B",
    "use_qalora": "QALoRA (use_qalora=true) is not a plain B·A product",
    "layer_replication": "layer_replication changes the base model's layers",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices) are not a LoRA",
    "target_parameters": "target_parameters (LoRA on raw parameters, e.g. MoE experts) is not supported",
}


@dataclass
class ConversionReport:
    """What a conversion did (or, with `dry_run`, would do)."""

    source: str
    base: str
    out: str | None
    architecture: str | None = None
    outtype: str = "f32"
    alpha: float = 0.0
    ranks: dict[str, int] = field(default_factory=dict)  # GGUF target → rank
    hf_modules: dict[str, str] = field(default_factory=dict)  # GGUF target → HF module
    permuted: list[str] = field(default_factory=list)  # targets whose B rows were permuted
    folded: dict[str, float] = field(default_factory=dict)  # targets whose B absorbed a scale factor
    use_rslora: bool = False
    invocation_tokens: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    dry_run: bool = False
    written: bool = False

    @property
    def targets(self) -> list[str]:
        return list(self.ranks)

    @property
    def rank(self) -> int:
        """The most common rank (per-target ranks are in `ranks`)."""
        return Counter(self.ranks.values()).most_common(1)[0][0] if self.ranks else 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """A few human-readable lines, as the CLI prints them."""
        ranks = sorted(set(self.ranks.values()))
        head = "would write" if self.dry_run else ("wrote" if self.written else "not written")
        lines = [f"{head}: {self.out or '-'}",
                 f"  base {self.base} ({self.architecture or '?'}), {len(self.ranks)} targets, "
                 f"rank {'/'.join(map(str, ranks)) or '-'}, alpha {self.alpha:g}, {self.outtype}"]
        if self.permuted:
            lines.append(f"  q/k rows permuted for llama.cpp's rotary layout: {len(self.permuted)} tensors")
        if self.folded:
            lines.append(f"  per-module scaling folded into B: {len(self.folded)} tensors")
        if self.invocation_tokens:
            lines.append(f"  aLoRA invocation tokens: {self.invocation_tokens}")
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# base-model helpers
# ---------------------------------------------------------------------------------------------

def _tensor_map(arch: str, n_blocks: int) -> Any:
    import gguf

    return gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, _ARCHS[arch].enum), n_blocks)


def _read_base(base: str | os.PathLike[str], problems: list[str]) -> GGUFHeader | None:
    try:
        h = read_header(base)
    except GGUFFormatError as e:
        problems.append(f"base model: {e.message}")
        return None
    if h.metadata.get("general.type") == "adapter":
        problems.append(f"base model {base} is an adapter, not a model")
    if h.architecture not in _ARCHS:
        problems.append(f"base architecture {h.architecture!r} is not supported by the converter "
                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return h


def _head_counts(h: GGUFHeader) -> tuple[int, int]:
    def scalar(v: Any) -> int:  # some archs store per-layer arrays
        return int(max(v)) if isinstance(v, list) else int(v)

    n_head = scalar(h.arch_value("attention.head_count", 0))
    n_kv = h.arch_value("attention.head_count_kv", None)
    return n_head, scalar(n_kv) if n_kv is not None else n_head


def permute_rows(b: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder rows as llama.cpp's HF converter does for llama q/k: per head, the two rotary halves
    (HF rotate_half layout) become interleaved pairs (GGML's normal rope layout)."""
    out = b.shape[0]
    return b.reshape(n_head, 2, out // n_head // 2, -1).swapaxes(1, 2).reshape(b.shape)


def unpermute_rows(b: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_rows`."""
    out = b.shape[0]
    return b.reshape(n_head, out // n_head // 2, 2, -1).swapaxes(1, 2).reshape(b.shape)


# ---------------------------------------------------------------------------------------------
# PEFT → GGUF
# ---------------------------------------------------------------------------------------------

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)\.(?P<kind>lora_A|lora_B|lora_embedding_A|"
                  r"lora_embedding_B|lora_magnitude_vector)(?:\.[A-Za-z0-9_]+)*$")


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern/alpha_pattern lookup: a key matches a module path ending in it."""
    for key, value in patterns.items():
        if re.match(rf"(^|.*\.){key}$", module):
            return value
    return default


def _config_problems(cfg: Mapping[str, Any]) -> list[str]:
    problems = []
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        problems.append(f"peft_type is {cfg.get('peft_type')!r}; only LORA adapters can be converted")
    for key, why in _UNSUPPORTED_FLAGS.items():
        if cfg.get(key):
            problems.append(why)
    if cfg.get("bias", "none") not in ("none", None):
        problems.append(f"bias={cfg['bias']!r}: trained biases are not part of a llama.cpp LoRA "
                        "(train with bias='none')")
    if cfg.get("modules_to_save"):
        problems.append(f"modules_to_save={cfg['modules_to_save']}: fully trained modules cannot be "
                        "carried by an adapter (merge them into the base instead)")
    return problems


def _hf_candidates(module: str) -> list[str]:
    # Multimodal checkpoints nest the text model (Gemma 3 / Mistral 3 style names).
    out = [module]
    for old in ("model.language_model.", "language_model.model.", "language_model."):
        if module.startswith(old):
            out.append("model." + module[len(old):])
    return out


def _collect_pairs(index: Mapping[str, Mapping[str, Any]], problems: list[str]) -> dict[str, dict[str, str]]:
    """Group safetensors keys into {hf_module: {"A": key, "B": key}}, noting everything else."""
    pairs: dict[str, dict[str, str]] = {}
    for key, entry in index.items():
        m = _KEY.match(key)
        if m is None:
            problems.append(f"tensor {key} is not a LoRA factor (modules_to_save or trainable tokens?)")
            continue
        module, kind = m["module"], m["kind"]
        if kind == "lora_magnitude_vector":
            problems.append(f"{key}: DoRA magnitude vector (DoRA cannot be converted)")
        elif kind.startswith("lora_embedding"):
            problems.append(f"{key}: LoRA on an embedding ({module}) is not converted; train without "
                            "the embedding in target_modules")
        elif key.endswith(".bias"):
            problems.append(f"{key}: trained LoRA bias is not supported")
        elif entry.get("dtype") not in ("F32", "F16", "BF16", "F64"):
            problems.append(f"{key} has dtype {entry.get('dtype')}; factors must be F32, F16, BF16 or F64")
        else:
            pairs.setdefault(module, {})[kind[-1]] = key
    for module, ab in pairs.items():
        for need in "AB":
            if need not in ab:
                problems.append(f"{module}: lora_{'B' if need == 'B' else 'A'}.weight is missing "
                                f"(only lora_{'A' if need == 'B' else 'B'} is present)")
    return {m: ab for m, ab in pairs.items() if len(ab) == 2}


def _orient(module: str, a: np.ndarray, b: np.ndarray, base_shape: tuple[int, ...] | None,
            fan_in_fan_out: bool) -> tuple[np.ndarray, np.ndarray, str | None]:
    """Check A (r, in), B (out, r) against the base's (out, in); accept transposed factors only when
    the config says fan_in_fan_out (a Conv1D-style writer) and the transposed shapes fit."""
    if a.ndim != 2 or b.ndim != 2:
        return a, b, f"{module}: factors must be 2-D, got A {a.shape}, B {b.shape}"
    if base_shape is None:
        return a, b, None
    fits = a.shape[0] == b.shape[1] and (b.shape[0], a.shape[1]) == tuple(base_shape)
    if not fits and fan_in_fan_out and a.shape[1] == b.shape[0] and (b.shape[1], a.shape[0]) == tuple(base_shape):
        return np.ascontiguousarray(a.T), np.ascontiguousarray(b.T), None
    if not fits:
        return a, b, (f"{module}: factors A {a.shape}, B {b.shape} do not fit the base tensor "
                      f"{tuple(base_shape)} (expected A (r, {base_shape[-1]}), B ({base_shape[0]}, r)): "
                      "is this adapter for this base model?")
    return a, b, None


def _global_alpha(effective: Mapping[str, float]) -> float:
    """The alpha written to the file: the most common alpha_eff = scaling·rank, so most modules
    need no folding (and a plain adapter round-trips bit-exactly)."""
    return Counter(effective.values()).most_common(1)[0][0] if effective else 0.0


def convert_peft(peft_dir: str | os.PathLike[str], base: str | os.PathLike[str], out: str | os.PathLike[str],
                 outtype: str = "f32", dry_run: bool = False, *, progress: bool | None = None,
                 name: str | None = None) -> ConversionReport:
    """Convert a PEFT LoRA directory into a llama.cpp adapter GGUF for `base`.

    Raises one `ConversionError` listing every problem (and writes nothing) unless `dry_run`, in
    which case the problems are returned in the report and nothing is written either.
    """
    if outtype not in OUTTYPES:
        raise ParameterError("outtype", f"{outtype!r} is not one of {', '.join(OUTTYPES)}")
    src = Path(peft_dir)
    rep = ConversionReport(str(src), str(base), None if dry_run else str(out), outtype=outtype, dry_run=dry_run)
    cfg, index, data_start = _read_peft_dir(src, rep.problems)
    h = _read_base(base, rep.problems)
    if h is not None:
        rep.architecture = h.architecture
    factors: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if cfg is not None and index is not None and h is not None and h.architecture in _ARCHS:
        factors = _convert_factors(src / WEIGHTS_NAME, cfg, index, data_start, h, rep, progress)
    if rep.problems:
        if dry_run:
            return rep
        raise ConversionError(str(src), f"cannot convert to a llama.cpp adapter for {base}",
                              problems=rep.problems,
                              hint="fix the listed problems; `loramux convert --dry-run` checks without writing")
    if dry_run:
        return rep
    assert h is not None and cfg is not None
    write_adapter(out, h.architecture or "", factors, rep.alpha, dtype=outtype,
                  invocation_tokens=rep.invocation_tokens or None, name=name or src.resolve().name,
                  extra=_adapter_metadata(h, cfg, outtype))
    rep.written = True
    return rep


def _read_peft_dir(src: Path, problems: list[str]) -> tuple[dict[str, Any] | None, dict | None, int]:
    cfg = index = None
    data_start = 0
    if not src.is_dir():
        problems.append(f"{src} is not a directory (expected a PEFT save_pretrained folder)")
        return None, None, 0
    try:
        cfg = json.loads((src / CONFIG_NAME).read_text())
        problems += _config_problems(cfg)
    except FileNotFoundError:
        problems.append(f"{CONFIG_NAME} is missing")
    except (OSError, ValueError) as e:
        problems.append(f"{CONFIG_NAME} is not readable JSON: {e}")
    weights = src / WEIGHTS_NAME
    if not weights.exists():
        legacy = " (found adapter_model.bin: re-save with safe_serialization=True)" \
            if (src / "adapter_model.bin").exists() else ""
        problems.append(f"{WEIGHTS_NAME} is missing{legacy}")
    else:
        try:
            index, data_start = read_safetensors_index(weights)
        except (OSError, ValueError) as e:
            problems.append(f"{WEIGHTS_NAME} is not a readable safetensors file: {e}")
    return cfg, index, data_start


def _convert_factors(weights: Path, cfg: Mapping[str, Any], index: Mapping[str, Any], data_start: int,
                     h: GGUFHeader, rep: ConversionReport, progress: bool | None
                     ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Map, orient, check and scale every factor pair; problems go into `rep.problems`."""
    arch = _ARCHS[h.architecture or ""]
    n_blocks = int(h.arch_value("block_count", 0) or 0)
    tmap = _tensor_map(h.architecture or "", max(n_blocks, 1))
    pairs = _collect_pairs(index, rep.problems)
    if not pairs and not rep.problems:
        rep.problems.append(f"{WEIGHTS_NAME} holds no LoRA factors")
    rep.use_rslora = bool(cfg.get("use_rslora"))
    raw: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    effective: dict[str, float] = {}
    scaling: dict[str, float] = {}
    for module, ab in progress_iter(pairs.items(), total=len(pairs), desc="convert", enabled=progress,
                                    unit="tensor"):
        target = _target_for(module, tmap, h, rep.problems)
        if target is None or target in raw:
            if target is not None:
                rep.problems.append(f"{module} and {rep.hf_modules[target]} both map to {target}")
            continue
        a = read_safetensors_tensor(weights, index[ab["A"]], data_start)
        b = read_safetensors_tensor(weights, index[ab["B"]], data_start)
        a, b, err = _orient(module, a, b, h.tensors[target].shape, bool(cfg.get("fan_in_fan_out")))
        r = a.shape[0]
        r_cfg = int(_pattern_value(cfg.get("rank_pattern") or {}, module, cfg.get("r", r)))
        if r_cfg != r and not err:
            err = f"{module}: the config says rank {r_cfg} but the factors have rank {r}"
        if err:
            rep.problems.append(err)
            continue
        alpha = float(_pattern_value(cfg.get("alpha_pattern") or {}, module, cfg.get("lora_alpha", r_cfg)))
        # PEFT scales B·A by alpha/r (alpha/sqrt(r) with rsLoRA); alpha_eff = scaling·r, kept exact.
        effective[target] = alpha * math.sqrt(r) if rep.use_rslora else alpha
        scaling[target] = alpha / math.sqrt(r) if rep.use_rslora else alpha / r
        if arch.permute_qk and target.split(".")[-2] in ("attn_q", "attn_k"):
            b = _permute_for(target, b, h, rep.problems)
            rep.permuted.append(target)
        raw[target] = (a, b)
        rep.ranks[target] = r
        rep.hf_modules[target] = module
    rep.alpha = _global_alpha(effective)
    rep.invocation_tokens = [int(t) for t in cfg.get("alora_invocation_tokens") or []]
    order = {n: i for i, n in enumerate(h.tensors)}
    out = {}
    for target in sorted(raw, key=lambda t: order.get(t, 0)):
        a, b = raw[target]
        factor = _fold_factor(effective[target], scaling[target], rep.alpha, rep.ranks[target])
        if factor != 1.0:
            rep.folded[target] = factor
            b = (b.astype(np.float64) * factor).astype(np.float32)
        out[target] = (a, b)
    rep.ranks = {t: rep.ranks[t] for t in out}
    return out


def _target_for(module: str, tmap: Any, h: GGUFHeader, problems: list[str]) -> str | None:
    """The base tensor a HF module's LoRA applies to, or None (with the reason in `problems`)."""
    target = next((t + ".weight" for c in _hf_candidates(module) if (t := tmap.get_name(c))), None)
    if target is None:
        problems.append(f"{module}: no {h.architecture} GGUF tensor corresponds to this module")
    elif target == "token_embd.weight":
        problems.append(f"{module}: LoRA on the token embedding is not converted")
    elif target not in h.tensors:
        problems.append(f"{module} → {target}, which the base model does not have (tied embeddings? "
                        "another model?)")
    else:
        return target
    return None


def _fold_factor(alpha_eff: float, scaling: float, alpha_global: float, rank: int) -> float:
    """What B must be multiplied by so llama.cpp's alpha_global/rank equals PEFT's scaling."""
    if alpha_eff == alpha_global and alpha_global != 0:
        return 1.0
    applied = alpha_global / rank if alpha_global != 0 else 1.0  # llama.cpp: alpha 0 means "no scaling"
    return scaling / applied


def _permute_for(target: str, b: np.ndarray, h: GGUFHeader, problems: list[str]) -> np.ndarray:
    n_head, n_kv = _head_counts(h)
    heads = n_head if target.endswith("attn_q.weight") else n_kv
    if heads <= 0 or b.shape[0] % (2 * heads):
        problems.append(f"{target}: cannot permute {b.shape[0]} rows into {heads} heads")
        return b
    return permute_rows(b, heads)


def _adapter_metadata(h: GGUFHeader, cfg: Mapping[str, Any], outtype: str) -> dict[str, Any]:
    import gguf

    meta: dict[str, Any] = {"general.file_type": int({"f32": gguf.LlamaFileType.ALL_F32,
                                                      "f16": gguf.LlamaFileType.MOSTLY_F16,
                                                      "bf16": gguf.LlamaFileType.MOSTLY_BF16}[outtype])}
    base_name = h.metadata.get("general.name")
    if base_name:
        meta["adapter.base_model"] = str(base_name)
        meta["general.base_model.count"] = 1
        meta["general.base_model.0.name"] = str(base_name)
    src = cfg.get("base_model_name_or_path")
    if src:
        meta["general.source.huggingface.repository"] = str(src)
        if re.fullmatch(r"[\w.-]+/[\w.-]+", str(src)):  # a hub id, not a local path
            meta["general.source.url"] = f"https://huggingface.co/{src}"
    return meta


# ---------------------------------------------------------------------------------------------
# GGUF → PEFT
# ---------------------------------------------------------------------------------------------

def _hf_module(arch: str, target: str, tmap: Any) -> str | None:
    """HF module path of a GGUF tensor name, checked against the gguf package's forward map."""
    spec = _ARCHS[arch]
    stem = target.removesuffix(".weight")
    if stem == "output":
        hf = "lm_head"
    else:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
        if m is None or m[2] not in spec.modules:
            return None
        hf = spec.block.format(bid=m[1]) + spec.modules[m[2]]
    return hf if tmap.get_name(hf) == stem else None


def export_peft(adapter_gguf: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                base_model_name_or_path: str | None = None, *, base: str | os.PathLike[str] | None = None
                ) -> Path:
    """Write a llama.cpp adapter GGUF as a PEFT LoRA folder (`adapter_config.json` +
    `adapter_model.safetensors`), loadable with `peft.PeftModel.from_pretrained`.

    Llama-family adapters need `base` (the GGUF base model) for its head counts, to undo the q/k
    row permutation. Factors keep their dtype, so GGUF → PEFT → GGUF is bit-exact.
    """
    src = Path(adapter_gguf)
    try:
        h = read_header(src)
    except GGUFFormatError as e:
        raise ConversionError(str(src), e.message.split(": ", 1)[-1]) from e
    problems = []
    arch = h.architecture or "?"
    if h.metadata.get("general.type") != "adapter" or h.metadata.get("adapter.type") != "lora":
        problems.append("not a LoRA adapter GGUF (general.type/adapter.type)")
    if arch not in _ARCHS:
        problems.append(f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    bh = _read_base(base, problems) if base is not None else None
    if arch in _ARCHS and _ARCHS[arch].permute_qk and base is None:
        problems.append(f"{arch} adapters store q/k rows permuted; pass base= (the base GGUF) so they can "
                        "be restored to Hugging Face order")
    if bh is not None and bh.architecture != arch:
        problems.append(f"the adapter is for {arch!r} but the base model is {bh.architecture!r}")
    if problems:
        raise ConversionError(str(src), "cannot export to PEFT", problems=problems)
    factors = read_adapter_factors(src)
    n_blocks = int(bh.arch_value("block_count", 0) or 0) if bh else _max_block(factors) + 1
    tmap = _tensor_map(arch, max(n_blocks, 1))
    tensors, ranks, modules = _export_tensors(h, factors, arch, tmap, bh, problems)
    if problems:
        raise ConversionError(str(src), "cannot export to PEFT", problems=problems)
    cfg = _peft_config(h, arch, ranks, modules, base_model_name_or_path, n_blocks)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors_file(out / WEIGHTS_NAME, tensors, {"format": "pt"})
    with atomic_path(out / CONFIG_NAME) as tmp:
        tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def _max_block(factors: Mapping[str, Any]) -> int:
    blocks = [int(m[1]) for t in factors if (m := re.match(r"blk\.(\d+)\.", t))]
    return max(blocks, default=0)


def _export_tensors(h: GGUFHeader, factors: Mapping[str, tuple[np.ndarray, np.ndarray]], arch: str,
                    tmap: Any, bh: GGUFHeader | None, problems: list[str]
                    ) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, int], list[str]]:
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    ranks: dict[str, int] = {}
    modules: list[str] = []
    for target, (a, b) in factors.items():
        module = _hf_module(arch, target, tmap)
        if module is None:
            problems.append(f"{target}: no Hugging Face module corresponds to this tensor for {arch}")
            continue
        if _ARCHS[arch].permute_qk and bh is not None and target.split(".")[-2] in ("attn_q", "attn_k"):
            n_head, n_kv = _head_counts(bh)
            b = unpermute_rows(b, n_head if target.endswith("attn_q.weight") else n_kv)
        gtype = h.tensors[target + ".lora_a"].ggml_type
        for kind, arr in (("lora_A", a), ("lora_B", b)):
            tensors[f"base_model.model.{module}.{kind}.weight"] = _to_st(arr, gtype)
        ranks[module] = a.shape[0]
        modules.append(module)
    return tensors, ranks, modules


def _to_st(arr: np.ndarray, ggml_type: int) -> tuple[str, np.ndarray]:
    # Keep the factor's own precision: F16/BF16 values are exactly representable, so nothing rounds.
    if ggml_type == F16:
        return "F16", arr.astype(np.float16)
    if ggml_type == BF16:
        return "BF16", to_bf16_bits(arr)
    return "F32", np.ascontiguousarray(arr, dtype=np.float32)


def _peft_config(h: GGUFHeader, arch: str, ranks: Mapping[str, int], modules: list[str],
                 base_model: str | None, n_blocks: int) -> dict[str, Any]:
    alpha = float(h.metadata.get("adapter.lora.alpha", 0.0) or 0.0)
    r = Counter(ranks.values()).most_common(1)[0][0]
    rank_pattern = {m: k for m, k in ranks.items() if k != r}
    # llama.cpp: alpha 0 means scaling 1, which PEFT expresses as alpha == rank per module.
    lora_alpha = alpha if alpha != 0 else float(r)
    alpha_pattern = {m: float(k) for m, k in rank_pattern.items()} if alpha == 0 else {}
    leaves = sorted({m.rsplit(".", 1)[-1] for m in modules})
    # A leaf name targets it in every block; list full paths when the adapter covers only some.
    full = all(sum(m.rsplit(".", 1)[-1] == leaf for m in modules) == (1 if leaf == "lm_head" else n_blocks)
               for leaf in leaves)
    inv = h.metadata.get("adapter.alora.invocation_tokens")
    cfg: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": lora_alpha,
        "target_modules": leaves if full else sorted(modules), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": _ARCHS[arch].fan_in_fan_out, "use_rslora": False, "use_dora": False,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": base_model or h.metadata.get("general.source.huggingface.repository")
        or h.metadata.get("adapter.base_model"),
    }
    if inv:
        cfg["alora_invocation_tokens"] = [int(t) for t in inv]
    return cfg



def peft_factors(tensors: Mapping[str, np.ndarray], base: GGUFHeader) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]],
                                                                           list[str]]:
    """PEFT-named factors (`…q_proj.lora_A.weight`, in memory) as base tensor name → (A, B), and problems.

    The names are mapped and the factors oriented (and, for llama-like models, q/k rows permuted)
    as `convert_peft` does; B is taken as it is: the scale applied is the loaded adapter's alpha/r.
    """
    problems: list[str] = []
    arch = _ARCHS.get(base.architecture or "")
    if arch is None:
        return {}, [f"PEFT names are not mapped for architecture {base.architecture!r}; send GGUF names "
                    "(blk.N.attn_q.weight.lora_a / .lora_b)"]
    tmap = _tensor_map(base.architecture or "", max(int(base.arch_value("block_count", 0) or 0), 1))
    index = {k: {"dtype": "F32"} for k in tensors}
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module, ab in _collect_pairs(index, problems).items():
        target = _target_for(module, tmap, base, problems)
        if target is None:
            continue
        a, b, err = _orient(module, tensors[ab["A"]], tensors[ab["B"]], base.tensors[target].shape, False)
        if err:
            problems.append(err)
            continue
        if arch.permute_qk and target.split(".")[-2] in ("attn_q", "attn_k"):
            b = _permute_for(target, b, base, problems)
        out[target] = (a, b)
    return out, problems
