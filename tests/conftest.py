"""Shared fixtures: the tiny model written by the suite, adapters for it, and the real default model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# llama.cpp's OpenMP workers spin while waiting by default; on a 2-core machine shared with the test
# process (and servers it starts) that spinning steals the cores. Passive waiting changes no result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tinymodel import write_tiny_lora, write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    write_tiny_model(d / "tiny.gguf")
    write_tiny_lora(d / "a.gguf", seed=1)
    write_tiny_lora(d / "b.gguf", seed=2, rank=4, alpha=2.0)
    write_tiny_lora(d / "zero.gguf", seed=3, zero=True)
    return d


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path) -> Path:
    return tiny_dir / "tiny.gguf"


@pytest.fixture()
def engine(tiny_model: Path):
    import loramux as lm

    eng = lm.Engine.load(tiny_model, n_ctx=256, n_threads=2)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    from loramux.config import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gemma(gemma_path: Path):
    import loramux as lm

    eng = lm.Engine.load(gemma_path, n_ctx=512, n_threads=2)
    yield eng
    eng.close()


PROMPT = "the cat sat on the mat and the dog ran"


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
