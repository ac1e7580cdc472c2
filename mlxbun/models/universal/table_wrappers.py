"""The VLM wrappers whose mlx-lm file builds another file's text model and nothing else: each row
is that text model's row behind `names.wrapper`, with the wrapper's own ModelArgs and sanitize.

A wrapper's sanitize replaces the text row's (mlx-lm's wrapper `sanitize` does not call the text
model's unless it says so: mistral3 does, pixtral / qwen2_vl / qwen3_vl do not), so a key the
text model's sanitize would drop (a tied lm_head, a rotary buffer) is refused here as mlx-lm's
strict load refuses it. Vision and audio towers are never built: their weights are dropped by
the wrapper's rule and a call that needs them is refused (`UniversalDense.__call__`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mlxbun.models.universal.schema import ArchDescriptor, SanitizeRule

__all__ = ["wrapper_rows"]

_TOWERS = "the vision tower (the text model runs alone)"
# qwen2_vl / qwen3_vl: the towers popped at the top, transformers 5's model.language_model taken
# as the text model (model.visual with it), every other key moved under language_model
_QWEN_VL_KEYS = SanitizeRule("wrapper_keys", ("visual.", "vision_tower.", "model.visual."),
                             "the VLM wrapper: text weights under language_model")


def _wrap(text: ArchDescriptor, model_type: str, *, sanitize: tuple[SanitizeRule, ...],
          notes: str, fields: Mapping[str, Any] | None = None, **changes) -> ArchDescriptor:
    """`text`'s row behind language_model (its knobs, its ModelArgs fields plus the defaults the
    wrapper writes into text_config), with the wrapper's sanitize."""
    return dataclasses.replace(
        text, model_type=model_type, fields={**text.fields, **(fields or {})},
        names=dataclasses.replace(text.names, wrapper="language_model"),
        sanitize=sanitize, notes=notes, **changes)


def wrapper_rows(text: Mapping[str, ArchDescriptor]) -> list[ArchDescriptor]:
    return [
        # pixtral.py: llama's text model; __post_init__ sets tie_word_embeddings False and
        # num_attention_heads 32 unless text_config has it; sanitize pops the towers only
        _wrap(text["llama"], "pixtral",
              fields={"tie_word_embeddings": False, "num_attention_heads": 32},
              wrapper_sets={"tie_word_embeddings": False},
              sanitize=(SanitizeRule("drop_prefix", ("vision_tower.", "multi_modal_projector."),
                                     _TOWERS),),
              notes="pixtral: llama's text model behind the VLM wrapper (language_model.*; "
                    "text_config's args, heads 32 by default, always untied; the vision tower "
                    "and projector dropped, no other key renamed or dropped, as mlx-lm's "
                    "sanitize)."),
    ]
