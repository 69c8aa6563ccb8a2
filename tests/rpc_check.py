"""Run by tests/test_rpc.py on a Python whose llama.cpp has RPC: the same requests on a local engine and on
one whose base is split over RPC workers; prints JSON with both answers per case.

    python tests/rpc_check.py MODEL A.gguf B.gguf HOST:PORT[,HOST:PORT...]

Cases: the base model; one adapter; a stack of two; after an in-place factor write; a control vector;
two requests on different adapters decoded together through the slot bank. Both engines run one thread
on F32 weights, so the two must agree token for token.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import loramux as lm
from loramux import _native as N
from loramux.engine.control import ControlVector

PROMPT = "the cat sat on"
GREEDY = {"max_tokens": 12, "temperature": 0.0}


def _cases(eng: lm.Engine, a: str, b: str) -> dict:
    eng.load_lora(a, "a")
    eng.load_lora(b, "b")
    out = {"base": eng.generate(PROMPT, **GREEDY).tokens,
           "adapter": eng.generate(PROMPT, loras={"a": 1.0}, **GREEDY).tokens,
           "stack": eng.generate(PROMPT, loras={"a": 0.7, "b": 0.5}, **GREEDY).tokens}
    ad = eng.adapter("a")
    name = ad.factor_names()[0]
    fa, fb = ad.get_factors(name)
    ad.set_factors(name, fa * 0.5, fb * 1.5)  # in place: ggml_backend_tensor_set (over RPC when remote)
    out["inplace"] = eng.generate(PROMPT, loras={"a": 1.0}, **GREEDY).tokens
    got = ad.get_factors(name)  # read back through ggml_backend_tensor_get
    out["readback_exact"] = bool(np.array_equal(got[0], fa * 0.5) and np.array_equal(got[1], fb * 1.5))
    e = eng.model.n_embd
    cv = ControlVector({1: (np.random.default_rng(3).standard_normal(e) * 2).astype(np.float32)}, "llama")
    eng.set_control_vector(cv, strength=1.0)
    out["control"] = eng.generate(PROMPT, **GREEDY).tokens
    eng.clear_control_vector()
    before = eng.stats().multi_seq_steps
    out["bank"] = [c.tokens for c in eng.generate_many([PROMPT, PROMPT], loras=[{"a": 1.0}, {"b": 1.0}], **GREEDY)]
    out["shared_steps"] = eng.stats().multi_seq_steps - before  # both decoded together
    out["bank_row_transfers"] = dict(eng.bank.transfers) if eng.bank is not None else {}
    return out


def main() -> None:
    model, a, b, endpoints = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    opts = {"n_ctx": 256, "n_threads": 1, "n_parallel": 2, "slots": 2, "slot_rank": 4, "kv_type": "f32"}
    res: dict = {"rpc_supported": N.rpc_supported()}
    with lm.Engine.load(model, **opts) as local:
        res["local"] = _cases(local, a, b)
    with lm.Engine.load(model, rpc=endpoints, **opts) as remote:
        # the adapters' tensors sit next to their layers: on the workers, not in host memory
        res["remote"] = _cases(remote, a, b)
        fac = next(iter(remote.adapter("a").factor_tensors().values()))
        res["adapter_on_host"] = N.tensor_host_address(fac.a) is not None
    print(json.dumps(res))


if __name__ == "__main__":
    main()
