"""Every shell command of README.md and docs/*.md, and every example of every `--help`, runs as a user types it.

Each command runs in a subprocess through the installed entry point (`loramux`, or Ray's `serve`), in a fresh
directory that holds the files the command names (tests/doc_fixtures.py makes them for the command's model),
and must exit as its Case says and print what its Case expects. The commands of one document run one after
another in one directory, as a reader works through the page: a server a page starts (`loramux serve`,
`loramux rpc-worker`, `serve run`) keeps running for the page's later commands (the curl lines of
docs/server.md talk to the server the page started) until a server of the same address replaces it, and is
asked one request as soon as it listens.

The tables:
- COMMANDS: each documented command → its Case. `model="tiny"` sets $LORAMUX_MODEL to the suite's tiny model,
  so that an omitted MODEL means it (a 120-step training run then takes seconds); `model="gemma"` runs the
  command on the embedded default model, exactly as typed.
- PLACEHOLDERS: text that stands for the reader's world (other hosts, a remote URL, more cores than CI has)
  → what runs instead.
- NOT_RUN: commands no CI machine can run, each with its reason.
A documented command that is in neither COMMANDS nor NOT_RUN fails `test_every_command_is_run_or_listed`; an
entry that no document or --help has any more fails it too.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import doc_fixtures as fx
import httpx
import pytest
from doc_commands import Script, all_scripts, untagged_command_blocks
from http_fixture import Server

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
DET = os.environ.get("LORAMUX_DET_PYTHON")  # the llama.cpp build with RPC (scripts/det-venv.sh)
TIMEOUT = 420.0  # seconds one command, or one server's start, may take on a slow 2-core machine


@dataclass(frozen=True)
class Case:
    """What one documented command must do."""

    expect: str  # a regex its stdout + stderr must match (a server: its start-up output)
    model: str = "tiny"  # what an omitted MODEL means: "tiny" ($LORAMUX_MODEL) or "gemma" (as typed)
    rc: int = 0
    env: tuple[tuple[str, str], ...] = ()  # the environment the page tells the reader to set


SERVE = r"models:  \S+ \(base\)"  # the first lines `loramux serve` prints once it listens

COMMANDS: dict[str, Case] = {
    # README.md
    'loramux run -p "The capital of France is"': Case(r"^The capital of France is", "gemma"),
    "curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": "
    "\"pirate\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of Germany?\"}], "
    "\"max_tokens\": 32}'": Case(r'"model":\s*"pirate",[^\[]*"choices":\[\{"index":0,"message":\{"role":"assistant"'),
    # docs/control.md
    'loramux run --control-vector examples/vectors/happy.gguf:0.25 -p "My week at work was"':
        Case(r"^My week at work was", "gemma"),
    'loramux run --control-vector happy.gguf:0.25 --control-vector formal.gguf:0.5 --control-vector-layers 6-14 '
    '-p "..."': Case(r"^\.\.\.", "gemma"),
    "loramux cvec train --positive happy.txt --negative sad.txt -o happy.gguf": Case(r"^wrote happy\.gguf: \d+ layers"),
    # docs/convert.md
    "loramux convert ./my-peft-adapter --base gemma-3-270m-q4_k_m.gguf -o my-adapter.gguf":
        Case(r"wrote: my-adapter\.gguf"),
    "loramux convert ./my-peft-adapter --base base.gguf -o my-adapter.gguf --outtype f16":
        Case(r"wrote: my-adapter\.gguf"),
    "loramux convert ./my-peft-adapter --base base.gguf -o x.gguf --dry-run": Case(r"^would write: -\n.*14 targets"),
    "loramux export-peft my-adapter.gguf ./peft-out --base base.gguf --base-model google/gemma-3-270m":
        Case(r"wrote peft-out/adapter_config\.json"),
    "loramux merge base.gguf --lora style.gguf:0.5 --lora domain.gguf -o merged.gguf":
        Case(r"style\.gguf ×0\.5, domain\.gguf ×1"),
    "loramux merge base.gguf --lora style.gguf -o merged.gguf --quant Q8_0": Case(r"Q8_0"),
    # docs/distributed.md
    "loramux rpc-worker --host 10.0.0.2 --port 50052 --threads 16": Case(r"127\.0\.0\.2:50052"),
    "loramux rpc-worker --host 10.0.0.2 --cache /var/cache/loramux-rpc --cache-max-bytes 68719476736":
        Case(r"127\.0\.0\.2:50052"),
    "loramux rpc-worker --host 10.0.0.2 --cache /var/cache/loramux-rpc --cache-sealed": Case(r"127\.0\.0\.2:50052"),
    "loramux serve big.gguf --rpc 10.0.0.2:50052,10.0.0.3:50052 --lora style=adapters/style.gguf":
        Case(SERVE + r"[\s\S]*style"),
    "serve run loramux.ray:app": Case(r"(?i)deployed|running", "gemma"),
    "serve run loramux.ray:build_app model=base.gguf adapters=a=/models/a.gguf,b=/models/b.gguf num_replicas=4":
        Case(r"(?i)deployed|running"),
    # docs/probe.md
    "loramux probe --threads 2": Case(r"^invariants: all hold"),
    "loramux probe --threads 2 --write probe-ref.json": Case(r"^wrote probe-ref\.json$"),
    "loramux probe --threads 2 --check probe-ref.json": Case(r"^probe matches probe-ref\.json \(exact"),
    "loramux probe --threads 2 --check other-build.json --rtol 0.02": Case(r"^probe matches other-build\.json \(rtol 0\.02"),
    "loramux probe --threads 2 --write refs/": Case(r"^wrote refs$"),
    "loramux probe --threads 2 --write src/loramux/data/probe_references/": Case(r"^wrote src/loramux/data/probe_references$"),
    # docs/scoring.md
    "loramux serve --lora style=style.gguf --n-ctx 2048": Case(SERVE + r", style"),
    "loramux eval items.jsonl --lora math=math.gguf --lora style=style.gguf --plot adapters.png":
        Case(r"^wrote adapters\.png"),
    # docs/server.md
    "loramux serve --lora pirate=adapters/pirate.gguf --lora formal=hf://owner/repo/formal.gguf:0.7 --parallel 8 "
    "--slots 8 --adapter-dir ./adapters": Case(SERVE + r", pirate, formal"),
    "curl http://127.0.0.1:8080/v1/models": Case(r'"id":\s*"pirate"'),
    "curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": "
    "\"pirate\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"max_tokens\": 16}'":
        Case(r'"model":\s*"pirate"'),
    "curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' -d '{\"messages\": "
    "[{\"role\": \"user\", \"content\": \"Hello!\"}], \"max_tokens\": 16, \"adapter_sets\": [{\"lora\": []}, "
    "{\"name\": \"pirate\", \"lora\": [{\"name\": \"pirate\", \"scale\": 0.8}]}]}'":
        Case(r'"adapter_set":"[^"]+"[\s\S]*"adapter_set":"pirate"'),
    "loramux serve --host 0.0.0.0 --allowed-hosts llm.internal,10.0.0.5 --api-key-file key.txt "
    "--admin-api-key-file admin-key.txt --adapter-dir ./adapters --max-queue 32 --write-timeout 10":
        Case(r"admin:   on"),
    "loramux serve --adapter-dir ./adapters --allow-remote-adapters --max-adapter-bytes 1073741824":
        Case(SERVE),
    "loramux serve --lora-dir ./adapters --max-loaded 64": Case(SERVE + r", pirate, style"),
    # docs/llama-server.md
    "loramux serve --cors-origins http://localhost:5173": Case(SERVE),
    "curl http://127.0.0.1:8080/completion -H 'Content-Type: application/json' -d '{\"prompt\": \"The capital of "
    "France is\", \"n_predict\": 8}'": Case(r'"content":"(?:[^"\\]|\\.)*","tokens":\[\],"id_slot":-1,"stop":true'),
    # docs/train.md
    "python examples/online_learning.py --steps 3 --threads 1": Case(r"step 3: .*pushed version \d+; sample on "
                                                                     r"version \d+"),
    "loramux train zo --data examples/data/captain_train.jsonl --eval examples/data/captain_eval.jsonl "
    "-o captain.gguf --steps 120 --log captain.csv --plot captain.png": Case(r"^wrote captain\.png$"),
    "loramux run --lora captain.gguf --chat -p \"Hi, I'm Jonas.\"": Case(r"\S"),
    # `loramux --help`
    "loramux run --lora style.gguf:0.5 --lora hf://owner/repo/domain.gguf -p \"Hello\"": Case(r"^Hello"),
    'loramux run --chat -p "Write a haiku about llamas"': Case(r"\S", "gemma"),
    "loramux inspect adapter.gguf --factors": Case(r"^kind: lora adapter$[\s\S]*^  blk\.1\.ffn_down\.weight "),
    "loramux serve": Case(SERVE + r", pirate", "gemma"),
    "loramux <command> --help": Case(r"usage: loramux run"),
    # `loramux run --help`
    "loramux run --lora style.gguf:0.5 -p 'Once upon a time'": Case(r"^Once upon a time"),
    # `loramux inspect`, `pull`
    "loramux pull https://example.org/style.gguf#sha256=<64 hex>": Case(r"style\.gguf\s*$"),
    "loramux pull hf://owner/repo/adapters/style.gguf@v1.0": Case(r"style\.gguf\s*$"),
    "loramux pull ./local.gguf": Case(r"local\.gguf\s*$"),
    # `loramux convert/export-peft/merge --help`
    "loramux convert ./my-peft-adapter --base gemma-3-270m.gguf -o my-adapter.gguf": Case(r"wrote: my-adapter\.gguf"),
    "loramux export-peft my-adapter.gguf ./my-peft-adapter --base base.gguf --base-model google/gemma-3-270m":
        Case(r"my-peft-adapter"),
    "loramux merge base.gguf --lora style.gguf -o merged.gguf": Case(r"merged\.gguf"),
    "loramux merge base.gguf --lora style.gguf:0.5 --lora domain.gguf -o merged.gguf --quant Q4_K_M":
        Case(r"Q4_K_M"),
    "loramux merge base.gguf --lora hf://owner/repo/style.gguf -o merged-f32.gguf --quant F32": Case(r"F32"),
    "loramux merge base.gguf --lora style.gguf -o merged.gguf --quant none": Case(r"merged\.gguf"),
    # `loramux serve --help`
    "loramux serve --lora pirate=adapters/pirate.gguf --parallel 4": Case(SERVE + r", pirate"),
    "loramux serve base.gguf --lora style=hf://owner/repo/style.gguf:0.5 --adapter-dir ./adapters --max-loaded 16 "
    "--api-key-file key.txt --admin-api-key-file admin.txt --host 0.0.0.0 --allowed-hosts llm.internal":
        Case(r"admin:   on"),
    "loramux serve --config deploy.toml": Case(SERVE + r", pirate, support-bot",
                                               env=(("LORAMUX_API_KEY", "user-key"),)),
    "loramux serve big.gguf --rpc 10.0.0.2:50052,10.0.0.3:50052": Case(SERVE),
    # `loramux rpc-worker --help`
    "loramux rpc-worker": Case(r"127\.0\.0\.1:50052"),
    "loramux rpc-worker --host 10.0.0.2 --port 50052 --threads 16 --cache": Case(r"127\.0\.0\.2:50052"),
    # `loramux eval --help`
    "loramux eval items.jsonl --lora a.gguf --lora b.gguf": Case(r"^b\s+\d+\.\d%"),
    "loramux eval items.jsonl --lora math=hf://me/adapters/math.gguf --plot adapters.png": Case(r"^wrote adapters\.png"),
    "loramux eval items.jsonl base.gguf --lora x.gguf --no-base --json": Case(r'"results": \[\{"adapter": "x"'),
    # `loramux probe --help`
    "loramux probe --threads 2 --write ref.json": Case(r"^wrote ref\.json$"),
    "loramux probe --threads 2 --check ref.json": Case(r"^probe matches ref\.json \(exact"),
    # on the tiny model no shipped reference fits: the refusal; tests/test_package.py checks the default model
    "loramux probe --threads 2 --check shipped": Case(r"no committed probe reference is for this model file", rc=2),
    "loramux probe base.gguf --lora my-adapter.gguf --markdown": Case(r"^\| `base` \| no adapter \|"),
    # `loramux drift --help`
    "loramux drift --lora style.gguf": Case(r"^mean KL\(base ‖ adapter\) = "),
    "loramux drift --lora style.gguf --scale 0.5 --json": Case(r'"scale":\s*0\.5'),
    "loramux drift base.gguf --lora a.gguf --prompts my_prompts.txt --max-tokens 48": Case(r"over 2 prompts"),
    # `loramux train zo --help`
    "loramux train zo --data examples/data/captain_train.jsonl --eval examples/data/captain_eval.jsonl "
    "-o captain.gguf --steps 300 --log captain.csv --plot captain.png": Case(r"^wrote captain\.png$"),
    "loramux train zo --data train.jsonl -o out.gguf --steps 600 --resume out.ckpt-000300.json":
        Case(r"^wrote out\.gguf"),
    "loramux run --lora captain.gguf --chat -p \"Hi, I'm Ana.\"": Case(r"\S"),
    # `loramux cvec train --help`
    "loramux run --control-vector happy.gguf:0.25 -p 'My week at work was'": Case(r"^My week at work was"),
    # `loramux bench --help`
    "loramux bench --lora style.gguf --parallel 8": Case(r"^decode, 8 streams\s+\d"),
}

# Text standing for the reader's world → what runs instead, and why. Applied to every command before it runs.
PLACEHOLDERS: dict[str, tuple[Callable[[Run], str], str]] = {
    "10.0.0.2": (lambda r: "127.0.0.2", "worker hosts: other loopback addresses of this machine"),
    "10.0.0.3": (lambda r: "127.0.0.3", "worker hosts: other loopback addresses of this machine"),
    "--host 0.0.0.0": (lambda r: "--host 127.0.0.1", "tests listen on loopback only"),
    "https://example.org/style.gguf#sha256=<64 hex>": (lambda r: r.ws.url_for("style.gguf"),
                                                       "a local HTTP server serves the file"),
    "/models/": (lambda r: str(r.ws.dir) + "/", "the reader's adapter directory: this run's directory"),
    "/var/cache/loramux-rpc": (lambda r: str(r.ws.dir / "rpc-cache"), "the worker's cache: this run's directory"),
    "num_replicas=4": (lambda r: "num_replicas=2", "one replica per core: CI machines have 2"),
    "<command>": (lambda r: "run", "one command stands for all; each one's --help is run by test_cli.py"),
}

NOT_RUN: dict[str, str] = {
    "pip install -e .": "the install itself: .ci/run installs the checkout; tests/test_package.py installs the "
                        "built wheel into a fresh venv and runs loramux from there",
    'pip install -e ".[dev]"': "the install itself (.ci/run runs it)",
    'pip install "loramux[ray]"': "the install itself (the dev extra includes ray[serve])",
    "python -m pytest -q": "the test suite itself (.ci/run runs it)",
    "det=$(scripts/det-venv.sh)": ".ci/run runs it (it builds llama.cpp once more, about 8 minutes)",
    "LORAMUX_DET_PYTHON=$det python -m pytest -q": "the test suite itself (.ci/run runs it)",
    'CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36':
        "rebuilds llama.cpp (minutes); scripts/det-venv.sh builds this variant for the RPC tests",
    'CMAKE_ARGS="-DGGML_LLAMAFILE=OFF" pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36':
        "rebuilds llama.cpp (minutes); scripts/det-venv.sh builds this variant for the deterministic tests",
    "HF_HUB_OFFLINE=1 lm_eval --model local-completions --model_args model=style,base_url=http://127.0.0.1:8080/"
    "v1/completions,tokenizer_backend=remote,num_concurrent=8,max_length=2048 --tasks hellaswag":
        "hellaswag is a Hub dataset and CI has no Hub; tests/test_lm_eval.py runs lm-eval's local-completions "
        "against loramux serve on a local task",
    **{f"python -m pytest -q {files}": "test files of this suite (.ci/run runs them with the rest)" for files in (
        "tests/test_adversarial.py", "tests/test_fair_share.py", "tests/test_security.py", "tests/test_ray.py",
        "tests/test_tokenize_queue.py tests/test_rpc_hostile.py tests/test_rpc_cache.py",
        "tests/test_api_fuzz.py tests/test_fuzz_gguf.py tests/test_gguf_bounds.py")},
    'ANTHROPIC_BASE_URL=http://127.0.0.1:8080 ANTHROPIC_API_KEY=- claude -p "Say hi" --model pirate':
        "Claude Code's turn takes minutes on 2 cores; tests/test_claude_code.py runs it when `claude` is installed",
    'codex exec --skip-git-repo-check "say hi"': "tests/test_codex.py runs this turn against loramux serve with the "
                                                   "pinned Codex CLI, which .ci/run installs",
    "python examples/train_zo_example.py --threads 1 --out-dir /tmp/zo/captain4":
        "a 7-minute training run on the default model; the same loop runs in tests/test_train.py on the tiny model",
    "python benchmarks/zo_step.py --threads 1 --steps 10 --batch 2":
        "a benchmark (over 2 minutes); its numbers are a measured report, not a check",
}

PROBE_TEXT = "the cat sat on the mat\nhello world\n"


# ------------------------------------------------------------------------------------------ fixtures
def _probe_ref(ws: fx.Workspace, path: Path) -> Path:
    """A probe reference of this build for the workspace's model (stands for one of another build)."""
    ws_env = dict(os.environ, LORAMUX_MODEL=str(ws.model))
    subprocess.run([str(BIN / "loramux"), "probe", "--threads", "2", "--write", str(path)], env=ws_env,
                   check=True, capture_output=True, timeout=TIMEOUT)
    return path


