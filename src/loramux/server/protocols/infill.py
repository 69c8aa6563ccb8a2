"""The fill-in-the-middle prompt of /infill, from the vocabulary's FIM tokens, in llama-server's layout
(the repository-level pattern of Qwen2.5-Coder, arXiv 2409.12186):

    [FIM_REP]myproject\\n [FIM_SEP]file0\\n text0 ... [FIM_SEP]filename\\n
    [BOS] [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]

Without a FIM_SEP token each extra file is introduced by a "--- snippet ---" line instead; without FIM_REP
there is no project line. A vocabulary without the prefix, suffix and middle tokens cannot infill: a 501
naming the missing ones (as llama-server answers), never a plain completion in its place.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...engine.runtime import Engine
from ..errors import APIError

MAX_EXTRA = 64  # input_extra entries
SNIPPET = "\n\n--- snippet ---\n\n"  # between extra files when the vocabulary has no FIM_SEP token


def prompt_tokens(engine: Engine, prefix: str, suffix: str, extra: Sequence[tuple[str, str]],
                  prompt: str = "") -> list[int]:
    """The tokens of an infill request (worker thread: it tokenizes)."""
    h = engine.model.handle
    fim = h.fim_tokens
    missing = [name for name in ("pre", "suf", "mid") if fim[name] is None]
    if missing:
        raise APIError(501, "Infill is not supported by this model: its vocabulary has no FIM "
                            + ", ".join({"pre": "prefix", "suf": "suffix", "mid": "middle"}[m] for m in missing)
                            + " token (tokenizer.ggml.fim_*_token_id); use a code model with FIM tokens, or "
                              "/completion with the text before the cursor", code="infill_not_supported",
                       param="input_prefix")

    def tok(text: str) -> list[int]:
        return engine.tokenize(text, add_bos=False, special=False) if text else []
    head: list[int] = []
    if fim["rep"] is not None:
        head += [fim["rep"], *tok("myproject\n")]
    for filename, text in extra:
        head += [fim["sep"], *tok(filename + "\n")] if fim["sep"] is not None else tok(SNIPPET)
        head += tok(text)
    if fim["sep"] is not None:
        head += [fim["sep"], *tok("filename\n")]
    bos = [h.bos] if h.add_bos else []
    pre, suf, mid = fim["pre"], fim["suf"], fim["mid"]
    assert pre is not None and suf is not None and mid is not None
    return [*head, *bos, pre, *tok(prefix), *tok(prompt), suf, *tok(suffix), mid]


__all__ = ["MAX_EXTRA", "SNIPPET", "prompt_tokens"]
