"""Which of my adapters is best: score a JSONL of prompts with choices (or references) under several adapters.

    from loramux.evaluate import evaluate, load_items
    report = evaluate(engine, load_items("items.jsonl"), {"base": {}, "style": {"style": 1.0}})
    print(report.table())
    report.plot("adapters.png")

Each line of the file is one item: ``{"prompt": "...", "choices": ["...", ...], "answer": 0}`` (a
multiple-choice item; `answer` is the index or the text of the right choice) or ``{"prompt": "...",
"reference": "..."}`` (a reference continuation, scored for its NLL only). A continuation's score is the sum of
its tokens' log-probabilities after the prompt (`Engine.score`, the same numbers `Engine.loss` gives). Every
(item, choice, adapter) sequence is queued together in batches, so with a slot bank sequences on different
adapters share decode steps.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .engine.registry import LoraArg
from .engine.runtime import Engine
from .engine.scoring import sum_logprobs
from .errors import ParameterError

MAX_ITEMS = 100_000  # items of one file
MAX_CHOICES = 32  # choices of one item
MAX_LINE_CHARS = 1 << 20  # characters of one JSONL line


@dataclass(frozen=True)
class EvalItem:
    """One item: a prompt with choices and the right one, or a prompt with a reference continuation."""

    prompt: str
    choices: tuple[str, ...] = ()
    answer: int | None = None
    reference: str | None = None

    @property
    def continuations(self) -> tuple[str, ...]:
        return self.choices if self.choices else (self.reference or "",)


def _item(obj: object, where: str) -> EvalItem:
    if not isinstance(obj, dict):
        raise ParameterError(where, "each line must be a JSON object")
    prompt = obj.get("prompt", obj.get("context"))
    if not isinstance(prompt, str):
        raise ParameterError(where, "needs a string 'prompt'")
    choices, ref = obj.get("choices"), obj.get("reference", obj.get("target"))
    if choices is not None:
        if (not isinstance(choices, list) or not 2 <= len(choices) <= MAX_CHOICES
                or not all(isinstance(c, str) and c for c in choices)):
            raise ParameterError(where, f"'choices' must be a list of 2 to {MAX_CHOICES} non-empty strings")
        ans = obj.get("answer", obj.get("label"))
        if isinstance(ans, str) and ans in choices:
            ans = choices.index(ans)
        if isinstance(ans, bool) or not isinstance(ans, int) or not 0 <= ans < len(choices):
            raise ParameterError(where, "'answer' must be the index or the text of one of the choices")
        return EvalItem(prompt, tuple(choices), ans)
    if isinstance(ref, str) and ref:
        return EvalItem(prompt, reference=ref)
    raise ParameterError(where, "needs 'choices' (with 'answer') or a non-empty 'reference'")


def load_items(path: str | os.PathLike[str]) -> list[EvalItem]:
    """Read a JSONL file of items; every problem names the file and line."""
    p = Path(path)
    if not p.is_file():
        raise ParameterError(str(p), "file not found", hint="give a JSONL file, one item per line")
    items: list[EvalItem] = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            where = f"{p}:{n}"
            if len(line) > MAX_LINE_CHARS:
                raise ParameterError(where, f"a line may have at most {MAX_LINE_CHARS} characters")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ParameterError(where, f"not JSON: {e.msg}") from None
            items.append(_item(obj, where))
            if len(items) > MAX_ITEMS:
                raise ParameterError(str(p), f"at most {MAX_ITEMS} items per file")
    if not items:
        raise ParameterError(str(p), "holds no items")
    return items


@dataclass
class AdapterResult:
    """One adapter set's scores over the items."""

    name: str
    mc_items: int = 0
    correct: int = 0
    correct_norm: int = 0  # right when each choice's logprob is divided by its length in characters
    nll_sum: float = 0.0  # over the right choice's (or the reference's) tokens
    nll_tokens: int = 0
    scores: list[list[float]] = field(default_factory=list)  # per item, each continuation's logprob sum

    @property
    def accuracy(self) -> float:
        return self.correct / self.mc_items if self.mc_items else math.nan

    @property
    def accuracy_norm(self) -> float:
        return self.correct_norm / self.mc_items if self.mc_items else math.nan

    @property
    def nll(self) -> float:
        """Mean NLL per token of the right continuations."""
        return self.nll_sum / self.nll_tokens if self.nll_tokens else math.nan


