"""Gemma3n's vision tower (MobileNetV5, `vision_tower.timm_model.*`), as mlx-vlm 0.7.10 runs it
(`models/gemma3n/vision.py`) op for op: a conv stem, stages of EdgeResidual /
UniversalInvertedResidual / MobileAttention blocks (RMS-normed convs, multi-query attention over
the feature map, layer scales), and the multi-scale fusion adapter (MSFA) that lifts the last
stages' maps to the first one's resolution, concatenates them, runs a pointwise inverted residual
and average-pools to the output resolution.

mlx-vlm hard-codes the ~300M layout (`gemma3n_mobilenet_def()`, a 64-channel stem, an MSFA of
1920 -> 2048 channels at 16 x 16). Here the layout is data, `MobileNetLayout`, whose default is
that one; a checkpoint may carry another under vision_config["mobilenet_layout"] (the zoo's tiny
one: mlx-vlm builds it when its stage list and widths are patched, mlxbun.zoo.towers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from mlxbun.errors import ConfigError, UnsupportedModelError

__all__ = ["FULL_LAYOUT", "AttentionBlock", "EdgeBlock", "MobileNetLayout", "MobileNetV5", "UirBlock"]


# ------------------------------------------------------------------ the layout (typed knobs)


@dataclasses.dataclass(frozen=True)
class EdgeBlock:
    """EdgeResidual: a k x k "same"-padded conv expanding to make_divisible(in x expand_ratio), norm +
    GELU, a 1 x 1 projection to `filters`, norm; the input added back where shapes allow."""

    kernel_size: int = 3
    filters: int = 32
    strides: int = 1
    expand_ratio: float = 4.0
    is_multiscale: bool = False


@dataclasses.dataclass(frozen=True)
class UirBlock:
    """UniversalInvertedResidual: an optional depthwise k x k conv (start), a 1 x 1 expansion + GELU,
    an optional depthwise "same" conv (mid, strided), a 1 x 1 projection, the layer scale, the skip.
    A kernel size of 0 means no such conv."""

    start_dw_kernel_size: int = 0
    mid_dw_kernel_size: int = 0
    filters: int = 32
    strides: int = 1
    expand_ratio: float = 4.0
    is_multiscale: bool = False


@dataclasses.dataclass(frozen=True)
class AttentionBlock:
    """MobileAttention: norm, multi-query attention (num_heads query heads of kv_dim, one key / value
    head; keys and values depthwise-downsampled by kv_strides first), the layer scale, the skip."""

    num_heads: int = 8
    kv_dim: int = 16
    kv_strides: int = 1
    is_multiscale: bool = False


Block = Union[EdgeBlock, UirBlock, AttentionBlock]
_KINDS = {"edge_residual": EdgeBlock, "uir": UirBlock, "attention": AttentionBlock}


def _er(k, filters, strides=1, expand=4.0):
    return EdgeBlock(k, filters, strides, expand)


def _uir(start, mid, filters, strides=1, expand=4.0, multiscale=False):
    return UirBlock(start, mid, filters, strides, expand, multiscale)


def _mqa(heads, kv_dim, kv_strides, multiscale=False):
    return AttentionBlock(heads, kv_dim, kv_strides, multiscale)


# mlx-vlm's gemma3n_mobilenet_def() (timm's mobilenetv5_300m_enc)
_FULL_STAGES = (
    (_er(3, 128, 2),) + (_er(3, 128, 1),) * 2,
    (_uir(3, 5, 256, 2, 6.0),) + tuple(_uir(k, 0, 256) for k in (5, 3, 5, 3)),
    (_uir(5, 5, 640, 2, 6.0),) + (_uir(5, 0, 640),) * 7 + (_uir(0, 0, 640, 1, 1.0),)
    + (_mqa(12, 64, 2), _uir(0, 0, 640, 1, 2.0)) * 13 + (_mqa(12, 64, 2), _uir(0, 0, 640, 1, 2.0, True)),
    (_uir(5, 5, 1280, 2, 6.0),) + (_mqa(16, 96, 1), _uir(0, 0, 1280, 1, 2.0)) * 18
    + (_mqa(16, 96, 1), _uir(0, 0, 1280, 1, 2.0, True)),
)


@dataclasses.dataclass(frozen=True)
class MobileNetLayout:
    """The tower's architecture: the stem's width (a 3 x 3 stride-2 "same" conv), the stages' blocks,
    which feature maps the MSFA fuses (0: the stem's, i: stage i's), its output width and the
    output resolution it pools to (its tokens: rows x columns)."""

    stages: tuple[tuple[Block, ...], ...] = _FULL_STAGES
    stem_channels: int = 64
    msfa_indices: tuple[int, ...] = (3, 4)
    msfa_out: int = 2048
    msfa_output_resolution: tuple[int, int] = (16, 16)

    def widths(self) -> list[int]:
        """Each feature map's channels: the stem's, then each stage's output."""
        out, c = [self.stem_channels], self.stem_channels
        for stage in self.stages:
            for b in stage:
                c = c if isinstance(b, AttentionBlock) else b.filters
            out.append(c)
        return out

    @property
    def msfa_in(self) -> int:
        """The MSFA's input width: the fused maps' channels concatenated (mlx-vlm: 640 + 1280)."""
        w = self.widths()
        return sum(w[i] for i in self.msfa_indices)

    @property
    def tokens(self) -> int:
        return self.msfa_output_resolution[0] * self.msfa_output_resolution[1]

    def sizes(self, height: int, width: int) -> list[tuple[int, int]]:
        """Each feature map's (rows, columns) for an image of height x width: every strided conv
        ("same" or symmetric padding, odd kernels) gives ceil(side / stride)."""
        h, w = -(-height // 2), -(-width // 2)
        out = [(h, w)]
        for stage in self.stages:
            for b in stage:
                s = 1 if isinstance(b, AttentionBlock) else b.strides
                h, w = -(-h // s), -(-w // s)
            out.append((h, w))
        return out

    def check_image(self, height: int, width: int) -> None:
        """The MSFA path mlx-vlm runs correctly for this image size, else UnsupportedModelError: the
        first fused map the largest, its size a multiple of the output resolution and not equal to
        it (mlx-vlm 0.7.10 then skips the norm and returns channels first; a size not a multiple
        takes its bicubic path, which feeds the norm channels-first maps)."""
        sizes = self.sizes(height, width)
        first = sizes[self.msfa_indices[0]]
        out = self.msfa_output_resolution
        if any(s[0] > first[0] or s[1] > first[1] for s in (sizes[i] for i in self.msfa_indices)):
            raise UnsupportedModelError(f"MobileNetV5 MSFA: a fused map larger than the first ({first})")
        if first[0] % out[0] or first[1] % out[1] or tuple(first) == tuple(out):
            raise UnsupportedModelError(
                f"MobileNetV5 MSFA: {height}x{width} images give {first[0]}x{first[1]} maps, which mlxbun pools "
                f"to {out[0]}x{out[1]} only where they are a multiple of it and larger (mlx-vlm 0.7.10's other "
                "paths mislay the channels)")

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "MobileNetLayout":
        """A layout from its JSON form (as_config's); ConfigError naming what is wrong."""
        try:
            stages = tuple(tuple(_block(b) for b in stage) for stage in d["stages"])
            return cls(stages, int(d["stem_channels"]), tuple(int(i) for i in d["msfa_indices"]),
                       int(d["msfa_out"]), tuple(int(i) for i in d["msfa_output_resolution"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"vision_config.mobilenet_layout: {e}") from None

    def as_config(self) -> dict:
        return {"stem_channels": self.stem_channels, "msfa_indices": list(self.msfa_indices),
                "msfa_out": self.msfa_out, "msfa_output_resolution": list(self.msfa_output_resolution),
                "stages": [[{"block": next(k for k, c in _KINDS.items() if isinstance(b, c)), **dataclasses.asdict(b)}
                            for b in stage] for stage in self.stages]}


def _block(d: Mapping[str, Any]) -> Block:
    d = dict(d)
    kind = d.pop("block")
    if kind not in _KINDS:
        raise ValueError(f"block {kind!r}; accepted: {', '.join(_KINDS)}")
    return _KINDS[kind](**d)


FULL_LAYOUT = MobileNetLayout()


# ------------------------------------------------------------------ the modules (mlx-vlm's ops)


def make_divisible(v: float, divisor: int = 8) -> int:
    """timm's make_divisible (round to the divisor, never more than 10% down)."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


class Norm2d(nn.Module):
    """RMSNormAct2d over an NHWC map: mlx-vlm's rms_norm2d on its channels-first view (mean of the
    squares over channels, the weight after the cast back), then GELU or nothing."""

    def __init__(self, channels: int, eps: float, act: bool = True):
        super().__init__()
        self.weight = mx.ones((channels,))
        self.eps, self._act = eps, act

    def __call__(self, x: mx.array) -> mx.array:
        x = x.transpose(0, 3, 1, 2)
        dtype = x.dtype
        v = mx.mean(mx.power(x, 2), axis=1, keepdims=True)
        x = (x * mx.rsqrt(v + self.eps)).astype(dtype) * self.weight.reshape(1, -1, 1, 1)
        if self._act:
            x = nn.gelu(x)
        return x.transpose(0, 2, 3, 1)


def _same_pad(size: int, k: int, stride: int, dilation: int) -> tuple[int, int]:
    total = max(0, (-(-size // stride) - 1) * stride + dilation * (k - 1) + 1 - size)
    return total // 2, total - total // 2


class SameConv(nn.Conv2d):
    """Conv2dSame: TF "same" padding from the input's size (the extra pixel after), then the conv."""

    def __call__(self, x: mx.array) -> mx.array:
        (kh, kw), d = self.weight.shape[1:3], self.dilation
        d = (d, d) if isinstance(d, int) else d
        x = mx.pad(x, [(0, 0), _same_pad(x.shape[1], kh, self.stride[0], d[0]),
                       _same_pad(x.shape[2], kw, self.stride[1], d[1]), (0, 0)], constant_values=0)
        y = mx.conv2d(x, self.weight, self.stride, self.padding, self.dilation, self.groups)
        return y + self.bias if "bias" in self else y


class ConvNorm(nn.Module):
    """ConvNormAct: `conv` then `bn` (Norm2d)."""

    def __init__(self, conv: nn.Conv2d, channels: int, eps: float = 1e-5, act: bool = True):
        super().__init__()
        self.conv, self.bn = conv, Norm2d(channels, eps, act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.bn(self.conv(x))


class LayerScale(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.gamma = mx.full((channels,), 1e-5)

    def __call__(self, x: mx.array) -> mx.array:
        return x * self.gamma


def _depthwise(c: int, k: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c, c, k, stride, (k - 1) // 2, groups=c, bias=False)


class EdgeResidual(nn.Module):
    def __init__(self, c_in: int, b: EdgeBlock):
        super().__init__()
        mid = make_divisible(c_in * b.expand_ratio)
        self._skip = c_in == b.filters and b.strides == 1
        self.conv_exp = SameConv(c_in, mid, b.kernel_size, b.strides, 0, (1, 1), 1, bias=False)
        self.bn1 = Norm2d(mid, 1e-5)
        self.conv_pwl = nn.Conv2d(mid, b.filters, 1, bias=False)
        self.bn2 = Norm2d(b.filters, 1e-5, act=False)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.bn2(self.conv_pwl(self.bn1(self.conv_exp(x))))
        return y + x if self._skip else y


class InvertedResidual(nn.Module):
    """UniversalInvertedResidual (the MSFA's ffn too: no depthwise convs, no layer scale, no skip)."""

    def __init__(self, c_in: int, c_out: int, start: int, mid_k: int, stride: int, expand: float,
                 layer_scale: bool = True, skip: bool = True):
        super().__init__()
        self._skip = c_in == c_out and stride == 1 and skip
        if start:
            self.dw_start = ConvNorm(nn.Conv2d(c_in, c_in, start, 1 if mid_k else stride, (start - 1) // 2, (1, 1),
                                               c_in, bias=False), c_in, act=False)
        mid = make_divisible(c_in * expand)
        self.pw_exp = ConvNorm(nn.Conv2d(c_in, mid, 1, 1, 0, (1, 1), 1, bias=False), mid)
        if mid_k:
            self.dw_mid = ConvNorm(SameConv(mid, mid, mid_k, stride, 0, (1, 1), mid, bias=False), mid)
        self.pw_proj = ConvNorm(nn.Conv2d(mid, c_out, 1, 1, 0, (1, 1), 1, bias=False), c_out, act=False)
        if layer_scale:
            self.layer_scale = LayerScale(c_out)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.dw_start(x) if "dw_start" in self else x
        y = self.pw_exp(y)
        y = self.dw_mid(y) if "dw_mid" in self else y
        y = self.pw_proj(y)
        y = self.layer_scale(y) if "layer_scale" in self else y
        return y + x if self._skip else y


class _Seq(nn.Module):
    """NamedSequential: its modules in order (a key / value path: down_conv, norm, proj)."""

    def __init__(self, **modules: nn.Module):
        super().__init__()
        self._order = list(modules)
        for name, m in modules.items():
            setattr(self, name, m)

    def __call__(self, x: mx.array) -> mx.array:
        for name in self._order:
            x = getattr(self, name)(x)
        return x


class MultiQueryAttention(nn.Module):
    """MultiQueryAttention2d: 1 x 1 query heads; one key and one value head, each from a depthwise
    strided conv + norm (kv_strides > 1) and a 1 x 1 projection; SDPA over the flattened map."""

    def __init__(self, dim: int, b: AttentionBlock):
        super().__init__()
        self.heads, self.kv_dim = b.num_heads, b.kv_dim
        self.query = _Seq(proj=nn.Conv2d(dim, b.num_heads * b.kv_dim, 1, bias=False))
        for name in ("key", "value"):
            down = {} if b.kv_strides == 1 else {"down_conv": _depthwise(dim, 3, b.kv_strides),
                                                  "norm": Norm2d(dim, 1e-6, act=False)}
            setattr(self, name, _Seq(**down, proj=nn.Conv2d(dim, b.kv_dim, 1, bias=False)))
        self.output = _Seq(proj=nn.Conv2d(b.kv_dim * b.num_heads, dim, 1, bias=False))

    def __call__(self, x: mx.array) -> mx.array:
        b, h, w, _ = x.shape
        q = self.query(x).reshape(b, h * w, self.heads, self.kv_dim).transpose(0, 2, 1, 3)
        k, v = self.key(x), self.value(x)
        k = k.reshape(k.shape[0], -1, k.shape[3])[:, None, :, :]
        v = v.reshape(v.shape[0], -1, v.shape[3])[:, None, :, :]
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(q.shape[-1]))
        return self.output(o.transpose(0, 2, 1, 3).reshape(b, h, w, -1))


class MobileAttention(nn.Module):
    def __init__(self, dim: int, b: AttentionBlock):
        super().__init__()
        self.norm = Norm2d(dim, 1e-5, act=False)
        self.attn = MultiQueryAttention(dim, b)
        self.layer_scale = LayerScale(dim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.layer_scale(self.attn(self.norm(x))) + x


def _nearest(x: mx.array, size: tuple[int, int]) -> mx.array:
    """mlx-vlm's nearest_interpolate off Metal ([B, C, H, W]: PyTorch's floor(out * in / out_size))."""
    in_h, in_w = x.shape[2:]
    ys = mx.clip(mx.floor(mx.arange(size[0], dtype=mx.float32) * (in_h / size[0])).astype(mx.int32), 0, in_h - 1)
    xs = mx.clip(mx.floor(mx.arange(size[1], dtype=mx.float32) * (in_w / size[1])).astype(mx.int32), 0, in_w - 1)
    return x[:, :, ys][:, :, :, xs]


class FusionAdapter(nn.Module):
    """MobileNetV5MultiScaleFusionAdapter on the pooling path (MobileNetLayout.check_image): the maps
    channels first, the smaller ones nearest-upsampled to the first's size, concatenated; the ffn
    on the (W, H)-swapped map; average-pooled on it to the output resolution; the norm. The result
    keeps the swap: [B, W', H', C] (get_image_features reads the tokens column by column)."""

    def __init__(self, layout: MobileNetLayout):
        super().__init__()
        self._out = tuple(layout.msfa_output_resolution)
        self.ffn = InvertedResidual(layout.msfa_in, layout.msfa_out, 0, 0, 1, 2.0, layer_scale=False, skip=False)
        self.norm = Norm2d(layout.msfa_out, 1e-6, act=False)

    def __call__(self, maps: list[mx.array]) -> mx.array:
        maps = [m.transpose(0, 3, 1, 2) for m in maps]
        high = maps[0].shape[-2:]
        maps = [_nearest(m, high) if any(r < hr for r, hr in zip(m.shape[-2:], high)) else m for m in maps]
        img = self.ffn(mx.concatenate(maps, axis=1).swapaxes(1, 3)).swapaxes(1, 3)
        kh, kw = high[0] // self._out[0], high[1] // self._out[1]
        img = nn.AvgPool2d(kernel_size=(kh, kw), stride=(kh, kw))(img.swapaxes(1, 3))
        return self.norm(img)


class MobileNetV5(nn.Module):
    """`vision_tower.timm_model`: pixels [B, 3, H, W] -> the MSFA's map [B, W', H', msfa_out]."""

    def __init__(self, layout: MobileNetLayout = FULL_LAYOUT):
        super().__init__()
        self.layout = layout
        self.conv_stem = ConvNorm(SameConv(3, layout.stem_channels, 3, 2, 0, (1, 1), 1, bias=True),
                                  layout.stem_channels)
        c, self.blocks = layout.stem_channels, []
        for stage in layout.stages:
            group = []
            for b in stage:
                if isinstance(b, EdgeBlock):
                    group.append(EdgeResidual(c, b))
                elif isinstance(b, UirBlock):
                    if b.strides > 1 and not (b.start_dw_kernel_size or b.mid_dw_kernel_size):
                        raise ConfigError(f"MobileNetV5 layout: a strided inverted residual without a depthwise "
                                          f"conv ({b})")
                    group.append(InvertedResidual(c, b.filters, b.start_dw_kernel_size, b.mid_dw_kernel_size,
                                                  b.strides, b.expand_ratio))
                else:
                    group.append(MobileAttention(c, b))
                c = c if isinstance(b, AttentionBlock) else b.filters
            self.blocks.append(group)
        self.msfa = FusionAdapter(layout)

    def __call__(self, pixels: mx.array, taps: Optional[list] = None) -> mx.array:
        x = self.conv_stem(pixels.transpose(0, 2, 3, 1))
        fused = [x] if 0 in self.layout.msfa_indices else []
        for i, group in enumerate(self.blocks, start=1):
            for block in group:
                x = block(x)
                if taps is not None:
                    taps.append(x)
            if i in self.layout.msfa_indices:
                fused.append(x)
        return self.msfa(fused)
