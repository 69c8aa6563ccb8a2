"""Which adapters are loaded (by name), which are active by default, and adapter sets with their fingerprints.

Every mutation is validate-then-commit: the new state is computed and checked completely before it
replaces the old one, so a failed load or swap leaves the previous state serving. The registry is
only touched on the engine thread.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import AdapterNotFoundError, ParameterError, ScaleError
from .adapters import LoRAAdapter

LoraArg = Mapping[str, float] | Sequence[Any] | None


@dataclass(frozen=True)
class AdapterSet:
    """An ordered set of (adapter, scale) pairs as applied to a context. Scale-0 entries are dropped."""

    items: tuple[tuple[LoRAAdapter, float], ...] = ()
    #: Fingerprint taken at creation: adapter identity, content version and scale. KV computed under
    #: one key is never reused under another, so an in-place write (new version) invalidates it.
    key: tuple[tuple[int, int, float], ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", tuple((a.uid, a.version, s) for a, s in self.items))

    def as_dict(self) -> dict[str, float]:
        return {a.name: s for a, s in self.items}

    @property
    def versions(self) -> dict[str, int]:
        """name → the content version this set is keyed by (what its request runs on)."""
        return {a.name: v for (a, _), (_, v, _) in zip(self.items, self.key)}

    def at_versions(self, versions: Mapping[int, int]) -> AdapterSet:
        """This set keyed by other content versions (adapter uid → version; the rest as they are now):
        the versions a request will run on once the pushes it waits for have landed (versions.py)."""
        out = AdapterSet(self.items)
        object.__setattr__(out, "key", tuple((a.uid, versions.get(a.uid, a.version), s) for a, s in self.items))
        return out

    def without_alora(self) -> AdapterSet:
        return AdapterSet(tuple((a, s) for a, s in self.items if not a.is_alora))

    @property
    def aloras(self) -> list[LoRAAdapter]:
        return [a for a, _ in self.items if a.is_alora]

    def __bool__(self) -> bool:
        return bool(self.items)


def check_scale(name: str, scale: Any) -> float:
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise ScaleError(f"scale of {name!r} must be a number, got {scale!r}") from None
    if not math.isfinite(s):
        raise ScaleError(f"scale of {name!r} must be finite, got {s}")
    return s


class Registry:
    """Loaded adapters by name, and the default active set (ordered name → scale). What is loaded is
    decided by the loaded tier (residency.py); the registry only names it."""

    def __init__(self) -> None:
        self.adapters: dict[str, LoRAAdapter] = {}
        self.active: dict[str, float] = {}

    def get(self, name: str) -> LoRAAdapter:
        try:
            return self.adapters[name]
        except KeyError:
            raise AdapterNotFoundError(name, self.adapters) from None

    def adapter_set(self, loras: LoraArg) -> AdapterSet:
        """Turn a per-call spec into an AdapterSet; None means the default active set."""
        pairs = self.active.items() if loras is None else _pairs(loras)
        items, missing = [], []
        for name, scale in pairs:
            s = check_scale(name, scale)
            if name not in self.adapters:
                missing.append(name)
            elif s != 0.0:
                items.append((self.adapters[name], s))
        if missing:
            raise AdapterNotFoundError(missing[0], self.adapters)
        return AdapterSet(tuple(items))

    def commit_add(self, adapter: LoRAAdapter, scale: float | None) -> LoRAAdapter | None:
        """Insert (or replace) an adapter; returns the one it replaced (to free once unused)."""
        old = self.adapters.get(adapter.name)
        self.adapters[adapter.name] = adapter
        if scale is not None:
            self.active[adapter.name] = scale
        return old

    def set_scale(self, name: str, scale: float) -> None:
        self.get(name)
        self.active[name] = check_scale(name, scale)

    def remove(self, name: str) -> LoRAAdapter:
        a = self.get(name)
        del self.adapters[name]
        self.active.pop(name, None)
        return a

    def names(self) -> Iterable[str]:
        return self.adapters.keys()


def requested_names(loras: LoraArg, active: Mapping[str, float]) -> list[str]:
    """The adapter names a per-call spec uses (None: the default active set), scale-0 entries left out.

    Nothing is checked here (`Registry.adapter_set` does that): a bad entry is simply passed through."""
    pairs = active.items() if loras is None else _pairs(loras)
    out = []
    for name, scale in pairs:
        try:
            if float(scale) == 0.0:
                continue
        except (TypeError, ValueError):
            pass
        out.append(name)
    return out


def _pairs(loras: Mapping[str, float] | Sequence[Any]) -> list[tuple[str, Any]]:
    if isinstance(loras, Mapping):
        return list(loras.items())
    out = []
    for i, item in enumerate(loras):
        if isinstance(item, str):
            out.append((item, 1.0))
        elif isinstance(item, Mapping):
            name = item.get("name", item.get("id"))
            if name is None:
                raise ParameterError(f"loras[{i}]", "needs a 'name'")
            out.append((str(name), item.get("scale", 1.0)))
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            out.append((str(item[0]), item[1]))
        else:
            raise ParameterError(f"loras[{i}]", f"expected a name, (name, scale) or {{'name', 'scale'}}, got {item!r}")
    return out


__all__ = ["AdapterSet", "LoraArg", "Registry", "check_scale", "requested_names"]
