"""Hub-layout checkpoints of the multimodal wrappers' text paths (tests/test_wrappers.py and
tests/test_wrappers_text.py): a zoo checkpoint rewritten as the hub ships it, and the prompt."""

import json
import shutil

import mlx.core as mx

IDS = mx.array([[5, 9, 2, 77, 31, 8, 100, 4, 17, 250, 3, 42]])


def rewrite_hub(src, dst, edit, config_edit=None):
    """A copy of checkpoint `src` as one safetensors file, its weights (and config) edited."""
    shutil.copytree(src, dst)
    weights = {}
    for shard in sorted(dst.glob("*.safetensors")):
        weights.update(mx.load(str(shard)))
        shard.unlink()
    (dst / "model.safetensors.index.json").unlink()
    mx.save_safetensors(str(dst / "model.safetensors"), edit(weights), metadata={"format": "pt"})
    if config_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst
