"""Targets behind the engine's interface (:class:`specwise.engine.target.DecodingTarget`).

``hf`` is a Hugging Face causal LM on torch (dense, or the GGUF's packed weights from ``native``)
with its KV cache (``kv_cache``); ``loading`` resolves aliases, directories and GGUF files into
one, ``aliases`` lists the packaged targets, ``chat`` renders chat templates.
"""
