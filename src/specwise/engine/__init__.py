"""The engine: one speculative loop shared by every method.

``loop`` runs propose → verify in one target forward → accept → commit or roll back → observe;
``verify`` holds the pure acceptance maths, ``tree`` the draft-tree layouts, ``cache`` the KV cache
commit and rollback, ``target`` the adapter over an unmodified Hugging Face model, ``sampling`` the
per-position logits processing, ``types`` the data passed between them, ``drafter`` the interface
every method implements, and ``cost_model`` / ``timing`` the speedup model and the forward timing
it is calibrated with. Nothing here imports the drafters, training or the lab tools.
"""
