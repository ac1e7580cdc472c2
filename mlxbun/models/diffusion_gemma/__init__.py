"""DiffusionGemma (text): mlx-vlm 0.7.10's `models/diffusion_gemma` graph, op for op (L2).

The model is an encoder-decoder that shares one stack of layers:
- the ENCODER runs causally over the prompt (and, later, over each finished canvas) and
  writes keys/values into per-layer caches (a `KVCache` for full layers, a
  `RotatingKVCache(sliding_window)` for sliding layers), scaling each layer's output by the
  encoder's own `layer_scalar`;
- the DECODER runs bidirectionally over a fixed-length canvas of token ids, attending to the
  encoder's cached keys/values (read, never written) plus the canvas itself, with RoPE
  positions starting at the encoder length, and its own `layer_scalar`s.
The head is the tied embedding with a compiled float32 tanh softcap. A self-conditioning MLP mixes the
previous step's soft embeddings into the canvas embeddings.

Everything numeric is transcribed from mlx-vlm (same ops, casts, python-float constants, the
same `mx.compile`d activations), so single encoder and decoder forwards are bit-identical.
The methods the diffusion engine drives keep mlx-vlm's names (`diffusion_prefill_cache`,
`diffusion_decoder_logits`, ...), so `mlxbun.diffusion` runs this graph or mlx-vlm's model.

Text only: a checkpoint's vision tower is dropped at load with its reason. Not ported:
padded batches (`attention_mask`), static prefix caches, quantized checkpoints.

Modules: `config` (the config dataclasses, their validation, config.json reading),
`layers` (the compiled ops, RoPE, the encoder-cache readers, attention / MLP / MoE /
decoder layer), `model` (encoder, decoder and `DiffusionGemmaModel`, the engine's
surface), `loader` (`load_diffusion_gemma`: checkpoint names, drop rules, audit).
"""
