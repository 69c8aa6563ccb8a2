"""Drift report: how far an adapter moves the base model on golden prompts.

For every golden prompt: KL(base ‖ adapter) of the next-token distributions at each position of the
prompt (mean over positions, float64 log-softmax), the fraction of positions whose top-1 token
agrees, and the greedy continuations of both side by side. A summary gives the means; `--json`
gives the whole report for CI.
"""

from __future__ import annotations

import itertools
import json
import os
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._progress import bar
from .errors import ParameterError

if TYPE_CHECKING:  # the engine loads llama.cpp: imported where it is used
    from .engine.runtime import Engine

DRIFT_NAME = "loramux-drift"


def golden_prompts(path: str | os.PathLike[str] | None = None) -> list[str]:
    """Prompts from a file (default: the golden set shipped with loramux).

    One prompt per line; blank lines and lines starting with ``#`` are skipped; ``\\n`` in a line
    stands for a newline inside the prompt.
    """
    if path is None:
        from .config import data_file

        text = data_file("golden_prompts.txt").read_text(encoding="utf-8")
        where = "the builtin golden set"
    else:
        p = Path(path)
        if not p.is_file():
            raise ParameterError("prompts", f"{p} is not a file", hint="give a text file with one prompt per line")
        text = p.read_text(encoding="utf-8")
        where = str(p)
    prompts = [ln.replace("\\n", "\n") for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    if not prompts:
        raise ParameterError("prompts", f"{where} holds no prompts",
                             hint="one prompt per line; lines starting with # are comments")
    return prompts


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def kl_rows(base_logits: np.ndarray, adapter_logits: np.ndarray) -> np.ndarray:
    """KL(base ‖ adapter) per row, in nats (float64; tiny negative rounding clamped to 0)."""
    lp, lq = log_softmax(base_logits), log_softmax(adapter_logits)
    return np.maximum((np.exp(lp) * (lp - lq)).sum(axis=-1), 0.0)


@dataclass
class DriftItem:
    """One golden prompt's drift."""

    prompt: str
    positions: int
    kl: float  # mean over positions, nats
    kl_max: float
    top1_agreement: float
    base_text: str
    adapter_text: str


@dataclass
class DriftResult:
    """Per-prompt drift and the summary (mean KL, mean top-1 agreement)."""

    items: list[DriftItem]
    adapter: dict[str, Any]
    model: dict[str, Any]
    scale: float
    max_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_kl(self) -> float:
        return float(np.mean([i.kl for i in self.items]))

    @property
    def mean_top1_agreement(self) -> float:
        return float(np.mean([i.top1_agreement for i in self.items]))

    def summary(self) -> str:
        return (f"mean KL(base ‖ adapter) = {self.mean_kl:.6g} nats/position, mean top-1 agreement = "
                f"{self.mean_top1_agreement:.4f} over {len(self.items)} prompts "
                f"(adapter {self.adapter.get('file')} at scale {self.scale:g})")

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "adapter": self.adapter, "scale": self.scale, "max_tokens": self.max_tokens,
                "mean_kl": self.mean_kl, "mean_top1_agreement": self.mean_top1_agreement,
                "prompts": [asdict(i) for i in self.items], **self.extra}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    def table(self, width: int = 100) -> str:
        """Per-prompt numbers, then the greedy continuations side by side, then the summary."""
        col = max(20, (width - 3) // 2)
        lines = [f"{'#':>2}  {'KL mean':>10}  {'KL max':>10}  {'top-1':>6}  {'pos':>4}  prompt"]
        for n, it in enumerate(self.items):
            lines.append(f"{n:>2}  {it.kl:>10.4g}  {it.kl_max:>10.4g}  {it.top1_agreement:>6.3f}  "
                         f"{it.positions:>4}  {_one_line(it.prompt, width - 42)}")
        lines.append("")
        lines.append(f"{'base (greedy)':<{col}} | adapter ×{self.scale:g} (greedy)")
        for n, it in enumerate(self.items):
            lines.append(f"{'-' * col}-+-{'-' * col}")
            lines.append(_one_line(f"[{n}] {it.prompt}", 2 * col + 3))
            left = textwrap.wrap(_flat(it.base_text), col) or [""]
            right = textwrap.wrap(_flat(it.adapter_text), col) or [""]
            for a, b in itertools.zip_longest(left, right, fillvalue=""):
                lines.append(f"{a:<{col}} | {b}")
        lines += ["", self.summary()]
        return "\n".join(lines) + "\n"


def _flat(text: str) -> str:
    return text.replace("\n", "⏎ ")


def _one_line(text: str, n: int) -> str:
    t = _flat(text)
    return t if len(t) <= n else t[: max(1, n - 1)] + "…"


def drift(engine_or_model_path: Engine | str | os.PathLike[str] | None = None, lora: str | os.PathLike[str] | None = None, *, scale: float = 1.0,
          prompts: Sequence[str] | str | os.PathLike[str] | None = None, max_tokens: int = 32,
          threads: int | None = None, n_gpu_layers: int = 0, n_ctx: int = 2048,
          progress: bool | None = None) -> DriftResult:
    """Measure how far `lora` (at `scale`) moves the base model on golden prompts.

    `engine_or_model_path`: an Engine (left open), a base GGUF path, or None for the default model.
    `lora`: a path/URL, or the name of an adapter loaded in the given engine. `prompts`: a list of
    prompts, a file (one per line), or None for the builtin golden set.
    """
    from .engine.registry import check_scale
    from .probes import open_engine

    if lora is None:
        raise ParameterError("lora", "drift needs an adapter", hint="pass --lora SRC (path, URL or hf://)")
    if max_tokens < 0:
        raise ParameterError("max_tokens", f"must be ≥ 0, got {max_tokens}")
    scale = check_scale("lora", scale)
    texts = golden_prompts(prompts) if prompts is None or isinstance(prompts, (str, os.PathLike)) else list(prompts)
    if not texts:
        raise ParameterError("prompts", "is empty")
    with open_engine(engine_or_model_path, threads=threads, n_gpu_layers=n_gpu_layers, n_ctx=n_ctx) as eng:
        own = not (str(lora) in eng.adapters and not Path(lora).exists())
        ad = eng.load_lora(lora, name=DRIFT_NAME) if own else eng.adapter(str(lora))
        try:
            steps = bar(len(texts), "drift", progress, unit="row")
            items = []
            for text in texts:
                items.append(_drift_one(eng, text, {ad.name: scale}, max_tokens))
                steps.update(1)
            steps.close()
            info = {"file": Path(str(lora)).name if own else ad.name, "sha256": ad.sha256, "rank": ad.rank,
                    "alpha": ad.alpha, "n_factors": ad.n_factors}
        finally:
            if own and eng.adapters.get(DRIFT_NAME) is ad:
                eng.remove_lora(DRIFT_NAME)
        model = {"file": eng.model.path.name, "sha256": eng.model.sha256}
    return DriftResult(items, info, model, scale, max_tokens)


def _drift_one(eng: Engine, text: str, on: dict[str, float], max_tokens: int) -> DriftItem:
    toks = eng.tokenize(text)
    base, adapted = eng.logits(toks, loras={}, control=None), eng.logits(toks, loras=on, control=None)
    kl = kl_rows(base, adapted)
    agree = float(np.mean(base.argmax(axis=-1) == adapted.argmax(axis=-1)))
    gen = {"max_tokens": max_tokens, "temperature": 0.0, "control": None}
    base_text = eng.generate(toks, loras={}, **gen).text if max_tokens else ""
    adapter_text = eng.generate(toks, loras=on, **gen).text if max_tokens else ""
    return DriftItem(text, len(toks), float(kl.mean()), float(kl.max()), agree, base_text, adapter_text)


__all__ = ["drift", "DriftResult", "DriftItem", "golden_prompts", "kl_rows", "log_softmax"]
