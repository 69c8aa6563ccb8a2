"""llama-server's code-completion stops, checked after each token's text: `n_indent` and `t_max_predict_ms`.

Both follow llama-server's own bookkeeping (server-context.cpp, process_token), so a request ends on the same
token there and here:

- once a new line has been sent, each later token looks at the line after the last new line seen so far
  (one new line further per token): when that line has text and its indentation (spaces and tabs) is below
  `n_indent`, generation stops and the output is cut at the start of that text (its indentation stays);
- a token whose sent text has a new line ends generation once more than `t_max_predict_ms` has passed since
  the first token.

Either ends the output as a length limit does (finish_reason "length", llama-server's stop_type "limit").
"""

from __future__ import annotations

from .sampling import TextAssembler


class LineStops:
    """One request's n_indent / t_max_predict_ms state."""

    def __init__(self, n_indent: int, t_max_predict_ms: int) -> None:
        self.n_indent = n_indent
        self.t_max_s = t_max_predict_ms / 1000.0 if t_max_predict_ms > 0 else None
        self.has_new_line = False
        self.last_nl = 0  # where the line after the last new line looked at starts

    @classmethod
    def make(cls, n_indent: int, t_max_predict_ms: int) -> LineStops | None:
        """The checker, or None when neither limit is set (nothing to check)."""
        return cls(n_indent, t_max_predict_ms) if n_indent > 0 or t_max_predict_ms > 0 else None

    def stop(self, text: TextAssembler, sent: str, elapsed_s: float) -> bool:
        """After a token: whether to stop now (`sent`: the text this token handed out; `elapsed_s`: since the
        first token). An indentation stop cuts the output in `text`."""
        stop = False
        if self.has_new_line and self.n_indent > 0:
            line = text.since(self.last_nl)  # the text from the line looked at on: not the whole output
            if self.last_nl > 0:
                lead = len(line) - len(line.lstrip(" \t"))
                if lead < len(line) and lead < self.n_indent:
                    text.cut(self.last_nl + lead)
                    line, stop = line[:lead], True
            nl = line.find("\n")
            if nl >= 0:
                self.last_nl += nl + 1
        if "\n" in sent:
            self.has_new_line = True
            if self.t_max_s is not None and elapsed_s > self.t_max_s:
                stop = True
        return stop


__all__ = ["LineStops"]
