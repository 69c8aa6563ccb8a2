"""The base model and its contexts: tokenize, batches of several sequences, logits, loss.

`Model` is loaded once. `Context` wraps one llama_context with a reusable batch; the engine owns
one serving context (several sequences) and one evaluation context (one sequence at a time, so
logits and losses never depend on what else is running).
"""

from __future__ import annotations

import codecs
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from .. import _native as N
from ..errors import ContextLengthError, ModelError
from ..gguf_io import GGUFFormatError, GGUFHeader, read_header, sha256_file


@dataclass(frozen=True)
class ContextOptions:
    """Settings of a llama_context."""

    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 1
    n_threads: int | None = None
    n_threads_batch: int | None = None
    kv_unified: bool = False
    flash_attn: bool = False
    kv_type: str = "f16"  # "f32" for reference comparisons (the F16 cache rounds K and V)


def default_threads() -> int:
    """Physical-core-ish default: all cores llama.cpp may use (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


class Model:
    """A base GGUF model loaded once; adapters and contexts hang off it."""

    def __init__(self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0, use_mmap: bool = True,
                 use_mlock: bool = False, repack: bool = True, devices: Sequence[int] = ()) -> None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ModelError(str(p), "file not found" if not p.exists() else "not a regular file",
                             hint="pass the path of a .gguf model, or omit MODEL to use the embedded default")
        try:
            self.header: GGUFHeader = read_header(p)
        except GGUFFormatError as e:
            raise ModelError(str(p), e.message.split(": ", 1)[-1], hint=e.hint) from e
        if self.header.file_type == "adapter":
            raise ModelError(str(p), "this is a LoRA adapter, not a base model",
                             hint="pass it with --lora / set_lora(...) and give the base model as MODEL")
        self.path = p
        self.n_gpu_layers = n_gpu_layers
        self.handle = N.ModelHandle.load(str(p), n_gpu_layers=n_gpu_layers, use_mmap=use_mmap,
                                         use_mlock=use_mlock, repack=repack, devices=devices)
        self.n_embd = self.handle.n_embd
        self.n_layer = self.handle.n_layer
        self.n_vocab = self.handle.n_vocab
        self.n_ctx_train = self.handle.n_ctx_train
        self.architecture = self.header.architecture or "?"
        self.name = str(self.header.metadata.get("general.name") or p.stem)
        #: the context kept for looking at graphs (adapter discovery): GraphProbe
        self.probe = GraphProbe(self)

    # -- facts -------------------------------------------------------------------------------
    @cached_property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """numpy shapes (out, in) of every tensor of the base model."""
        return {n: t.shape for n, t in self.header.tensors.items()}

    @cached_property
    def sha256(self) -> str:
        return sha256_file(self.path)

    @cached_property
    def chat_template(self) -> str | None:
        return self.header.metadata.get("tokenizer.chat_template") or self.handle.chat_template()

    def token_text(self, token: int) -> str:
        return self.handle.token_bytes(token, special=True).decode("utf-8", errors="replace")

    # -- vocabulary --------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        """Tokens of `text`; `add_bos` adds the model's BOS when the model wants one."""
        return self.handle.tokenize(text, add_special=add_bos, parse_special=special)

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out = [dec.decode(self.handle.token_bytes(t, special=special)) for t in tokens]
        out.append(dec.decode(b"", final=True))
        return "".join(out)

    def is_eog(self, token: int) -> bool:
        return self.handle.is_eog(token)

    def close(self) -> None:
        self.probe.close()  # a context of this model: freed before it
        self.handle.close()


