"""Training adapters on a quantized model without backpropagation (zeroth-order, forward-only).

    import loramux as lm
    res = lm.train_zo(None, "train.jsonl", "persona.gguf", eval_data="eval.jsonl", steps=300)
    print(res.initial_eval_loss, "→", res.best_eval_loss)
"""

from __future__ import annotations

from .data import Example, load_examples
from .zo import TrainResult, ZOConfig, ZOTrainer, train_zo

__all__ = ["Example", "TrainResult", "ZOConfig", "ZOTrainer", "load_examples", "train_zo"]
