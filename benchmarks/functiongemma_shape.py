"""A stand-in for FunctionGemma: Gemma 3 270M with FunctionGemma's control tokens and chat template.

`benchmarks/attacks.py` measures what a forced tool call costs a neighbour under `loramux serve
--tool-format function_gemma`. That format's grammar names FunctionGemma's control tokens
(`<start_function_call>`, `<end_function_call>`, `<escape>`, ...), which Gemma 3's vocabulary lacks,
so the embedded model refuses such calls. FunctionGemma is a fine-tune of Gemma 3 270M with the same
architecture and the same vocabulary size, its tags taking the place of unused tokens. This script
writes a copy of a Gemma 3 GGUF (default: loramux's embedded Gemma 3 270M Q4_K_M) in which the first
seven `<unusedN>` tokens are renamed to those seven tags (token type CONTROL) and whose chat template
has FunctionGemma's layout: a developer turn with the function declarations, user and model turns, a
model turn's calls followed in the same turn by the tools' responses and then its answer. Every tensor
and every other metadata field is copied unchanged.

The result costs what FunctionGemma costs per token and per grammar pass (same tensors and shapes, same
vocabulary size, the tags single control tokens); its weights are Gemma 3's, which never learned the
tags, so its answers mean nothing. For cost measurements only: never serve it as FunctionGemma.

    python benchmarks/functiongemma_shape.py -o OUT.gguf                   # from the embedded model
    python benchmarks/functiongemma_shape.py -o OUT.gguf --model BASE.gguf
    python benchmarks/attacks.py --only control,tools,tools_deep --model OUT.gguf

Not shipped and not run in CI.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import gguf
import numpy as np
from _common import copy_gguf_fields, model_path, progress

#: FunctionGemma's control tokens, in the order they take the place of <unused0>, <unused1>, ...
TAGS = ("<start_function_declaration>", "<end_function_declaration>", "<start_function_call>",
        "<end_function_call>", "<start_function_response>", "<end_function_response>", "<escape>")
TOKENS, TYPES, TEMPLATE = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.chat_template"
UNUSED = re.compile(r"<unused(\d+)>")

#: FunctionGemma's conversation layout. Values are written in its call format (strings between <escape>
#: tokens, bare keys, numbers and true/false/null bare; declarations with their types in capitals), the
#: format server/tool_formats/function_gemma.py reads and forces. A model turn with calls stays open: the
#: tools' responses follow in it, then the model's answer (or, with add_generation_prompt, the model goes
#: on there).
CHAT_TEMPLATE = """\
{%- macro fg(v, decl) -%}
{%- if v is string -%}
<escape>{{ v }}<escape>
{%- elif v is boolean -%}
{{ 'true' if v else 'false' }}
{%- elif v is none -%}
null
{%- elif v is mapping -%}
{{ '{' }}
{%- for k, x in v | dictsort -%}
{{ ',' if not loop.first else '' }}{{ k }}:
{%- if decl and k == 'type' and x is string -%}
<escape>{{ x | upper }}<escape>
{%- else -%}
{{ fg(x, decl) }}
{%- endif -%}
{%- endfor -%}
{{ '}' }}
{%- elif v is iterable -%}
[
{%- for x in v -%}
{{ ',' if not loop.first else '' }}{{ fg(x, decl) }}
{%- endfor -%}
]
{%- else -%}
{{ v }}
{%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set ns = namespace(open=false, calls=[]) -%}
{%- set rest = messages -%}
{%- set system = none -%}
{%- if messages and messages[0].role in ['system', 'developer'] -%}
{%- set system = messages[0].content -%}
{%- set rest = messages[1:] -%}
{%- endif -%}
{%- if tools or system is not none -%}
<start_of_turn>developer{{ '\\n' }}
{%- if system is not none -%}
{{ system | trim }}
{%- else -%}
You are a model that can do function calling with the following functions
{%- endif -%}
{%- for t in tools or [] -%}
{%- set f = t.function or t -%}
<start_function_declaration>declaration:{{ f.name }}{{ '{' }}
{{- 'description:<escape>' ~ (f.description or '') ~ '<escape>' }}
{%- if f.parameters -%}
,parameters:{{ fg(f.parameters, true) }}
{%- endif -%}
{{ '}' }}<end_function_declaration>
{%- endfor -%}
<end_of_turn>{{ '\\n' }}
{%- endif -%}
{%- for m in rest -%}
{%- if m.role == 'tool' -%}
{%- if not ns.open -%}
<start_of_turn>model{{ '\\n' }}
{%- set ns.open = true -%}
{%- endif -%}
{%- set found = namespace(name=m.name or '') -%}
{%- for c in ns.calls if not found.name and c[0] == m.tool_call_id -%}
{%- set found.name = c[1] -%}
{%- endfor -%}
<start_function_response>response:{{ found.name or 'tool' }}
{%- if m.content is mapping -%}
{{ fg(m.content, false) }}
{%- else -%}
{{ '{' }}value:{{ fg(m.content, false) }}{{ '}' }}
{%- endif -%}
<end_function_response>
{%- else -%}
{%- set role = 'model' if m.role == 'assistant' else 'developer' if m.role == 'system' else m.role -%}
{%- if not (ns.open and role == 'model') -%}
{%- if ns.open -%}
<end_of_turn>{{ '\\n' }}
{%- endif -%}
<start_of_turn>{{ role }}{{ '\\n' }}
{%- endif -%}
{{ (m.content or '') | trim }}
{%- if m.tool_calls -%}
{%- set ns.calls = [] -%}
{%- endif -%}
{%- for c in m.tool_calls or [] -%}
<start_function_call>call:{{ c.function.name }}
{%- if c.function.arguments is mapping -%}
{{ fg(c.function.arguments, false) }}
{%- else -%}
{{ '{' }}{{ c.function.arguments or '' }}{{ '}' }}
{%- endif -%}
<end_function_call>
{%- set ns.calls = ns.calls + [[c.id, c.function.name]] -%}
{%- endfor -%}
{%- set ns.open = (m.tool_calls or []) | length > 0 -%}
{%- if not ns.open -%}
<end_of_turn>{{ '\\n' }}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not ns.open -%}
<start_of_turn>model{{ '\\n' }}
{%- endif -%}
"""


def unused_ids(tokens: list[str], n: int) -> list[int]:
    """The ids of <unused0>, <unused1>, ... (the n lowest N present)."""
    found = {int(m.group(1)): i for i, t in enumerate(tokens) if (m := UNUSED.fullmatch(t))}
    if len(found) < n:
        raise SystemExit(f"error: the vocabulary has {len(found)} <unusedN> tokens, {n} are needed")
    return [found[k] for k in sorted(found)[:n]]


def read_vocab(ref: gguf.GGUFReader) -> tuple[list[str], list[int]]:
    """The reference's token texts and token types."""
    toks, types = ref.fields[TOKENS], ref.fields[TYPES]
    return ([bytes(toks.parts[i]).decode("utf-8", "surrogateescape") for i in toks.data],
            [int(types.parts[i][0]) for i in types.data])


