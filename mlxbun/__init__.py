"""mlxbun: a Jupyter-first research workbench for language-model inference on MLX."""

__version__ = "0.1.0"


def load_model_config(path):
    """Load a checkpoint directory's normalized TextConfig (see mlxbun.config)."""
    from mlxbun.config import load_model_config as _load

    return _load(path)


__all__ = ["load_model_config", "__version__"]


def open_model(path):
    """Open a checkpoint directory as a RuntimeModel (profile resolved first; see mlxbun.factory)."""
    from mlxbun.factory import open_model as _open

    return _open(path)


__all__ += ["open_model"]
