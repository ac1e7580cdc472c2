"""UniversalDense: one config-driven module for every dense arch in the descriptor table.

Each branch is a transcription of the mlx-lm 0.32.2 file of the arch that takes
it (same ops, order, casts, python-float constants, compiled kernels, mask and
attention dispatch), and the module tree uses that file's attribute names, so
parameter paths, safetensors keys and tap paths are identical to mlx-lm's.
The descriptor (`archs.ArchDescriptor`) selects branches; `archs.resolve_args`
supplies the numbers.

`forward_hidden` returns the final-normed hidden state (what feeds the head);
`logits_from_hidden` applies the head and its post-processing, so
`model(ids) == logits_from_hidden(forward_hidden(ids))` bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxbun.attention import softcapped_attention
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import MlxbunError
from mlxbun.models import layers as L
from mlxbun.models import rope as R
from mlxbun.models.base import create_attention_mask, scaled_dot_product_attention
from mlxbun.models.universal.archs import ArchDescriptor, LayerSpec, UniversalArgs

__all__ = ["UniversalDense"]


def _make_rope(spec: tuple | None) -> nn.Module:
    if spec is None:
        return R.NoPE()
    kind = spec[0]
    if kind == "initialize":
        _, dims, base, traditional, scaling, max_pos = spec
        return R.initialize_rope(dims, base, traditional, scaling, max_pos)
    if kind == "phi3":  # phi3.py builds its rope by hand
        _, dims, base, traditional, scaling, max_pos, orig_max_pos = spec
        if scaling and scaling["type"] in ["longrope", "su"]:
            return R.SuScaledRoPE(
                dims, base=base, max_position_embeddings=max_pos,
                original_max_position_embeddings=orig_max_pos,
                short_factor=scaling["short_factor"], long_factor=scaling["long_factor"],
            )
        rope_scale = 1.0
        if scaling and scaling["type"] == "linear":
            rope_scale = 1 / scaling["factor"]
        return nn.RoPE(dims, traditional=traditional, base=base, scale=rope_scale)
    if kind == "nemotron":
        _, dims, base, scale = spec
        return nn.RoPE(dims, base=base, scale=scale)
    if kind == "hunyuan_alpha":
        _, dims, base, alpha = spec
        return R.DynamicNTKAlphaRoPE(dims, base=base, scaling_alpha=alpha)
    if kind == "nanochat":
        _, dims, base = spec
        return R.NanochatRoPE(dims, base=base)
    raise ValueError(f"unknown rope kind {kind!r}")


def _make_norm(kind: str, dims: int, eps: float, bias: bool):
    """A norm module, or None for the parameter-free functional RMSNorm."""
    if kind == "rms":
        return nn.RMSNorm(dims, eps=eps)
    if kind == "gemma_rms":
        return L.GemmaRMSNorm(dims, eps=eps)
    if kind == "layernorm":
        return nn.LayerNorm(dims, eps=eps, bias=bias)
    if kind == "layernorm1p":
        return L.NemotronLayerNorm1P(dims, eps=eps)
    if kind == "functional_rms":
        return None
    raise ValueError(f"unknown norm kind {kind!r}")


class Attention(nn.Module):
    def __init__(self, a: UniversalArgs, d: ArchDescriptor, spec: LayerSpec):
        super().__init__()
        self._d, self._n = d, d.names
        self._h, self._kv, self._hd = H, KV, hd = a.n_heads, a.n_kv_heads, a.head_dim
        self._scale, self._softcap = a.attn_scale, a.attn_softcap
        D, n = a.hidden, d.names
        if d.qkv == "separate":
            setattr(self, n.q, nn.Linear(D, H * hd, bias=a.attn_bias))
            setattr(self, n.k, nn.Linear(D, KV * hd, bias=a.attn_bias))
            setattr(self, n.v, nn.Linear(D, KV * hd, bias=a.attn_bias))
        elif d.qkv == "fused":
            setattr(self, n.qkv, nn.Linear(D, H * hd + 2 * (KV * hd), bias=a.attn_bias))
        elif d.qkv == "fused_neox":
            setattr(self, n.qkv, nn.Linear(D, 3 * D, bias=a.attn_bias))
        else:
            raise ValueError(f"unknown qkv layout {d.qkv!r}")
        setattr(self, n.o, nn.Linear(H * hd, D, bias=a.out_bias))

        self._qk = d.qk_norm if a.qk_norm else None
        if self._qk is not None:
            kind, (qn, kn) = self._qk.kind, self._qk.names
            if kind in ("rms", "gemma_rms"):
                cls = nn.RMSNorm if kind == "rms" else L.GemmaRMSNorm
                qd, kd = (H * hd, KV * hd) if self._qk.at == "flat" else (hd, hd)
                setattr(self, qn, cls(qd, eps=a.eps))
                setattr(self, kn, cls(kd, eps=a.eps))
            elif kind == "layernorm2d":
                setattr(self, qn, L.LayerNorm2D(H, hd, eps=a.eps))
                setattr(self, kn, L.LayerNorm2D(KV, hd, eps=a.eps))
            elif kind == "layernorm_per_head":
                setattr(self, qn, L.LayerNormPerHead(hd, H, eps=a.eps))
                setattr(self, kn, L.LayerNormPerHead(hd, KV, eps=a.eps))
            elif kind != "functional_rms":
                raise ValueError(f"unknown qk-norm kind {kind!r}")
        if d.block.inner_norms:
            setattr(self, n.inner_norm, nn.RMSNorm(D, eps=a.eps))
        rope = _make_rope(spec.rope)
        # the call goes through _rope_fn; the tree holds `rope` only where mlx-lm's does
        object.__setattr__(self, "_rope_fn", rope)
        if d.rope.child and (spec.rope is not None or d.rope.nope_child):
            self.rope = rope

    def _qk_norm(self, q, k):
        if self._qk.kind == "functional_rms":
            return L.rms_norm_no_weight(q), L.rms_norm_no_weight(k)
        qn, kn = self._qk.names
        return self[qn](q), self[kn](k)

    def __call__(self, x, mask=None, cache=None, attn_scale=None):
        d, n = self._d, self._n
        H, KV, hd = self._h, self._kv, self._hd
        B, L_, _ = x.shape
        if d.block.inner_norms:
            x = self[n.inner_norm](x)
        at = self._qk.at if self._qk is not None else None

        if d.qkv == "fused_neox":
            qkv = self[n.qkv](x)
            qkv = qkv.reshape(*(qkv.shape[:-1] + (H, 3 * hd)))
            queries, keys, values = [t.transpose(0, 2, 1, 3) for t in qkv.split(3, -1)]
        else:
            if d.qkv == "fused":
                qkv = self[n.qkv](x)
                q_size = H * hd
                queries, keys, values = mx.split(qkv, [q_size, q_size + KV * hd], axis=-1)
            else:
                queries, keys, values = self[n.q](x), self[n.k](x), self[n.v](x)
            if at == "flat":
                queries, keys = self._qk_norm(queries, keys)
            queries = queries.reshape(B, L_, H, -1)
            keys = keys.reshape(B, L_, KV, -1)
            if at == "heads":
                queries, keys = self._qk_norm(queries, keys)
            queries = queries.transpose(0, 2, 1, 3)
            keys = keys.transpose(0, 2, 1, 3)
            values = values.reshape(B, L_, KV, -1).transpose(0, 2, 1, 3)
            if at == "heads_transposed":
                queries, keys = self._qk_norm(queries, keys)

        offset = cache.offset if cache is not None else 0
        queries = self._rope_fn(queries, offset=offset)
        keys = self._rope_fn(keys, offset=offset)
        if at == "after_rope":
            queries, keys = self._qk_norm(queries, keys)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        if attn_scale is not None:
            queries = queries * attn_scale

        kind, scale = d.attention, self._scale
        if kind == "sdpa":
            output = scaled_dot_product_attention(
                queries, keys, values, cache=cache, scale=scale, mask=mask)
        elif kind == "softcap":
            output = softcapped_attention(queries, keys, values, scale, self._softcap, mask)
        elif kind == "sdpa_f32_if_f16":  # cohere2
            sdpa_type = mx.float32 if queries.dtype == mx.float16 else queries.dtype
            output = scaled_dot_product_attention(
                queries.astype(sdpa_type), keys, values, cache=cache, scale=scale, mask=mask,
            ).astype(queries.dtype)
        elif kind == "sdpa_q_f32":  # phi
            output = scaled_dot_product_attention(
                queries.astype(mx.float32), keys, values, cache=cache, scale=scale, mask=mask,
            ).astype(values.dtype)
        elif kind == "sdpa_qk_f32":  # stablelm
            queries = queries.astype(mx.float32)
            keys = keys.astype(mx.float32)
            output = scaled_dot_product_attention(
                queries, keys, values, cache=cache, scale=scale, mask=mask).astype(values.dtype)
        else:
            raise ValueError(f"unknown attention kind {kind!r}")
        output = output.transpose(0, 2, 1, 3).reshape(B, L_, -1)
        return self[n.o](output)


class MLP(nn.Module):
    def __init__(self, a: UniversalArgs, d: ArchDescriptor):
        super().__init__()
        self._d, self._n = d, d.names
        D, I, bias, n = a.hidden, a.intermediate, a.mlp_bias, d.names
        kind = d.mlp.kind
        if kind == "gated":
            setattr(self, n.gate, nn.Linear(D, I, bias=bias))
            setattr(self, n.up, nn.Linear(D, I, bias=bias))
        elif kind == "gated_fused":
            setattr(self, n.gate_up, nn.Linear(D, 2 * I, bias=bias))
        elif kind == "plain":
            setattr(self, n.up, nn.Linear(D, I, bias=bias))
            if d.mlp.act == "xielu":
                setattr(self, n.act, L.XieLU())
        else:
            raise ValueError(f"unknown MLP kind {kind!r}")
        setattr(self, n.down, nn.Linear(I, D, bias=bias))
        if d.block.inner_norms:
            setattr(self, n.inner_norm, nn.RMSNorm(D, eps=a.eps))

    def __call__(self, x):
        d, n = self._d, self._n
        kind, act = d.mlp.kind, d.mlp.act
        if d.block.inner_norms:
            x = self[n.inner_norm](x)
        if kind == "gated":
            gate, up = self[n.gate](x), self[n.up](x)
            if act == "silu":
                h = L.swiglu(gate, up)
            elif act == "gelu":
                h = L.gelu_mul(gate, up)
            elif act == "gelu_approx":
                h = L.gelu_approx_mul(gate, up)
            else:
                raise ValueError(f"unknown gated activation {act!r}")
        elif kind == "gated_fused":
            x = self[n.gate_up](x)
            gate, x = mx.split(x, 2, axis=-1)
            h = L.swiglu(gate, x)
        else:
            h = self[n.up](x)
            if act == "gelu":
                h = nn.gelu(h)
            elif act == "gelu_approx":
                h = nn.gelu_approx(h)
            elif act == "relu_squared":
                h = L.relu_squared(h)
            elif act == "relu2":
                h = nn.relu2(h)
            elif act == "xielu":
                h = self[n.act](h)
            else:
                raise ValueError(f"unknown activation {act!r}")
        return self[n.down](h)


# which of Names.norms (pre-attn, post-attn, pre-mlp, post-mlp) each block kind uses
_SLOTS = {"pre": (0, 2), "sandwich": (0, 1, 2, 3), "post": (1, 3)}


class Block(nn.Module):
    def __init__(self, a: UniversalArgs, d: ArchDescriptor, spec: LayerSpec):
        super().__init__()
        self._d, self._n = d, d.names
        self._parallel = a.parallel
        self._residual_scale = a.residual_scale
        self.use_sliding = spec.sliding  # mlx-lm's llama/ministral3 attribute
        setattr(self, d.names.attn, Attention(a, d, spec))
        setattr(self, d.names.mlp, MLP(a, d))
        if d.block.inner_norms:
            slots: tuple[int, ...] = ()
        elif a.parallel:
            slots = (0, 2) if d.block.parallel_mlp_norm == "own" else (0,)
        else:
            slots = _SLOTS[d.block.kind]
        self._slots = frozenset(slots)  # a tuple would join the module tree
        for s in slots:
            name = d.names.norms[s]
            norm = _make_norm(d.norm.kind, a.hidden, a.eps, a.norm_bias)
            if name is None:
                raise ValueError(f"{d.model_type}: norm slot {s} has no name")
            if norm is not None:
                setattr(self, name, norm)

    def _norm(self, slot: int, x):
        if slot not in self._slots:
            return x
        if self._d.norm.kind == "functional_rms":
            return L.rms_norm_no_weight(x)
        return self[self._n.norms[slot]](x)

    def _add(self, x, r):
        kind = self._d.block.residual
        if kind == "plain":
            return x + r
        if kind == "scaled":
            return x + r * self._residual_scale
        if kind == "clip_f16":
            return L.clip_residual(x, r)
        raise ValueError(f"unknown residual kind {kind!r}")

    def __call__(self, x, mask=None, cache=None, attn_scale=None):
        attn, mlp = self[self._n.attn], self[self._n.mlp]
        if self._parallel:
            h = self._norm(0, x)
            attn_h = attn(h, mask, cache, attn_scale)
            ff_h = mlp(h if self._d.block.parallel_mlp_norm == "shared" else self._norm(2, x))
            if self._d.block.parallel_sum == "attn_ff_x":
                return attn_h + ff_h + x
            return x + attn_h + ff_h
        r = attn(self._norm(0, x), mask, cache, attn_scale)
        r = self._norm(1, r)
        h = self._add(x, r)
        r = mlp(self._norm(2, h))
        r = self._norm(3, r)
        return self._add(h, r)


class Backbone(nn.Module):
    """mlx-lm's inner model (`model` / `transformer`): embedding, blocks, final norm."""

    def __init__(self, a: UniversalArgs, d: ArchDescriptor):
        super().__init__()
        n = d.names
        setattr(self, n.embed, nn.Embedding(a.vocab, a.hidden))
        setattr(self, n.layers, [Block(a, d, spec) for spec in a.layers])
        if n.final_norm is not None:
            norm = _make_norm(d.norm.kind, a.hidden, a.eps, a.norm_bias)
            if norm is not None:
                setattr(self, n.final_norm, norm)
        if d.head.in_root:
            setattr(self, n.head, nn.Linear(a.hidden, a.vocab, bias=d.head.bias))