def _deploy_toml(ws: fx.Workspace, path: Path) -> Path:
    """deploy/deploy.toml as shipped, but listening on loopback and reading its adapters from ./adapters."""
    adapters = ws.file("adapters")
    fx.lora(2, 13)(ws, adapters / "support-bot.gguf")
    text = (fx.ROOT / "deploy" / "deploy.toml").read_text(encoding="utf-8")
    assert 'host = "0.0.0.0"' in text and '"/adapters/' in text
    path.write_text(text.replace('host = "0.0.0.0"', 'host = "127.0.0.1"').replace('"/adapters', '"adapters'),
                    encoding="utf-8")
    return path


def _checkpoint(ws: fx.Workspace, path: Path) -> Path:
    """The checkpoint `train zo ... --steps 600 --resume out.ckpt-000300.json` continues from: what a 600-step
    run of the same settings leaves at step 300 (as if it had been stopped there)."""
    data = ws.file("train.jsonl")
    subprocess.run([str(BIN / "loramux"), "train", "zo", str(ws.model), "--data", str(data), "-o",
                    str(ws.dir / "out.gguf"), "--steps", "600", "--checkpoint-every", "300"],
                   check=True, capture_output=True, timeout=TIMEOUT, cwd=ws.dir)
    assert path.exists(), sorted(p.name for p in ws.dir.iterdir())
    return path


