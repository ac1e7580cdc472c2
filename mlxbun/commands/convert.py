"""`mlxbun convert SRC --out DIR`: a Hugging Face checkpoint as an MLX one, as mlx_lm.convert writes it."""

from __future__ import annotations


def register(sub) -> None:
    from mlxbun.commands.hub_flags import add_offline
    from mlxbun.convert import DTYPES, GROUP_SIZES, QUANTS
    from mlxbun.names import MODEL_FORMS

    p = sub.add_parser(
        "convert", help="a Hugging Face checkpoint (or any model name) as an MLX one, byte-identical to mlx_lm.convert",
        description="Convert a checkpoint as mlx_lm.convert does with the same options (its own load, cast, "
                    "quantize and save), written in a staging directory and renamed into place. A hub repo "
                    "is downloaded first (ORG/REPO[@REVISION]).")
    p.add_argument("src", metavar="SRC", help=f"the model ({MODEL_FORMS})")
    p.add_argument("--out", required=True, metavar="DIR", help="the new MLX checkpoint directory (must not exist)")
    p.add_argument("--quant", choices=QUANTS, help="4|8: affine quantization (mlx_lm.convert -q --q-bits N); a "
                   "mixed recipe: mlx_lm.convert -q --quant-predicate RECIPE (default: not quantized)")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=64,
                   help="quantization group size (mlx_lm.convert --q-group-size; default 64)")
    p.add_argument("--dtype", choices=DTYPES, help="dtype of the unquantized parameters (default: the "
                   "config's torch_dtype, as mlx_lm.convert)")
    p.add_argument("--upload", metavar="REPO", help="not supported (see the error it gives)")
    add_offline(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from mlxbun.convert import ConvertError, convert

    if args.upload is not None:
        raise ConvertError(f"--upload {args.upload}: mlxbun does not upload (it could not be tested against a "
                           "stand-in hub); convert, then upload the directory with `hf upload REPO DIR`")
    print(convert(args.src, args.out, quant=args.quant, group_size=args.group_size, dtype=args.dtype))
    return 0
