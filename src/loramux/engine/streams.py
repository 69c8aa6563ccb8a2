"""`TextStream`: the iterator `Engine.stream` returns over one request's text chunks."""

from __future__ import annotations

from collections.abc import Iterator

from .request import Request
from .sampling import Completion


class TextStream(Iterator[str]):
    """Iterator over a request's text chunks; `.completion` holds the result once exhausted."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.completion: Completion | None = None

    def __next__(self) -> str:
        if self.completion is not None:
            raise StopIteration
        kind, value = self.request.events.get()
        while kind in ("logprobs", "prompt_logprobs"):  # scores also arrive in the Completion
            kind, value = self.request.events.get()
        if kind == "text":
            return value
        if kind == "error":
            raise value
        self.completion = value
        raise StopIteration

    def consume(self) -> Completion:
        for _ in self:
            pass
        assert self.completion is not None
        return self.completion

    def cancel(self) -> None:
        """Stop generating; the completion ends with finish_reason 'cancelled'."""
        self.request.cancelled.set()

    def close(self) -> None:
        self.cancel()


__all__ = ["TextStream"]
