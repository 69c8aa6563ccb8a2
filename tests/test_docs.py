"""Every ```python block of README.md and docs/*.md runs, for real, in a test of its own.

How a block runs (test id ``README.md:L31`` = the line of its opening fence):

- in a fresh temporary directory, made the current directory, holding every file the block names that
  FILES below knows how to make: adapters written for the block's base model under the names the docs
  use (style.gguf, domain.gguf, ...), the base model itself as base.gguf, a PEFT directory saved by PEFT,
  training data, the shipped example vector;
- ``hf://owner/repo/...`` sources are served by a real HTTP server on 127.0.0.1 that answers the Hub's
  resolve requests (HF_ENDPOINT points huggingface_hub at it). Addresses that stand for a server of the
  reader's (https://example.org/..., the OpenAI client's http://127.0.0.1:8080) are replaced in the block's
  text by the address of a real local server (SUBSTITUTIONS; every entry must match some block);
- on the tiny test model: ``loramux.config.default_model_path`` is patched to return it, so
  ``Engine.load()`` without a path and every other use of the embedded default model get the tiny model.
  A block marked ``<!-- doc-test: gemma (why) -->`` on the line before its fence runs on the real
  default model instead (marker ``gemma``); ``<!-- doc-test: skip (why) -->`` skips it. Each mark gives
  its reason.

Shell blocks do not run, but every ``loramux`` command line in a ```bash block is parsed by the real
argument parser, and every command named in README's "Command line" synopsis must exist.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import doc_fixtures
import pytest
from doc_commands import fenced_blocks
from doc_fixtures import (
    EVAL,
    TRAIN,
    adapter_dir,
    control_vector,
    copy_model,
    jsonl,
    lora,
    peft_dir,
    repo_file,
)
from http_fixture import Server

import loramux.config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!--\s*doc-test:\s*(?P<mode>[\w-]+)\s*(?:\((?P<reason>.*)\))?\s*-->\s*$")
MODES = ("gemma", "skip")


# ------------------------------------------------------------------------------------------ blocks
@dataclass(frozen=True)
class Block:
    doc: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    mode: str | None = None  # a doc-test mark on the line before the fence
    reason: str | None = None

    @property
    def id(self) -> str:
        return f"{self.doc}:L{self.line}"


def read_blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, each with the doc-test mark on the line above it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    for line, lang, body in fenced_blocks(path):
        mark = MARK.match(lines[line - 2].strip()) if line > 1 else None
        out.append(Block(str(path.relative_to(ROOT)), line, lang, "\n".join(body),
                         mark["mode"] if mark else None, (mark["reason"] or "").strip() or None if mark else None))
    return out


ALL_BLOCKS = [b for doc in DOCS for b in read_blocks(doc)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang in ("python", "py")]


def _param(b: Block):  # noqa: ANN202 - a pytest ParameterSet
    marks = []
    if b.mode == "gemma":
        marks = [pytest.mark.gemma]
    elif b.mode == "skip":
        marks = [pytest.mark.skip(reason=f"{b.id}: {b.reason}")]
    return pytest.param(b, id=b.id, marks=marks)


# ------------------------------------------------------------------------------------------ workspace
@dataclass
class Workspace(doc_fixtures.Workspace):
    """The directory a block runs in, its base model, and the local servers that stand in for remote ones."""

    server: str | None = None  # the block's loramux server, once started

    def openai_server(self) -> str:
        """A real loramux server on the block's model with the adapters the docs name (one per block); its URL."""
        if self.server is not None:
            return self.server
        import loramux as lm
        from loramux.server import ServerSettings, create_app, serve_in_thread

        eng = lm.Engine.load(self.model, n_ctx=2048, n_parallel=4, n_threads=2)  # tool prompts on the tiny vocabulary
        try:
            for name in SERVER_FILES:
                eng.load_lora(self.file(name), Path(name).stem)
            app = create_app(eng, ServerSettings(served_model_name=loramux.config.DEFAULT_MODEL_NAME),
                             own_engine=True)
        except BaseException:
            eng.close()
            raise
        srv = self.stack.enter_context(serve_in_thread(app))
        self.server = srv.url
        return srv.url


# Every file a sample names, by the name it uses; made only when the block's text mentions it.
FILES: dict[str, doc_fixtures.Maker] = {
    "style.gguf": lora(2, 1),
    "domain.gguf": lora(4, 2, alpha=8.0),
    "pirate.gguf": lora(2, 4),
    "formal.gguf": lora(2, 5),
    "base.gguf": copy_model,
    "adapters": adapter_dir("pirate"),
    "my-peft-adapter": peft_dir,
    "train.jsonl": jsonl(TRAIN),
    "eval.jsonl": jsonl(EVAL),
    "examples/vectors/happy.gguf": repo_file("examples/vectors/happy.gguf"),
}
# The adapters of the server that stands in for the reader's (docs/server.md's client sample).
SERVER_FILES = ("pirate.gguf", "formal.gguf")
# Files named by a block of docs/control.md are control vectors, not adapters.
CONTROL_FILES: dict[str, doc_fixtures.Maker] = {"formal.gguf": control_vector}

