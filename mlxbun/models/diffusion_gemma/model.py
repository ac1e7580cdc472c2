"""DiffusionGemmaModel: the encoder-decoder over one shared stack of layers, with the
methods mlxbun's diffusion engine drives (mlx-vlm 0.7.10's names)."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import UnsupportedModelError
from mlxbun.models.base import create_attention_mask
from mlxbun.models.diffusion_gemma.config import (
    FULL,
    MODEL_TYPE,
    SLIDING,
    DiffusionGemmaConfig,
    DiffusionGemmaTextConfig,
    eos_token_ids,
)
from mlxbun.models.diffusion_gemma.layers import (
    DecoderLayer,
    SelfConditioning,
    cache_offset,
    cache_state,
    make_compiled_softcap,
)
from mlxbun.models.taps import capture

__all__ = ["DiffusionGemmaModel"]


class _ScalarOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_scalar = mx.ones((1,))


class EncoderLanguageModel(nn.Module):
    """The encoder's own parameters: one `layer_scalar` per layer (the rest is the decoder's)."""

    def __init__(self, num_layers: int):
        super().__init__()
        self.layers = [_ScalarOnly() for _ in range(num_layers)]


class Encoder(nn.Module):
    def __init__(self, num_layers: int):
        super().__init__()
        self.language_model = EncoderLanguageModel(num_layers)


class Decoder(nn.Module):
    def __init__(self, c: DiffusionGemmaTextConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_scale = c.hidden_size**0.5
        self.layers = [DecoderLayer(c, i) for i in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_conditioning = SelfConditioning(c)

    def embed_canvas(self, canvas_ids, self_conditioning_embeddings=None):
        inputs_embeds = self.embed_tokens(canvas_ids) * self.embed_scale
        if self_conditioning_embeddings is not None:
            soft_embeddings = self_conditioning_embeddings.astype(inputs_embeds.dtype)
        else:
            soft_embeddings = mx.zeros_like(inputs_embeds)
        return self.self_conditioning(inputs_embeds, soft_embeddings)

    def make_masks(self, canvas_length: int, batch: int, caches):
        """mlx-vlm `_make_decoder_masks` without a padding mask: per layer kind, None (all
        visible) or a bool row [B, 1, canvas, encoder + canvas] hiding out-of-window keys."""
        masks = {}
        for layer_type in set(self.config.layer_types):
            cache = next((c for c, layer in zip(caches or [], self.layers)
                          if layer.layer_type == layer_type), None)
            state = cache_state(cache)
            encoder_len = state[0].shape[2] if state is not None else 0
            valid_encoder_len = min(cache_offset(cache), encoder_len)
            key_len = encoder_len + canvas_length
            if layer_type == FULL:
                if encoder_len == valid_encoder_len:
                    masks[layer_type] = None
                else:
                    row = mx.concatenate([mx.arange(encoder_len) < valid_encoder_len,
                                          mx.ones((canvas_length,), dtype=mx.bool_)], axis=0)
                    masks[layer_type] = mx.broadcast_to(row[None, None, None, :],
                                                        (batch, 1, canvas_length, key_len))
                continue
            window_prefix = max(self.config.sliding_window - 1, 0)
            if encoder_len == valid_encoder_len and encoder_len <= window_prefix:
                masks[layer_type] = None
                continue
            start = max(0, valid_encoder_len - window_prefix)
            positions = mx.arange(encoder_len)
            encoder_mask = (positions >= start) & (positions < valid_encoder_len)
            canvas_mask = mx.ones((canvas_length,), dtype=mx.bool_)
            row = mx.concatenate([encoder_mask, canvas_mask], axis=0)
            masks[layer_type] = mx.broadcast_to(row[None, None, None, :],
                                                (batch, 1, canvas_length, key_len))
        return masks

    def __call__(self, canvas_ids, cache=None, self_conditioning_embeddings=None, masks=None):
        h = self.embed_canvas(canvas_ids, self_conditioning_embeddings)
        cache = cache or [None] * len(self.layers)
        if masks is None:
            masks = self.make_masks(h.shape[1], h.shape[0], cache)
        offset = cache_offset(cache[0]) if cache else 0
        for layer, c in zip(self.layers, cache):
            h = layer(h, masks.get(layer.layer_type), c, decoder=True, offset=offset)
        return self.norm(h)


class Backbone(nn.Module):
    def __init__(self, c: DiffusionGemmaTextConfig):
        super().__init__()
        self.decoder = Decoder(c)
        self.encoder = Encoder(c.num_hidden_layers)


class DiffusionGemmaModel(nn.Module):
    """The DiffusionGemma text graph. Parameter paths are mlx-vlm's (after its sanitize).

    Engine surface (mlx-vlm's names): `make_cache`, `diffusion_prefill_cache`,
    `diffusion_update_cache`, `diffusion_decoder_masks`, `diffusion_decoder_logits`,
    `diffusion_prepare_self_conditioning`, `diffusion_self_conditioning`.
    """

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        self.config = config
        self.profile = None
        tc = config.text_config
        self.model = Backbone(tc)
        self._softcap = make_compiled_softcap(float(tc.final_logit_softcapping))

    # -- identity

    @property
    def model_type(self) -> str:
        return MODEL_TYPE

    @property
    def layers(self):
        return self.model.decoder.layers

    @property
    def weights_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids the model declares: config.json / generation_config.json's top-level ones."""
        return eos_token_ids(self.config)

    def make_cache(self, **kv_options) -> list:
        """One cache per layer: KVCache for full layers, RotatingKVCache(window) for sliding.
        (The decoder reads these caches' raw keys/values: no quantized or bounded variants.)"""
        if any(v is not None for v in kv_options.values()):
            raise UnsupportedModelError(
                f"DiffusionGemma: KV cache options are not supported ({', '.join(sorted(kv_options))})"
            )
        tc = self.config.text_config
        return [KVCache() if t == FULL else RotatingKVCache(max_size=tc.sliding_window)
                for t in tc.layer_types]

    # -- encoder

    def _embed_inputs(self, input_ids):
        cfg, dec = self.config, self.model.decoder
        image_mask = (input_ids == cfg.image_token_id if cfg.image_token_id is not None
                      else mx.zeros(input_ids.shape, dtype=mx.bool_))
        video_mask = (input_ids == cfg.video_token_id if cfg.video_token_id is not None
                      else mx.zeros(input_ids.shape, dtype=mx.bool_))
        # mlx-vlm replaces media placeholder ids by the pad id before the embedding
        llm_input_ids = mx.where(image_mask | video_mask, cfg.text_config.pad_token_id, input_ids)
        return dec.embed_tokens(llm_input_ids) * dec.embed_scale

    def encode(self, input_ids, cache=None):
        """Causal encoder pass: writes every layer's keys/values into `cache`; returns
        (final-norm hidden states, cache)."""
        tc = self.config.text_config
        h = self._embed_inputs(input_ids)
        if cache is None:
            cache = self.make_cache()
        dec = self.model.decoder
        masks = [
            create_attention_mask(h, c, window_size=tc.sliding_window if layer.layer_type == SLIDING else None)
            for layer, c in zip(dec.layers, cache)
        ]
        scalars = self.model.encoder.language_model.layers
        for layer, c, mask, s in zip(dec.layers, cache, masks, scalars):
            h = layer(h, mask, c, decoder=False, layer_scalar=s.layer_scalar)
        return dec.norm(h), cache

    def diffusion_prefill_cache(self, input_ids, *, cache=None, prefill_step_size: Optional[int] = None,
                                chunk_prefill: bool = False, **unsupported):
        """Encode the prompt into `cache` (in `prefill_step_size` chunks when `chunk_prefill`)."""
        _refuse_media(unsupported)
        if not chunk_prefill:
            _, cache = self.encode(input_ids, cache)
            return cache
        for start in range(0, input_ids.shape[1], prefill_step_size):
            end = min(start + prefill_step_size, input_ids.shape[1])
            _, cache = self.encode(input_ids[:, start:end], cache)
            mx.eval([a for c in cache for a in (c.keys, c.values)])
            mx.clear_cache()
        return cache

    def diffusion_update_cache(self, input_ids, *, cache):
        """Feed a finished canvas through the encoder (appends it to the caches)."""
        _, cache = self.encode(input_ids, cache)
        return cache

    def chunked_prefill_policy(self, **_):
        return True  # text-only, unpadded: mlx-vlm's policy allows chunking

    # -- decoder

    @property
    def prefers_logits_self_conditioning(self) -> bool:
        return False  # only for a quantized embedding (not ported)

    def diffusion_prepare_self_conditioning(self):
        return self.model.decoder.embed_tokens.weight

    def diffusion_self_conditioning(self, processed_logits, embedding_weight):
        """Soft embeddings of the processed logits, stored in the embedding dtype (as HF)."""
        dec = self.model.decoder
        probs = mx.softmax(processed_logits.astype(embedding_weight.dtype), axis=-1, precise=True)
        return (probs.astype(embedding_weight.dtype) @ embedding_weight).astype(
            embedding_weight.dtype
        ) * dec.embed_scale

    def diffusion_decoder_masks(self, canvas_ids, cache, decoder_attention_mask=None):
        if decoder_attention_mask is not None:
            raise UnsupportedModelError("DiffusionGemma: padded prompts (decoder_attention_mask) are not ported")
        return self.model.decoder.make_masks(canvas_ids.shape[1], canvas_ids.shape[0], cache)

    def decode_hidden(self, canvas_ids, cache=None, self_conditioning=None, masks=None):
        """Decoder pass over the canvas (reads, never writes, `cache`): final hidden states."""
        return self.model.decoder(canvas_ids, cache=cache, self_conditioning_embeddings=self_conditioning,
                                  masks=masks)

    def logits_from_hidden(self, h):
        return self._softcap(self.model.decoder.embed_tokens.as_linear(h))

    def diffusion_decoder_logits(self, canvas_ids, cache=None, self_conditioning=None,
                                 decoder_attention_mask=None):
        """Decoder logits [B, canvas, V] (float32, softcapped). `decoder_attention_mask` is
        mlx-vlm's slot, which carries the precomputed per-kind mask dict."""
        masks = decoder_attention_mask
        if masks is not None and not isinstance(masks, dict):
            raise UnsupportedModelError("DiffusionGemma: padded prompts (decoder_attention_mask) are not ported")
        return self.logits_from_hidden(self.decode_hidden(canvas_ids, cache, self_conditioning, masks))

    def __call__(self, input_ids=None, cache=None, canvas_ids=None, self_conditioning_embeddings=None):
        """mlx-vlm `Model.__call__` (text): optional encoder pass, then decoder logits. A
        missing canvas is drawn uniformly at random, as mlx-vlm draws it."""
        if input_ids is not None:
            _, cache = self.encode(input_ids, cache)
        elif cache is None:
            raise ValueError("DiffusionGemma: give input_ids or an encoder cache")
        if canvas_ids is None:
            canvas_ids = mx.random.randint(0, self.config.text_config.vocab_size,
                                           (input_ids.shape[0], self.config.canvas_length))
        h = self.model.decoder(canvas_ids, cache=cache,
                               self_conditioning_embeddings=self_conditioning_embeddings)
        return self.logits_from_hidden(h)

    def layers_tap(self, paths=None):
        return capture(self, paths)


def _refuse_media(kwargs: dict) -> None:
    for key in ("pixel_values", "mm_token_type_ids", "attention_mask"):
        if kwargs.pop(key, None) is not None:
            raise UnsupportedModelError(f"DiffusionGemma (text graph): {key} is not supported")
    if kwargs:
        raise TypeError(f"unexpected arguments: {', '.join(sorted(kwargs))}")

