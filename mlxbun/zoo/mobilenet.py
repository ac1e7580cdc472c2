"""The zoo's tiny gemma3n vision tower and the patch under which mlx-vlm 0.7.10 builds it.

mlx-vlm's gemma3n VisionTower hard-codes MobileNetV5's ~300M layout: its stage list
(`vision.gemma3n_mobilenet_def()`), a 64-channel stem, an MSFA of 1920 -> 2048 channels pooled to
16 x 16. `mobilenet_layout(layout)` swaps exactly those for a `MobileNetLayout`'s: the stage list
(as mlx-vlm's own EdgeResidualConfig / UniversalInvertedResidualConfig /
MultiQueryAttentionBlockConfig), and VisionTower.__init__ rebuilt with mlx-vlm's own ConvNormAct
stem and MobileNetV5MultiScaleFusionAdapter at the layout's widths. Its build(), its blocks and
its forward run unchanged: the oracle is mlx-vlm's code with a shorter stage list.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Mapping

from mlxbun.towers.mobilenet5 import AttentionBlock, EdgeBlock, MobileNetLayout, UirBlock

__all__ = ["TINY_LAYOUT", "mobilenet_layout", "mobilenet_patch", "vlm_stages"]

# one or two blocks a stage, every block kind: strided and residual EdgeResiduals; inverted
# residuals with start + mid, start only, and neither depthwise conv; multi-query attention with
# kv strides 2 (stage 3, a 4 x 4 map) and 1 (stage 4, 2 x 2); the MSFA fuses stages 3 and 4
# (24 + 32 channels), 2 x 2 tokens of 32 from a 64 x 64 image
TINY_LAYOUT = MobileNetLayout(
    stages=((EdgeBlock(3, 8, 2), EdgeBlock(3, 8, 1)),
            (UirBlock(3, 5, 16, 2, 6.0), UirBlock(5, 0, 16)),
            (UirBlock(5, 5, 24, 2, 6.0), UirBlock(0, 0, 24, 1, 1.0), AttentionBlock(2, 8, 2),
             UirBlock(0, 0, 24, 1, 2.0, True)),
            (UirBlock(5, 5, 32, 2, 6.0), AttentionBlock(2, 8, 1), UirBlock(0, 0, 32, 1, 2.0, True))),
    stem_channels=8, msfa_indices=(3, 4), msfa_out=32, msfa_output_resolution=(2, 2))


def vlm_stages(layout: MobileNetLayout) -> list[list]:
    """The layout's stages as mlx-vlm's own block configs (gemma3n_mobilenet_def()'s form: the
    knobs' field names are theirs)."""
    from mlx_vlm.models.gemma3n import config as c

    kinds = {EdgeBlock: c.EdgeResidualConfig, UirBlock: c.UniversalInvertedResidualConfig,
             AttentionBlock: c.MultiQueryAttentionBlockConfig}
    return [[kinds[type(b)](**dataclasses.asdict(b)) for b in stage] for stage in layout.stages]


@contextlib.contextmanager
def mobilenet_layout(layout: MobileNetLayout):
    """mlx-vlm's gemma3n VisionTower built at `layout` while the context lasts (module docstring)."""
    import mlx.nn as nn
    from mlx_vlm.models.gemma3n import vision as v

    stages = vlm_stages(layout)

    def init(self, config):  # mlx-vlm's VisionTower.__init__, its constants the layout's
        nn.Module.__init__(self)
        self.conv_stem = v.ConvNormAct(v.Conv2dSame, in_chs=3, out_chs=layout.stem_channels, kernel_size=3,
                                       stride=2, padding=0, eps=1e-05, bias=True)
        num_features, self.blocks = self.build()
        self.num_features = self.head_hidden_size = num_features
        self.msfa_indices = tuple(layout.msfa_indices)
        self.msfa_output_resolution = tuple(layout.msfa_output_resolution)
        self.msfa = v.MobileNetV5MultiScaleFusionAdapter(in_chs=[layout.msfa_in], out_chs=layout.msfa_out,
                                                         output_resolution=self.msfa_output_resolution)

    saved = v.gemma3n_mobilenet_def, v.VisionTower.__init__
    v.gemma3n_mobilenet_def, v.VisionTower.__init__ = (lambda: stages), init
    try:
        yield
    finally:
        v.gemma3n_mobilenet_def, v.VisionTower.__init__ = saved


def mobilenet_patch(config: Mapping):
    """The context mlx-vlm's model of `config` (a config.json) is built and loaded under: its
    vision_config's mobilenet_layout patched in where it gives one, else nothing."""
    layout = (config.get("vision_config") or {}).get("mobilenet_layout")
    if config.get("model_type") != "gemma3n" or layout is None:
        return contextlib.nullcontext()
    return mobilenet_layout(MobileNetLayout.from_config(layout))