class UniversalDense(nn.Module):
    """A dense decoder for any descriptor in `archs.DESCRIPTORS`, parameter tree == mlx-lm's."""

    def __init__(self, args: UniversalArgs, descriptor: ArchDescriptor,
                 config: Any = None, raw_config: Optional[Mapping] = None):
        super().__init__()
        d, n = descriptor, descriptor.names
        self.descriptor = d
        self.args = args
        self.config = config  # mlxbun.config.TextConfig when known
        self.raw_config = MappingProxyType(dict(raw_config or {}))
        self.profile = None
        self._tied = args.tie
        setattr(self, n.root, Backbone(args, d))
        if not d.head.in_root and (not args.tie or d.head.always):
            setattr(self, n.head, nn.Linear(args.hidden, args.vocab, bias=d.head.bias))
        kinds = [s.sliding for s in args.layers]
        self._full_idx = kinds.index(False) if False in kinds else None
        self._swa_idx = kinds.index(True) if True in kinds else None

    # ------------------------------------------------------------- structure

    @property
    def model_type(self) -> str:
        return self.descriptor.model_type

    @property
    def backbone(self) -> Backbone:
        return self[self.descriptor.names.root]

    @property
    def layers(self) -> list:
        return self.backbone[self.descriptor.names.layers]

    @property
    def tied(self) -> bool:
        return self._tied

    def tie_to_embedding(self) -> None:
        """gemma3_text: no lm_head in the checkpoint means a tied head (mlx-lm's sanitize)."""
        if self.descriptor.names.head in self:
            self.pop(self.descriptor.names.head)
        self._tied = True

    @property
    def weights_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))

    def make_cache(self, max_kv_size: Optional[int] = None, **kv_options: Any) -> list:
        """mlx-lm's caches: the file's own make_cache, else make_prompt_cache's default."""
        if kv_options:
            raise MlxbunError(f"{self.model_type}: cache options not supported by the universal "
                              f"graph: {', '.join(sorted(kv_options))}")
        if self.descriptor.layers.make_cache == "rotating_sliding":
            # mlx-lm's file ignores max_kv_size here; mlxbun bounds the full-attention layers too.
            w = self.args.sliding_window
            full = (lambda: RotatingKVCache(max_size=max_kv_size, keep=4)) if max_kv_size else KVCache
            return [RotatingKVCache(max_size=w) if s.sliding else full() for s in self.args.layers]
        if max_kv_size is not None:
            return [RotatingKVCache(max_size=max_kv_size, keep=4) for _ in self.args.layers]
        return [KVCache() for _ in self.args.layers]

    def layers_tap(self, paths: Any = None):
        from mlxbun.parity.taps import capture

        return capture(self, paths)

    # ------------------------------------------------------------- forward

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None) -> mx.array:
        """The final-normed hidden state [B, L, H] that feeds the head."""
        d, a, n, root = self.descriptor, self.args, self.descriptor.names, self.backbone
        h = root[n.embed](ids)
        es = d.embed_scale
        if es == "sqrt_hidden":
            h = h * (a.fields["hidden_size"] ** 0.5)
        elif es == "sqrt_hidden_bf16":
            h = h * mx.array(a.fields["hidden_size"] ** 0.5, mx.bfloat16).astype(h.dtype)
        elif es is not None:
            h = h * a.embed_scale
        if d.embed_norm:
            h = L.rms_norm_no_weight(h)

        blocks = root[n.layers]
        attn_scale = None
        if a.llama4 is not None:
            offset = 0 if cache is None else cache[0].offset
            attn_scale = R.llama4_attn_scale(ids.shape[1], offset, *a.llama4).astype(h.dtype)
        if cache is None:
            cache = [None] * len(blocks)
        fa_mask = swa_mask = None
        if self._full_idx is not None:
            fa_mask = create_attention_mask(h, cache[self._full_idx],
                                            return_array=d.layers.mask_array)
        if self._swa_idx is not None:
            swa_mask = create_attention_mask(h, cache[self._swa_idx], window_size=a.sliding_window)
        for layer, c in zip(blocks, cache):
            h = layer(h, swa_mask if layer.use_sliding else fa_mask, c, attn_scale)

        if d.norm.kind == "functional_rms":
            return L.rms_norm_no_weight(h)
        return root[n.final_norm](h)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        d, a, n = self.descriptor, self.args, self.descriptor.names
        if d.head.in_root:
            out = self.backbone[n.head](h)
        elif self._tied:
            embed = self.backbone[n.embed]
            out = embed.as_linear(h) if d.head.tied_op == "as_linear" else h @ embed.weight.T
        else:
            if a.head_pre_divide is not None:
                h = h / a.head_pre_divide
            out = self[n.head](h)
        if a.head_post is not None:
            op, value = a.head_post
            out = out / value if op == "div" else out * value
        if a.final_softcap == "nanochat":
            out = L.softcap_compiled(out)
        elif a.final_softcap is not None:
            out = L.logit_softcap(out, a.final_softcap)
        return out

    def __call__(self, ids: mx.array, cache: Optional[list] = None) -> mx.array:
        return self.logits_from_hidden(self.forward_hidden(ids, cache))
