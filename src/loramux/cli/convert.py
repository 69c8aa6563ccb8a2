"""`loramux convert`, `loramux export-peft` and `loramux merge`: PEFT ⇄ GGUF and merging.

Errors are `LoramuxError`s; the main CLI prints them and exits with status 2.
"""

from __future__ import annotations

import argparse
from typing import Any

CONVERT_EPILOG = """\
examples:
  loramux convert ./my-peft-adapter --base gemma-3-270m.gguf -o my-adapter.gguf
  loramux convert ./my-peft-adapter --base base.gguf -o my-adapter.gguf --outtype f16
  loramux convert ./my-peft-adapter --base base.gguf -o x.gguf --dry-run   # check, write nothing

PEFT_DIR is what `peft_model.save_pretrained(PEFT_DIR)` wrote: adapter_config.json and
adapter_model.safetensors. The base GGUF must be the model the adapter was trained on, converted
by llama.cpp (any quantization): its architecture and tensor shapes are checked. Supported
architectures: llama (also Mistral), qwen2, qwen3, gemma, gemma2, gemma3, phi3, gpt2.
rsLoRA, rank_pattern/alpha_pattern and fan_in_fan_out are converted exactly; DoRA, trained
biases, modules_to_save and embedding LoRA are refused with a list of what to change.
"""

EXPORT_EPILOG = """\
examples:
  loramux export-peft my-adapter.gguf ./my-peft-adapter --base base.gguf --base-model google/gemma-3-270m
  python -c "from peft import PeftModel; PeftModel.from_pretrained(hf_model, './my-peft-adapter')"

Writes adapter_config.json and adapter_model.safetensors with Hugging Face module names, for
PEFT, vLLM or transformers. Llama-family adapters need --base (the GGUF base model): llama.cpp
stores their q/k rows permuted, and the head counts to undo that are in the base.
"""

MERGE_EPILOG = """\
examples:
  loramux merge base.gguf --lora style.gguf -o merged.gguf                 # keep the base's quantization
  loramux merge base.gguf --lora style.gguf:0.5 --lora domain.gguf -o merged.gguf --quant Q4_K_M
  loramux merge base.gguf --lora hf://owner/repo/style.gguf -o merged-f32.gguf --quant F32
  loramux merge base.gguf --lora style.gguf -o merged.gguf --quant none    # merged tensors as F32

The merged model computes base + Σ scale·alpha/rank·B·A, exactly what llama.cpp applies at run
time, with no adapter needed. Tensors an adapter touches are dequantized, merged and (unless
--quant none) re-quantized by llama.cpp; all other tensors are copied byte for byte.
--quant takes llama.cpp's names: Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, F16, BF16, F32, ...
"""


def parse_lora_arg(text: str) -> tuple[str, float]:
    """`SRC[:SCALE]` as every command parses it (`LoraSpec.parse`): the part after the last ':' is a
    scale only if it parses as a number, so paths and URLs that contain ':' still work. A merged
    adapter has no name, so a `NAME=` prefix is refused rather than ignored."""
    from ..engine.specs import LoraSpec
    from ..errors import ParameterError

    spec = LoraSpec.parse(text)
    if spec.name is not None:
        raise ParameterError("--lora", f"{text!r}: merge takes SRC[:SCALE], not NAME=SRC",
                             hint=f"drop '{spec.name}=', or write ./{text} for a file whose name holds '='")
    return spec.source, spec.scale


def cmd_convert(args: argparse.Namespace) -> int:
    from ..convert import convert_peft

    rep = convert_peft(args.peft_dir, args.base, args.output, outtype=args.outtype, dry_run=args.dry_run,
                       progress=args.progress or None)
    print(rep.summary())
    return 2 if rep.problems else 0


def cmd_export(args: argparse.Namespace) -> int:
    from ..convert import export_peft

    out = export_peft(args.adapter, args.out_dir, args.base_model, base=args.base)
    print(f"wrote {out}/adapter_config.json and {out}/adapter_model.safetensors")
    return 0


