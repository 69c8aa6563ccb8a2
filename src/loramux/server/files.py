"""Training files (admin plane), in the shape of OpenAI's files API:

    POST   /v1/files            multipart: file (JSONL), purpose "fine-tune"   → the file object
    GET    /v1/files            GET /v1/files/{id}            DELETE /v1/files/{id}

Bounded: one file at most --max-upload-bytes (guard.py), at most MAX_FILES files and MAX_TOTAL_BYTES
bytes kept. A file is checked on upload (UTF-8, one JSON object per line); whether its records are
training examples for this model is checked when a job names it (jobs.py). Files live in the jobs
directory and are forgotten when the server stops.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest

from .errors import APIError

MAX_FILES = 64
MAX_TOTAL_BYTES = 1 << 30
PURPOSES = ("fine-tune",)


@dataclass
class StoredFile:
    """One uploaded file (OpenAI's file object, plus where it is kept)."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"

    def body(self) -> dict[str, Any]:
        return asdict(self)


class FileStore:
    """The uploaded files of one server, kept under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[str, StoredFile] = {}

    def path(self, file_id: str, param: str = "file_id") -> Path:
        """Where a known file is kept; 404 naming `param` for an unknown id."""
        if file_id not in self.files:
            raise APIError(404, f"no file {file_id!r}; GET /v1/files lists them", code="file_not_found",
                           param=param)
        return self.root / f"{file_id}.jsonl"

    def add(self, data: bytes, filename: str, purpose: str) -> StoredFile:
        """Check and keep an upload: every problem is a 400 naming the file."""
        if purpose not in PURPOSES:
            raise APIError(400, f"purpose {purpose!r} is not supported here; use {PURPOSES[0]!r}",
                           code="invalid_purpose", param="purpose")
        if len(self.files) >= MAX_FILES or sum(f.bytes for f in self.files.values()) + len(data) > MAX_TOTAL_BYTES:
            raise APIError(429, f"at most {MAX_FILES} files and {MAX_TOTAL_BYTES} bytes are kept; delete some "
                                "(DELETE /v1/files/{id})", code="file_store_full")
        check_jsonl(data, filename)
        f = StoredFile("file-" + secrets.token_hex(12), len(data), int(time.time()), filename, purpose)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / f"{f.id}.jsonl").write_bytes(data)
        self.files[f.id] = f
        return f

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)
        del self.files[file_id]


def check_jsonl(data: bytes, filename: str) -> None:
    """UTF-8, and one JSON object per non-blank line; a 400 listing the first problems."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"{filename}: not UTF-8 ({e})", code="invalid_file", param="file") from None
    problems, n = [], 0
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        n += 1
        try:
            ok = isinstance(json.loads(line), dict)
        except ValueError as e:
            problems.append(f"line {i}: not JSON ({e})")
            continue
        if not ok:
            problems.append(f"line {i}: not a JSON object")
    if not n:
        problems.append("no records (JSONL: one JSON object per line)")
    if problems:
        raise APIError(400, f"{filename}: " + "; ".join(problems[:5]), code="invalid_file", param="file")


def add_routes(app: FastAPI, store: FileStore) -> None:
    """The /v1/files routes over `store`."""

    @app.post("/v1/files")
    async def upload(http: HTTPRequest) -> dict[str, Any]:
        try:
            form = await http.form(max_files=1, max_fields=4)
        except Exception as e:  # noqa: BLE001 - a malformed multipart body is the client's error
            raise APIError(400, f"the body is not multipart/form-data with a file: {e}", code="invalid_request",
                           param="file") from None
        unknown = sorted(set(form) - {"file", "purpose"})
        if unknown:
            raise APIError(400, f"{unknown[0]}: unknown field (file and purpose are taken)",
                           code="invalid_request", param=unknown[0])
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None or isinstance(upload, str):
            raise APIError(400, "file: missing (send the JSONL as the multipart field 'file')",
                           code="invalid_request", param="file")
        if not isinstance(purpose, str):
            raise APIError(400, "purpose: missing (send 'fine-tune')", code="invalid_request", param="purpose")
        data = await upload.read()
        return store.add(data, upload.filename or "data.jsonl", purpose).body()

    @app.get("/v1/files")
    async def list_files() -> dict[str, Any]:
        return {"object": "list", "data": [f.body() for f in store.files.values()]}

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str) -> dict[str, Any]:
        store.path(file_id)
        return store.files[file_id].body()

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> dict[str, Any]:
        store.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}


__all__ = ["MAX_FILES", "MAX_TOTAL_BYTES", "FileStore", "StoredFile", "add_routes", "check_jsonl"]