# Stand-ins for servers of the reader's: text in the block → its local replacement.
SUBSTITUTIONS: dict[str, Callable[[Workspace], str]] = {
    "https://example.org/style.gguf#sha256=…": lambda ws: ws.url_for("style.gguf"),
    "http://127.0.0.1:8080/v1": lambda ws: ws.openai_server() + "/v1",
    # the server's root, for the clients of Anthropic's and Ollama's APIs (after the /v1 form: same server)
    "http://127.0.0.1:8080": lambda ws: ws.openai_server(),
}


def prepare(block: Block, ws: Workspace) -> str:
    """Make the files the block names, serve its hf:// sources, and return its code with substitutions."""
    code = block.code
    if block.doc == "docs/control.md":
        ws.made.update({n: mk(ws, ws.dir / n) for n, mk in CONTROL_FILES.items() if n in code})
    ws.make_named(code)
    ws.serve_hub_sources(code)
    for text, make in SUBSTITUTIONS.items():
        if text in code:
            code = code.replace(text, make(ws))
    return code


@pytest.fixture
def workspace(request: pytest.FixtureRequest, tmp_path: Path, tiny_model: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[Workspace]:
    block: Block = request.node.callspec.params["block"]
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
                "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    gemma = block.mode == "gemma"
    model = loramux.config.default_model_path() if gemma else tiny_model
    monkeypatch.setenv("LORAMUX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if not gemma:
        monkeypatch.setattr(loramux.config, "default_model_path", lambda: tiny_model)
    run_dir = tmp_path / "work"
    run_dir.mkdir()
    monkeypatch.chdir(run_dir)
    hub = Server()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{hub.port}")
    with contextlib.ExitStack() as stack:
        stack.callback(hub.stop)
        yield Workspace(run_dir, model, hub, stack, FILES)


def _close_engines(namespace: dict[str, object]) -> None:
    """Close what a sample left open (a sample may end with the engine still in use)."""
    from loramux.engine.runtime import Engine

    for value in namespace.values():
        if isinstance(value, Engine) and not value.closed:
            value.close()


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("block", [_param(b) for b in PYTHON_BLOCKS])
def test_python_sample_runs(block: Block, workspace: Workspace) -> None:
    code = prepare(block, workspace)
    # Leading newlines put the block's lines at their line numbers in the doc, so a traceback names them.
    compiled = compile("\n" * block.line + code, str(ROOT / block.doc), "exec")
    namespace: dict[str, object] = {"__name__": "__doc_sample__"}
    try:
        exec(compiled, namespace)  # noqa: S102 - running the documentation is the point
    finally:
        _close_engines(namespace)
    # what the block fetched from "remote" sources really came over HTTP
    assert [p for p in workspace.hub.blobs if not workspace.hub.for_path(p)] == []


def test_samples_were_found() -> None:
    docs = {b.doc for b in PYTHON_BLOCKS}
    assert {"README.md", "docs/convert.md", "docs/server.md", "docs/train.md", "docs/control.md"} <= docs, docs
    assert len(PYTHON_BLOCKS) >= 10


def test_every_mark_is_known_and_gives_a_reason() -> None:
    for doc in DOCS:
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if "doc-test" not in line:
                continue
            m = MARK.match(line.strip())
            where = f"{doc.relative_to(ROOT)}:L{n}"
            assert m, f"{where}: malformed mark {line.strip()!r} (want <!-- doc-test: MODE (reason) -->)"
            assert m["mode"] in MODES, f"{where}: unknown mode {m['mode']!r} (known: {MODES})"
            assert (m["reason"] or "").strip(), f"{where}: a {m['mode']} mark must say why in parentheses"
            nxt = doc.read_text(encoding="utf-8").splitlines()[n]
            assert nxt.startswith("```python"), f"{where}: a mark must stand right before a ```python fence"


def test_every_substitution_and_fixture_file_is_used() -> None:
    code = "\n".join(b.code for b in PYTHON_BLOCKS)
    assert [t for t in SUBSTITUTIONS if t not in code] == []
    assert [n for n in FILES if n not in code and n not in SERVER_FILES] == []


# ------------------------------------------------------------------------------------------ command lines
def _parser():  # noqa: ANN202 - argparse.ArgumentParser
    from loramux.cli import build_parser

    return build_parser()


def _help(argv: list[str]) -> str | None:
    """`loramux ARGV --help` from the real parser: its text, or None when the parser refuses it."""
    sink = io.StringIO()
    with pytest.raises(SystemExit) as ei, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        _parser().parse_args([*argv, "--help"])
    return sink.getvalue() if ei.value.code == 0 else None


@dataclass(frozen=True)
class Synopsis:
    where: str
    command: tuple[str, ...]  # `cvec train [MODEL] ...` → ("cvec", "train")
    options: tuple[str, ...]  # every -x / --xyz it names


def synopses(block: Block) -> list[Synopsis]:
    """The `loramux ...` commands of an untagged (synopsis) block; `A | loramux B` holds two of them."""
    out = []
    for n, line in enumerate(block.code.splitlines(), block.line + 1):
        line = re.sub(r"\s+#\s.*$", "", line.strip().removeprefix("$ "))
        for seg in re.split(r"\s\|\s+(?=loramux\b)", line):
            words = seg.split()
            if not words or words[0] != "loramux":
                continue
            cmd = []
            for w in words[1:]:
                if not re.fullmatch(r"[a-z][a-z0-9-]*", w):
                    break
                cmd.append(w)
            opts = re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", seg)
            out.append(Synopsis(f"{block.doc}:L{n}", tuple(cmd), tuple(opts)))
    return out


SYNOPSIS_BLOCKS = [b for b in ALL_BLOCKS if not b.lang and re.search(r"(?m)^(\$ )?loramux\s", b.code)]


def test_readme_command_line_block_is_checked() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    heading = text[:text.index("## Command line")].count("\n") + 1
    block = next(b for b in read_blocks(ROOT / "README.md") if b.line > heading)
    assert block in SYNOPSIS_BLOCKS
    assert len({s.command for s in synopses(block) if s.command}) >= 12


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in SYNOPSIS_BLOCKS])
def test_synopsis_names_real_commands_and_options(block: Block) -> None:
    """Each command of the block is listed by `loramux --help`, and each option it names is in that
    command's own --help."""
    top = _help([])
    assert top is not None
    items = synopses(block)
    assert items, block.id
    for s in items:
        if s.command:
            assert re.search(rf"(?<![\w-]){re.escape(s.command[0])}(?![\w-])", top), \
                f"{s.where}: `loramux {s.command[0]}` is not in `loramux --help`"
        text = _help(list(s.command))
        assert text is not None, f"{s.where}: `loramux {' '.join(s.command)} --help` is refused"
        missing = [o for o in s.options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text)]
        assert not missing, f"{s.where}: `loramux {' '.join(s.command)}` has no option {missing}"