def _local(src: str) -> str:
    # Remote adapters (https://, hf://) are fetched into the cache first; local paths go to merge
    # unchanged so that a missing file is reported together with every other problem.
    if src.startswith(("http://", "https://", "hf://")):
        from ..sources import resolve

        return str(resolve(src))
    return src


def cmd_merge(args: argparse.Namespace) -> int:
    from ..merging import merge

    loras = [parse_lora_arg(s) for s in args.lora]
    loras = [(_local(src), scale) for src, scale in loras]
    quant: Any = args.quant
    if isinstance(quant, str) and quant.lower() == "none":
        quant = None
    rep = merge(args.base, loras, args.output, quant=quant, dtype=args.dtype, progress=args.progress or None,
                nthread=args.threads)
    print(rep.summary())
    return 0


def add_parsers(sub: Any) -> None:
    """Register convert, export-peft and merge on the main CLI's subparsers."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("convert", help="convert a PEFT LoRA (safetensors) into a llama.cpp adapter GGUF",
                       description="Convert a PEFT LoRA adapter into a llama.cpp adapter GGUF for a base model.",
                       epilog=CONVERT_EPILOG, formatter_class=raw)
    p.add_argument("peft_dir", metavar="PEFT_DIR", help="folder with adapter_config.json + adapter_model.safetensors")
    p.add_argument("--base", required=True, metavar="BASE.gguf", help="the base model GGUF the adapter is for")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf", help="adapter GGUF to write (atomically)")
    p.add_argument("--outtype", choices=("f32", "f16", "bf16"), default="f32",
                   help="factor precision in the file (default f32; f16 halves the size)")
    p.add_argument("--dry-run", action="store_true", help="check and report, write nothing")
    p.add_argument("--progress", action="store_true", help="show a progress bar even when not on a terminal")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("export-peft", help="write a llama.cpp adapter GGUF as a PEFT LoRA folder",
                       description="Export a llama.cpp LoRA adapter GGUF to PEFT's format.",
                       epilog=EXPORT_EPILOG, formatter_class=raw)
    p.add_argument("adapter", metavar="ADAPTER.gguf", help="the adapter GGUF")
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (created if missing)")
    p.add_argument("--base", metavar="BASE.gguf", default=None,
                   help="base model GGUF (required for llama-family adapters, to undo the q/k permutation)")
    p.add_argument("--base-model", metavar="NAME", default=None,
                   help="base_model_name_or_path to record, e.g. a Hugging Face repo id")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("merge", help="merge adapters into a base model and write a (re-quantized) GGUF",
                       description="Merge LoRA adapters into a base GGUF.", epilog=MERGE_EPILOG,
                       formatter_class=raw)
    p.add_argument("base", metavar="BASE.gguf", help="the base model GGUF")
    p.add_argument("--lora", action="append", required=True, metavar="SRC[:SCALE]",
                   help="adapter to merge (repeatable): path, https:// URL or hf://owner/repo/file.gguf, "
                        "optional :SCALE (default 1.0)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf", help="model GGUF to write (atomically)")
    p.add_argument("--quant", default="auto", metavar="TYPE",
                   help="re-quantize to TYPE (Q4_K_M, Q8_0, F16, F32, ...); 'auto' (default) = the base's "
                        "type; 'none' = merged tensors stay F32/F16, others as they were")
    p.add_argument("--dtype", choices=("f32", "f16"), default="f32",
                   help="precision of merged tensors with --quant none (default f32)")
    p.add_argument("--threads", type=int, default=0, help="quantization threads (default: all)")
    p.add_argument("--progress", action="store_true", help="show a progress bar even when not on a terminal")
    p.set_defaults(func=cmd_merge)


__all__ = ["CONVERT_EPILOG", "EXPORT_EPILOG", "MERGE_EPILOG", "add_parsers", "cmd_convert", "cmd_export",
           "cmd_merge", "parse_lora_arg"]
