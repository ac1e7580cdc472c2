"""Loading a DiffusionGemma checkpoint (HF or mlx-vlm-converted layout), audited: which
checkpoint tensor fills which parameter, and what the text graph drops and why."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxbun.errors import LoadError, UnsupportedModelError
from mlxbun.models.diffusion_gemma.config import load_config
from mlxbun.models.diffusion_gemma.model import DiffusionGemmaModel
from mlxbun.weight_audit import DropRule, WeightAudit
from mlxbun.weights import read_index

__all__ = ["checkpoint_name", "drop_rules", "load_diffusion_gemma"]

# checkpoint name -> module path: HF stores the fused expert tensors without ".weight"
_EXPERT_HF = re.compile(r"^(model\.decoder\.layers\.\d+\.experts\.(?:gate_up_proj|down_proj))$")


def checkpoint_name(param: str, present) -> str:
    """The checkpoint tensor that fills module parameter `param` (HF or mlx-converted name)."""
    if param.endswith(".weight") and _EXPERT_HF.match(param[: -len(".weight")]):
        hf = param[: -len(".weight")]
        return param if param in present and hf not in present else hf
    return param


def drop_rules():
    """Tensors a DiffusionGemma checkpoint carries that the text graph reads elsewhere or not at all."""
    return [
        DropRule(r"^lm_head\.weight$", "the head is tied to model.decoder.embed_tokens (as mlx-vlm)"),
        DropRule(r"rotary_emb", "precomputed RoPE tables; the graph computes RoPE itself"),
        DropRule(lambda n: n.startswith("model.encoder.language_model.") and not n.endswith(".layer_scalar"),
                 "encoder text weights are tied to the decoder's (only encoder layer_scalars are its own)"),
        DropRule(r"^model\.encoder\.(vision_tower|embed_vision)\.",
                 "the vision tower: this text-only graph does not take image input"),
    ]


def load_diffusion_gemma(path, *, lazy: bool = False) -> DiffusionGemmaModel:
    """Load a DiffusionGemma checkpoint directory (HF or mlx-vlm-converted layout), audited."""
    root = Path(path)
    config = load_config(root)
    index = read_index(root)
    quantized = [n for n in index.tensors if n.endswith(".scales")]
    if quantized:
        raise UnsupportedModelError(
            f"{root}: quantized DiffusionGemma checkpoints are not ported (e.g. {quantized[0]})"
        )
    model = DiffusionGemmaModel(config)
    params = dict(tree_flatten(model.parameters()))
    audit = WeightAudit(index, drop_rules())
    names = {}
    for p, a in params.items():
        name = checkpoint_name(p, index.tensors)
        names[name] = p
        audit.expect(name, a.shape)  # shapes only: the checkpoint's dtype is kept (as mlx-vlm)
    audit.check()
    arrays = index.load(list(names))
    try:
        model.load_weights([(names[n], a) for n, a in arrays.items()], strict=True)
    except ValueError as e:  # the audit should have caught it; never let mlx's error escape raw
        raise LoadError(f"{root}: {e}") from None
    if not lazy:
        mx.eval(model.parameters())
    model.eval()
    return model
