"""Config-key coverage: does the descriptor understand every key that could change numerics?

Every top-level config.json key falls in one bucket:
  understood  a ModelArgs field the descriptor reads (or a loader key: quantization)
  harmless    metadata, token ids, training-only settings (HARMLESS_KEYS)
  ignored     a key mlx-lm deliberately ignores for this arch (the descriptor says why)
  unknown     anything else. A non-neutral unknown value (not null/false/0/empty) might
              change numerics in the real model, so it fails coverage and names the key.
A value outside `accepted_values` (e.g. hidden_act "gelu" for an arch that only
runs silu) fails too, as does an alias that disagrees with the field mlx-lm reads
(gpt_neox rope_theta vs rotary_emb_base), a transformers-5 `rope_parameters`
that disagrees with the rope keys mlx-lm reads, or `layer_types` that disagree
with the layer pattern mlx-lm derives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxbun.config_reader import thaw
from mlxbun.errors import UnsupportedModelError
from mlxbun.models.rope import rope_type_of
from mlxbun.models.universal.hybrid_args import mixer_layers
from mlxbun.models.universal.kinds import (
    HeadDim,
    LayerKinds,
)
from mlxbun.models.universal.kinds_hybrid import (
    MixerKind,
)
from mlxbun.models.universal.media import VLM_KEYS
from mlxbun.models.universal.resolve import descriptor_for, layer_kinds, model_args, text_config

__all__ = ["CoverageReport", "HARMLESS_KEYS", "check_coverage", "require_coverage"]

# Keys that never change a forward pass at inference.
HARMLESS_KEYS = frozenset({
    # identity / provenance
    "architectures", "auto_map", "transformers_version", "_name_or_path", "_commit_hash",
    "model_file_version", "torch_dtype", "dtype", "use_bfloat16", "tokenizer_class", "prefix",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "_attn_implementation_internal", "license", "library_name",
    # token ids
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "unk_token_id", "eod_token_id",
    "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id",
    # runtime / training switches
    "use_cache", "initializer_range", "initializer_factor", "gradient_checkpointing",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript", "pruned_heads",
    "tie_encoder_decoder", "is_decoder", "is_encoder_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "chunk_size_feed_forward", "tf_legacy_loss",
    "use_return_dict", "problem_type", "finetuning_task", "task_specific_params",
    "id2label", "label2id", "num_labels", "pretraining_tp", "router_aux_loss_coef",
    # dropout (not applied at inference, whatever the probability)
    "attention_dropout", "hidden_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob",
    "embd_pdrop", "resid_pdrop", "attn_pdrop", "embed_dropout", "dropout", "classifier_dropout",
    "residual_dropout", "embedding_dropout", "ffn_dropout", "summary_first_dropout",
    # generation defaults (sampling, not the forward pass)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "max_new_tokens", "generation_config",
    # handled by the loader (mlx-packed weights; anything else refuses there)
    "quantization", "quantization_config",
})

_NEUTRAL = (None, False, 0, 0.0, "", [], {})


def _neutral(value: Any) -> bool:
    return any(value == n and type(value) is type(n) for n in _NEUTRAL) or value is None


@dataclass(frozen=True)
class CoverageReport:
    model_type: str
    understood: tuple[str, ...]
    harmless: tuple[str, ...]
    ignored: Mapping[str, str]  # key -> why mlx-lm ignores it
    unknown: tuple[str, ...]  # keys not understood, with neutral values
    offending: Mapping[str, str] = field(default_factory=dict)  # key -> why it fails coverage

    @property
    def ok(self) -> bool:
        return not self.offending

    def describe(self) -> str:
        if self.ok:
            return (f"{self.model_type}: {len(self.understood)} keys understood, "
                    f"{len(self.harmless)} harmless, {len(self.ignored)} ignored as mlx-lm does")
        bad = "; ".join(f"'{k}' ({why})" for k, why in self.offending.items())
        return f"{self.model_type}: config key(s) the universal graph does not support: {bad}"


def check_coverage(model_type: str, config: Mapping[str, Any]) -> CoverageReport:
    """Sort the config's keys; see the module docstring. Unknown model_types refuse."""
    config = thaw(config)  # read-only configs hold tuples where the json had lists
    d = descriptor_for(model_type, config)
    a = model_args(d, config)  # ConfigError for a config mlx-lm could not build
    understood, harmless, unknown = [], [], []
    ignored: dict[str, str] = {}
    outer, config = config, text_config(d, config)
    if config is not outer and d.text_config_merge:  # muse_glimmer: text_config over the top level
        understood.append("text_config")
    elif config is not outer:  # a VLM wrapper: the rest is the vision model's, or bookkeeping
        ignored.update({k: "outside text_config (mlx-lm's wrapper reads only text_config)"
                        for k in outer if k != "text_config" and k not in d.wrapper_fields})
        ignored.update({f"text_config.{k}": f"the wrapper writes its own {k} over it"
                        for k in d.wrapper_fields if k in outer["text_config"]})
        ignored.update({f"text_config.{k}": f"the wrapper sets {k}={v!r} whatever text_config holds"
                        for k, v in d.wrapper_sets.items() if k in outer["text_config"]})
    offending: dict[str, str] = {}
    for key, value in config.items():
        if key in d.accepted_values and value is not None and value not in d.accepted_values[key]:
            offending[key] = (f"value {value!r}; {d.model_type} runs only "
                              f"{', '.join(map(repr, d.accepted_values[key]))}")
        elif key in d.aliases:
            if value != a[d.aliases[key]]:
                offending[key] = (f"{value!r} disagrees with {d.aliases[key]}="
                                  f"{a[d.aliases[key]]!r}, which mlx-lm reads")
            else:
                understood.append(key)
        elif key == "rope_parameters" and key not in d.fields and value is not None:
            problems = _rope_parameter_problems(d, a, config, value)
            if problems:
                offending[key] = "disagrees with the rope keys mlx-lm reads: " + "; ".join(problems)
            else:
                understood.append(key)
        elif (key == "layer_types" and d.layers.kinds in (LayerKinds.PERIOD, LayerKinds.EXAONE)
              and value is not None):
            problem = _layer_types_problem(d, a, value)
            if problem:
                offending[key] = problem
            else:
                understood.append(key)
        elif (key in d.fields or key in d.accepted_values
              or (key == "head_dim" and d.head_dim is HeadDim.SPLIT and d.mla is None)
              or (key == "layer_types" and _hybrid_layer_types(d))):
            understood.append(key)  # a split head_dim is checked against hidden // heads below,
            # a hybrid's layer_types against the layers its rule picks
        elif key in d.ignored_keys:
            ignored[key] = d.ignored_keys[key] or "not read by mlx-lm for this arch"
        elif (d.names.wrapper or d.text_config_merge) and key in VLM_KEYS:  # qwen2_vl: no text_config
            ignored[key] = "the VLM's own (mlx-lm's wrapper builds no tower)"
        elif key in HARMLESS_KEYS:
            harmless.append(key)
        elif _neutral(value):
            unknown.append(key)
        else:
            offending[key] = f"unknown key with value {value!r} could change numerics"
    _check_layer_types(d, a, config, offending)
    hd = config.get("head_dim")
    # (an MLA row's head_dim is transformers' qk_rope_head_dim, which mlx-lm does not read: ignored_keys)
    if d.head_dim is HeadDim.SPLIT and d.mla is None and hd is not None and hd != a[d.hidden] // a[d.n_heads]:
        offending["head_dim"] = (f"{hd!r}, but mlx-lm's {d.model_type} uses hidden_size // "
                                 f"num_attention_heads = {a[d.hidden] // a[d.n_heads]}")
    return CoverageReport(d.model_type, tuple(understood), tuple(harmless), ignored,
                          tuple(unknown), offending)


