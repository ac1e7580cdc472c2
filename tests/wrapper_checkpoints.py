"""Hub-layout checkpoints of the multimodal wrappers' text paths (tests/test_wrappers.py and
tests/test_wrappers_text.py): a zoo checkpoint rewritten as the hub ships it, and the prompt."""

import mlx.core as mx

from tests.checkpoint_edits import rewrite_checkpoint

IDS = mx.array([[5, 9, 2, 77, 31, 8, 100, 4, 17, 250, 3, 42]])


def rewrite_hub(src, dst, edit, config=None):
    """`rewrite_checkpoint` with the hub's metadata ("pt")."""
    return rewrite_checkpoint(src, dst, edit, config, fmt="pt")
