"""The theoretical speedup model of speculative decoding, its calibration on this machine, and plots
that check it against benchmark measurements (docs/design.md, Measuring; docs/algorithms.md §1.5).

The model itself (:mod:`specwise.engine.cost_model`) and the forward timing
(:mod:`specwise.engine.timing`, :mod:`specwise.drafters.timing`) live with the engine, which needs
them at run time; this package holds the overlay of measurements on the model, its plots and the
``specwise analyze`` command. Submodules are imported explicitly (``plots`` needs matplotlib).
"""
