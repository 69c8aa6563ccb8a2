"""`rpc-worker --cache`: the keeper that bounds and checks ggml-rpc's cache directory, on a real
directory written as ggml-rpc writes it (files named by 16 hex digits, one per cached upload). A peer
cannot grow it past its byte and file bounds, cannot replace an entry's bytes under the same name (a
FNV-1a collision), and cannot add anything to a sealed cache. The CLI refuses cache options that do
not apply."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from loramux.cli import main
from loramux.engine.rpc_cache import MANIFEST, CacheKeeper

OLD = 1_000_000_000  # a past mtime (s): what a finished write looks like a pass later


def put(d: Path, name: str, data: bytes, age: int = 0) -> Path:
    """An entry as ggml-rpc writes it; `age` orders entries (older first), all in the past."""
    p = d / name
    p.write_bytes(data)
    os.utime(p, (OLD + age, OLD + age))
    return p


def settle(k: CacheKeeper) -> None:
    """Two passes: the first sees new files, the second records those that did not change."""
    k.scan()
    k.scan()


def names(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()} - {MANIFEST}


def test_the_cache_stays_within_its_byte_and_file_bounds(tmp_path):
    for i in range(6):
        put(tmp_path, f"{i:016x}", bytes([i]) * 1000, age=i)
    k = CacheKeeper(tmp_path, max_bytes=3500, max_files=100, interval=0.01)
    settle(k)
    assert names(tmp_path) == {f"{i:016x}" for i in (3, 4, 5)} and k.deleted == 3  # the newest that fit
    for i in range(6, 9):
        put(tmp_path, f"{i:016x}", bytes([i]) * 10, age=i)
    k.max_files = 4
    settle(k)
    assert names(tmp_path) == {f"{i:016x}" for i in (5, 6, 7, 8)}
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert set(manifest) == names(tmp_path)
    assert manifest[f"{8:016x}"]["sha256"] == hashlib.sha256(bytes([8]) * 10).hexdigest()


def test_what_ggml_rpc_does_not_write_is_deleted(tmp_path):
    put(tmp_path, "notes.txt", b"x")
    put(tmp_path, "ABCDEF0123456789", b"x")  # ggml-rpc writes lower-case hex
    (tmp_path / "0123456789abcdee").mkdir()
    (tmp_path / "0123456789abcdef").symlink_to(tmp_path / "notes.txt")
    put(tmp_path, "00000000000000aa", b"kept")
    k = CacheKeeper(tmp_path, interval=0.01)
    settle(k)
    assert names(tmp_path) == {"00000000000000aa"}


def test_an_entry_whose_bytes_change_under_its_name_is_deleted(tmp_path):
    name = "1111111111111111"
    put(tmp_path, name, b"A" * 64)
    k = CacheKeeper(tmp_path, interval=0.01)
    settle(k)
    assert k.entries[name].sha256 == hashlib.sha256(b"A" * 64).hexdigest()
    put(tmp_path, name, b"A" * 64, age=1)  # written again with the same bytes (a client re-sending): kept
    settle(k)
    assert names(tmp_path) == {name}
    put(tmp_path, name, b"B" * 64, age=2)  # the same name, other bytes: a collision
    settle(k)
    assert names(tmp_path) == set() and name not in k.entries
    assert name not in json.loads((tmp_path / MANIFEST).read_text())


def test_a_sealed_cache_keeps_only_its_recorded_entries(tmp_path):
    keep, changed = "2222222222222222", "3333333333333333"
    put(tmp_path, keep, b"K" * 32)
    put(tmp_path, changed, b"C" * 32)
    settle(CacheKeeper(tmp_path, interval=0.01))  # filled by a trusted server
    put(tmp_path, changed, b"X" * 32, age=5)
    put(tmp_path, "4444444444444444", b"new")
    k = CacheKeeper(tmp_path, sealed=True, interval=3600).start()
    try:
        assert names(tmp_path) == {keep}  # the first pass ran before start() returned
        assert stat.S_IMODE(os.stat(tmp_path).st_mode) == 0o555
        assert stat.S_IMODE(os.stat(tmp_path / keep).st_mode) == 0o444
        assert (tmp_path / keep).read_bytes() == b"K" * 32
    finally:
        k.stop()
        os.chmod(tmp_path, 0o755)
    k = CacheKeeper(tmp_path, interval=0.01)  # unsealed again: writable again, the entry still known
    k.start().stop()
    assert os.stat(tmp_path).st_mode & stat.S_IWUSR and set(k.entries) == {keep}


def test_cli_cache_options(tmp_path, capsys):
    for argv in (["--cache-max-bytes", "5"], ["--cache-sealed"]):
        assert main(["rpc-worker", *argv]) == 2
        assert "only applies with --cache" in capsys.readouterr().err
    assert main(["rpc-worker", "--cache", str(tmp_path), "--cache-max-files", "0"]) == 2
    assert "--cache-max-files: must be a positive integer" in capsys.readouterr().err