def _rope_parameter_problems(d, a: Mapping, config: Mapping, rp: Any) -> list[str]:
    """Where a transformers-5 rope_parameters dict disagrees with what mlx-lm reads."""
    if not isinstance(rp, Mapping):
        return [f"expected an object, got {rp!r}"]
    per_kind = {k: rp[k] for k in ("full_attention", "sliding_attention") if isinstance(rp.get(k), Mapping)}
    groups = per_kind or {"full_attention": rp}
    problems = []
    for kind, p in groups.items():
        sliding = kind == "sliding_attention" and d.rope.sliding_theta is not None
        theta = a[d.rope.sliding_theta] if sliding else _field(a, d.rope.theta)
        if "rope_theta" in p and p["rope_theta"] != theta:
            problems.append(f"{kind} rope_theta {p['rope_theta']!r} vs {theta!r}")
        legacy = None if sliding or d.rope.scaling is None else a.get(d.rope.scaling)
        want = p.get("rope_type") or p.get("type") or "default"
        have = rope_type_of(legacy) if legacy else "default"
        if want != have:
            problems.append(f"{kind} rope type {want!r} vs {have!r}")
        for k, v in p.items():
            if k in ("rope_theta", "rope_type", "type", "partial_rotary_factor"):
                continue
            got = legacy.get(k, config.get(k)) if isinstance(legacy, Mapping) else config.get(k)
            if got != v:
                problems.append(f"{kind} {k} {v!r} vs {got!r}")
        rotary_dim = a[d.rope.rotary_dim] if d.rope.rotary_dim else None
        if "partial_rotary_factor" in p and rotary_dim is not None:  # minimax: rotary_dim of head_dim
            hd = _head_dim(d, a)
            if p["partial_rotary_factor"] * hd != rotary_dim:
                problems.append(f"partial_rotary_factor {p['partial_rotary_factor']!r} of head_dim "
                                f"{hd} vs {d.rope.rotary_dim} {rotary_dim!r}")
        elif "partial_rotary_factor" in p and "partial_rotary_factor" not in d.ignored_keys:
            # (a row whose mlx-lm file ignores the fraction ignores it here too: glm)
            frac = a[d.rope.partial] if d.rope.partial else 1.0
            if p["partial_rotary_factor"] != frac:
                problems.append(f"partial_rotary_factor {p['partial_rotary_factor']!r} vs {frac!r}")
    return problems


