"""gemma3n's language model (mlx-lm 0.32.2 `models/gemma3n.py`), a dedicated port held bit-exact
(L1) to mlx-lm: `config` (the checked text_config and its key coverage), `layers` (AltUp,
LAuReL, sparse MLP, KV-shared attention, the decoder layer), `model` (the backbone and the
RuntimeModel), `loader` (sanitize, quantize, audit, load), `explain` (`mlxbun explain`).

Why a dedicated port rather than a universal row: the hidden state between layers is a stack of
AltUp streams, every layer takes a per-layer input slice and the cache list is shorter than the
layer list (shared layers read their owner's cache); none of that is a branch point of the
universal block, so the port reuses mlxbun's layers, rope factory and attention dispatch (every
mlxbun cache attends through it) and is selected by its family profile.
"""
