"""What callers name when they load adapters or pick a control vector: `LoraSpec` (an adapter to load,
as the CLI's `[NAME=]SRC[:SCALE]` parses), `adapter_name` (the default name of a source), and
`Inherit` / `ControlArg` (a request's control vector, or the engine's own default).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from .control import ControlSetting


class Inherit(enum.Enum):
    """A request's control vector when it names none: the engine's own default setting."""

    ENGINE = "engine"


ControlArg = ControlSetting | None | Literal[Inherit.ENGINE]
"""A request's control vector: a setting, None (no vector), or `Inherit.ENGINE` (the engine's)."""


@dataclass(frozen=True)
class LoraSpec:
    """An adapter to load: a source (path, URL, hf://), a scale and an optional name."""

    source: str
    scale: float = 1.0
    name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoraSpec:
        """`[NAME=]SRC[:SCALE]` as the CLI takes it (a ':' suffix counts only if it is a number)."""
        name = None
        if "=" in text.split("/", 1)[0] and not text.startswith(("http://", "https://", "hf://")):
            name, text = text.split("=", 1)
        scale = 1.0
        head, sep, tail = text.rpartition(":")
        if sep and head:
            try:
                scale = float(tail)
                text = head
            except ValueError:
                pass
        return cls(text, scale, name)


def adapter_name(source: str) -> str:
    """Default adapter name: the file name without .gguf (``hf://o/r/style.gguf@v1`` → ``style``)."""
    base = source.split("#", 1)[0].rstrip("/").rsplit("/", 1)[-1].split("@", 1)[0]
    return base[:-5] if base.endswith(".gguf") else base


__all__ = ["ControlArg", "Inherit", "LoraSpec", "adapter_name"]
