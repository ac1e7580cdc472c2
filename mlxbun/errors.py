"""The user-facing error hierarchy.

Every error a user can cause by their input (a bad file, an unknown model_type,
a bad argument) is an `MlxbunError` subclass whose message names the culprit
(file, key, tensor). The CLI prints these as one line, never a traceback.
"""


class MlxbunError(Exception):
    """Base class of every error mlxbun raises for bad input or refused work."""


class ConfigError(MlxbunError):
    """A config file is missing, malformed, or lacks a required key."""


class WeightsError(MlxbunError):
    """A safetensors file or shard index is unreadable or inconsistent."""


class LoadError(MlxbunError):
    """Weights do not match the graph (missing, unconsumed, wrong shape/dtype)."""


class TokenizerError(MlxbunError):
    """Tokenizer files are missing or malformed, or a chat template failed."""


class UnsupportedModelError(MlxbunError):
    """The model_type or a numerics-changing config key is not supported."""


class GenerationError(MlxbunError, ValueError):
    """A generation, sampling or KV-cache option is out of range or not supported."""
