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

from mlxbun.models.universal.kinds_sanitize import SanitizeOp
from mlxbun.models.universal.kinds_hybrid import GateUpLayout
from mlxbun.models.universal.schema import ArchDescriptor, SanitizeRule
from mlxbun.models.universal.schema_moe import StackExperts

__all__ = ["wrapper_rows"]

_TOWERS = "the vision tower (the text model runs alone)"
_MEDIA = "A call with pixel_values / input_embeddings is refused by name."
# qwen2_vl / qwen3_vl: the towers popped at the top, transformers 5's model.language_model taken
# as the text model (model.visual with it), every other key moved under language_model
_QWEN_VL_KEYS = SanitizeRule("wrapper_keys", ("visual.", "vision_tower.", "model.visual."),
                             "the VLM wrapper: text weights under language_model")


def _wrap(text: ArchDescriptor, model_type: str, *, sanitize: tuple[SanitizeRule, ...],
          notes: str, fields: Mapping[str, Any] | None = None, drop_fields: tuple[str, ...] = (),
          **changes) -> ArchDescriptor:
    """`text`'s row behind language_model (its knobs, its ModelArgs fields plus the defaults the
    wrapper writes into text_config, less those the wrapper's own text args lack), with the
    wrapper's sanitize."""
    kept = {k: v for k, v in text.fields.items() if k not in drop_fields}
    changes.setdefault("text_config_required", True)  # but qwen2_vl / qwen3_vl's from_dict
    return dataclasses.replace(
        text, model_type=model_type, fields={**kept, **(fields or {})},
        names=dataclasses.replace(text.names, wrapper="language_model"),
        sanitize=sanitize, notes=notes, **changes)


def _under_wrapper(rule: SanitizeRule) -> SanitizeRule:
    """A text row's rule as the wrapper's sanitize applies it to language_model's keys: a
    drop_prefix rule's prefixes under language_model (the other ops match anywhere in a key,
    or read names.wrapper)."""
    if rule.op is not SanitizeOp.DROP_PREFIX:
        return rule
    prefixes = (rule.arg,) if isinstance(rule.arg, str) else rule.arg
    return dataclasses.replace(rule, arg=tuple(f"language_model.{p}" for p in prefixes))


# mistral3: the towers dropped (either layout), transformers 5's model.language_model moved
_MISTRAL3_KEYS = SanitizeRule("wrapper_keys", ("vision_tower", "multi_modal_projector",
                                               "model.vision_tower", "model.multi_modal_projector"),
                              "the VLM wrapper: text weights under language_model")


def _mistral3(text: ArchDescriptor, notes: str, **changes) -> ArchDescriptor:
    """mistral3.py around `text`'s model: tie_word_embeddings False unless text_config sets it;
    its sanitize moves the keys, then calls the text model's."""
    return _wrap(text, "mistral3", fields={"tie_word_embeddings": False},
                 sanitize=(_MISTRAL3_KEYS, *text.sanitize), notes=notes, **changes)


