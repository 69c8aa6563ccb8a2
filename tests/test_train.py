"""Zeroth-order LoRA training on the tiny model: learning, determinism, resume, errors, the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import PROMPT, max_diff

import loramux as lm
from loramux.cli import main
from loramux.gguf_io import read_adapter_factors, validate_adapter
from loramux.train.data import load_examples

# A prompt → completion copy task the tiny random model can learn in a few dozen steps.
TASK = [{"prompt": p, "completion": " the big red cat sat on the mat"}
        for p in ("hello world", "we ran", "she is big", "a dog and a cat", "it was red", "you sat on it")]
HELD_OUT = [{"prompt": "he ran to the mat", "completion": " the big red cat sat on the mat"}]
FAST = dict(rank=4, batch=2, lr=1e-2, eps=1e-2, targets="attn_q,attn_v")


@pytest.fixture()
def eng1(tiny_model):
    # One thread: the tiny model gains nothing from more, and one thread keeps decodes fast on a busy machine.
    eng = lm.Engine.load(tiny_model, n_ctx=256, n_threads=1)
    yield eng
    eng.close()


def test_loss_decreases_on_a_learnable_task(eng1, tmp_path):
    # Settings that learn this task for every seed tried (0-3: final held-out loss 2.2-2.9 below the start).
    res = lm.train_zo(eng1, TASK, tmp_path / "copy.gguf", eval_data=HELD_OUT, steps=80, eval_every=20,
                      progress=False, **{**FAST, "batch": 3, "lr": 4e-2, "targets": "attn_v,attn_output,ffn_down"})
    assert res.steps == 80 and len(res.losses) == 80
    assert [s for s, _ in res.eval_history] == [0, 20, 40, 60, 80]
    assert res.best_eval_loss < res.initial_eval_loss - 1.5, res.eval_history
    assert res.final_eval_loss < res.initial_eval_loss - 1.0, res.eval_history
    # The best factors are in OUT, loaded back into the engine under the adapter's name.
    assert res.name == "copy" and "copy" in eng1.adapters
    exs = load_examples(eng1, HELD_OUT)
    again = eng1.loss([e.tokens for e in exs], masks=[e.mask for e in exs], loras={"copy": 1.0}, control=None)
    assert again == res.best_eval_loss
    assert res.last is not None and res.last.exists()
    assert res.forward_seconds > 0 and res.write_seconds > 0 and 0 < res.write_share < 1


@pytest.mark.parametrize("normalize", [True, False], ids=["rms", "plain-mezo"])
def test_same_seed_same_losses_to_the_last_digit(eng1, tmp_path, normalize):
    kw = dict(steps=8, progress=False, normalize=normalize, **FAST)
    runs = [lm.train_zo(eng1, TASK, tmp_path / f"r{i}.gguf", seed=7, **kw) for i in range(2)]
    assert runs[0].losses == runs[1].losses
    assert [r["grad"] for r in runs[0].log] == [r["grad"] for r in runs[1].log]
    other = lm.train_zo(eng1, TASK, tmp_path / "r3.gguf", seed=8, **kw)
    assert other.losses != runs[0].losses
    fa, fb = read_adapter_factors(runs[0].out), read_adapter_factors(runs[1].out)
    assert all(np.array_equal(fa[n][0], fb[n][0]) and np.array_equal(fa[n][1], fb[n][1]) for n in fa)


def test_resume_continues_the_exact_same_run(eng1, tiny_model, tmp_path):
    kw = dict(eval_data=HELD_OUT, steps=10, eval_every=3, seed=3, progress=False, **FAST)
    full = lm.train_zo(eng1, TASK, tmp_path / "full.gguf", checkpoint_every=5, **kw)
    ckpt = tmp_path / "full.ckpt-000005.json"
    assert ckpt.exists() and full.checkpoints[-1].name == "full.ckpt-000010.json"
    # Resume as a new process would: a fresh engine, from the step-5 checkpoint.
    resumed = lm.train_zo(tiny_model, TASK, tmp_path / "res.gguf", resume=ckpt, n_ctx=256, n_threads=1, **kw)
    assert resumed.steps == 10
    assert resumed.losses == full.losses
    assert resumed.eval_history == full.eval_history
    assert (resumed.best_step, resumed.best_eval_loss) == (full.best_step, full.best_eval_loss)
    for a, b in ((full.last, resumed.last), (full.out, resumed.out)):
        fa, fb = read_adapter_factors(a), read_adapter_factors(b)
        assert all(np.array_equal(fa[n][0], fb[n][0]) and np.array_equal(fa[n][1], fb[n][1]) for n in fa)
    # A checkpoint refuses a run whose settings would change the loss sequence.
    with pytest.raises(lm.TrainingError, match="lr: checkpoint has 0.01"):
        lm.train_zo(eng1, TASK, tmp_path / "bad.gguf", resume=ckpt, **{**kw, "lr": 0.02})
    with pytest.raises(lm.TrainingError, match="training data differs"):
        lm.train_zo(eng1, TASK[:-1], tmp_path / "bad.gguf", resume=ckpt, **kw)


def test_step_zero_adapter_is_the_base_exactly(eng1, tmp_path):
    res = lm.train_zo(eng1, TASK, tmp_path / "z.gguf", steps=0, rank=4, targets="attn_q,attn_v,ffn_down",
                      progress=False)
    assert res.steps == 0 and res.losses == []
    info = validate_adapter(res.out, "llama", eng1.model.tensor_shapes)
    assert info.rank == 4 and len(info.targets) == 6
    f = read_adapter_factors(res.out)
    assert all(np.abs(a).max() > 0 and not b.any() for a, b in f.values())  # A random, B zero
    base = eng1.logits(PROMPT, loras={})
    assert max_diff(eng1.logits(PROMPT, loras={"z": 1.0}), base) == 0.0
    # ... and the file loads like any adapter (`loramux run --lora z.gguf`).
    eng1.set_lora(res.out, name="fresh")
    assert max_diff(eng1.logits(PROMPT, loras={"fresh": 1.0}), base) == 0.0


def test_non_finite_loss_restores_the_last_good_factors(eng1, tmp_path, monkeypatch):
    seen: list[dict] = []

    def snapshot(row):
        seen.append(eng1.adapter("nan").all_factors())

    real = eng1.loss_sum
    calls = {"n": 0}

    def flaky(*args, **kw):
        calls["n"] += 1
        total, count = real(*args, **kw)
        return (math.nan, count) if calls["n"] == 2 * 3 + 1 else (total, count)  # L+ of step 4

    monkeypatch.setattr(eng1, "loss_sum", flaky)
    with pytest.raises(lm.TrainingError, match="step 4: non-finite") as err:
        lm.train_zo(eng1, TASK, tmp_path / "nan.gguf", steps=10, eval_every=0, progress=False,
                    callback=snapshot, **FAST)
    assert err.value.step == 4 and err.value.result.steps == 3
    live = eng1.adapter("nan").all_factors()
    assert len(seen) == 3
    for n, (a, b) in seen[-1].items():
        assert np.array_equal(live[n][0], a) and np.array_equal(live[n][1], b)
    saved = read_adapter_factors(tmp_path / "nan.gguf")  # the last good factors are on disk too
    assert all(np.array_equal(saved[n][1], seen[-1][n][1]) for n in saved)


def test_huge_learning_rate_stops_with_typed_error(eng1, tmp_path):
    with pytest.raises(lm.TrainingError, match="non-finite") as err:
        lm.train_zo(eng1, TASK, tmp_path / "boom.gguf", steps=50, progress=False,
                    **{**FAST, "lr": 1e30})
    assert err.value.step is not None
    live = eng1.adapter("boom").all_factors()
    assert all(np.isfinite(a).all() and np.isfinite(b).all() for a, b in live.values())


def test_data_formats_and_masks(eng1, tmp_path):
    chat = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the cat"},
                         {"role": "user", "content": "and"}, {"role": "assistant", "content": "the dog"}]}
    t, pc, ch = load_examples(eng1, [{"text": "the cat sat"}, {"prompt": "hello", "completion": " world"}, chat])
    assert all(t.mask) and t.n_scored == len(t.tokens) - 1
    assert eng1.detokenize([x for x, m in zip(pc.tokens, pc.mask) if m]).strip() == "world"
    learned = eng1.model.detokenize([x for x, m in zip(ch.tokens, ch.mask) if m], special=True)
    assert "the cat" in learned and "the dog" in learned
    assert "hello" not in learned and "and" not in learned and learned.count("<end_of_turn>") == 2


def test_malformed_data_names_the_line(eng1, tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "fine"}\n{"text": oops}\n\n{"foo": 1}\n{"prompt": "only a prompt"}\n'
                 '{"messages": [{"role": "user", "content": "no answer"}]}\n')
    with pytest.raises(lm.TrainingError) as err:
        load_examples(eng1, p)
    msg = str(err.value)
    assert f"{p}:2: not valid JSON" in msg
    with pytest.raises(lm.TrainingError) as err:
        load_examples(eng1, [json.loads(x) for x in p.read_text().splitlines() if x and "oops" not in x])
    msg = str(err.value)
    assert "data[1]: unknown format" in msg and "data[2]: 'prompt' and 'completion' go together" in msg
    assert "data[3]: no assistant turn" in msg
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(lm.TrainingError, match="no examples"):
        load_examples(eng1, tmp_path / "empty.jsonl")
    long = tmp_path / "long.jsonl"
    long.write_text('{"text": "ok"}\n' + json.dumps({"text": "the cat sat " * 200}) + "\n")
    with pytest.raises(lm.TrainingError, match="longer than the context") as err:
        load_examples(eng1, long)
    assert f"{long}:2:" in str(err.value)
    with pytest.raises(lm.ParameterError, match="batch"):
        lm.train_zo(eng1, TASK[:1], tmp_path / "o.gguf", batch=2, progress=False)
    with pytest.raises(lm.ParameterError, match="targets"):
        lm.train_zo(eng1, TASK, tmp_path / "o.gguf", targets="attn_x", progress=False)


def test_cli_train_zo_writes_adapter_log_plot(tiny_model, tmp_path, capsys):
    data, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TASK))
    evals.write_text("".join(json.dumps(r) + "\n" for r in HELD_OUT))
    out = tmp_path / "cli.gguf"
    rc = main(["train", "zo", str(tiny_model), "--threads", "1", "--n-ctx", "256", "--data", str(data),
               "--eval", str(evals), "-o", str(out), "--steps", "6", "--eval-every", "3", "--rank", "2",
               "--batch", "2", "--checkpoint-every", "3", "--log", str(tmp_path / "log.csv"),
               "--plot", str(tmp_path / "loss.png"), "-q"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "trained 6 steps" in text and "held-out loss" in text
    lines = (tmp_path / "log.csv").read_text().splitlines()
    assert lines[0].startswith("step,loss_plus,loss_minus,loss,grad,lr,eval_loss,write_s,forward_s")
    assert len(lines) == 1 + 1 + 6  # header, the step-0 evaluation, six steps
    assert (tmp_path / "cli.ckpt-000003.json").exists() and (tmp_path / "cli.last.gguf").exists()
    assert validate_adapter(out, "llama", None).rank == 2
    png = tmp_path / "loss.png"
    if png.exists():  # matplotlib is optional
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    # The result is a normal llama.cpp LoRA GGUF: `loramux run --lora OUT.gguf` takes it.
    assert main(["run", str(tiny_model), "--lora", str(out), "--threads", "1", "-n", "4", "-p", "hello", "-v"]) == 0
    assert "adapters: {'cli': 1.0}" in capsys.readouterr().err
    rc = main(["train", "zo", str(tiny_model), "--data", str(tmp_path / "nope.jsonl"), "-o", str(out)])
    assert rc == 2 and "not found" in capsys.readouterr().err


def test_ctrl_c_keeps_what_was_learned(eng1, tmp_path):
    seen: list[dict] = []

    def interrupt(row):
        seen.append(eng1.adapter("stop").all_factors())
        if row["step"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        lm.train_zo(eng1, TASK, tmp_path / "stop.gguf", steps=10, progress=False, callback=interrupt,
                    log=tmp_path / "stop.json", **FAST)
    saved = read_adapter_factors(tmp_path / "stop.gguf")
    assert all(np.array_equal(saved[n][0], seen[-1][n][0]) and np.array_equal(saved[n][1], seen[-1][n][1])
               for n in saved)
    assert [r["step"] for r in json.loads((tmp_path / "stop.json").read_text())] == [1, 2, 3]
