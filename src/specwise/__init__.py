"""specwise: lossless speculative decoding for Hugging Face causal LMs.

    import specwise
    target = specwise.load_target("gemma-3-270m")
    result = specwise.generate(target, "def quicksort(arr):", method="pld", max_new_tokens=128)
    result.text, result.token_ids, result.stats
"""

from specwise.api import build_drafter, generate, load_drafter
from specwise.drafters import METHODS, Drafter, register_drafter
from specwise.engine.sampling import SamplingConfig
from specwise.engine.target import Target, load_target
from specwise.engine.types import GenerationResult, Proposal, SpecStats
from specwise.errors import SpecwiseError

__all__ = [
    "METHODS", "Drafter", "GenerationResult", "Proposal", "SamplingConfig", "SpecStats",
    "SpecwiseError", "Target", "build_drafter", "generate", "load_drafter", "load_target", "register_drafter",
]
