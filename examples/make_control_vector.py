"""Make the shipped example control vector: "happy vs sad" tone on the default model (Gemma 3 270M).

    python examples/make_control_vector.py            # writes examples/vectors/happy.gguf, prints a table
    python examples/make_control_vector.py --eval-only

Each training pair is the same sentence with a happy and a sad wording; the vector is loramux's default:
per layer, the first principal component of the paired token-averaged residuals (see docs/control.md). The evaluation uses
held-out prompts, each with a happy and a sad continuation: the log-probability margin (happy − sad) should
rise with the strength, while the perplexity of neutral text barely moves. tests/test_control.py imports
the data and the measures from this file.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "vectors" / "happy.gguf"
LAYERS = None  # application range (inclusive, direction.N numbering); None = every layer
STRENGTH = 0.25  # the α of the evaluation and of tests/test_control.py
PPL_BOUND = 1.25  # neutral-text perplexity at ±α stays below this multiple of the base perplexity

# (happy, sad): same sentence, opposite mood. ~20 pairs, varied topics.
TRAIN_PAIRS = [
    ("I just heard the news and I feel so happy.", "I just heard the news and I feel so sad."),
    ("What a wonderful morning, everything is going great!", "What an awful morning, everything is going wrong."),
    ("She smiled with joy when she opened the letter.", "She cried with grief when she opened the letter."),
    ("Our team won the final and the whole town is celebrating.", "Our team lost the final and the whole town is mourning."),
    ("I love this city, the people here are so kind.", "I hate this city, the people here are so cruel."),
    ("The party was fantastic and we laughed all night.", "The funeral was heartbreaking and we wept all night."),
    ("My best friend is coming to visit, I can't wait!", "My best friend moved away, I miss her terribly."),
    ("He felt cheerful and full of hope about the future.", "He felt gloomy and full of dread about the future."),
    ("The garden is blooming and the sun is shining brightly.", "The garden is dying and the sky is dark and grey."),
    ("I passed the exam! This is the best day of my life.", "I failed the exam. This is the worst day of my life."),
    ("The children played happily in the park.", "The children sat alone and lonely in the park."),
    ("We had a delightful dinner full of laughter.", "We had a miserable dinner full of silence."),
    ("Thank you so much, this gift makes me really glad.", "I'm sorry, this loss makes me really sad."),
    ("The concert was joyful and everyone was dancing.", "The concert was cancelled and everyone was disappointed."),
    ("I am thrilled to start my new job tomorrow.", "I am devastated that I lost my job today."),
    ("Their wedding was a beautiful, happy celebration.", "Their divorce was a painful, sad ending."),
    ("The puppy wagged its tail, overjoyed to see us.", "The old dog lay still, too sick to greet us."),
    ("Life is good and I feel grateful for everything.", "Life is hard and I feel hopeless about everything."),
    ("The holiday was amazing, I enjoyed every minute.", "The holiday was a disaster, I regretted every minute."),
    ("Good news: the doctor says she is completely healthy!", "Bad news: the doctor says she is seriously ill."),
]

# Held out (not used in training): prompt, happy continuation, sad continuation.
HELD_OUT = [
    ("When I woke up this morning, I felt", " wonderful", " terrible"),
    ("The movie ended and everyone in the room was", " smiling", " crying"),
    ("After the long week, my mood is", " great", " awful"),
    ("Looking at the photos from that summer makes me", " happy", " sad"),
    ("The weather outside is", " beautiful", " miserable"),
    ("She read the message and her face became", " bright", " pale"),
    ("Honestly, the whole trip was", " fantastic", " horrible"),
    ("Walking home, he was feeling", " cheerful", " lonely"),
]

NEUTRAL = [
    "The Pacific Ocean is the largest and deepest of Earth's five oceanic divisions. It extends from the "
    "Arctic Ocean in the north to the Southern Ocean in the south.",
    "To install the package, download the archive, extract it into a folder and run the setup script "
    "from a terminal. The program reads its settings from a configuration file.",
    "Photosynthesis is the process by which plants use sunlight, water and carbon dioxide to produce "
    "oxygen and energy in the form of sugar.",
]


def margins(engine, control) -> list[float]:
    """Per held-out prompt: log p(happy continuation) − log p(sad continuation), under `control`."""
    import numpy as np

    out = []
    for prompt, good, bad in HELD_OUT:
        g, b = engine.tokenize(good, add_bos=False), engine.tokenize(bad, add_bos=False)
        if len(g) == len(b) == 1:  # one forward pass gives both
            row = engine.logits(prompt, control=control)[-1].astype(np.float64)
            out.append(float(row[g[0]] - row[b[0]]))
            continue
        lp = []
        for cont in (g, b):
            p = engine.tokenize(prompt)
            mask = [False] * len(p) + [True] * len(cont)
            lp.append(-engine.loss_sum([p + cont], masks=[mask], control=control)[0])
        out.append(lp[0] - lp[1])
    return out


def neutral_ppl(engine, control) -> float:
    """Perplexity of the neutral texts under `control`."""
    return math.exp(engine.loss(NEUTRAL, control=control))


def evaluate(engine, cv, strengths, layers=LAYERS) -> list[tuple[float, float, float, int]]:
    """Rows (strength, mean margin, neutral perplexity, pairs whose margin rose vs strength 0)."""
    from loramux.engine.control import ControlSetting

    base = margins(engine, None)
    rows = []
    for s in strengths:
        setting = ControlSetting.build(engine.model, [(cv, s)], layers) if s else None
        m = margins(engine, setting)
        rose = sum(a > b for a, b in zip(m, base))
        rows.append((s, sum(m) / len(m), neutral_ppl(engine, setting), rose))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="base GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("-o", "--output", default=str(OUT))
    ap.add_argument("--method", default="pca", choices=("pca", "mean"))
    ap.add_argument("--eval-only", action="store_true", help="evaluate the existing file, do not train")
    ap.add_argument("--strengths", default="-0.5,-0.25,-0.1,0,0.1,0.25,0.5")
    ap.add_argument("--layers", default=None, help="range A-B to evaluate with (default: every layer)")
    args = ap.parse_args(argv)

    import loramux as lm
    from loramux.engine.control import ControlVector, parse_layers

    with lm.Engine.load(args.model, n_ctx=512, n_threads=2) as eng:
        if args.eval_only:
            cv = ControlVector.load(args.output)
        else:
            cv = ControlVector.train(eng, [p for p, _ in TRAIN_PAIRS], [n for _, n in TRAIN_PAIRS],
                                     method=args.method)
            cv.save(args.output)
            print(f"wrote {args.output} ({len(cv.layers)} layers × {cv.n_embd})")
            print("layer   norm  agree  explained")
            for k, st in cv.stats.items():
                print(f"{k:>5} {st['norm']:>6.2f} {st['agree']:>6.2f} {st.get('explained', float('nan')):>9.2f}")
        strengths = [float(x) for x in args.strengths.split(",")]
        layers = parse_layers(args.layers)
        print(f"\nlayers {layers}: strength, mean margin (happy − sad, nats), neutral perplexity, "
              f"held-out prompts whose margin rose (of {len(HELD_OUT)})")
        for s, m, ppl, rose in evaluate(eng, cv, strengths, layers):
            print(f"{s:>6.2f} {m:>8.3f} {ppl:>8.3f} {rose:>3}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
