"""The descriptor row's `sanitize` rules applied to a checkpoint's tensors, each a transcription of
the mlx-lm file's `sanitize` step (renames, drops, stacked experts, fused or split projections,
fp8 dequantization, conv layouts, muP folding ...), on real arrays or on header-only `Meta`
tensors (enough for quantization and the weight audit without reading the data)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import mlx.core as mx

from mlxbun.errors import LoadError
from mlxbun.models.universal.gemma4_sanitize import gemma4_sanitize
from mlxbun.models.universal.kinds import (
    exhaustive,
)
from mlxbun.models.universal.kinds_sanitize import SanitizeOp
from mlxbun.models.universal.kinds_hybrid import (
    ConvLayout,
    GateUpLayout,
    HfCheckpoint,
)
from mlxbun.models.universal.moe_args import moe_layers
from mlxbun.models.universal.mup import fold_falcon_h1
from mlxbun.models.universal.sanitize_fp8 import fp8_block_dequant, fp8_dequant_broadcast
from mlxbun.models.universal.schema import (
    ArchDescriptor,
    SanitizeRule,
)
from mlxbun.models.universal.schema_moe import (
    StackExperts,
)
from mlxbun.models.universal.weight_meta import Meta
from mlxbun.weights import name_list

__all__ = ["Meta", "sanitize_weights"]


_NEOX_BUFFERS = (".attention.bias", ".attention.masked_bias", ".attention.rotary_emb.inv_freq")


_EXPERT_KEY = re.compile(r"^(.*)\.([^.]+)\.(\d+)\.([^.]+)\.([^.]+)$")  # <prefix>.<container>.<e>.<src>.<key>


def _stack_experts(d: ArchDescriptor, spec: StackExperts, w: dict, fields: Mapping) -> dict:
    """mlx-lm's sanitize loop: per layer, each (src, dst) and key present for expert 0 is
    stacked over experts 0..E-1 into <block>.<switch>.<dst>.<key>."""
    m = d.moe
    n_experts = fields[m.experts]
    block = m.names.block or d.names.mlp
    rename = dict(spec.names)
    firsts = []
    for k in w:
        hit = _EXPERT_KEY.match(k)
        if (hit and hit.group(2) == spec.container and hit.group(3) == "0" and hit.group(1).endswith(f".{block}")
                and hit.group(4) in rename and hit.group(5) in spec.keys):
            firsts.append(hit)
    out = dict(w)
    for hit in firsts:
        prefix, src, key = hit.group(1), hit.group(4), hit.group(5)
        names = [f"{prefix}.{spec.container}.{e}.{src}.{key}" for e in range(n_experts)]
        missing = [name for name in names if name not in out]
        if missing:
            raise LoadError(f"cannot stack experts: {name_list(missing)} missing "
                            f"({m.experts} = {n_experts})")
        out[f"{prefix}.{m.names.switch}.{rename[src]}.{key}"] = _stack([out.pop(name) for name in names])
    return out


def _stack(tensors: list):
    if isinstance(tensors[0], Meta):
        return Meta((len(tensors), *tensors[0].shape), tensors[0].dtype)
    return mx.stack(tensors)


def _split_glu_experts(d: ArchDescriptor, w: dict, fields: Mapping) -> dict:
    """granitemoe.sanitize: input_linear [E, 2I, D] -> gate_proj | up_proj, output_linear -> down_proj."""
    n, block = d.moe.names, d.moe.names.block or d.names.mlp
    if f"model.layers.0.{block}.input_linear.weight" not in w:
        return w
    out = dict(w)
    for layer in range(fields[d.n_layers]):
        prefix = f"model.layers.{layer}.{block}"
        value = out.pop(f"{prefix}.input_linear.weight")
        gate, up = _split_half(value)
        out[f"{prefix}.{n.switch}.{n.gate_proj}.weight"] = gate
        out[f"{prefix}.{n.switch}.{n.up_proj}.weight"] = up
        out[f"{prefix}.{n.switch}.{n.down_proj}.weight"] = out.pop(f"{prefix}.output_linear.weight")
    return out


def _shared_mlp_dense(d: ArchDescriptor, w: dict, fields: Mapping) -> dict:
    """granitemoehybrid.sanitize without experts: shared_mlp.input_linear [2I, D] -> mlp.gate_proj |
    mlp.up_proj, shared_mlp.output_linear -> mlp.down_proj."""
    n = d.names
    if f"{n.root}.{n.layers}.0.shared_mlp.input_linear.weight" not in w:
        return w
    out = dict(w)
    for layer in range(fields[d.n_layers]):
        prefix = f"{n.root}.{n.layers}.{layer}"
        value = out.pop(f"{prefix}.shared_mlp.input_linear.weight")
        if isinstance(value, Meta):
            two_i, dims = value.shape
            gate = up = Meta((two_i // 2, dims), value.dtype)
        else:
            gate, up = mx.split(value, 2, axis=0)
        out[f"{prefix}.{n.mlp}.{n.gate}.weight"] = gate
        out[f"{prefix}.{n.mlp}.{n.up}.weight"] = up
        out[f"{prefix}.{n.mlp}.{n.down}.weight"] = out.pop(f"{prefix}.shared_mlp.output_linear.weight")
    return out


def _split_half(value):
    if isinstance(value, Meta):
        e, two_i, dims = value.shape
        half = Meta((e, two_i // 2, dims), value.dtype)
        return half, half
    return mx.split(value, 2, axis=1)


def _rename_in_moe_layers(d: ArchDescriptor, pairs, w: dict, fields: Mapping) -> dict:
    """Keys under the MoE block of each MoE layer renamed (src -> dst), where present."""
    n, block = d.names, d.moe.names.block or d.names.mlp
    out = dict(w)
    for layer, routed in enumerate(moe_layers(d, fields, fields[d.n_layers])):
        prefix = f"{n.root}.{n.layers}.{layer}.{block}"
        for src, dst in pairs if routed else ():
            if f"{prefix}.{src}" in out:
                out[f"{prefix}.{dst}"] = out.pop(f"{prefix}.{src}")
    return out


def _hunyuan_fused(w: dict, fields: Mapping) -> dict:
    """hunyuan.sanitize's first step, op for op: fused qkv_proj / gate_and_up_proj split."""
    if "model.layers.0.mlp.gate_and_up_proj.weight" not in w:
        return w
    heads, n_kv = fields["num_attention_heads"], fields["num_key_value_heads"]
    groups, head_dim = heads // n_kv, fields["hidden_size"] // heads
    out = {}
    for k, v in w.items():
        if "qkv_proj" in k:
            for name, part in zip(["q_proj", "k_proj", "v_proj"], _split_qkv(v, n_kv, groups, head_dim)):
                out[k.replace("qkv_proj", name)] = part
        elif "gate_and_up_proj" in k:
            for name, part in zip(["up_proj", "gate_proj"], _split_rows(v)):
                out[k.replace("gate_and_up_proj", name)] = part
        else:
            out[k] = v
    return out


