"""DFlash: block diffusion drafting, its drafter network, the speculators / z-lab formats (``interop``) and its training recipe."""
