"""The one ctypes boundary of loramux: llama.cpp (through llama-cpp-python's low-level module) and ggml.

Everything above this module sees Python values and typed errors. This module:
- checks at import that the binding is the pinned llama-cpp-python (internals differ between builds);
- turns NULL handles and negative status codes into `BackendError(function=..., code=...)`;
- owns handle lifetimes (idempotent `close()`, context managers, callbacks kept referenced);
- mirrors `struct ggml_tensor` to find and rewrite adapter tensors in place, and checks the mirror
  against the library before any write;
- routes llama.cpp's log to Python `logging` (logger ``loramux.llama``, quiet unless configured).
"""

from __future__ import annotations

# One boundary split by concept (lib, tensors, callbacks, handles, rpc, sampling): the rest of loramux
# imports this package only (`from .. import _native as N`, then `N.name`), through these re-exports.
# Every submodule imports lib first, so the binding's version pin is checked before any native call.
from .callbacks import MatmulStops as MatmulStops
from .handles import KV_TYPES as KV_TYPES
from .handles import AdapterHandle as AdapterHandle
from .handles import Batch as Batch
from .handles import ContextHandle as ContextHandle
from .handles import ModelHandle as ModelHandle
from .handles import logits_view as logits_view
from .handles import memory_seq_cp as memory_seq_cp
from .lib import FTYPES as FTYPES
from .lib import PINNED_VERSION as PINNED_VERSION
from .lib import TILED_ENV as TILED_ENV
from .lib import binding_version as binding_version
from .lib import decode_floats as decode_floats
from .lib import enable_batch_invariant_kernels as enable_batch_invariant_kernels
from .lib import log as log
from .lib import model_quantize as model_quantize
from .lib import system_info as system_info
from .rpc import RPC_CONN_CAPS as RPC_CONN_CAPS
from .rpc import RPC_HELLO as RPC_HELLO
from .rpc import RPC_PROTO_MAJOR as RPC_PROTO_MAJOR
from .rpc import rpc_broken as rpc_broken
from .rpc import rpc_connected as rpc_connected
from .rpc import rpc_devices as rpc_devices
from .rpc import rpc_on_lost as rpc_on_lost
from .rpc import rpc_serve as rpc_serve
from .rpc import rpc_supported as rpc_supported
from .rpc import rpc_worker_devices as rpc_worker_devices
from .sampling import GRAMMAR_INVALID_CHARS as GRAMMAR_INVALID_CHARS
from .sampling import GRAMMAR_RESERVED_NAMES as GRAMMAR_RESERVED_NAMES
from .sampling import GREEDY_SCAN as GREEDY_SCAN
from .sampling import JSON_GBNF as JSON_GBNF
from .sampling import GrammarHandle as GrammarHandle
from .sampling import SamplerHandle as SamplerHandle
from .sampling import SchemaConverter as SchemaConverter
from .sampling import sampler_accept as sampler_accept
from .tensors import OP_MUL_MAT as OP_MUL_MAT
from .tensors import OP_SET_ROWS as OP_SET_ROWS
from .tensors import EvalCallback as EvalCallback
from .tensors import GgmlTensor as GgmlTensor
from .tensors import buffer_alignment as buffer_alignment
from .tensors import host_bytes as host_bytes
from .tensors import host_f32_view as host_f32_view
from .tensors import node_ne1 as node_ne1
from .tensors import node_op as node_op
from .tensors import node_place as node_place
from .tensors import node_src0 as node_src0
from .tensors import set_rows_parts as set_rows_parts
from .tensors import tensor_get as tensor_get
from .tensors import tensor_host_address as tensor_host_address
from .tensors import tensor_name as tensor_name
from .tensors import tensor_nbytes as tensor_nbytes
from .tensors import tensor_set as tensor_set
from .tensors import tensor_set_2d as tensor_set_2d
from .tensors import tensor_set_raw as tensor_set_raw
from .tensors import tensor_view as tensor_view
from .tensors import zero_rows as zero_rows

__all__ = ["FTYPES", "GRAMMAR_INVALID_CHARS", "GRAMMAR_RESERVED_NAMES", "GREEDY_SCAN", "JSON_GBNF", "KV_TYPES",
           "OP_MUL_MAT", "OP_SET_ROWS", "PINNED_VERSION", "RPC_CONN_CAPS", "RPC_HELLO", "RPC_PROTO_MAJOR",
           "TILED_ENV", "AdapterHandle", "Batch", "ContextHandle", "EvalCallback", "GgmlTensor", "GrammarHandle",
           "MatmulStops", "ModelHandle", "SamplerHandle", "SchemaConverter", "binding_version", "decode_floats",
           "buffer_alignment", "enable_batch_invariant_kernels", "host_bytes", "host_f32_view", "log", "logits_view",
           "memory_seq_cp", "model_quantize", "node_ne1", "node_op", "node_place", "node_src0", "rpc_broken",
           "rpc_connected", "rpc_devices", "rpc_on_lost", "rpc_serve", "rpc_supported", "rpc_worker_devices",
           "sampler_accept", "set_rows_parts", "system_info", "tensor_get", "tensor_host_address", "tensor_name",
           "tensor_nbytes", "tensor_set", "tensor_set_2d", "tensor_set_raw", "tensor_view", "zero_rows"]
