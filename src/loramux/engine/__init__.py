"""The engine: one base model, its adapters and the engine thread that owns every llama.cpp context.

Inside, dependencies point one way: ``runtime`` (the public ``Engine``) ─► ``scheduler`` (continuous
batching) ─► ``bank`` (mixed-adapter slots) and ``registry`` (adapter sets) ─► ``adapters`` ─►
``factor_writer`` (the one way factors change) ─► ``factor_stage`` (their memory) ─► ``model`` (model
and contexts) ─► ``loramux._native``.
"""

__all__: list[str] = []  # the package's modules are imported by name; loramux itself re-exports Engine
