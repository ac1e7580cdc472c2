"""kimi_vl's text model as mlx-vlm 0.7.10 runs it beside MoonViT (mlx_vlm/models/kimi_vl/language.py),
which is not mlx-lm's kimi_vl (deepseek_v3.py: absorbed MLA, whose checkpoints split kv_b_proj):
the kimi_vl text row (deepseek_v3's, behind language_model) with

- the expanded MLA of deepseek_v2 (kv_b_proj per head into k_nope | values, full keys and values
  cached, the string causal mask), deepseek's own yarn rope when rope_scaling is set, else a
  traditional rope;
- the experts' activation mlx-vlm's clipped_silu (silu clipped to +-100);
- with one expert group, the top k by argsort (ascending: the experts summed in that order).

Its checkpoints are mlx-vlm's (kv_b_proj kept); open_vlm builds this graph for kimi_vl, `open_model`
keeps mlx-lm's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping

from mlxbun.models.universal.kinds import ExpertKind, GroupGuard
from mlxbun.models.universal.kinds_mla import MlaKind, MlaRope
from mlxbun.models.universal.resolve import descriptor_for
from mlxbun.models.universal.schema import ArchDescriptor

__all__ = ["kimi_vl_text_descriptor", "open_kimi_vl_text"]


def kimi_vl_text_descriptor(config: Mapping) -> ArchDescriptor:
    """The kimi_vl row rebuilt as mlx-vlm's language model (`config`: the checkpoint's config.json)."""
    d = descriptor_for("kimi_vl", config)
    text = config.get("text_config") or {}
    rope = MlaRope.INITIALIZE if text.get("rope_scaling") is None else MlaRope.DEEPSEEK_YARN
    router = dataclasses.replace(d.moe.router, group_guard=GroupGuard.N_GROUP_GT_1_ARGSORT)
    return dataclasses.replace(
        d, mla=dataclasses.replace(d.mla, kind=MlaKind.EXPANDED, rope=rope),
        layers=dataclasses.replace(d.layers, mask_array=False),
        moe=dataclasses.replace(d.moe, expert=ExpertKind.GLU_CLIPPED, router=router),
        notes="kimi_vl as mlx-vlm runs it: expanded MLA (kv_b_proj), clipped-silu experts, an "
              "ungrouped top k by argsort")


def open_kimi_vl_text(path: Path):
    """The text RuntimeModel of a kimi_vl checkpoint with its tower (mlx-vlm's layout)."""
    from mlxbun.config import load_model_config
    from mlxbun.config_reader import thaw
    from mlxbun.models.universal.coverage import require_coverage
    from mlxbun.models.universal.loader import load_universal

    config = load_model_config(path)
    require_coverage(config.model_type, thaw(config.raw_full))
    return load_universal(path, config, descriptor=kimi_vl_text_descriptor(thaw(config.raw_full)))
