"""EAGLE-3 with EAGLE-2 dynamic trees: the drafter, its head (``network``), the SpecForge / speculators formats (``interop``) and its training recipe."""
