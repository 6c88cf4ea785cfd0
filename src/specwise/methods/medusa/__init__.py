"""Medusa: the drafter, its heads (``network``), the static tree and its calibration, FasterDecoding's format (``interop``) and the training recipe."""
