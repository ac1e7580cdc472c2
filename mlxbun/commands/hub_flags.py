"""`--offline`, for every command that takes a model name: `cli.main` applies it (`mlxbun.hub.go_offline`)
before the command runs, so a hub repo comes from the local cache alone, as under HF_HUB_OFFLINE=1."""

from __future__ import annotations


def add_offline(parser) -> None:
    parser.add_argument("--offline", action="store_true",
                        help="download nothing: a hub repo must be complete in the local hub cache "
                             "(as HF_HUB_OFFLINE=1)")