FILES: dict[str, fx.Maker] = {
    "style.gguf": fx.lora(2, 1), "domain.gguf": fx.lora(4, 2, alpha=8.0), "formal.gguf": fx.lora(2, 5),
    "a.gguf": fx.lora(2, 6), "b.gguf": fx.lora(4, 7), "x.gguf": fx.lora(2, 8), "math.gguf": fx.lora(2, 9),
    "adapter.gguf": fx.lora(2, 10), "local.gguf": fx.lora(2, 11), "my-adapter.gguf": fx.lora(2, 12),
    "base.gguf": fx.copy_model, "big.gguf": fx.copy_model, "gemma-3-270m.gguf": fx.copy_model,
    "gemma-3-270m-q4_k_m.gguf": fx.copy_model,
    "adapters": fx.adapter_dir("pirate", "style"),
    "my-peft-adapter": fx.peft_dir,
    "train.jsonl": fx.jsonl(fx.TRAIN),
    "items.jsonl": fx.jsonl([{"prompt": "2 + 2 =", "choices": [" 4", " 5"], "answer": 0},
                             {"prompt": "the cat sat on the", "choices": [" mat", " moon"], "answer": 0}]),
    "happy.txt": fx.text("I love this!\nWhat a wonderful day.\n"),
    "sad.txt": fx.text("I hate this.\nWhat a terrible day.\n"),
    "my_prompts.txt": fx.text(PROBE_TEXT),
    "key.txt": fx.text("user-key\n"), "admin-key.txt": fx.text("admin-key\n"), "admin.txt": fx.text("admin-key\n"),
    "deploy.toml": _deploy_toml,
    "examples/vectors/happy.gguf": fx.repo_file("examples/vectors/happy.gguf"),
    "examples/data/captain_train.jsonl": fx.repo_file("examples/data/captain_train.jsonl"),
    "examples/data/captain_eval.jsonl": fx.repo_file("examples/data/captain_eval.jsonl"),
    "examples/online_learning.py": fx.repo_file("examples/online_learning.py"),
    "other-build.json": _probe_ref,
    "out.ckpt-000300.json": _checkpoint,
}
# docs/control.md's happy.gguf and formal.gguf are control vectors (the shipped one, and a random one).
CONTROL_FILES: dict[str, fx.Maker] = {"happy.gguf": fx.repo_file("examples/vectors/happy.gguf"),
                                      "formal.gguf": fx.control_vector}


