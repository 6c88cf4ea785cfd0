"""The decoding methods, each found here rather than listed anywhere.

A training-free method is one module ``methods/<name>.py`` that registers its drafter. A trained
method is one folder ``methods/<name>/`` whose modules each play one role, found by name:

========== ================================================== ==========================
module     what it holds                                      who finds it
========== ================================================== ==========================
drafter    the ``Drafter``, registered by name with its       the method registry
           options dataclass (``register_drafter``)           (``specwise.METHODS``)
network    the torch module(s) of the drafter                 its drafter and recipe
interop    reading and writing other projects' formats:       ``specwise export`` and
           ``FORMATS`` (what it exports to), ``export(...)``, format detection
           ``recognize(config)`` (which configs are its)
recipe     the training recipe, registered by name            ``specwise train``
           (``register_recipe``)
========== ================================================== ==========================

A folder may hold other modules of its own (Medusa's tree and its calibration). Adding a method
edits nothing outside its module or folder. Another directory of method folders joins by being
added to this package's ``__path__`` (``specwise.methods.__path__.append(dir)``): the next lookup
finds its methods as it finds these. The finding is :mod:`specwise.discovery`'s (by the package's
name, so the layers that look methods up never import this package); this ``__init__`` is this
docstring alone, as each method folder's is.
"""