def _head_dim(d, a: Mapping) -> Any:
    """The head width as resolve_args computes it."""
    split = a[d.hidden] // a[d.n_heads]
    if d.head_dim is HeadDim.SPLIT:
        return split
    return a["head_dim"] if d.head_dim is HeadDim.FIELD else (a.get("head_dim") or split)


def _field(a: Mapping, spec: str | float) -> Any:
    if not isinstance(spec, str):  # a literal rope base (qwen)
        return spec
    head, _, rest = spec.partition(".")
    return a[head][rest] if rest else a[head]


def _layer_types_problem(d, a: Mapping, layer_types: Any) -> str | None:
    """period / exaone archs: mlx-lm derives the kinds from the pattern; they must agree."""
    kinds = layer_kinds(d, a, a[d.n_layers])
    want = ["sliding_attention" if s else "full_attention" for s in kinds]
    if list(layer_types) != want:
        return (f"{list(layer_types)} disagrees with the kinds mlx-lm derives from "
                f"{d.layers.period}: {want}")
    return None


def _hybrid_layer_types(d) -> bool:
    """A hybrid whose ModelArgs lacks layer_types (qwen3_next: mlx-lm reads an interval) but whose
    checkpoints write it: coverage still holds it to the layers the rule picks."""
    return d.hybrid is not None and bool(d.hybrid.layer_types)


def _check_layer_types(d, a: Mapping[str, Any], config: Mapping[str, Any], offending: dict[str, str]) -> None:
    lt = config.get("layer_types")
    if ("layer_types" not in d.fields and not _hybrid_layer_types(d)) or not lt:
        return
    recurrent = d.hybrid.layer_types if d.hybrid is not None else ()
    attend = ("attention",) if recurrent else ()  # granitemoehybrid's spelling
    odd = sorted({t for t in lt if t not in ("full_attention", "sliding_attention", *attend, *recurrent,
                                             *d.layers.other_types)})
    if odd:
        offending["layer_types"] = f"layer kind(s) {', '.join(map(repr, odd))} are not supported"
    elif d.hybrid is not None:  # the layers mlx-lm builds come from the rule's field
        n = a[d.n_layers]
        said = [t in recurrent for t in lt[:n]]
        built = [m is not MixerKind.ATTENTION for m in mixer_layers(d, dict(a), n)]
        if said != built:
            offending["layer_types"] = (f"disagrees with {d.hybrid.field}={a[d.hybrid.field]!r}, which "
                                        f"mlx-lm reads to pick the {d.hybrid.mixer.value} layers")


def require_coverage(model_type: str, config: Mapping[str, Any]) -> CoverageReport:
    """`check_coverage`, raising `UnsupportedModelError` naming the offending key(s)."""
    report = check_coverage(model_type, config)
    if not report.ok:
        raise UnsupportedModelError(report.describe())
    return report