def _blocks_as_uint32(v):
    """mxfp4 `_blocks` [.., G, 16] uint8 -> [.., G * 4] uint32 (`v.view(mx.uint32).flatten(-2)`)."""
    if isinstance(v, Meta):
        *lead, groups, width = v.shape
        return Meta((*lead, groups * width * v.dtype.size // 4), mx.uint32)
    return v.view(mx.uint32).flatten(-2)


def _rows(v, start: int, last_axis: bool = False):
    """`mx.contiguous(v[..., start::2, :])` (or `v[..., start::2]` with last_axis)."""
    if isinstance(v, Meta):
        axis = -1 if last_axis else -2
        shape = list(v.shape)
        shape[axis] = len(range(start, shape[axis], 2))
        return Meta(shape, v.dtype)
    return mx.contiguous(v[..., start::2] if last_axis else v[..., start::2, :])


def _packed_name(k: str, v):
    if "_blocks" in k:
        v = _blocks_as_uint32(v)
        k = k.replace("_blocks", ".weight")
    if "_scales" in k:
        k = k.replace("_scales", ".scales")
    return k, v


def _split_interleaved_experts(w: dict) -> dict:
    """gpt_oss.sanitize, branch for branch: gate_up_proj rows interleave gate (even) and up
    (odd); mxfp4 `_blocks` / `_scales` become `.weight` (uint32) / `.scales`."""
    if any("gate_proj.weight" in k for k in w):
        return w  # already sanitized
    out = {}
    for k, v in w.items():
        if "gate_up_proj" in k and "bias" not in k:
            k, v = _packed_name(k, v)
            out[k.replace("gate_up_proj", "gate_proj")] = _rows(v, 0)
            out[k.replace("gate_up_proj", "up_proj")] = _rows(v, 1)
        elif "down_proj" in k and "bias" not in k:
            k, v = _packed_name(k, v)
            out[k] = v
        elif "gate_up_proj_bias" in k:
            out[k.replace("gate_up_proj_bias", "gate_proj.bias")] = _rows(v, 0, last_axis=True)
            out[k.replace("gate_up_proj_bias", "up_proj.bias")] = _rows(v, 1, last_axis=True)
        elif "down_proj_bias" in k:
            out[k.replace("down_proj_bias", "down_proj.bias")] = v
        else:
            out[k] = v
    return out


def _split_qkv(v, n_kv: int, groups: int, head_dim: int) -> list:
    if isinstance(v, Meta):
        last = v.shape[0] * (v.shape[1] if len(v.shape) > 1 else 1) // (n_kv * (groups + 2) * head_dim)
        return [Meta((n_kv * g * head_dim, last), v.dtype) for g in (groups, 1, 1)]
    v = v.reshape(n_kv, groups + 2, head_dim, -1)
    return [mx.flatten(part, 0, 2) for part in v.split([groups, groups + 1], axis=1)]


def _split_rows(v) -> list:
    if isinstance(v, Meta):
        half = Meta((v.shape[0] // 2, *v.shape[1:]), v.dtype)
        return [half, half]
    return v.split(2, axis=0)


def _norm_head(flag: str, w: dict, fields: Mapping) -> dict:
    """bailing_moe.sanitize: lm_head.weight / (its float32 column norms + 1e-7), in its dtype
    (what is there: mlx-lm applies it to a packed quantized head too)."""
    if not fields[flag]:
        return w
    if "lm_head.weight" not in w:
        raise LoadError(f"{flag} is set but the checkpoint has no lm_head.weight (mlx-lm's sanitize "
                        "normalizes it, and fails without it)")
    v = w["lm_head.weight"]
    if isinstance(v, Meta):
        return w
    dtype = v.dtype
    weight_norm = mx.linalg.norm(v.astype(mx.float32), axis=0, keepdims=True) + 1e-7
    return {**w, "lm_head.weight": (v / weight_norm).astype(dtype)}


def _int4_packed(w: dict) -> dict:
    """deepseek_v3.sanitize's int4 remap: X.weight_shape marks a packed X."""
    out = {}
    for k, v in w.items():
        if k.endswith("weight_shape"):
            base = k.replace("weight_shape", "")
            packed, s = w[base + "weight_packed"], w[base + "weight_scale"]
            out[base + "weight"] = (Meta(packed.shape[:-1] + (packed.shape[-1] * packed.dtype.size // 4,),
                                         mx.uint32) if isinstance(packed, Meta) else packed.view(mx.uint32))
            out[base + "scales"] = s
            out[base + "biases"] = Meta(s.shape, s.dtype) if isinstance(s, Meta) else -8 * s
        elif not (k.endswith("weight_scale") or k.endswith("weight_packed")):
            out[k] = v
    return out


def _split_kv_b(w: dict, fields: Mapping, d: ArchDescriptor) -> dict:
    """deepseek_v3.sanitize: each kv_b_proj [H*(dn+dv), kv] -> embed_q [H, kv, dn] (k part,
    transposed) and unembed_out [H, dv, kv]; a quantized one dequantized, split, requantized."""
    w = dict(w)
    m = d.mla
    dn, dv, kv, heads = fields[m.nope_dim], fields[m.v_dim], fields[m.kv_lora_rank], fields[d.n_heads]
    n = d.names
    base = f"{n.wrapper}.{n.root}" if n.wrapper else n.root  # under a wrapper (kimi_k25)
    for layer in range(fields[d.n_layers]):
        prefix = f"{base}.{n.layers}.{layer}.{n.attn}"
        if f"{prefix}.kv_b_proj.weight" not in w:
            continue
        quantized = f"{prefix}.kv_b_proj.scales" in w
        v = w.pop(f"{prefix}.kv_b_proj.weight")
        head_dim = dn + dv
        if quantized:
            scales = w.pop(f"{prefix}.kv_b_proj.scales")
            biases = w.pop(f"{prefix}.kv_b_proj.biases")
            bits = (v.shape[-1] * 32) // kv
            group_size = kv // scales.shape[-1]
        if isinstance(v, Meta):
            shapes = {"embed_q": (heads, kv, dn), "unembed_out": (heads, dv, kv)}
            for name, shape in shapes.items():
                if quantized:
                    w[f"{prefix}.{name}.weight"] = Meta(shape[:-1] + (shape[-1] * bits // 32,), mx.uint32)
                    for part in ("scales", "biases"):
                        w[f"{prefix}.{name}.{part}"] = Meta(shape[:-1] + (shape[-1] // group_size,),
                                                            scales.dtype)
                else:
                    w[f"{prefix}.{name}.weight"] = Meta(shape, v.dtype)
            continue
        if quantized:
            v = mx.dequantize(v, scales, biases, bits=bits, group_size=group_size)
        v = v.reshape(heads, head_dim, -1)
        wk = mx.contiguous(v[:, :dn, :].swapaxes(-1, -2))
        wv = mx.contiguous(v[:, dn:, :])
        if quantized:
            wk, wk_scales, wk_biases = mx.quantize(wk, bits=bits, group_size=group_size)
            wv, wv_scales, wv_biases = mx.quantize(wv, bits=bits, group_size=group_size)
            w[f"{prefix}.embed_q.scales"] = wk_scales
            w[f"{prefix}.unembed_out.scales"] = wv_scales
            w[f"{prefix}.embed_q.biases"] = wk_biases
            w[f"{prefix}.unembed_out.biases"] = wv_biases
        w[f"{prefix}.embed_q.weight"] = wk
        w[f"{prefix}.unembed_out.weight"] = wv
    return w


_STEP3P5_REMAP = (
    (".moe.gate_proj.", ".mlp.switch_mlp.gate_proj."),
    (".moe.up_proj.", ".mlp.switch_mlp.up_proj."),
    (".moe.down_proj.", ".mlp.switch_mlp.down_proj."),
    (".moe.gate.", ".mlp.gate.gate."),
    (".moe.router_bias", ".mlp.gate.router_bias"),
    (".share_expert.", ".mlp.share_expert."),
)


def _step3p5(w: dict, fields: Mapping) -> tuple[dict, dict[str, str]]:
    """step3p5.sanitize, in its order: HF ("vanilla") checkpoints get their keys renamed and
    their zero-centred norm weights + 1."""
    is_vanilla = any(src in k and dst not in k for k in w for src, dst in _STEP3P5_REMAP)
    out, dropped = {}, {}
    for k, v in w.items():
        if ".mtp" in k:
            dropped[k] = "multi-token-prediction weights"
            continue
        if "model.layers." in k:
            parts = k.split(".")
            if len(parts) > 2 and parts[2].isdigit() and int(parts[2]) >= fields["num_hidden_layers"]:
                dropped[k] = "a layer past num_hidden_layers (multi-token prediction)"
                continue
        for src, dst in _STEP3P5_REMAP:
            if src in k and dst not in k:
                k = k.replace(src, dst)
                break
        if is_vanilla and k.endswith(".weight") and "norm" in k and not isinstance(v, Meta):
            v = v + 1
        out[k] = v
    return out, dropped


def _conv1d_layout(arg, w: dict) -> dict:
    """The mlx-lm file's depthwise-conv fix: a torch-layout [C, 1, K] weight whose key holds
    `contains` goes to mlx's [C, K, 1] (transpose(0, 2, 1) and moveaxis(2, 1) are one swap)."""
    contains, layout = arg
    out = {}
    for k, v in w.items():
        if contains in k and len(v.shape) == 3:
            torch_layout = (v.shape[-1] > v.shape[1] if layout is ConvLayout.LAST_GT_MIDDLE
                            else v.shape[1] == 1 if layout is ConvLayout.MIDDLE_ONE else v.shape[-1] != 1)
            if torch_layout:
                v = v.swapaxes(1, 2)
        out[k] = v
    return out


_HF_TESTS = exhaustive(HfCheckpoint, {  # the mlx-lm file's test, on (key, tensor)
    HfCheckpoint.EXPERT_WEIGHTS: lambda k, v: (k.startswith("model.layers.")
                                               and k.endswith(".mlp.experts.0.up_proj.weight")),
    HfCheckpoint.TORCH_CONV1D: lambda k, v: "conv1d.weight" in k and v.shape[-1] != 1,
})


def _norm_plus_one(arg, w: dict) -> dict:
    """qwen3_next / qwen3_5: a transformers checkpoint's (1 + w) norm weights get their + 1."""
    suffixes, test = arg
    if not any(_HF_TESTS[test](k, v) for k, v in w.items()):
        return w
    return {k: (v + 1.0 if k.endswith(tuple(suffixes)) and len(v.shape) == 1 else v)
            for k, v in w.items()}


def _wrapper_keys(d: ArchDescriptor, prefixes, w: dict) -> tuple[dict, dict[str, str]]:
    """qwen3_5's Model.sanitize: keys starting with `prefixes` (the vision tower) dropped, HF's
    model.<wrapper> -> <wrapper>.<root>, every other key moved under <wrapper>."""
    n = d.names
    hf, ours = f"{n.root}.{n.wrapper}", f"{n.wrapper}.{n.root}"
    out, dropped = {}, {}
    for k, v in w.items():
        if k.startswith(tuple(prefixes)):
            dropped[k] = "the vision tower (the text model runs alone)"
            continue
        if k.startswith(hf):
            k = k.replace(hf, ours)
        elif not k.startswith(f"{n.wrapper}."):
            k = f"{n.wrapper}.{k}"
        out[k] = v
    return out, dropped


def _split_gate_up_experts(d: ArchDescriptor, w: dict, fields: Mapping, layout) -> dict:
    """qwen3_5_moe.sanitize (layout None / rows): per layer holding them, experts.gate_up_proj
    [E, 2I, D] -> gate_proj | up_proj and experts.down_proj -> down_proj of the fused SwitchGLU;
    qwen3_vl_moe's (last_transposed): [E, D, 2I] halves and down_proj, each swapaxes(-2, -1)."""
    n, m = d.names, d.moe.names
    base = f"{n.wrapper}.{n.root}" if n.wrapper else n.root
    last = layout is GateUpLayout.LAST_TRANSPOSED
    out = dict(w)
    for layer in range(fields[d.n_layers]):
        prefix = f"{base}.{n.layers}.{layer}.{m.block or n.mlp}"
        if f"{prefix}.experts.gate_up_proj" in out:
            gate_up = out.pop(f"{prefix}.experts.gate_up_proj")
            gate, up = _split_last_transposed(gate_up) if last else _split_half(gate_up)
            down = out.pop(f"{prefix}.experts.down_proj")
            out[f"{prefix}.{m.switch}.{m.gate_proj}.weight"] = gate
            out[f"{prefix}.{m.switch}.{m.up_proj}.weight"] = up
            out[f"{prefix}.{m.switch}.{m.down_proj}.weight"] = down.swapaxes(-2, -1) if last else down
    return out


def _split_last_transposed(value):
    """qwen3_vl_moe: [E, D, 2I] -> gate_up[..., :I], gate_up[..., I:], each swapaxes(-2, -1)."""
    if isinstance(value, Meta):
        e, dims, two_i = value.shape
        half = Meta((e, two_i // 2, dims), value.dtype)
        return half, half
    mid = value.shape[-1] // 2
    return value[..., :mid].swapaxes(-2, -1), value[..., mid:].swapaxes(-2, -1)


def _dbrx_experts(w: dict, fields: Mapping) -> dict:
    """dbrx.sanitize: each fused [E * ffn, D] expert matrix split per expert (w2's transposed)."""
    n = fields["ffn_config"]["moe_num_experts"]
    out = {k: v for k, v in w.items() if "experts.mlp" not in k}
    for k, v in w.items():
        if "experts.mlp" not in k:
            continue
        if isinstance(v, Meta):
            parts = [Meta((v.shape[0] // n, *v.shape[1:]), v.dtype)] * n
        else:
            parts = mx.split(v, n, axis=0)
        for e, part in enumerate(parts):
            out[k.replace(".mlp", f".{e}") + ".weight"] = part.swapaxes(0, 1) if k.endswith("w2") else part
    return out


def _gpt2(w: dict, fields: Mapping) -> tuple[dict, dict[str, str]]:
    """gpt2.sanitize: each layer's causal-mask buffer dropped and its Conv1D weights transposed
    (unprefixed keys only, as mlx-lm's loop reads them), then every key under model."""
    dropped = {}
    for i in range(fields["n_layer"]):
        if f"h.{i}.attn.bias" in w:
            del w[f"h.{i}.attn.bias"]
            dropped[f"h.{i}.attn.bias"] = "the causal-mask buffer of transformers' GPT-2"
        for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            if f"h.{i}.{name}.weight" in w:
                w[f"h.{i}.{name}.weight"] = w[f"h.{i}.{name}.weight"].swapaxes(0, 1)
    return {(k if k.startswith("model.") else f"model.{k}"): v for k, v in w.items()}, dropped


def _apply_rule(rule: SanitizeRule, w: dict, tied: bool, d: ArchDescriptor,
                fields: Mapping) -> tuple[dict, dict[str, str]]:
    dropped: dict[str, str] = {}
    op = rule.op
    if op is SanitizeOp.STACK_EXPERTS:
        return _stack_experts(d, rule.arg, w, fields), {}
    if op is SanitizeOp.SPLIT_GLU_EXPERTS:
        return _split_glu_experts(d, w, fields), {}
    if op is SanitizeOp.RENAME_IN_MOE_LAYERS:
        return _rename_in_moe_layers(d, rule.arg, w, fields), {}
    if op is SanitizeOp.HUNYUAN_FUSED:
        return _hunyuan_fused(w, fields), {}
    if op is SanitizeOp.NORM_HEAD:
        return _norm_head(rule.arg, w, fields), {}
    if op is SanitizeOp.SPLIT_INTERLEAVED_EXPERTS:
        return _split_interleaved_experts(w), {}
    if op is SanitizeOp.STEP3P5:
        return _step3p5(w, fields)
    if op is SanitizeOp.RESHAPE_TO_HEADS:  # rwkv7.sanitize
        subs, field = rule.arg
        shape = (fields["hidden_size"] // fields[field], fields[field])
        return {k: ((Meta(shape, v.dtype) if isinstance(v, Meta) else v.reshape(*shape))
                    if any(s in k for s in subs) else v) for k, v in w.items()}, {}
    if op is SanitizeOp.ROW_NORM_HEAD:  # baichuan_m1.sanitize
        w = dict(w)
        if "lm_head.scales" not in w and "lm_head.weight" in w and not isinstance(w["lm_head.weight"], Meta):
            v = w["lm_head.weight"]
            f32 = v.astype(mx.float32)
            w["lm_head.weight"] = (f32 / (mx.linalg.norm(f32, axis=-1, keepdims=True) + 1e-7)).astype(v.dtype)
        return w, {}
    if op is SanitizeOp.DBRX_EXPERTS:
        return _dbrx_experts(w, fields), {}
    if op is SanitizeOp.GPT2:
        return _gpt2(w, fields)
    if op is SanitizeOp.GEMMA4:
        return gemma4_sanitize(w, fields, rule.arg)
    if op is SanitizeOp.RENAME_SUBSTRINGS:  # lfm2_moe.sanitize's loop, replacement by replacement
        out = {}
        for k, v in w.items():
            for old, new in rule.arg:
                if old in k:
                    k = k.replace(old, new)
            out[k] = v
        return out, {}
    if op is SanitizeOp.RENAME_PREFIXES:  # muse_glimmer.sanitize's elif chain
        return {next((new + k[len(old):] for old, new in rule.arg if k.startswith(old)), k): v
                for k, v in w.items()}, {}
    if op is SanitizeOp.SHARED_MLP_DENSE:
        return _shared_mlp_dense(d, w, fields), {}
    if op is SanitizeOp.CONV1D_LAYOUT:
        return _conv1d_layout(rule.arg, w), {}
    if op is SanitizeOp.NORM_PLUS_ONE:
        return _norm_plus_one(rule.arg, w), {}
    if op is SanitizeOp.WRAPPER_KEYS:
        return _wrapper_keys(d, rule.arg, w)
    if op is SanitizeOp.SPLIT_GATE_UP_EXPERTS:
        return _split_gate_up_experts(d, w, fields, rule.arg), {}
    if op is SanitizeOp.INT4_PACKED:
        return _int4_packed(w), {}
    if op is SanitizeOp.SPLIT_KV_B:
        return _split_kv_b(w, fields, d), {}
    if op is SanitizeOp.FALCON_H1_MUP:
        return fold_falcon_h1(w, fields, d.model_type), {}
    if op is SanitizeOp.STRIP_PREFIX:  # laguna: repacked checkpoints wrap every tensor in it
        if any(k.startswith(rule.arg) for k in w):
            return {(k[len(rule.arg):] if k.startswith(rule.arg) else k): v for k, v in w.items()}, {}
        return w, {}
    if op is SanitizeOp.DROP_PREFIX:
        dropped = {k: rule.reason for k in w if k.startswith(rule.arg)}
    elif op is SanitizeOp.DROP_LAYER_N:  # startswith, as mlx-lm writes it
        head = f"model.layers.{fields[d.n_layers]}"
        dropped = {k: rule.reason for k in w if k.startswith(head)}
    elif op is SanitizeOp.DROP_LAYERS_FROM_N:  # glm4_moe_lite's is_mpt_layer
        n = fields[d.n_layers]
        dropped = {k: rule.reason for k in w
                   if (p := k.split("."))[1:2] == ["layers"] and len(p) > 2 and p[2].isdigit() and int(p[2]) >= n}
    elif op is SanitizeOp.DROP_CONTAINING:
        dropped = {k: rule.reason for k in w if rule.arg in k}
    elif op is SanitizeOp.DROP_SUFFIXES:
        dropped = {k: rule.reason for k in w if k.endswith(tuple(rule.arg))}
    elif op is SanitizeOp.DROP_PER_LAYER:  # gptj: only these exact keys, as mlx-lm's loop
        names = {t.format(i=i) for i in range(fields[d.n_layers]) for t in rule.arg}
        dropped = {k: rule.reason for k in w if k in names}
    elif op is SanitizeOp.DROP_TIED_HEAD:  # under the wrapper (mistral3) where there is one
        head = f"{d.names.wrapper}.lm_head.weight" if d.names.wrapper else "lm_head.weight"
        if tied and head in w:
            dropped = {head: rule.reason}
    elif op is SanitizeOp.NEOX_RENAME:  # gpt_neox.sanitize
        out = {}
        for k, v in w.items():
            if k.endswith(_NEOX_BUFFERS):
                dropped[k] = "a transformers attention buffer, not a weight"
                continue
            if not k.startswith("model."):
                k = f"model.{k}"
            k = k.replace(".gpt_neox.layers.", ".h.").replace(".gpt_neox.", ".")
            out[k] = v
        return out, dropped
    elif op is SanitizeOp.MOVE_IF_MISSING:
        dst, src = rule.arg
        if src in w and dst not in w:
            return {(dst if k == src else k): v for k, v in w.items()}, {}
    elif op is SanitizeOp.COPY_IF_MISSING:
        dst, src = rule.arg
        if dst not in w and src in w:
            return {**w, dst: w[src]}, {}
    elif op is SanitizeOp.SQUEEZE_SUFFIXES:
        return {k: v.squeeze() if k.endswith(tuple(rule.arg)) else v for k, v in w.items()}, {}
    elif op is SanitizeOp.FP8_DEQUANT_BROADCAST:  # mistral4.sanitize
        return fp8_dequant_broadcast(w)
    elif op is SanitizeOp.FP8_BLOCK_DEQUANT:  # minimax.sanitize
        out = {}
        for k, v in w.items():
            if "weight_scale_inv" in k:
                wk = k.replace("_scale_inv", "")
                if wk not in w:
                    raise LoadError(f"tensor {k!r} has no matching {wk!r} to dequantize")
                out[wk] = fp8_block_dequant(w[wk], v)
                dropped[k] = f"folded into {wk} (fp8 block dequantization)"
            elif k not in out:
                out[k] = v
        return out, dropped
    else:  # SanitizeOp.FP8_SCALE_INV: ministral3.sanitize
        out = {}
        for k, v in w.items():
            if "weight_scale_inv" in k:
                wk = k.replace("_scale_inv", "")
                if wk not in w:
                    raise LoadError(f"tensor {k!r} has no matching {wk!r} to rescale")
                out[wk] = w[wk] * v
                dropped[k] = f"folded into {wk} (fp8 dequantization)"
            elif "activation_scale" in k:
                dropped[k] = "fp8 activation scale (unused at inference)"
            elif k not in out:
                out[k] = v
        return out, dropped
    return {k: v for k, v in w.items() if k not in dropped}, dropped


def sanitize_weights(d: ArchDescriptor, weights: Mapping[str, Any], tied: bool,
                     fields: Mapping[str, Any] = MappingProxyType({})
                     ) -> tuple[dict[str, Any], dict[str, str]]:
    """Apply the arch's sanitize rules in order: (weights, dropped name -> reason).
    `fields` is the emulated ModelArgs (`model.args.fields`): the MoE rules read it."""
    w, dropped = dict(weights), {}
    for rule in d.sanitize:
        w, gone = _apply_rule(rule, w, tied, d, fields)
        dropped.update(gone)
    return w, dropped