def wrapper_rows(text: Mapping[str, ArchDescriptor]) -> list[ArchDescriptor]:
    return [
        # mistral3.py (llava remaps here): llama's text model, or ministral3's / mistral4's when
        # text_config.model_type says so
        _mistral3(text["llama"], post_init=("mistral3_llama_text", *text["llama"].post_init),
                  text_rows={"ministral3": _mistral3(
                      text["ministral3"],
                      "mistral3 with a ministral3 text_config: ministral3's text model behind the "
                      "VLM wrapper (language_model.*; untied unless text_config ties; the towers "
                      "dropped, then ministral3's sanitize)."),
                             "mistral4": _mistral3(
                      text["mistral4"],
                      "mistral3 with a mistral4 text_config: mistral4's MLA + MoE text model behind "
                      "the VLM wrapper (language_model.*; untied unless text_config ties; the towers "
                      "dropped, then mistral4's sanitize).")},
                  notes="mistral3 (and llava, remapped to it): llama's text model behind the VLM "
                        "wrapper (language_model.*; text_config's args, untied unless text_config "
                        "ties; the vision tower and projector dropped); a ministral3 text_config "
                        "runs ministral3's text model (yarn, llama-4 query scale) and a mistral4 "
                        "one mistral4's (MLA + MoE), as mlx-lm's wrapper picks them. " + _MEDIA),
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
                    "sanitize). " + _MEDIA),
        # qwen2_vl.py (qwen2_5_vl remaps here): qwen2's text model, text_config else the whole
        # config; an mrope rope_scaling is plain RoPE on text positions (initialize_rope)
        _wrap(text["qwen2"], "qwen2_vl", sanitize=(_QWEN_VL_KEYS,), text_config_required=False,
              notes="qwen2_vl (and qwen2_5_vl, remapped to it): qwen2's text model behind the VLM "
                    "wrapper (language_model.*; text_config's args, else the whole config's; "
                    "rope_scaling type mrope runs plain RoPE on the text positions, as mlx-lm's "
                    "initialize_rope; the vision tower dropped, transformers 5's "
                    "model.language_model moved; qwen2's own sanitize not applied, so a tied head "
                    "or a rotary buffer in the checkpoint is refused, as by mlx-lm). " + _MEDIA),
        # qwen3_vl.py: qwen3's text model, the same wrapper as qwen2_vl's
        _wrap(text["qwen3"], "qwen3_vl", sanitize=(_QWEN_VL_KEYS,), text_config_required=False,
              notes="qwen3_vl: qwen3's text model behind the VLM wrapper (language_model.*; "
                    "text_config's args, else the whole config's; the mrope sections (interleaved "
                    "or not) are not applied: plain RoPE on the text positions, as mlx-lm; the "
                    "vision tower (deepstack mergers with it) dropped, transformers 5's "
                    "model.language_model moved; a tied head in the checkpoint is refused, as by "
                    "mlx-lm). " + _MEDIA),
        # qwen3_vl_moe.py: qwen3_moe's text model (text_config required); its sanitize keeps
        # language_model.model / lm_head (either layout; the tower dropped) and splits HF's fused
        # experts ([E, D, 2I]); qwen3_moe's own sanitize (per-expert stacking, a tied head) is not
        # applied
        _wrap(text["qwen3_moe"], "qwen3_vl_moe",
              sanitize=(SanitizeRule("wrapper_keys", ("visual.", "vision_tower.", "model.visual."),
                                     "the VLM wrapper: text weights under language_model (mlx-lm's "
                                     "keeps language_model alone: mlx-vlm's vision_tower.* dropped too)"),
                        SanitizeRule("split_gate_up_experts", GateUpLayout.LAST_TRANSPOSED,
                                     "HF fused experts gate_up_proj [E, D, 2I] split, each "
                                     "expert matrix transposed")),
              # its sanitize needs an lm_head, which a tied qwen3_moe does not build: mlx-lm loads
              # no tied checkpoint, so none is run here either
              accepted_values={**text["qwen3_moe"].accepted_values, "tie_word_embeddings": (False,)},
              notes="qwen3_vl_moe: qwen3_moe's text model behind the VLM wrapper (language_model.*; "
                    "text_config's args; softmax top-k router, plain RoPE on text positions, the "
                    "mrope sections not applied); the vision tower dropped, transformers 5's "
                    "model.language_model moved, HF's fused experts gate_up_proj [E, D, 2I] split "
                    "and transposed as mlx-lm's sanitize; qwen3_moe's per-expert stacking is not "
                    "applied (nor by mlx-lm); a tied text_config is refused (mlx-lm loads none). "
                    + _MEDIA),
        # kimi_vl.py: deepseek_v3's model (its own TextArgs: deepseek_v3's fields but
        # model_type) and an lm_head always; its sanitize drops the towers and rotary buffers and
        # stacks per-expert tensors, nothing of deepseek_v3's (no kv_b_proj split)
        _wrap(text["deepseek_v3"], "kimi_vl", drop_fields=("model_type",),
              sanitize=(*(SanitizeRule("drop_containing", key, reason) for key, reason in (
                            ("vision_tower", _TOWERS), ("rotary_emb", "precomputed rotary freqs"),
                            ("multi_modal_projector", _TOWERS))),
                        SanitizeRule("stack_experts", StackExperts(),
                                     "per-expert tensors stacked into the fused SwitchGLU weights")),
              ignored_keys={**text["deepseek_v3"].ignored_keys,
                            "model_type": "kimi_vl's TextArgs has no model_type"},
              notes="kimi_vl: deepseek_v3's text model behind the VLM wrapper (language_model.*; "
                    "text_config's args, deepseek_v3's defaults; absorbed MLA, noaux_tc router; "
                    "its own lm_head always); the towers and rotary buffers dropped and per-expert "
                    "tensors stacked, nothing of deepseek_v3's sanitize (a kv_b_proj checkpoint is "
                    "refused, as by mlx-lm's strict load). " + _MEDIA),
        # kimi_k25.py: deepseek_v3's model and args, an lm_head always; its sanitize pops the
        # towers, then runs deepseek_v3's on language_model's keys
        _wrap(text["deepseek_v3"], "kimi_k25",
              sanitize=(SanitizeRule("drop_prefix", ("vision_tower.", "vision_model.",
                                                     "multi_modal_projector.", "mm_projector."),
                                     _TOWERS),
                        *map(_under_wrapper, text["deepseek_v3"].sanitize)),
              notes="kimi_k25: deepseek_v3's text model behind the VLM wrapper (language_model.*; "
                    "text_config read as deepseek_v3's args; absorbed MLA, noaux_tc router; its "
                    "own lm_head always); the towers dropped, then deepseek_v3's sanitize (int4 / "
                    "fp8 checkpoints, per-expert stacking, the kv_b_proj split, the MTP layer "
                    "dropped) under language_model. " + _MEDIA),
        # lfm2-vl.py: lfm2's text model (always tied: the tie_word_embeddings False its
        # __post_init__ writes is not an lfm2 field); sanitize pops the towers only, so the
        # conv weights must be in mlx's layout already (lfm2's own sanitize is not applied)
        _wrap(text["lfm2"], "lfm2-vl",
              sanitize=(SanitizeRule("drop_prefix", ("vision_tower.", "multi_modal_projector."),
                                     _TOWERS),),
              notes="lfm2-vl: lfm2's text model behind the VLM wrapper (language_model.*; "
                    "text_config's args; the head is the embedding whatever tie_word_embeddings "
                    "says; lfm2's caches); the vision tower and projector dropped, nothing else: "
                    "a torch-layout conv1d weight is refused, as by mlx-lm's strict load. " + _MEDIA),
    ]
