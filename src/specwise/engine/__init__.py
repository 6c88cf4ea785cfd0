"""The engine: the decoding core, one speculative loop shared by every method and every target.

``loop`` runs propose → verify in one target forward → accept → commit or roll back → observe;
``step`` is the one-forward verification, ``verify`` and ``acceptance`` the pure acceptance maths,
``tree`` the draft-tree layouts, ``sampling`` the per-position logits processing, ``stopping`` the
stop rules, ``types`` the data passed between them, ``target`` and ``drafter`` the interfaces a
target and a method implement, and ``cost_model`` / ``timing`` the speedup model and the forward
timing it is calibrated with. The targets themselves live in :mod:`specwise.targets`. Nothing here
imports the targets, the drafters, training or the lab tools.
"""
