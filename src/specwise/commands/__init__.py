"""The ``specwise`` subcommands that are not part of a layer below: ``generate`` and ``targets``."""
