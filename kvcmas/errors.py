"""Errors that reach the user as one line naming the problem (the CLI exits with status 2).

They live here, below every layer, so that any module can raise them and the CLI can catch
them all as :class:`KvcmasError` without importing the layers above it.
"""

from __future__ import annotations


class KvcmasError(Exception):
    """Bad input or a missing resource; the message names the field, file or value."""


class UsageError(KvcmasError):
    """Bad command-line input."""


class ConfigError(KvcmasError, ValueError):
    """A method's options are invalid (unknown option, wrong type, out of range)."""


class WorkflowError(KvcmasError, ValueError):
    """A workflow or request that cannot run."""


class ModelLoadError(KvcmasError, RuntimeError):
    """The model could not be found or read."""


class DeviceError(KvcmasError, RuntimeError):
    """The requested device is unknown, or this torch build or machine cannot run on it."""


class UnsupportedModelError(KvcmasError, ValueError):
    """The model's architecture or RoPE variant is one this runtime does not handle exactly."""


class DataMissingError(KvcmasError, RuntimeError):
    """A benchmark file is not on disk and could not be prepared."""