# ------------------------------------------------------------------------------------------ running
class NeedsRpc(Exception):
    """The command needs llama.cpp's RPC backend, which this venv's build lacks (LORAMUX_DET_PYTHON unset)."""


@dataclass
class Service:
    """A server a command started, and the address it answers on."""

    command: str
    proc: subprocess.Popen[bytes]
    address: tuple[str, int]
    log: Path

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


@dataclass
class Run:
    """One document's (or one --help's) commands, run in order in one directory."""

    ws: fx.Workspace
    cache: Path
    models: dict[str, Path]  # what Case.model names: "tiny", "gemma"
    services: list[Service] = field(default_factory=list)
    done: list[str] = field(default_factory=list)

    def env(self, case: Case) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
               "LORAMUX_API_KEY", "LORAMUX_ADMIN_API_KEY", "LORAMUX_MODEL") and "proxy" not in k.lower()}
        env.update(LORAMUX_CACHE=str(self.cache), HF_HOME=str(self.ws.dir / ".hf"), PYTHONUNBUFFERED="1",
                   HF_ENDPOINT=f"http://127.0.0.1:{self.ws.hub.port}", HF_HUB_DISABLE_PROGRESS_BARS="1",
                   OMP_WAIT_POLICY="PASSIVE", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        if case.model == "tiny":
            env["LORAMUX_MODEL"] = str(self.ws.model)
        env.update(case.env)
        return env

    def argv(self, command: str) -> list[str]:
        text = command
        for placeholder, (make, _why) in PLACEHOLDERS.items():
            if placeholder in text:
                text = text.replace(placeholder, make(self))
        argv = shlex.split(text)
        if argv[0] == "loramux" and ("rpc-worker" in argv or "--rpc" in argv):
            if not DET:
                raise NeedsRpc(command)
            argv[0] = str(Path(DET).parent / "loramux")
        elif argv[0] in ("loramux", "serve"):
            argv[0] = str(BIN / argv[0])
        return argv

    def stop_services(self, address: tuple[str, int] | None = None) -> None:
        """Stop every server (or the one at `address`, and the servers that use it as an RPC worker)."""
        def uses(s: Service) -> bool:
            return address is None or s.address == address or (
                "--rpc" in s.proc.args and f"{address[0]}:{address[1]}" in s.proc.args[s.proc.args.index("--rpc") + 1])
        for s in [s for s in self.services if uses(s)]:
            s.stop()
            self.services.remove(s)


def _listens(address: tuple[str, int]) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(address, timeout=0.5):
        return True
    return False


def _service_address(argv: list[str], cwd: Path) -> tuple[str, int] | None:
    """Where a server command listens, or None for a command that runs to its end."""
    def opt(name: str, default: str) -> str:
        return argv[argv.index(name) + 1] if name in argv else default
    if argv[1:2] == ["serve"] and Path(argv[0]).name == "loramux":
        conf = tomllib.loads((cwd / opt("--config", "")).read_text()) if "--config" in argv else {}
        return opt("--host", conf.get("host", "127.0.0.1")), int(opt("--port", conf.get("port", 8080)))
    if argv[1:2] == ["rpc-worker"]:
        return opt("--host", "127.0.0.1"), int(opt("--port", "50052"))
    if Path(argv[0]).name == "serve" and argv[1:2] == ["run"]:
        return "127.0.0.1", 8000
    return None


def _start(run: Run, command: str, argv: list[str], case: Case, address: tuple[str, int]) -> Service:
    run.stop_services(address)
    deadline = time.monotonic() + 120  # a stopped server's helpers (Ray's proxy actor) may hold it a while
    while _listens(address):
        assert time.monotonic() < deadline, f"`{command}`: {address[0]}:{address[1]} is taken by another program"
        time.sleep(0.5)
    for endpoint in argv[argv.index("--rpc") + 1].split(",") if "--rpc" in argv else ():
        host, port = endpoint.rsplit(":", 1)
        if not any(s.address == (host, int(port)) for s in run.services):  # the page's other worker host
            worker = f"loramux rpc-worker --host {host} --port {port}"
            _start(run, worker, run.argv(worker), case, (host, int(port)))
    log = run.ws.dir / f".service-{len(run.done)}-{address[1]}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=run.ws.dir, env=run.env(case), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    service = Service(command, proc, address, log)
    run.services.append(service)
    deadline = time.monotonic() + TIMEOUT
    while not _ready(service):
        assert proc.poll() is None, f"`{command}` exited {proc.returncode} before listening:\n{service.output()}"
        assert time.monotonic() < deadline, f"`{command}` did not listen in {TIMEOUT:.0f} s:\n{service.output()}"
        time.sleep(0.25)
    return service


def _ready(service: Service) -> bool:
    if not _listens(service.address):
        return False
    if Path(service.proc.args[0]).name == "serve":  # Ray's proxy listens before the app is deployed
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"http://127.0.0.1:{service.address[1]}/v1/models", timeout=10).status_code == 200
        return False
    return "rpc-worker" in service.proc.args or "listening on" in service.output()