def _shell_commands(code: str) -> Iterator[list[str]]:
    """Every `loramux ...` command of a shell block, as argv (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    for line in joined.splitlines():
        for part in re.split(r"&&|\|\||;", line):
            words = shlex.split(part, comments=True)
            if words and words[0] == "loramux":
                yield words[1:]


SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in ("bash", "sh", "shell", "console")]


def test_shell_blocks_hold_commands() -> None:
    assert sum(1 for b in SHELL_BLOCKS for _ in _shell_commands(b.code)) >= 10


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in SHELL_BLOCKS])
def test_shell_sample_parses(block: Block) -> None:
    """The real argument parser accepts every loramux command of the block (options, choices, arity)."""
    for argv in _shell_commands(block.code):
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                _parser().parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{block.id}: `loramux {shlex.join(argv)}` is refused by the parser (exit {e.code})")


# ------------------------------------------------------------------------------------------ README vs CI
def test_readme_test_commands_are_what_ci_runs() -> None:
    """README's test command is .ci/run's, and both get the deterministic build from one script."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    det_test = (ROOT / "tests" / "test_deterministic.py").read_text(encoding="utf-8")
    script = ROOT / "scripts" / "det-venv.sh"
    shell = [ln for b in read_blocks(ROOT / "README.md") if b.lang == "bash" for ln in b.code.splitlines()]
    assert 'pip install -e ".[dev]" && python -m pytest -q' in shell
    ci_lines = [ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert 'python -m pip install --quiet -e ".[dev]"' in ci_lines and ci_lines[-1] == "python -m pytest -q"
    det = next(ln for ln in shell if "scripts/det-venv.sh" in ln)
    assert det.endswith("LORAMUX_DET_PYTHON=$det python -m pytest -q"), det
    assert 'LORAMUX_DET_PYTHON="$(scripts/det-venv.sh)"' in ci and "export LORAMUX_DET_PYTHON" in ci
    assert 'os.environ.get("LORAMUX_DET_PYTHON")' in det_test
    assert script.exists() and script.stat().st_mode & 0o111, "scripts/det-venv.sh must be executable"
    assert "wheels/llamafile-off" in script.read_text(encoding="utf-8")
