"""GGUF files (llama.cpp's format) as Hugging Face-layout MLX checkpoints (`mlxbun import gguf`).

- `reader`: the file's metadata and tensor directory (errors name the file);
- `blocks`: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K blocks repacked bit for bit as MLX affine quantization;
- `tensors`: every other GGML type dequantized (llama.cpp's `gguf` library), cast, re-quantized;
- `archs`: config.json and tensor names per architecture, llama.cpp's layout changes undone;
- `tokenizer`: tokenizer.json and tokenizer_config.json rebuilt from the metadata;
- `writer`: shards and JSON files; `importer`: the import (checked, atomic) and its cache.
"""
