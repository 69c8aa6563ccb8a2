"""A small client for a loramux server's admin plane: factor pushes and training jobs.

::

    from loramux.client import Client
    c = Client("http://127.0.0.1:8000", api_key=ADMIN_KEY)
    v = c.push("style", {"blk.0.attn_q.weight": (A, B), ...})["version"]   # numpy or torch, one call
    job = c.create_job(c.upload_file("train.jsonl")["id"], suffix="mine", hyperparameters={"n_epochs": 1})
    c.wait(job["id"]); c.events(job["id"])

Generation goes through any OpenAI client (``base_url=URL + "/v1"``); responses name the adapter
versions that produced them (``adapter_versions`` and the ``x-loramux-adapter-versions`` header).
It needs only httpx and numpy (torch tensors are accepted when torch is installed).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import httpx

from .errors import ServerError
from .gguf_io.safetensors import dump_safetensors


def factor_tensors(factors: Mapping[str, Any]) -> dict[str, Any]:
    """{base tensor: (A, B)} as safetensors tensors (`<base>.lora_a` / `.lora_b`); tensors named already pass."""
    out: dict[str, Any] = {}
    for name, value in factors.items():
        if isinstance(value, (tuple, list)) and len(value) == 2:
            out[name + ".lora_a"], out[name + ".lora_b"] = value
        else:
            out[name] = value
    return out


class Client:
    """HTTP client of one server. `api_key`: the admin key (pushes and jobs are on the admin plane)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 120.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    def _json(self, r: httpx.Response) -> Any:
        try:
            body = r.json()
        except ValueError:
            body = r.text
        if r.status_code >= 400:
            raise ServerError(r.status_code, body)
        return body

    # -- factors -------------------------------------------------------------------------------
    def push(self, adapter: str, factors: Mapping[str, Any]) -> dict[str, Any]:
        """Replace factors of `adapter` in one request; returns {"version", "sha256", "servable_ms", ...}.

        `factors`: base tensor name → (A (r, in), B (out, r)), or tensors named as in a GGUF or by PEFT.
        """
        body = dump_safetensors(factor_tensors(factors))
        return self._json(self.http.put(f"/v1/adapters/{adapter}/factors", content=body,
                                        headers={"Content-Type": "application/octet-stream"}))

    def adapter(self, name: str) -> dict[str, Any]:
        """Rank, alpha, version and every target's factor shapes of a loaded adapter."""
        return self._json(self.http.get(f"/v1/adapters/{name}"))

    # -- files and jobs ------------------------------------------------------------------------
    def upload_file(self, data: str | os.PathLike[str] | bytes, purpose: str = "fine-tune",
                    filename: str = "data.jsonl") -> dict[str, Any]:
        """Upload JSONL training data (a path or bytes); returns the file object ({"id", ...})."""
        if not isinstance(data, bytes):
            filename = os.path.basename(os.fspath(data))
            with open(data, "rb") as f:
                data = f.read()
        return self._json(self.http.post("/v1/files", files={"file": (filename, data)}, data={"purpose": purpose}))

    def create_job(self, training_file: str, *, model: str | None = None, suffix: str | None = None,
                   hyperparameters: Mapping[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        """Start a fine-tuning job (OpenAI's fields; `model`: an adapter to continue, or the base)."""
        body = {"training_file": training_file, **fields}
        if model is not None:
            body["model"] = model
        if suffix is not None:
            body["suffix"] = suffix
        if hyperparameters is not None:
            body["hyperparameters"] = dict(hyperparameters)
        return self._json(self.http.post("/v1/fine_tuning/jobs", json=body))

    def job(self, job_id: str) -> dict[str, Any]:
        return self._json(self.http.get(f"/v1/fine_tuning/jobs/{job_id}"))

    def jobs(self) -> list[dict[str, Any]]:
        return self._json(self.http.get("/v1/fine_tuning/jobs"))["data"]

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._json(self.http.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", json={}))

    def events(self, job_id: str) -> list[dict[str, Any]]:
        """The job's events, oldest first (one per step with its loss)."""
        return list(reversed(self._json(self.http.get(f"/v1/fine_tuning/jobs/{job_id}/events",
                                                      params={"limit": 10000}))["data"]))

    def wait(self, job_id: str, timeout: float = 600.0, poll: float = 0.2) -> dict[str, Any]:
        """Poll until the job succeeded, failed or was cancelled; returns the job."""
        deadline = time.monotonic() + timeout
        while True:
            j = self.job(job_id)
            if j["status"] in ("succeeded", "failed", "cancelled"):
                return j
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {j['status']} after {timeout} s")
            time.sleep(poll)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Client", "factor_tensors"]
