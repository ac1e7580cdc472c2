"""The transformers configuration classes the zoo's rows start from (a row's `hf_config`),
imported without PyTorch's advisory and read with config validation chatter silenced."""

from __future__ import annotations

import contextlib
import os

__all__ = ["quiet_transformers", "transformers_config_class"]


def transformers_config_class(name: str):
    # transformers nags about PyTorch at import; the zoo only needs configuration classes
    key = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    saved = os.environ.get(key)
    os.environ[key] = "1"
    try:
        import transformers
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved
    return getattr(transformers, name)


@contextlib.contextmanager
def quiet_transformers():
    """Silence config validation chatter (hub-style keys transformers 5 does not know)."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