@dataclass
class EvalReport:
    """Per-adapter results of one run."""

    results: list[AdapterResult]
    items: int
    sequences: int
    elapsed_s: float

    def best(self) -> AdapterResult:
        """The adapter with the highest accuracy (multiple choice), else the lowest NLL."""
        if any(r.mc_items for r in self.results):
            return max(self.results, key=lambda r: (r.accuracy, -r.nll))
        return min(self.results, key=lambda r: r.nll)

    def table(self) -> str:
        rows = [("adapter", "accuracy", "acc_norm", "NLL/token", "ppl")]
        for r in self.results:
            rows.append((r.name, _pct(r.accuracy), _pct(r.accuracy_norm), f"{r.nll:.4f}",
                         f"{math.exp(r.nll):.2f}" if r.nll_tokens else "-"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                 for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(f"{self.items} items, {self.sequences} sequences scored in {self.elapsed_s:.2f} s; "
                     f"best: {self.best().name}")
        return "\n".join(lines) + "\n"

    def plot(self, path: str | os.PathLike[str]) -> Path | None:
        """A PNG with per-adapter accuracy and NLL bars; None if matplotlib is not installed."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        names = [r.name for r in self.results]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(6.0, 1.2 * len(names) + 3), 3.5))
        a1.bar(names, [0.0 if math.isnan(r.accuracy) else r.accuracy for r in self.results], color="tab:blue")
        a1.set_ylim(0, 1)
        a1.set_title("accuracy (higher is better)")
        a2.bar(names, [0.0 if math.isnan(r.nll) else r.nll for r in self.results], color="tab:orange")
        a2.set_title("NLL per token (lower is better)")
        for ax in (a1, a2):
            ax.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f}%"


def evaluate(engine: Engine, items: Sequence[EvalItem], adapters: Mapping[str, LoraArg], *,
             batch: int = 64) -> EvalReport:
    """Score every item's continuations under every adapter set (`adapters`: display name → the set, e.g.
    {"base": {}, "style": {"style": 1.0}}); `batch` sequences are queued at a time, adapters interleaved."""
    if not adapters:
        raise ParameterError("adapters", "give at least one adapter set (e.g. {'base': {}})")
    if batch < 1:
        raise ParameterError("batch", f"must be ≥ 1, got {batch}")
    t0 = time.perf_counter()
    jobs: list[tuple[int, int, int, list[int], int]] = []  # (adapter, item, continuation, tokens, n_context)
    for i, it in enumerate(items):
        ctx = engine.tokenize(it.prompt)
        for c, text in enumerate(it.continuations):
            toks = ctx + engine.tokenize(text, add_bos=False)
            if len(toks) <= len(ctx):
                raise ParameterError(f"items[{i}]", f"continuation {c} has no tokens")
            for a in range(len(adapters)):
                jobs.append((a, i, c, toks, len(ctx)))
    jobs.sort(key=lambda j: (j[1], j[2], j[0]))  # adjacent jobs differ in adapter: each batch mixes them
    sets = list(adapters.values())
    sums: dict[tuple[int, int, int], tuple[float, int]] = {}
    for start in range(0, len(jobs), batch):
        chunk = jobs[start:start + batch]
        scored = engine.score([j[3] for j in chunk], loras=[sets[j[0]] for j in chunk])
        for (a, i, c, toks, n_ctx), entries in zip(chunk, scored):
            sums[(a, i, c)] = (sum_logprobs(entries, n_ctx), len(toks) - n_ctx)
    results = [AdapterResult(name) for name in adapters]
    for a, r in enumerate(results):
        for i, it in enumerate(items):
            lps = [sums[(a, i, c)][0] for c in range(len(it.continuations))]
            r.scores.append(lps)
            right = it.answer if it.choices else 0
            r.nll_sum -= lps[right or 0]
            r.nll_tokens += sums[(a, i, right or 0)][1]
            if it.choices:
                r.mc_items += 1
                r.correct += int(max(range(len(lps)), key=lambda k: lps[k]) == right)
                norm = [lp / max(1, len(t)) for lp, t in zip(lps, it.choices)]
                r.correct_norm += int(max(range(len(norm)), key=lambda k: norm[k]) == right)
    return EvalReport(results, len(items), len(jobs), time.perf_counter() - t0)


__all__ = ["MAX_CHOICES", "MAX_ITEMS", "AdapterResult", "EvalItem", "EvalReport", "evaluate", "load_items"]
