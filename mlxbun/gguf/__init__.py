"""GGUF files (llama.cpp's format) as Hugging Face-layout MLX checkpoints.

`reader` opens a file (metadata and tensor directory, with errors that name the file).
"""