class Context:
    """A llama_context plus a batch buffer and helpers for prompts, logits and losses."""

    def __init__(self, model: Model, opts: ContextOptions, callback: N.EvalCallback | None = None) -> None:
        threads = opts.n_threads or default_threads()
        self.model = model
        self.opts = opts
        self.handle = N.ContextHandle.create(
            model.handle, n_ctx=opts.n_ctx, n_batch=opts.n_batch, n_ubatch=opts.n_ubatch,
            n_seq_max=opts.n_seq_max, n_threads=threads, n_threads_batch=opts.n_threads_batch or threads,
            kv_unified=opts.kv_unified, flash_attn=opts.flash_attn, kv_type=opts.kv_type, callback=callback)
        self.n_ctx = self.handle.n_ctx
        self.n_batch = opts.n_batch
        self.batch = N.Batch(opts.n_batch)

    def check_fits(self, n_tokens: int, what: str = "prompt") -> None:
        """Per-sequence room: with several sequences llama.cpp splits n_ctx between them."""
        room = self.n_ctx if self.opts.kv_unified else self.n_ctx // max(1, self.opts.n_seq_max)
        if n_tokens > room:
            raise ContextLengthError(n_tokens, room, what)

    def prefill(self, seq: int, tokens: Sequence[int], pos0: int = 0, *, all_logits: bool = False
                ) -> np.ndarray | None:
        """Decode `tokens` for one sequence in n_batch chunks.

        Returns the logits of every token (all_logits) or of the last one, as float32 rows.
        """
        rows: list[np.ndarray] = []
        n = len(tokens)
        for start in range(0, n, self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            last_chunk = start + len(chunk) == n
            self.batch.clear()
            flags = True if all_logits else [False] * (len(chunk) - 1) + [last_chunk]
            self.batch.add(chunk, pos0 + start, seq, flags)
            self.handle.decode(self.batch)
            if all_logits:
                rows.extend(self.handle.logits_row(i) for i in range(len(chunk)))
        if all_logits:
            return np.stack(rows) if rows else np.zeros((0, self.model.n_vocab), np.float32)
        return self.handle.logits_row(-1)[None, :] if n else None

    def token_nll(self, seq: int, tokens: Sequence[int], mask: Sequence[bool] | None = None
                  ) -> tuple[float, int]:
        """Sum of -log p(token[i] | tokens[:i]) over i ≥ 1 where mask[i]; and the count. float64."""
        total, count = 0.0, 0
        for start in range(0, len(tokens), self.n_batch):
            s, c = self.nll_chunk(seq, tokens, start, mask)
            total += s
            count += c
        return total, count

    def nll_chunk(self, seq: int, tokens: Sequence[int], start: int, mask: Sequence[bool] | None = None
                  ) -> tuple[float, int]:
        """`token_nll`'s share of tokens[start:start + n_batch]: decodes them (tokens[:start] must be in
        `seq`'s cache already) and scores the tokens they predict. For callers that spread a long
        forward over several engine commands."""
        total, count = 0.0, 0
        n = len(tokens)
        chunk = tokens[start:start + self.n_batch]
        # Only rows predicting a scored token need logits (row j predicts token start+j+1); llama.cpp
        # then skips the output projection, the largest matmul, for the others.
        want = [start + j + 1 < n and (mask is None or bool(mask[start + j + 1])) for j in range(len(chunk))]
        self.batch.clear()
        self.batch.add(chunk, start, seq, want)
        self.handle.decode(self.batch)
        for j, w in enumerate(want):
            if not w:
                continue
            i = start + j + 1
            row = self.handle.logits_row(j).astype(np.float64)
            m = row.max()
            lse = m + np.log(np.exp(row - m).sum())
            total += float(lse - row[tokens[i]])
            count += 1
        return total, count

    def clear(self, seq: int | None = None) -> None:
        if seq is None:
            self.handle.memory_clear()
        else:
            self.handle.memory_seq_rm(seq, -1, -1)

    def close(self) -> None:
        self.handle.close()


PROBE_OPTIONS = ContextOptions(n_ctx=64, n_batch=1, n_ubatch=1, n_seq_max=1, n_threads=1)


class GraphProbe:
    """One small context of a model, kept to look at the graph of a one-token decode with one adapter
    active, built but not computed (how an adapter's live tensors are found: adapters.py).

    Kept, not made per look: a new context reserves scheduler and graph room for every adapter the model
    holds (`graph_max_nodes`), over 10 MB allocated and zeroed with 64 adapters loaded, under the model's
    adapter lock; made per cold load, that was most of a load's time in a busy server. The kept context
    was sized when it was made, with the adapter it was made for loaded: llama.cpp's room per adapter is
    6 nodes per target, so any adapter with no more targets fits (`look` makes a new one for one with more).
    One look at a time (the graph is the context's); any thread.
    """

    def __init__(self, model: Model) -> None:
        self.model = model
        self._lock = threading.Lock()
        self._ctx: Context | None = None
        self._room = 0  # targets of the adapter the context was made with
        self._closed = False

    def look(self, adapter: N.AdapterHandle, n_targets: int, see: Callable[[int], None]) -> bool:
        """Call `see` on every node of a one-token decode's graph with only `adapter` active (scale 1),
        while the graph exists. `n_targets`: the adapter's target count. False, with nothing seen, where this
        llama.cpp cannot build a graph without computing it (then decode with an eval callback instead)."""
        with self._lock:
            if self._closed:
                raise ModelError(str(self.model.path), "the model was closed")
            if self._ctx is None or n_targets > self._room:
                if self._ctx is not None:
                    self._ctx.close()
                    self._ctx = None
                self._ctx, self._room = Context(self.model, PROBE_OPTIONS), n_targets
            handle = self._ctx.handle
            handle.set_adapters([adapter], [1.0])
            try:
                nodes = handle.graph_nodes()
                for t in nodes or ():
                    see(t)
            finally:
                handle.set_adapters([], [])  # hold no pointer to an adapter that may be freed next
            return nodes is not None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._ctx is not None:
                self._ctx.close()
                self._ctx = None


__all__ = ["Context", "ContextOptions", "GraphProbe", "Model", "default_threads"]