def write_shaped(base: Path, out: Path) -> list[tuple[int, str, int, str]]:
    """Write the copy of `base` with the tags and the template to `out` (through OUT.partial, renamed when
    complete); (id, old text, old type, new text) of every renamed token."""
    ref = gguf.GGUFReader(base)
    tokens, types = read_vocab(ref)
    have = [t for t in TAGS if t in tokens]
    if have:
        raise SystemExit(f"error: {base} already has {', '.join(have)}: it needs no stand-in")
    ids = unused_ids(tokens, len(TAGS))
    renamed = [(i, tokens[i], types[i], tag) for i, tag in zip(ids, TAGS, strict=True)]
    for i, _old, _type, tag in renamed:
        tokens[i], types[i] = tag, int(gguf.TokenType.CONTROL)
    field = ref.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(tmp, arch)
    copy_gguf_fields(w, ref, replace={TOKENS: tokens, TYPES: types, TEMPLATE: CHAT_TEMPLATE})
    if TEMPLATE not in ref.fields:
        w.add_chat_template(CHAT_TEMPLATE)
    for t in ref.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in progress(ref.tensors, f"writing {out.name}"):
        w.write_tensor_data(t.data)
    w.close()
    tmp.replace(out)
    return renamed


def check_copy(base: Path, out: Path, ids: list[int]) -> None:
    """Read both files back: the same tensors byte for byte, the same vocabulary but the renamed tokens."""
    ref, got = gguf.GGUFReader(base), gguf.GGUFReader(out)
    (t0, y0), (t1, y1) = read_vocab(ref), read_vocab(got)
    changed = [i for i in range(len(t0)) if (t0[i], y0[i]) != (t1[i], y1[i])]
    assert len(t0) == len(t1) and changed == sorted(ids), changed
    assert [t1[i] for i in ids] == list(TAGS) and {y1[i] for i in ids} == {int(gguf.TokenType.CONTROL)}
    field = got.fields[TEMPLATE]
    assert bytes(field.parts[field.data[0]]).decode() == CHAT_TEMPLATE
    others = {k for k in ref.fields if not k.startswith("GGUF.")} | {TEMPLATE}
    assert others == {k for k in got.fields if not k.startswith("GGUF.")}, others ^ set(got.fields)
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ref.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in got.tensors]
    for a, b in zip(ref.tensors, got.tensors, strict=True):
        assert np.array_equal(a.data, b.data), a.name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", required=True, metavar="OUT.gguf", help="the GGUF to write")
    ap.add_argument("--model", default=None, metavar="BASE.gguf",
                    help="the Gemma 3 GGUF to copy (default: loramux's embedded Gemma 3 270M Q4_K_M)")
    args = ap.parse_args()
    base, out = model_path(args.model), Path(args.output).expanduser()
    renamed = write_shaped(base, out)
    check_copy(base, out, [i for i, *_ in renamed])
    names = {int(v): k for k, v in gguf.TokenType.__members__.items()}
    for i, old, kind, tag in renamed:
        print(f"token {i}: {old} ({names.get(kind, kind)}) -> {tag} (CONTROL)")
    print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB): {base.name} with FunctionGemma's tags and "
          "chat template; for cost measurements only", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
