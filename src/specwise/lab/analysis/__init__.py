"""The theoretical speedup model of speculative decoding, its calibration on this machine, and plots
that check it against benchmark measurements (ARCHITECTURE.md §5, ALGORITHMS.md §1.5).

Submodules are imported explicitly (``specwise.engine.cost_model`` is pure numpy; ``calibrate`` needs
a target; ``plots`` needs matplotlib), so importing this package is light.
"""
