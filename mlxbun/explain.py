"""`mlxbun explain`: the forward the universal graph runs for an arch or a checkpoint.

    explain("olmo2").text()                  # sized by the zoo's tiny config
    explain("zoo:llama@q4,head_dim=32")      # that zoo checkpoint's config.json
    explain("path/to/ckpt").as_dict()        # a checkpoint directory (or a hub repo id)

The listing itself is `mlxbun.models.universal.explain.explain_config`; this module turns the
names a user types into the config it explains.
"""

from __future__ import annotations

from pathlib import Path

from mlxbun.config import load_model_config
from mlxbun.config_reader import thaw
from mlxbun.errors import ConfigError, UnsupportedModelError
from mlxbun.locate import locate
from mlxbun.models.gemma3n.config import MODEL_TYPE as GEMMA3N
from mlxbun.models.gemma3n.explain import explain_gemma3n
from mlxbun.models.universal.explain import Explanation, explain_config
from mlxbun.models.universal.resolve import descriptor_for
from mlxbun.names import parse_model
from mlxbun.zoo import ARCHS, tiny_config

__all__ = ["Explanation", "explain"]


def explain(target: str | Path) -> Explanation:
    """Explain a model_type or zoo arch (`llama`, `zoo:llama`: sized by the zoo's tiny config), or
    a checkpoint: a directory (or its config.json), a repo in the local hub cache, or a zoo name
    with options (`zoo:llama@q4,head_dim=32`: that checkpoint's config)."""
    text = str(target)
    path = Path(text).expanduser()
    if text.startswith("zoo:"):
        spec = parse_model(text)
        if spec.variant is None and spec.seed is None and spec.head_dim is None:
            return _explain_arch(spec.value, text)
        path = locate(spec)
    elif path.exists() or "/" in text or path.suffix == ".json":
        if not path.exists():
            if parse_model(text).kind != "hub":
                raise ConfigError(f"{text}: no such checkpoint directory")
            path = locate(text)
    else:
        return _explain_arch(text, text)
    config = load_model_config(path)
    if config.model_type == GEMMA3N:  # a dedicated port (models/gemma3n/)
        return explain_gemma3n(thaw(config.raw_full), target=text,
                               source=f"{path / 'config.json' if path.is_dir() else path}")
    return explain_config(thaw(config.raw_full), target=text,
                          source=f"{path / 'config.json' if path.is_dir() else path}",
                          model_type=config.model_type)


def _explain_arch(arch: str, target: str) -> Explanation:
    if arch == GEMMA3N:
        return explain_gemma3n(tiny_config(arch), target=target,
                               source=f"the zoo's tiny config (mlxbun.zoo.tiny_config({arch!r}))")
    if arch not in ARCHS:  # (a zoo arch may name a wrapper's second text model: mistral3-ministral3)
        d = descriptor_for(arch)  # refuses unknown and not-covered model_types, naming them
        raise UnsupportedModelError(f"'{arch}' ({d.model_type}) has no zoo config to size it; "
                                    f"explain a checkpoint directory instead")
    return explain_config(tiny_config(arch), target=target,
                          source=f"the zoo's tiny config (mlxbun.zoo.tiny_config({arch!r}))")
