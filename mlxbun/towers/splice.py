"""The prompt splice of image tokens and the merge of the soft tokens into the text embeddings,
one function per `MergeKind`, equal to mlx-vlm's processor (the prompt text expanded around each
image placeholder, then tokenized) and model (`prepare_inputs_for_multimodal`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxbun.towers.errors import ImageCountError
from mlxbun.towers.knobs import MergeKind

__all__ = ["expand_prompt", "image_sequence", "merge_embeddings"]


def image_sequence(kind: MergeKind, boi: str, image: str, eoi: str, tokens_per_image: int) -> str:
    """The text one image placeholder becomes (gemma3's processor: blank lines around
    begin-of-image, the soft-token placeholders, end-of-image)."""
    if kind is MergeKind.GEMMA3_SCALED:
        return f"\n\n{boi}{image * tokens_per_image}{eoi}\n\n"
    raise ValueError(f"no prompt splice for {kind!r}")


def expand_prompt(text: str, placeholder: str, sequence: str, n_images: int) -> str:
    """`text` with each `placeholder` replaced by `sequence`; a prompt without placeholders gets
    one per image in front ("<placeholder> <placeholder> ...", as the processor writes for an
    empty text, then a space). ImageCountError where the placeholders and images disagree."""
    found = text.count(placeholder)
    if found == 0 and n_images:
        text = " ".join([placeholder] * n_images) + " " + text
        found = n_images
    if found != n_images:
        raise ImageCountError(f"the prompt holds {found} image placeholder(s) ({placeholder!r}) but "
                              f"{n_images} image(s) were given")
    return text.replace(placeholder, sequence)


def merge_embeddings(kind: MergeKind, ids: mx.array, embeds: mx.array, features: mx.array, *,
                     image_token_id: int, pad_token_id: int | None, hidden_size: int) -> mx.array:
    """The text model's input rows [B, L, D]: `embeds` (the ids' embeddings) with pad rows zeroed
    and each image-token row the next soft token of `features` [N, T, D] (gemma3: divided by
    `hidden_size` ** 0.5 in the features' dtype)."""
    if kind is not MergeKind.GEMMA3_SCALED:
        raise ValueError(f"no merge for {kind!r}")
    flat_ids = np.array(ids).reshape(-1)
    positions = np.nonzero(flat_ids == image_token_id)[0]
    n_soft = features.shape[0] * features.shape[1]
    if positions.size != n_soft:
        raise ImageCountError(f"the prompt holds {positions.size} image token(s) (id {image_token_id}) "
                              f"for {n_soft} soft tokens")
    scaled = features / (hidden_size ** 0.5)
    pad = pad_token_id if pad_token_id is not None else 0
    B, L, D = embeds.shape
    out = mx.where((ids == pad)[..., None], mx.zeros_like(embeds), embeds).reshape(B * L, D)
    out[mx.array(positions.astype(np.uint32))] = scaled.reshape(-1, D).astype(out.dtype)
    return out.reshape(B, L, D)
