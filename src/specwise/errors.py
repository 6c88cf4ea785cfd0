"""User-facing errors.

Every error that bad input can cause derives from :class:`SpecwiseError`; the CLI prints its
message as one sentence on stderr and exits non-zero, without a traceback.
"""

from __future__ import annotations


class SpecwiseError(Exception):
    """Base class of every error that the user can fix by changing their input."""


class ConfigError(SpecwiseError, ValueError):
    """An option is out of range or options contradict each other."""


class TargetLoadError(SpecwiseError):
    """A target model could not be found or loaded (missing path, unreadable file, bad format)."""


class PromptError(SpecwiseError, ValueError):
    """The prompt is empty or does not fit in the target's context."""


class DrafterError(SpecwiseError):
    """A drafter is unknown, missing weights, or incompatible with the target."""


class EngineError(SpecwiseError):
    """The engine failed on valid input (an internal fault, not the caller's): the server answers 500."""


class CapacityError(EngineError):
    """The engine has no room for this work now (cache cells or generations in use by others),
    though the input is valid: retry later; the server answers 503."""
