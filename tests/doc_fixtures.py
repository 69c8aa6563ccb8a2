"""The files and stand-in servers that the documentation's samples name, made for real on demand.

Shared by tests/test_docs.py (the Python samples) and tests/test_commands.py (the shell commands): a sample
says `style.gguf`, `base.gguf`, `./my-peft-adapter` or `hf://owner/repo/x.gguf`; a `Workspace` makes that
file in the sample's directory, for the sample's base model, the first time it is asked for, and serves
Hub and HTTPS sources from a real HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from http_fixture import Server

from loramux.gguf_io import read_header, write_adapter

ROOT = Path(__file__).resolve().parents[1]
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
TRAIN = [{"prompt": "Hi, I'm Jonas.", "completion": " Ahoy, Jonas!"},
         {"prompt": "the cat sat", "completion": " on the mat, matey."},
         {"prompt": "hello world", "completion": " Ahoy, world!"}]
EVAL = [{"prompt": "Hi, I'm Ana.", "completion": " Ahoy, Ana!"}]

Maker = Callable[["Workspace", Path], Path]


@dataclass
class Workspace:
    """The directory a sample runs in, its base model, and the local server standing in for remote ones."""

    dir: Path
    model: Path  # the base model the sample's default model resolves to
    hub: Server  # Hugging Face Hub stand-in (HF_ENDPOINT) and plain HTTPS stand-in
    stack: contextlib.ExitStack
    files: dict[str, Maker]  # what this workspace knows how to make, by the name a sample uses
    made: dict[str, Path] = field(default_factory=dict)

    def file(self, name: str) -> Path:
        """Make the fixture file `name` in the workspace (once) and return its path."""
        if name not in self.made:
            path = self.dir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            self.made[name] = self.files[name](self, path)
        return self.made[name]

    def url_for(self, name: str) -> str:
        """Serve the fixture file `name` over HTTP; its address with the `#sha256=` pin."""
        data = self.file(name).read_bytes()
        self.hub.add(f"/files/{name}", data)
        return self.hub.url(f"/files/{name}") + "#sha256=" + hashlib.sha256(data).hexdigest()

    def make_named(self, text: str) -> None:
        """Make every known file that `text` names (as a whole word)."""
        for name in self.files:
            if re.search(r"(?<![\w.-])(\./)?" + re.escape(name) + r"(?![\w-])", text):
                self.file(name)

    def serve_hub_sources(self, text: str) -> None:
        """Serve each ``hf://owner/repo/<path>[@rev]`` that `text` names, as the Hub's resolve endpoint does."""
        for spec in re.findall(r"hf://([\w.-]+/[\w.-]+/[\w./-]+(?:@[\w.-]+)?)", text):
            repo_path, _, rev = spec.partition("@")
            owner, repo, rel = repo_path.split("/", 2)
            data = self.file(Path(rel).name).read_bytes() if Path(rel).name in self.files else b""
            etag = '"' + hashlib.sha256(data).hexdigest() + '"'
            self.hub.add(f"/{owner}/{repo}/resolve/{rev or 'main'}/{rel}", data, etag=etag,
                         headers={"X-Repo-Commit": hashlib.sha1(spec.encode()).hexdigest()})


def lora(rank: int, seed: int, alpha: float | None = None) -> Maker:
    """A random LoRA over every projection of the workspace's base model, small enough to keep text sane."""
    def make(ws: Workspace, path: Path) -> Path:
        h = read_header(ws.model)
        rng = np.random.default_rng(seed)
        factors = {}
        for name, t in h.tensors.items():
            if name.startswith("blk.") and name.split(".")[2] in PROJECTIONS:
                n_out, n_in = t.shape
                factors[name] = (rng.standard_normal((rank, n_in)).astype(np.float32) * 0.05,
                                 rng.standard_normal((n_out, rank)).astype(np.float32) * 0.05)
        return write_adapter(path, h.architecture, factors, float(rank if alpha is None else alpha))
    return make


def copy_model(ws: Workspace, path: Path) -> Path:
    return Path(shutil.copyfile(ws.model, path))


def repo_file(rel: str) -> Maker:
    """A file of this repository, copied under the same relative path."""
    def make(ws: Workspace, path: Path) -> Path:
        return Path(shutil.copyfile(ROOT / rel, path))
    return make


def adapter_dir(*names: str) -> Maker:
    """A directory of random adapters for the workspace's model, one per name."""
    def make(ws: Workspace, path: Path) -> Path:
        path.mkdir(exist_ok=True)
        for i, name in enumerate(names):
            lora(2, 41 + i)(ws, path / f"{name}.gguf")
        return path
    return make


def jsonl(rows: list[dict[str, str]]) -> Maker:
    def make(ws: Workspace, path: Path) -> Path:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return path
    return make


def text(content: str) -> Maker:
    def make(ws: Workspace, path: Path) -> Path:
        path.write_text(content, encoding="utf-8")
        return path
    return make


def control_vector(ws: Workspace, path: Path) -> Path:
    """A small random control vector for the workspace's model."""
    import loramux as lm

    h = read_header(ws.model)
    n_layer, n_embd = int(h.arch_value("block_count")), int(h.arch_value("embedding_length"))
    rng = np.random.default_rng(7)
    vec = {i: (rng.standard_normal(n_embd) * 0.05).astype(np.float32) for i in range(1, n_layer)}
    return lm.ControlVector(vec).save(path)


def peft_dir(ws: Workspace, path: Path) -> Path:
    """What `peft_model.save_pretrained(dir)` writes (config and safetensors, PEFT's names), rank 2 over
    every projection of a llama model shaped like the base. tests/test_convert.py checks the conversion of
    PEFT's own output against PEFT's numerics; here only the layout matters, and torch stays unimported."""
    from safetensors.numpy import save_file

    h = read_header(ws.model)
    if h.architecture != "llama":
        raise AssertionError("the PEFT fixture maps llama module names; run this sample on the tiny (llama) model")
    hf = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
    rng = np.random.default_rng(3)
    tensors = {}
    for name, t in h.tensors.items():
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in hf:
            n_out, n_in = t.shape
            key = f"base_model.model.model.layers.{parts[1]}.{hf[parts[2]]}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((2, n_in)) * 0.05).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((n_out, 2)) * 0.05).astype(np.float32)
    path.mkdir()
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none", "fan_in_fan_out": False,
              "target_modules": sorted({v.split(".")[1] for v in hf.values()}), "use_dora": False}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path
