"""`mlxbun kv-plan MODEL --budget KLD`: the per-layer KV plan with the fewest bytes whose measured
mean KLD vs plain KV stays within the budget, written as the kv_config file `mlxbun generate
--kv-config FILE` reads (`mlxbun.parity.kv_plan`: each layer quantized alone, a greedy search,
the final plan measured)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def _bits(text: str) -> list[int]:
    import argparse

    from mlxbun.names import NamingError, comma_items

    try:
        items = comma_items(text, "bit widths")
    except NamingError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    try:
        return [int(b) for b in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _budget(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a mean KLD >= 0 in nats, got {text!r}")
    return value


def register(sub) -> None:
    from mlxbun.names import MODEL_FORMS

    p = sub.add_parser(
        "kv-plan", help="per-layer KV plan: the fewest KV bytes within a KLD budget (a kv_config file)",
        description="Measures each full-attention layer's KV quantized alone at each bit width (KLD vs plain KV "
                    "over a teacher-forced continuation of a text), builds the greedy plan within --budget, "
                    "measures that plan, and writes it as the kv_config file `mlxbun generate --kv-config` reads.")
    p.add_argument("model", metavar="MODEL", help=f"the model ({MODEL_FORMS})")
    p.add_argument("--budget", type=_budget, required=True, metavar="KLD",
                   help="mean KL divergence vs plain KV (nats) the plan may reach, e.g. 0.01")
    p.add_argument("--bits", type=_bits, default=[8, 4, 3, 2], metavar="B,B,...",
                   help="candidate affine KV widths per layer (from 2, 3, 4, 5, 6, 8; default 8,4,3,2)")
    p.add_argument("--group-size", type=int, default=64, help="affine KV group size (32, 64, 128; default 64)")
    p.add_argument("--prompt-file", metavar="FILE", help="the text measured on (default: the zoo corpus, a short "
                   "English story); repeated when shorter than --prefill + --eval-tokens tokens")
    p.add_argument("--prefill", type=int, default=256, metavar="N",
                   help="prompt tokens prefilled through plain KV before the scored tokens (default 256)")
    p.add_argument("--eval-tokens", type=int, default=64, metavar="M",
                   help="teacher-forced tokens scored after the prompt (default 64)")
    p.add_argument("--out", metavar="FILE", help="write the kv_config here (default: print it to stdout)")
    p.add_argument("--zoo-cache", metavar="DIR", help="where zoo checkpoints are built (default ~/.cache/mlxbun/zoo)")
    p.set_defaults(func=run)


def run(args) -> int:
    from mlxbun.atomic import unwritable
    from mlxbun.commands.generate import zoo_hint
    from mlxbun.errors import MlxbunError
    from mlxbun.experiments.common import model_path, optional_tokenizer
    from mlxbun.generation_caches import KVHeadDimError
    from mlxbun.locate import open_runtime
    from mlxbun.parity import kv_plan as kp
    from mlxbun.parity.forced import eval_ids

    if args.prefill < 2 or args.eval_tokens < 1:
        raise MlxbunError(f"--prefill must be >= 2 and --eval-tokens >= 1, got {args.prefill} and {args.eval_tokens}")
    bits = kp.check_bits(args.bits, args.group_size)
    out = None
    if args.out:  # where the plan goes, before the measurement
        out = Path(args.out).expanduser()
        if out.is_dir():
            raise MlxbunError(f"--out {out}: is a directory; give a file path (e.g. {out / 'kv_config.json'})")
        if why := unwritable(out, parents=False):
            raise MlxbunError(f"--out {out}: cannot be written: {why}")
    text = None
    if args.prompt_file:
        file = Path(args.prompt_file).expanduser()
        if not file.is_file():
            raise MlxbunError(f"--prompt-file {file}: no such file")
        text = file.read_text(encoding="utf-8")
    path = model_path(args.model, zoo_root=args.zoo_cache)
    tok = optional_tokenizer(path)
    if tok is None:
        raise MlxbunError(f"{args.model}: the checkpoint has no tokenizer to encode the text")
    probe = kp.KVProbe(open_runtime(path, "mlxbun"), eval_ids(tok, args.prefill + args.eval_tokens, text),
                       prefill=args.prefill)
    if not probe.candidates:
        raise MlxbunError(f"{args.model}: no full-attention KV layer for a plan to quantize")
    try:
        probe.check_group_size(args.group_size)
    except KVHeadDimError as e:
        raise MlxbunError(f"{e}{zoo_hint(args.model, e.group_size, flag='')}") from None
    table = kp.sensitivity(probe, bits, args.group_size)
    found = kp.search_plan(probe, table, args.budget)
    m = found.measured
    meta = {"model": args.model, "budget_kld": args.budget, "kld_mean": m.kld_mean, "kld_p99": m.kld_p99,
            "top1_agreement": m.top1_agreement, "bytes_per_token": m.bytes_per_token,
            "plain_bytes_per_token": probe.plain.bytes_per_token, "predicted_kld": found.predicted_kld,
            "prefill": args.prefill, "eval_tokens": args.eval_tokens, "candidates": probe.candidates,
            "measured_runs": probe.measurements}
    config = json.dumps(kp.kv_config(found.layers, probe.num_layers, meta), indent=1)
    summary = sys.stdout if args.out else sys.stderr
    plan = " ".join(str(found.layers[i][0]) if i in found.layers else "-" for i in probe.candidates)
    print(f"{args.model}: {len(found.layers)} of {probe.num_layers} cache layers quantized "
          f"({len(probe.candidates)} can be); bits per candidate layer: {plan}\n"
          f"measured: mean KLD {m.kld_mean:.4g} nats (budget {args.budget:.4g}, predicted {found.predicted_kld:.4g}), "
          f"top-1 agreement {m.top1_agreement:.4f}, KV {m.bytes_per_token:.0f} bytes/token = "
          f"{m.kv_bytes / probe.plain_bytes:.3f} x plain", file=summary)
    if out is not None:
        out.write_text(config + "\n", encoding="utf-8")
        print(f"wrote {out} (mlxbun generate --kv-config {out})", file=summary)
    else:
        print(config)
    return 0