def _ask(run: Run, service: Service) -> None:
    """One chat request to a server a command started, as a client of it would send: its first adapter,
    with the API key and Host name the command configured."""
    argv = service.proc.args
    if "rpc-worker" in argv:
        return  # asked through the `serve --rpc` that uses it
    headers = {}
    key = dict(COMMANDS[service.command].env).get("LORAMUX_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if "--api-key-file" in argv:
        key = (run.ws.dir / argv[argv.index("--api-key-file") + 1]).read_text().strip()
        headers["Authorization"] = f"Bearer {key}"
    if "--allowed-hosts" in argv:
        headers["Host"] = argv[argv.index("--allowed-hosts") + 1].split(",")[0]
    if Path(argv[0]).name == "serve":  # Ray: the catalog's first adapter, else the embedded model's example
        catalog = next((a.split("=", 1)[1] for a in argv if a.startswith("adapters=")), "pirate=")
        model = catalog.split("=", 1)[0]
    else:
        listed = re.search(r"models:  \S+ \(base\)(?:, ([^,\s]+))?", service.output())
        assert listed, service.output()
        model = listed[1] or listed[0].split()[1]
    url = f"http://127.0.0.1:{service.address[1]}/v1/chat/completions"
    body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
    r = httpx.post(url, json=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200, f"`{service.command}`: a chat on {model!r} answered {r.status_code}: {r.text}"
    reply = r.json()
    assert reply["model"] == model and isinstance(reply["choices"][0]["message"]["content"], str), reply


def run_command(run: Run, command: str) -> None:
    """Run one documented command as its Case says; a server is started, checked and left running."""
    case = COMMANDS[command]
    run.ws.model = run.models[case.model]
    run.ws.make_named(command)
    run.ws.serve_hub_sources(command)
    argv = run.argv(command)
    address = _service_address(argv, run.ws.dir)
    if address is not None:
        service = _start(run, command, argv, case, address)
        assert re.search(case.expect, service.output(), re.M), \
            f"`{command}` printed no match for {case.expect!r}:\n{service.output()}"
        _ask(run, service)
    else:
        p = subprocess.run(argv, cwd=run.ws.dir, env=run.env(case), capture_output=True, text=True,
                           timeout=TIMEOUT)
        out = f"{p.stdout}\n{p.stderr}"
        assert p.returncode == case.rc, f"`{command}` exited {p.returncode} (want {case.rc}):\n{out}"
        assert re.search(case.expect, p.stdout, re.M) or re.search(case.expect, out, re.M), \
            f"`{command}` printed no match for {case.expect!r}:\n{out}"
    run.done.append(command)


# ------------------------------------------------------------------------------------------ tests
SCRIPTS = all_scripts()
# One test per document (its blocks in order, in one directory) and one per --help with examples.
# A document whose every command is in NOT_RUN has nothing to run (test_every_command_is_run_or_listed
# still holds it to the tables).
GROUPS: dict[str, list[Script]] = {}
for _s in SCRIPTS:
    GROUPS.setdefault(_s.where.split(":L")[0], []).append(_s)
GROUPS = {g: ss for g, ss in GROUPS.items() if any(c not in NOT_RUN for s in ss for c in s.commands)}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory, gemma_path: Path) -> Path:
    """loramux's cache for the commands: empty but for the embedded model (linked, not assembled again)."""
    root = tmp_path_factory.mktemp("loramux-cache")
    target = root / "models" / gemma_path.name
    target.parent.mkdir(parents=True)
    try:
        os.link(gemma_path, target)
    except OSError:
        shutil.copyfile(gemma_path, target)
    return root


@pytest.fixture
def run(tmp_path: Path, tiny_model: Path, gemma_path: Path, cache: Path,
        request: pytest.FixtureRequest) -> Iterator[Run]:
    group = request.node.callspec.params["group"]
    work = tmp_path / "work"
    work.mkdir()
    hub = Server()
    files = dict(FILES)
    if group == "docs/control.md":
        files.update(CONTROL_FILES)
    with contextlib.ExitStack() as stack:
        stack.callback(hub.stop)
        r = Run(fx.Workspace(work, tiny_model, hub, stack, files), cache, {"tiny": tiny_model, "gemma": gemma_path})
        stack.callback(r.stop_services)
        yield r


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_documented_commands_run(group: str, run: Run) -> None:
    """Each command of the document (or --help) in order: exit status and one fact of its output; each
    server it starts answers one request."""
    skipped = []
    for script in GROUPS[group]:
        for command in script.commands:
            if command in NOT_RUN:
                continue
            try:
                run_command(run, command)
            except AssertionError as e:
                raise AssertionError(f"{script.where}: {e}") from None
            except NeedsRpc:
                skipped.append(command)
    if skipped:
        pytest.skip(f"{group}: {len(run.done)} commands ran; these need llama.cpp's RPC backend "
                    f"(set LORAMUX_DET_PYTHON, scripts/det-venv.sh): {skipped}")
    assert run.done, f"{group}: no command ran"


def test_every_command_is_run_or_listed() -> None:
    documented = {c for s in SCRIPTS for c in s.commands}
    assert documented - COMMANDS.keys() - NOT_RUN.keys() == set(), "documented commands with no Case or reason"
    assert (COMMANDS.keys() | NOT_RUN.keys()) - documented == set(), "table entries no document has any more"
    assert COMMANDS.keys() & NOT_RUN.keys() == set()
    text = "\n".join(documented)
    assert [p for p in PLACEHOLDERS if p not in text] == [], "placeholders no command uses"
    assert [n for n in FILES if n not in text] == [], "fixture files no command names"


def test_command_blocks_are_tagged() -> None:
    """A block of commands without a ```bash tag would escape the tests above."""
    assert untagged_command_blocks() == []


def test_every_server_command_is_asked() -> None:
    """The table's server commands are recognised as servers (started and asked), not run to an end."""
    servers = [c for c in COMMANDS if re.match(r"(loramux (serve|rpc-worker)|serve run)\b", c)]
    assert len(servers) >= 12
    for c in servers:
        argv = shlex.split(c)
        argv[0] = str(BIN / argv[0])
        assert _service_address(argv, fx.ROOT / "deploy") is not None, c
