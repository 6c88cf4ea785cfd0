"""A draft language model: the drafter (a specwise checkpoint, an HF causal LM or a GGUF), the small LM it distils (``network``) and its recipe."""
