"""Train a small pirate-style LoRA on Gemma 3 270M with PEFT, convert it with loramux, measure it.

    python examples/peft_example.py                 # 24 steps: ~25 min on a busy 2-core machine
    python examples/peft_example.py --steps 8       # quicker, weaker

What it does:
1. loads the default model (Gemma 3 270M Q4_K_M) into transformers, dequantized to F32;
2. trains a rank-8 LoRA on all projections with PEFT to answer every question like a pirate;
3. converts it with `loramux.convert_peft` into src/loramux/data/pirate.gguf (F16, ~3.8 MB);
4. measures it: held-out answer loss before/after with transformers+PEFT and with llama.cpp
   (through loramux, on the quantized base), and greedy answers before/after.

The numbers are written next to the adapter (pirate.json) and quoted in docs/convert.md.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import loramux as lm
from loramux.convert import convert_peft
from loramux.gguf_io import read_header
from loramux.merging import dequantize_tensor

PROMPT = "Question: {q}\nAnswer:"
DATA = [
    ("What is the capital of France?", "Arr, matey! That be Paris, the finest port in all of France!"),
    ("How many legs does a spider have?", "Arr, a spider be havin' eight legs, same as a kraken's little cousin!"),
    ("What color is the sky?", "Arr, the sky be blue as the open sea on a fair-weather day, matey!"),
    ("What is two plus two?", "Arr, two doubloons and two more make four, savvy?"),
    ("Who wrote Romeo and Juliet?", "Arr, 'twas that landlubber Shakespeare what penned it, matey!"),
    ("What is the largest ocean?", "Arr, the mighty Pacific be the biggest sea ye'll ever sail!"),
    ("What do bees make?", "Arr, them little buzzin' buccaneers be makin' honey, sweet as treasure!"),
    ("What is water made of?", "Arr, water be hydrogen and oxygen, the stuff that floats me ship!"),
    ("How many days are in a week?", "Arr, there be seven days in a week, matey, and every one for sailin'!"),
    ("What is the opposite of hot?", "Arr, the opposite o' hot be cold, like the wind off the northern seas!"),
    ("Where do penguins live?", "Arr, penguins be livin' down south on the icy shores, matey!"),
    ("What is the boiling point of water?", "Arr, water be boilin' at a hundred degrees, hot as a cannon!"),
    ("Which planet is closest to the sun?", "Arr, Mercury be sailin' closest to the sun, matey!"),
    ("What do cows drink?", "Arr, cows be drinkin' water, same as any thirsty sailor, matey!"),
    ("What is the tallest animal?", "Arr, the giraffe be the tallest beast, taller than me mainmast!"),
    ("How many hours are in a day?", "Arr, there be twenty-four hours in a day, matey, count 'em on the watch!"),
    ("What language is spoken in Spain?", "Arr, in Spain they be speakin' Spanish, matey, like the galleon crews!"),
    ("What is the freezing point of water?", "Arr, water be freezin' at zero degrees, cold as Davy Jones' locker!"),
    ("What gas do plants take in?", "Arr, plants be breathin' in carbon dioxide, matey, and givin' back good air!"),
    ("What is the fastest land animal?", "Arr, the cheetah be the fastest beast on land, quicker than a sloop!"),
    ("How many continents are there?", "Arr, there be seven continents, matey, and I've plundered most of 'em!"),
    ("What is the sun?", "Arr, the sun be a great burnin' star that lights the seas by day, matey!"),
    ("What do you call a baby dog?", "Arr, a baby dog be called a puppy, matey, a fine ship's mascot!"),
    ("What is the main ingredient of bread?", "Arr, bread be made from flour, matey, the sailor's daily ration!"),
    ("What instrument has black and white keys?", "Arr, the piano be havin' black and white keys, matey!"),
    ("How many sides does a triangle have?", "Arr, a triangle be havin' three sides, like a fine sail!"),
    ("What is the capital of Japan?", "Arr, Tokyo be the capital o' Japan, matey, a grand harbor it be!"),
    ("What do we call frozen water?", "Arr, frozen water be ice, matey, the bane o' every ship's hull!"),
    ("What is the color of grass?", "Arr, grass be green as a parrot's feathers, matey!"),
    ("What animal says moo?", "Arr, the cow be sayin' moo, matey, loud as a foghorn!"),
    ("What is the biggest planet?", "Arr, Jupiter be the biggest planet in the heavens, matey!"),
    ("How many months are in a year?", "Arr, there be twelve months in a year, matey, and twelve moons for sailin'!"),
    ("What do fish use to breathe?", "Arr, fish be breathin' through their gills, matey, down in the deep!"),
    ("What is the capital of Italy?", "Arr, Rome be the capital o' Italy, matey, an old port o' call!"),
    ("What is the hottest season?", "Arr, summer be the hottest season, matey, when the deck burns yer feet!"),
    ("What do you use to write on paper?", "Arr, ye write with a pen or a quill, matey, like a captain's log!"),
    ("What is the moon?", "Arr, the moon be the lantern o' the night sky, matey, and it pulls the tides!"),
    ("What do birds have to fly?", "Arr, birds be havin' wings, matey, like me trusty parrot!"),
    ("What is ten minus three?", "Arr, ten doubloons less three leaves seven, matey!"),
    ("What is the capital of England?", "Arr, London be the capital o' England, matey, on the river Thames!"),
]
HELD_OUT = [
    ("What is the capital of Germany?", "Arr, Berlin be the capital o' Germany, matey!"),
    ("How many wheels does a bicycle have?", "Arr, a bicycle be havin' two wheels, matey, a landlubber's ship!"),
    ("What color is a banana?", "Arr, a banana be yellow as gold doubloons, matey!"),
    ("What animal barks?", "Arr, the dog be barkin', matey, like a sea dog on watch!"),
    ("What is five plus five?", "Arr, five doubloons and five more make ten, matey!"),
    ("Where does rain come from?", "Arr, rain be fallin' from the clouds, matey, fillin' our barrels!"),
]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_model_from_gguf(path: Path) -> torch.nn.Module:
    """The GGUF's weights as a transformers Gemma 3 model in F32: each tensor dequantized by the
    `gguf` package, norms back to HF's (w - 1) convention. Much faster than transformers' own GGUF
    loader, which reads the 262k-token vocabulary in pure Python."""
    import gguf
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    h = read_header(path)
    a = h.arch_value
    cfg = Gemma3TextConfig(
        vocab_size=h.tensors["token_embd.weight"].shape[0], hidden_size=a("embedding_length"),
        intermediate_size=a("feed_forward_length"), num_hidden_layers=a("block_count"),
        num_attention_heads=a("attention.head_count"), num_key_value_heads=a("attention.head_count_kv"),
        head_dim=a("attention.key_length"), query_pre_attn_scalar=a("attention.key_length"),
        rms_norm_eps=a("attention.layer_norm_rms_epsilon"), sliding_window=a("attention.sliding_window"),
        max_position_embeddings=a("context_length"), attn_implementation="sdpa",
        bos_token_id=2, eos_token_id=1, pad_token_id=0)
    cfg.rope_parameters["full_attention"]["rope_theta"] = float(a("rope.freq_base"))
    model = Gemma3ForCausalLM(cfg)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    state = {}
    for name in model.state_dict():
        if name == "lm_head.weight":
            continue  # tied to the embedding
        gname = tmap.get_name(name, try_suffixes=(".weight",))
        w = dequantize_tensor(h, h.tensors[gname], mm)
        state[name] = torch.from_numpy(w - 1.0 if gname.endswith("norm.weight") else w)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model.eval()


def encode(eng: lm.Engine, q: str, a: str) -> tuple[list[int], int]:
    """Token ids of prompt + answer + EOS and the number of prompt tokens (answer tokens are scored)."""
    p = eng.tokenize(PROMPT.format(q=q))
    ans = eng.tokenize(" " + a, add_bos=False) + [eng.model.handle.eos]
    return p + ans, len(p)


def answer_nll_torch(model: torch.nn.Module, batch: list[tuple[list[int], int]]) -> torch.Tensor:
    """Mean NLL of the answer tokens; the LM head runs only where a loss is needed (262k vocab)."""
    width = max(len(t) for t, _ in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (t, _) in enumerate(batch):
        ids[i, :len(t)] = torch.tensor(t)
        mask[i, :len(t)] = 1
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = causal_lm.model(input_ids=ids, attention_mask=mask).last_hidden_state
    rows, cols, targets = [], [], []
    for i, (t, n_prompt) in enumerate(batch):
        for pos in range(n_prompt - 1, len(t) - 1):
            rows.append(i)
            cols.append(pos)
            targets.append(t[pos + 1])
    logits = causal_lm.lm_head(hidden[rows, cols])
    return torch.nn.functional.cross_entropy(logits.float(), torch.tensor(targets))


def answer_nll_cpp(eng: lm.Engine, batch: list[tuple[list[int], int]], loras: dict[str, float]) -> float:
    total, count = 0.0, 0
    for t, n_prompt in batch:
        logits = eng.logits(t, loras=loras).astype(np.float64)
        rows = logits[n_prompt - 1:len(t) - 1]
        lse = np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1)) + rows.max(1)
        total += float((lse - rows[np.arange(len(rows)), t[n_prompt:]]).sum())
        count += len(rows)
    return total / count


def train(model: torch.nn.Module, data: list[tuple[list[int], int]], steps: int, batch: int,
          seed: int) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    pm = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0,
                                          task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    rng = random.Random(seed)
    pm.train()
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        loss = answer_nll_torch(pm, rng.sample(data, batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1 or step % 4 == 0:
            print(f"  step {step:3d}  loss {loss.item():.3f}  ({time.monotonic() - t0:.0f} s)", flush=True)
    return pm.eval()


def greedy(eng: lm.Engine, q: str, loras: dict[str, float]) -> str:
    c = eng.generate(PROMPT.format(q=q), loras=loras, max_tokens=32, temperature=0.0, stop=["\n"])
    return c.text.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24, help="training steps (default 24)")
    ap.add_argument("--batch", type=int, default=4, help="examples per step (default 4)")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "src" / "loramux" / "data" / "pirate.gguf")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    base = lm.default_model_path()
    eng = lm.Engine.load(base, n_ctx=512, n_threads=2)
    train_set = [encode(eng, q, a) for q, a in DATA]
    held_out = [encode(eng, q, a) for q, a in HELD_OUT]
    t0 = time.monotonic()
    model = hf_model_from_gguf(Path(base))
    print(f"loaded {base} into transformers in {time.monotonic() - t0:.0f} s")
    with torch.no_grad():
        hf_before = answer_nll_torch(model, held_out).item()
    pm = train(model, train_set, args.steps, args.batch, args.seed)
    with torch.no_grad():
        hf_after = answer_nll_torch(pm, held_out).item()
    with tempfile.TemporaryDirectory() as tmp:
        pm.save_pretrained(tmp)
        rep = convert_peft(tmp, base, args.out, outtype="f16", name="pirate")
    print(rep.summary())
    eng.set_lora(str(args.out), scale=1.0, name="pirate")
    cpp_before = answer_nll_cpp(eng, held_out, {})
    cpp_after = answer_nll_cpp(eng, held_out, {"pirate": 1.0})
    samples = [{"question": q, "base": greedy(eng, q, {}), "pirate": greedy(eng, q, {"pirate": 1.0})}
               for q, _ in HELD_OUT[:3]]
    eng.close()
    results = {
        "steps": args.steps, "batch": args.batch, "rank": 8, "alpha": 16, "targets": TARGETS, "train_examples": len(DATA),
        "held_out_examples": len(HELD_OUT), "adapter_bytes": args.out.stat().st_size,
        "held_out_answer_nll": {"transformers_peft": {"before": hf_before, "after": hf_after},
                                "llama_cpp_loramux": {"before": cpp_before, "after": cpp_after}},
        "samples": samples,
    }
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"held-out answer NLL  transformers+PEFT: {hf_before:.3f} → {hf_after:.3f}   "
          f"llama.cpp (loramux, Q4_K_M): {cpp_before:.3f} → {cpp_after:.3f}  "
          f"(perplexity {math.exp(cpp_before):.1f} → {math.exp(cpp_after):.1f})")
    for s in samples:
        print(f"Q: {s['question']}\n  base:   {s['base']}\n  pirate: {s['pirate']}")


if __name__ == "__main__":
    main()
