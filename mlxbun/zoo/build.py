"""The builder of the dense archs (the arch table's rows, held to mlx-lm): a validated
`variant`, then `build_files` writes its config, sharded weights and tokenizer in HF layout."""

from __future__ import annotations

from pathlib import Path

from mlxbun.zoo.archs import get_arch, tiny_config
from mlxbun.zoo.common import Variant, ZooArgumentError, check_dtype_and_seed, parse_quant, zoo_fingerprint


def variant(arch: str, *, quant=None, dtype: str = "float32", seed: int = 0, head_dim: int | None = None) -> Variant:
    get_arch(arch)  # UnsupportedModelError naming the known archs
    check_dtype_and_seed(dtype, seed)
    if head_dim is not None:
        check_head_dim(arch, head_dim)
    return Variant(arch, parse_quant(quant), dtype, seed, head_dim)


def _head_dim_owner(config: dict) -> dict:
    """The dict whose head_dim mlx-lm reads: a VLM wrapper's text_config when it carries one (the
    wrapper hands text_config to its text model: gemma3n, gemma3, mistral3), else the config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) and "head_dim" in text else config


def check_head_dim(arch: str, head_dim) -> None:
    """Only archs whose mlx-lm ModelArgs (or a wrapper's text model) read `head_dim` can widen
    their heads: elsewhere the key would be ignored and the checkpoint silently keep hidden/heads
    (an MLA arch never reads it for its heads)."""
    import inspect

    from mlx_lm.utils import _get_classes

    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ZooArgumentError(f"head_dim must be an even integer >= 2, got {head_dim!r}")
    from mlxbun.models.universal.table import DESCRIPTORS

    config = tiny_config(arch)
    d = DESCRIPTORS.get(config["model_type"])
    if d is not None and d.mla is not None:  # mistral4's ModelArgs reads head_dim, its MLA does not
        m = d.mla
        raise ZooArgumentError(
            f"zoo arch {arch!r}: multi-head latent attention sizes its heads by {m.nope_dim} + {m.rope_dim} "
            f"(q / k: {config[m.nope_dim]} + {config[m.rope_dim]}) and {m.v_dim or 'hidden_size // heads'} "
            "(values), never head_dim, so its heads cannot be widened")
    if _head_dim_owner(config) is not config:
        return
    _, args_class = _get_classes(config)
    if "head_dim" not in inspect.signature(args_class).parameters:
        raise ZooArgumentError(f"zoo arch {arch!r}: mlx-lm's {args_class.__module__} has no head_dim "
                               "setting, so its heads cannot be widened")


def build_files(v: Variant, out: Path, config_overrides: dict | None = None) -> None:
    """Write every file of variant `v` into the existing empty directory `out`; `config_overrides`
    (keys over the tiny config, e.g. wider MLA head dims for a bench) make an off-zoo variant."""
    from mlx_lm.utils import save_config

    from mlxbun.zoo import weights
    from mlxbun.zoo.tokenizer import write_tokenizer_files

    config = {**tiny_config(v.arch), **(config_overrides or {})}
    config["torch_dtype"] = v.dtype
    if v.head_dim is not None:
        _head_dim_owner(config)["head_dim"] = v.head_dim
    model = weights.build_model(config, v.seed)
    weights.cast(model, v.dtype)
    if v.quant is not None:
        config = weights.quantize(model, config, v.quant)
    weights.save_weights(model, out)
    save_config(config, out / "config.json")  # what mlx_lm.convert writes: sorted, indent 4
    write_tokenizer_files(out)


def cache_key() -> str:
    """The cache directory of the dense builds: the zoo fingerprint."""
    return zoo_fingerprint()
