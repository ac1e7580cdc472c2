"""`mlxbun import gguf FILE --out DIR`: a GGUF file as a Hugging Face-layout MLX checkpoint."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "import", help="import a model from another format (gguf) as an MLX checkpoint",
        description="Import a model from another format as a Hugging Face-layout MLX checkpoint.")
    sub = parser.add_subparsers(dest="import_format", metavar="FORMAT", parser_class=type(parser))
    g = sub.add_parser(
        "gguf", help="a llama.cpp GGUF file (llama/mistral, qwen2, qwen3, gemma3, phi3)",
        description="Import a llama.cpp GGUF file: config.json, model.safetensors, tokenizer files, "
                    "generation_config.json. Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K tensors stay "
                    "quantized with the same bits (MLX affine, group 32); other GGML types (Q6_K, ...) are dequantized (or re-quantized with "
                    "--quant 4|8; --quant none dequantizes everything). The directory is written in a temp dir and renamed into place.")
    g.add_argument("file", metavar="FILE", help="the .gguf file")
    g.add_argument("--out", required=True, metavar="DIR",
                   help="output directory (refused when not empty, unless it holds an import of the same file)")
    g.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="dtype of float tensors and of packed scales/biases (default float32: exact, and "
                        "MLX's fastest on CPU; float16 rounds the K-quants' scales d*sc, bfloat16 every "
                        "packed scale: each tensor's line says so)")
    g.add_argument("--quant", default="keep", choices=("keep", "none", "4", "8"),
                   help="keep (default): Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K stay packed, other "
                        "GGML types become float; "
                        "4|8: re-quantize those others (affine, group 64); none: dequantize everything")
    g.add_argument("--force", action="store_true", help="replace a non-empty --out whatever it holds")
    g.set_defaults(func=_import_gguf)
    parser.set_defaults(func=lambda args: _help(parser))


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _import_gguf(args) -> int:
    import sys

    from mlxbun.gguf.importer import DEFAULT_DTYPE, import_gguf

    res = import_gguf(args.file, args.out, dtype=args.dtype or DEFAULT_DTYPE, quant=args.quant, force=args.force)
    quantized = f", {res.requantized} of those quantized to {res.quant}-bit g64" if res.requantized else ""
    print(f"{res.out}\t{res.arch} -> {res.model_type}, {res.dtype}: {res.packed} kept packed, "
          f"{res.dequantized} dequantized, {res.floats} float{quantized}; "
          f"{', '.join(res.files)}; {res.seconds:.1f} s")
    if res.swept:
        print(f"note: removed {len(res.swept)} staging director{'y' if len(res.swept) == 1 else 'ies'} a killed "
              f"import left: {', '.join(str(p) for p in res.swept)}", file=sys.stderr)
    for line in res.summary():  # per GGML type: what it became, and whether exactly
        print(f"  {line}")
    rounded = sum(not t["exact"] and t["as"].startswith("packed") for t in res.tensors)
    if rounded:
        print(f"note: {res.dtype} rounds the scales or biases of {rounded} packed tensors "
              "(float32 keeps every one exact)", file=sys.stderr)
    return 0
