"""Worked example: teach Gemma 3 270M (Q4_K_M, on CPU) a persona greeting, forward passes only.

The data (examples/data/captain_*.jsonl) are chats where the user introduces themselves and the
assistant always answers "Ahoy, <name>! Captain Loramux at your service." — 20 for training, 8 with
other names and phrasings held out. The script trains a rank-8 LoRA on attn_q/attn_v with
zeroth-order SPSA (no backpropagation, the quantized model as served), then reports the held-out loss
before and after and shows greedy replies to held-out greetings with and without the adapter.

    python examples/train_zo_example.py                      # 120 steps; see docs/train.md
    python examples/train_zo_example.py --steps 40 --threads 2 --out-dir /tmp/captain
    loramux run --lora /tmp/captain/captain.gguf --chat -p "Hi, I'm Jonas."   # the result loads anywhere
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "data" / "captain_train.jsonl"
EVAL = HERE / "data" / "captain_eval.jsonl"
PROMPTS = ["Hi, I'm Jonas.", "Good morning! I am Hana.", "Hello, my name is Beatrix."]


def replies(eng, loras: dict[str, float] | None, max_tokens: int) -> list[str]:
    out = []
    for p in PROMPTS:
        c = eng.chat([{"role": "user", "content": p}], loras=loras or {}, max_tokens=max_tokens, temperature=0.0)
        out.append(c.text.strip().replace("\n", " "))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2, help="peak step size along z (decays linearly to 0)")
    ap.add_argument("--eps", type=float, default=2e-2)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per greedy reply shown")
    ap.add_argument("--out-dir", default="zo_example_out", help="where the adapter, log and plot go")
    args = ap.parse_args()

    import loramux as lm

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    eng = lm.Engine.load(n_ctx=512, n_threads=args.threads)
    try:
        before = replies(eng, None, args.max_tokens)
        res = lm.train_zo(eng, TRAIN, out / "captain.gguf", eval_data=EVAL, steps=args.steps, batch=args.batch,
                          lr=args.lr, eps=args.eps, rank=args.rank, targets="attn_q,attn_v", seed=args.seed,
                          eval_every=args.eval_every, log=out / "captain.csv", plot=out / "captain.png")
        after = replies(eng, {res.name: 1.0}, args.max_tokens)
    finally:
        eng.close()
    total = time.perf_counter() - t0

    n = max(res.steps, 1)
    print(f"\nsteps {res.steps} (batch {args.batch}, rank {args.rank} on attn_q,attn_v = {res.n_params:,} parameters, "
          f"lr {args.lr:g}, eps {args.eps:g}, seed {args.seed}, {args.threads} threads)")
    print(f"held-out loss (mean NLL of the assistant tokens, 8 unseen chats): "
          f"{res.initial_eval_loss:.4f} before → {res.best_eval_loss:.4f} best (step {res.best_step}), "
          f"{res.final_eval_loss:.4f} at the end")
    print("held-out loss by step: " + ", ".join(f"{s}: {v:.3f}" for s, v in res.eval_history))
    print(f"training wall time {res.wall_seconds:.1f} s ({res.wall_seconds / n:.2f} s/step); whole script {total:.1f} s")
    print(f"per step: forward passes {1e3 * res.forward_seconds / n:.1f} ms, factor writes "
          f"{1e3 * res.write_seconds / n:.2f} ms ({100 * res.write_share:.2f} %), noise + arithmetic "
          f"{1e3 * res.other_seconds / n:.2f} ms; evaluation {res.eval_seconds:.1f} s in all")
    print(f"wrote {res.out}, {res.last}, {out / 'captain.csv'}" + (f", {res.plot_file}" if res.plot_file else ""))
    print("\ngreedy replies to held-out greetings (base → trained):")
    for p, b, a in zip(PROMPTS, before, after):
        print(f"  user: {p}\n    base:    {b}\n    trained: {a}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
