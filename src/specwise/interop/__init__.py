"""Drafters in other projects' formats: detect, import and export (docs/interop.md).

- :mod:`specwise.interop.formats`: which format a directory holds, and the method it drafts for;
- :mod:`specwise.interop.vocab`: draft vocabularies as ``d2t`` / ``t2d`` tables;
- :mod:`specwise.methods.eagle.interop`: EAGLE-3 heads as speculators (vLLM) and SpecForge / SGLang write them;
- :mod:`specwise.methods.dflash.interop`: DFlash drafters as speculators and z-lab write them;
- :mod:`specwise.methods.medusa.interop`: Medusa heads as FasterDecoding's Medusa writes them.
"""
