"""Progress bars on stderr: a tqdm bar when one is wanted, otherwise a bar that shows nothing.

Ground module: imports nothing of loramux. tqdm is imported only when a bar is shown, so a
library call that shows none never pays for it. Every function takes `enabled`: True shows a bar,
False shows none, None shows one when stderr is a terminal (the default of the library's calls,
so that piped output and logs stay clean).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Bar(Protocol):
    """The part of tqdm's bar that loramux uses."""

    def update(self, n: int = 1) -> Any: ...

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> Any: ...

    def close(self) -> Any: ...


class NoBar:
    """A bar that shows nothing: what `bar` returns when no bar is wanted."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def wanted(enabled: bool | None) -> bool:
    """Whether to show a bar: `enabled`, or when it is None whether stderr is a terminal."""
    return sys.stderr.isatty() if enabled is None else bool(enabled)


def bar(total: int, desc: str, enabled: bool | None = None, *, unit: str = "it", initial: int = 0,
        leave: bool = False) -> Bar:
    """A bar over `total` steps (starting at `initial`), or a `NoBar` when none is wanted.

    `leave`: keep the finished bar on screen (for long runs whose end state matters).
    """
    if not wanted(enabled):
        return NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=leave, dynamic_ncols=True)


def progress_iter(items: Iterable[T], *, total: int | None = None, desc: str = "", enabled: bool | None = None,
                  unit: str = "it") -> Iterator[T]:
    """Yield `items`, advancing a bar when one is wanted (see `bar`)."""
    if not wanted(enabled):
        yield from items
        return
    from tqdm.auto import tqdm

    yield from tqdm(items, total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)


__all__ = ["Bar", "NoBar", "bar", "progress_iter", "wanted"]
