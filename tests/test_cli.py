"""The command line: run, inspect, pull, help — through loramux.cli.main in-process."""

from __future__ import annotations

import json

import pytest

from loramux.cli import main


def test_run_streams_text_with_adapters(tiny_model, tiny_dir, capsys):
    rc = main(["run", str(tiny_model), "--lora", f"{tiny_dir / 'a.gguf'}:0.5", "-p", "the cat", "-n", "6",
               "--threads", "2", "-v"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.startswith("the cat")
    assert "adapters: {'a': 0.5}" in err and "generated tokens" in err


def test_run_chat_and_bad_adapter(tiny_model, tiny_dir, capsys):
    assert main(["run", str(tiny_model), "--chat", "-p", "hello", "-n", "4", "-q"]) == 0
    rc = main(["run", str(tiny_model), "--lora", str(tiny_model), "-p", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and "base model, not an adapter" in err


def test_inspect_base_adapter_json(tiny_model, tiny_dir, capsys):
    assert main(["inspect", str(tiny_model)]) == 0
    out = capsys.readouterr().out
    assert "kind: base model" in out and "architecture: llama" in out
    assert main(["inspect", str(tiny_dir / "b.gguf"), "--factors", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rank"] == 4 and info["alpha"] == 2.0 and len(info["factors"]) == 14
    assert info["factors"][0]["a"] == [4, 64]


def test_pull_local_and_bad_form(tiny_dir, capsys):
    assert main(["pull", str(tiny_dir / "a.gguf")]) == 0
    assert capsys.readouterr().out.strip() == str(tiny_dir / "a.gguf")
    assert main(["pull", "s3://bucket/x.gguf"]) == 2
    assert "accepted forms" in capsys.readouterr().err


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("run", "inspect", "pull", "bench"):
        assert cmd in out
