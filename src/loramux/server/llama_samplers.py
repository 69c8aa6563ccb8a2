"""llama-server's other sampler and limit fields (docs/llama-server.md), each honoured as llama-server does:

- `samplers`: the chain's order, as names (llama-server's, and its alternative spellings) or one string of
  its letters; built with llama.cpp's samplers (_native/sampling.py). `top_n_sigma` is taken and left out of
  the chain (loramux has no field to set it, and at its default it does nothing); `adaptive_p` and unknown
  names are refused by name.
- `typical_p`, `mirostat` (+ `mirostat_tau`, `mirostat_eta`), `dry_*`, `xtc_*`: llama.cpp's samplers, with
  llama-server's defaults (each default is neutral: the tokens of a request without it).
- `n_indent`, `t_max_predict_ms`: llama-server's code-completion stops (engine/linestops.py).
- `t_max_prompt_ms`: taken as llama-server takes it: this llama.cpp's server has no prompt time limit (its
  field is marked unimplemented) and processes the whole prompt whatever the value; so does loramux.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from ..engine.sampling import DEFAULT_SAMPLER_ORDER as DEFAULT_ORDER
from ..engine.sampling import SAMPLER_NAMES as BUILT

MAX_SAMPLERS = 32  # entries of `samplers`
MAX_BREAKERS = 64  # entries of `dry_sequence_breakers`
MAX_BREAKER_CHARS = 64
DRY_BASE = 1.75  # llama-server: a dry_base below 1 is replaced by this default
# llama-server's names and their alternative spellings (common_sampler_types_from_names), and its letters
ALIASES = {"top-k": "top_k", "top-p": "top_p", "nucleus": "top_p", "typical_p": "typ_p", "typical-p": "typ_p",
           "typical": "typ_p", "typ-p": "typ_p", "typ": "typ_p", "min-p": "min_p", "temp": "temperature",
           "top-n-sigma": "top_n_sigma", "adaptive-p": "adaptive_p"}
LETTERS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
           "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}
# llama-server's defaults of the other samplers' fields, as generation_settings reports them
DEFAULTS = {"typical_p": 1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1, "mirostat": 0, "mirostat_tau": 5.0,
            "mirostat_eta": 0.1, "dry_multiplier": 0.0, "dry_base": DRY_BASE, "dry_allowed_length": 2,
            "dry_penalty_last_n": 64, "n_indent": 0, "t_max_predict_ms": -1}
PASSED = ("typical_p", "xtc_probability", "xtc_threshold", "mirostat", "mirostat_tau", "mirostat_eta",
          "dry_multiplier", "dry_allowed_length", "dry_penalty_last_n", "n_indent", "t_max_predict_ms")


class SamplerFields(BaseModel):
    """The fields, mixed into llama_fields.LlamaFields."""

    samplers: list[str] | str | None = Field(default=None, max_length=MAX_SAMPLERS)
    typical_p: float | None = Field(default=None, ge=0.0, le=1.0)
    xtc_probability: float | None = Field(default=None, ge=0.0, le=1.0)
    xtc_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    mirostat: int | None = Field(default=None, ge=0, le=2)
    mirostat_tau: float | None = Field(default=None, ge=0.0, le=100.0)
    mirostat_eta: float | None = Field(default=None, ge=0.0, le=1.0)
    dry_multiplier: float | None = Field(default=None, ge=0.0, le=100.0)
    dry_base: float | None = Field(default=None, ge=0.0, le=100.0)
    dry_allowed_length: int | None = Field(default=None, ge=0, le=2**31 - 1)
    dry_penalty_last_n: int | None = Field(default=None, ge=0, le=2**31 - 1)
    dry_sequence_breakers: list[str] | None = Field(default=None, min_length=1, max_length=MAX_BREAKERS)
    n_indent: int | None = Field(default=None, ge=0, le=2**31 - 1)
    t_max_predict_ms: int | None = Field(default=None, ge=-1)
    t_max_prompt_ms: int | None = Field(default=None, ge=-1)

    def sampler_order(self) -> tuple[str, ...] | None:
        """`samplers` in llama-server's canonical names (top_n_sigma left out: see the module), or None."""
        if self.samplers is None:
            return None
        names = [LETTERS.get(c, c) for c in self.samplers] if isinstance(self.samplers, str) else self.samplers
        return tuple(n for n in (ALIASES.get(n, n) for n in names) if n != "top_n_sigma")

    def sampler_problems(self) -> list[tuple[str, str]]:
        """(field, why) for a value llama-server takes and loramux cannot build."""
        out = []
        for n in self.sampler_order() or ():
            if n not in BUILT:
                why = ("adaptive_p is not built by loramux" if n == "adaptive_p" else f"unknown sampler {n[:40]!r}")
                out.append(("samplers", f"{why}: use {', '.join(BUILT)} (or their letters)"))
                break
        if any(not b or len(b) > MAX_BREAKER_CHARS for b in self.dry_sequence_breakers or ()):
            out.append(("dry_sequence_breakers", f"each breaker must be 1 to {MAX_BREAKER_CHARS} characters"))
        return out

    def sampler_settings(self) -> dict[str, Any]:
        """generation_settings' entries for these fields (llama-server's defaults for those left out)."""
        out: dict[str, Any] = {k: v if getattr(self, k) is None else getattr(self, k) for k, v in DEFAULTS.items()}
        args = self.sampler_args()
        out["dry_base"] = args.get("dry_base", DRY_BASE)
        out["dry_sequence_breakers"] = list(self.dry_sequence_breakers or ("\n", ":", "\"", "*"))
        order = self.sampler_order()
        out["samplers"] = list(DEFAULT_ORDER if order is None else order)
        return out

    def sampler_args(self) -> dict[str, Any]:
        """The engine's SamplingParams keywords for the fields that are set."""
        args: dict[str, Any] = {n: getattr(self, n) for n in PASSED if getattr(self, n) is not None}
        if self.samplers is not None:
            args["samplers"] = self.sampler_order()
        if self.dry_base is not None:
            args["dry_base"] = self.dry_base if self.dry_base >= 1.0 else DRY_BASE
        if self.dry_sequence_breakers is not None:
            args["dry_sequence_breakers"] = tuple(self.dry_sequence_breakers)
        return args


__all__ = ["ALIASES", "DEFAULTS", "DRY_BASE", "LETTERS", "MAX_BREAKERS", "MAX_SAMPLERS", "SamplerFields"]
