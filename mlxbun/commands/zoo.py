"""`mlxbun zoo`: build tiny checkpoints (`zoo build ARCH... --out DIR`) and list the archs (`zoo list`,
`zoo ls`): the text archs, the graphs held to mlx-vlm, then the VLM checkpoints with their towers
(`gemma3-vision`, ...: the names `zoo:NAME` takes)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "zoo",
        help="tiny checkpoints in Hugging Face layout for every supported arch",
        description="Tiny checkpoints in Hugging Face layout for every supported arch.",
    )
    sub = parser.add_subparsers(dest="zoo_command", metavar="ZOO_COMMAND",
                                parser_class=type(parser))

    build = sub.add_parser("build", help="build checkpoints (one line per checkpoint: arch, the directory written)")
    build.add_argument("archs", nargs="+", metavar="ARCH",
                       help="arch names (`zoo list`; a tower checkpoint's name, e.g. gemma3-vision), or `all` "
                            "(every text arch)")
    build.add_argument("--out", required=True, metavar="DIR", help="output directory")
    build.add_argument("--quant", default=None, metavar="{4,8,mixed,mxfp4}",
                       help="quantize like mlx_lm.convert (affine, group 64; mxfp4: --q-mode mxfp4, "
                            "group 32)")
    build.add_argument("--dtype", default="float32", metavar="{float32,float16,bfloat16}",
                       help="dtype of the unquantized parameters (default float32)")
    build.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    build.add_argument("--head-dim", type=int, default=None, metavar="N",
                       help="widen the heads (zoo default 16; quantized KV needs 32+); "
                            "the same checkpoint as the name zoo:ARCH,head_dim=N")
    build.add_argument("--hf-cache", action="store_true",
                       help="lay out as a hub cache: DIR/models--mlxbun--tiny-ARCH/snapshots/REV")
    build.set_defaults(func=_build)

    listing = sub.add_parser("list", aliases=["ls"], help="list the zoo's archs (and tower checkpoints)")
    listing.set_defaults(func=_list)

    parser.set_defaults(func=lambda args: _help(parser))


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _build(args) -> int:
    from mlxbun.zoo import ARCHS, check_build, make_checkpoint
    from mlxbun.zoo.archs import get_arch

    archs = list(ARCHS) if "all" in args.archs else list(dict.fromkeys(args.archs))
    if "all" in args.archs and args.quant is not None:  # 'all': every arch the options can build
        skipped = [a for a in archs if get_arch(a).unquantizable]
        archs = [a for a in archs if a not in skipped]
        for arch in skipped:
            print(f"{arch}	skipped: float weights only (mlx-lm cannot quantize it)", file=sys.stderr)
    options = dict(quant=args.quant, dtype=args.dtype, seed=args.seed, hf_cache=args.hf_cache,
                   head_dim=args.head_dim)
    for arch in archs:  # refuse every bad argument and destination before building anything
        check_build(arch, args.out, **options)
    for arch in archs:
        path = make_checkpoint(arch, args.out, **options)
        print(f"{arch}\t{path}", flush=True)
    return 0


def _list(args) -> int:
    from mlxbun.zoo import ARCHS, ORACLE_VLM_ARCHS, TOWER_ZOO_ARCHS
    from mlxbun.zoo.towers import describe

    for arch in ARCHS:
        print(arch)
    for arch in ORACLE_VLM_ARCHS:
        print(f"{arch}\t(float weights only; oracle: mlx-vlm)")
    for name in TOWER_ZOO_ARCHS:
        print(f"{name}\t({describe(name)}; oracle: mlx-vlm)")
    return 0
