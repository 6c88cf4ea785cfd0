"""specwise: lossless speculative decoding for Hugging Face causal LMs.

    import specwise
    target = specwise.load_target("gemma-3-270m")
    result = specwise.generate(target, "def quicksort(arr):", method="pld", max_new_tokens=128)
    result.text, result.token_ids, result.stats

The names below are imported on first use (PEP 562), so ``import specwise`` and the command
line's ``--help`` load no model code.
"""

import importlib

#: public name -> the module that defines it
_EXPORTS = {
    "METHODS": "specwise.drafters",
    "Drafter": "specwise.drafters",
    "register_drafter": "specwise.drafters",
    "GenerationResult": "specwise.engine.types",
    "Proposal": "specwise.engine.types",
    "SpecStats": "specwise.engine.types",
    "SamplingConfig": "specwise.engine.sampling",
    "SpecwiseError": "specwise.errors",
    "Target": "specwise.targets.hf",
    "load_target": "specwise.targets.loading",
    "build_drafter": "specwise.api",
    "generate": "specwise.api",
    "generate_many": "specwise.many",
    "load_drafter": "specwise.api",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specwise' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
