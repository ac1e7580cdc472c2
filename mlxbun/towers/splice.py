"""The prompt splice of image tokens and the merge of the soft tokens into the text embeddings,
one function per `MergeKind`, equal to mlx-vlm's processor (the prompt text expanded around each
image placeholder, then tokenized) and model (`prepare_inputs_for_multimodal`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxbun.towers.errors import ImageCountError
from mlxbun.towers.knobs import MergeKind, SpliceKind

__all__ = ["count_placeholders", "expand_prompt", "image_sequence", "merge_embeddings", "tiles_sequence"]


def image_sequence(kind: SpliceKind, marks: dict[str, str], rows: int, cols: int) -> str:
    """The text one image placeholder becomes, for an image of `rows` x `cols` soft tokens:
    gemma3's processor: blank lines around begin-of-image, the soft-token placeholders,
    end-of-image; qwen2_vl's: the image pad token repeated (its vision start / end tokens are the
    prompt's); pixtral's: each row's image tokens, rows split by the break token, then the end
    token. `marks`: the tokens' texts (boi, image, eoi, break, end)."""
    image = marks["image"]
    if kind is SpliceKind.GEMMA3:
        return f"\n\n{marks['boi']}{image * (rows * cols)}{marks['eoi']}\n\n"
    if kind is SpliceKind.REPEAT:
        return image * (rows * cols)
    if kind is SpliceKind.ROWS:
        return marks["break"].join([image * cols] * rows) + marks["end"]
    raise ValueError(f"no prompt splice for {kind!r}")


def tiles_sequence(marks: dict[str, str], rows: int, cols: int, per_tile: int, whole: int, thumbnail: bool) -> str:
    """LFM2-VL's expansion of one image: start; a tiled image's tiles row-major, each its
    <|img_row_R_col_C|> marker and `per_tile` image tokens, then (thumbnail) the thumbnail marker
    and `whole` tokens; an untiled image's `whole` tokens; end."""
    image = marks["image"]
    if rows > 1 or cols > 1:
        body = "".join(f"<|img_row_{r + 1}_col_{c + 1}|>" + image * per_tile for r in range(rows) for c in range(cols))
        if thumbnail:
            body += marks["thumbnail"] + image * whole
    else:
        body = image * whole
    return marks["start"] + body + marks["end_image"]


def count_placeholders(text: str, placeholder: str, n_images: int, lead: str) -> tuple[str, int]:
    """(`text`, its placeholder count); a prompt without placeholders gets `lead` per image in
    front (gemma3: "<placeholder> " each, as its processor writes for an empty text)."""
    found = text.count(placeholder)
    if found == 0 and n_images:
        text = "".join([lead] * n_images) + text
        found = text.count(placeholder)
    return text, found


def expand_prompt(text: str, placeholder: str, sequences: list[str]) -> str:
    """`text` with its i-th `placeholder` replaced by `sequences[i]`. ImageCountError where the
    placeholders and images disagree."""
    found = text.count(placeholder)
    if found != len(sequences):
        raise ImageCountError(f"the prompt holds {found} image placeholder(s) ({placeholder!r}) but "
                              f"{len(sequences)} image(s) were given")
    parts = text.split(placeholder)
    return parts[0] + "".join(seq + rest for seq, rest in zip(sequences, parts[1:]))


def merge_embeddings(kind: MergeKind, ids: mx.array, embeds: mx.array, features: mx.array, *,
                     image_token_id: int, pad_token_id: int | None, hidden_size: int) -> mx.array:
    """The text model's input rows [B, L, D]: `embeds` (the ids' embeddings), each image-token row
    the next soft token of `features` ([N, T, D], or [tokens, D]); gemma3: pad rows zeroed, the
    soft tokens divided by `hidden_size` ** 0.5 in their dtype."""
    flat_ids = np.array(ids).reshape(-1)
    positions = np.nonzero(flat_ids == image_token_id)[0]
    if kind is MergeKind.IN_ORDER and features.ndim == 3 and features.shape[0] == 1:
        features = features[0]  # pixtral's projector keeps the tower's batch of one sequence
    n_soft = features.shape[0] * features.shape[1] if features.ndim == 3 else features.shape[0]
    if positions.size != n_soft:
        raise ImageCountError(f"the prompt holds {positions.size} image token(s) (id {image_token_id}) "
                              f"for {n_soft} soft tokens")
    if kind is MergeKind.IN_ORDER:  # merge_input_ids_with_image_features (batch 1)
        mask = ids[0] == image_token_id
        index = mx.where(mask, mx.cumsum(mask.astype(mx.int32)) - 1, 0)
        return mx.stack([mx.where(mx.expand_dims(mask, -1), features[index], embeds[0])], axis=0)
    B, L, D = embeds.shape
    if kind is MergeKind.SCATTER:  # masked_scatter: the rows cast to the embeddings' dtype
        out = embeds.reshape(B * L, D)
        out[mx.array(positions.astype(np.uint32))] = features.reshape(-1, D).astype(out.dtype)
        return out.reshape(B, L, D)
    if kind is not MergeKind.GEMMA3_SCALED:
        raise ValueError(f"no merge for {kind!r}")
    scaled = features / (hidden_size ** 0.5)
    pad = pad_token_id if pad_token_id is not None else 0
    out = mx.where((ids == pad)[..., None], mx.zeros_like(embeds), embeds).reshape(B * L, D)
    out[mx.array(positions.astype(np.uint32))] = scaled.reshape(-1, D).astype(out.dtype)
    return out.reshape(B, L, D)
