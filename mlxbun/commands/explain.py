"""`mlxbun explain ARCH|MODEL`: the resolved forward of a covered arch, as a short listing."""

from __future__ import annotations

import json


def register(sub) -> None:
    from mlxbun.commands.hub_flags import add_offline

    p = sub.add_parser(
        "explain",
        help="print the forward pass the universal graph runs for an arch or a checkpoint",
        description="Print the forward pass the universal graph runs (mlx-lm-style listing): "
                    "ARCH is a model_type or zoo:ARCH (sized by the zoo's tiny config), "
                    "MODEL a checkpoint: a directory, a hub repo id (downloaded once), or a zoo name "
                    "with options such as zoo:llama@q4,head_dim=32 (its config.json).",
    )
    p.add_argument("target", metavar="ARCH|MODEL", help="model_type / zoo:ARCH, or a checkpoint (directory, "
                                                         "hub repo id, zoo:ARCH@VARIANT,...)")
    p.add_argument("--json", action="store_true", help="the structured form, as JSON")
    add_offline(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from mlxbun.explain import explain

    explanation = explain(args.target)
    print(json.dumps(explanation.as_dict(), indent=2) if args.json else explanation.text())
    return 0
