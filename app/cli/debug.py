"""`localchat debug MODEL [--reference REF]`: where a compiled model departs from its reference,
layer by layer (and, with --ops LAYER, operation by operation), as a table or JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from localchat.cli.common import log, open_store
from localchat.errors import InvalidRequestError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "debug", help="compare a compiled model with its reference, layer by layer",
        description="Run a prompt through a debug build of MODEL that returns every layer's "
                    "output and through a reference (transformers on the CPU, float32), and "
                    "name the first layer whose error exceeds the tolerance of the model's "
                    "quantization. Needs the debug extra: pip install 'localchat-tvm[debug]'.")
    p.add_argument("model", metavar="MODEL", help="name, name:quantization or model directory")
    p.add_argument("--reference", metavar="REF",
                   help="an HF model folder or a .gguf file (default: the model's own source, "
                        "while it is still on disk)")
    p.add_argument("--prompt", help="the text to run (default: a short English sentence)")
    p.add_argument("--token-ids", metavar="IDS",
                   help="comma-separated token ids to run instead of a prompt (for a model "
                        "without a tokenizer)")
    p.add_argument("--ops", type=int, metavar="LAYER",
                   help="also break layer LAYER (counted from 0) into its operations")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", default="cpu", help="device to run on (default: cpu)")
    p.set_defaults(handler=cmd_debug)


def cmd_debug(args: argparse.Namespace) -> int:
    from localchat import model_dir as md
    from localchat.engine import DEBUG_PROMPT, debug_model

    path = Path(args.model).expanduser()
    model_dir = path if md.is_model_dir(path) else open_store().resolve(args.model)
    meta = md.load_config(model_dir)
    if args.reference:
        reference: Path | None = Path(args.reference).expanduser()
    else:
        from localchat.downloader import source_on_disk

        reference = source_on_disk(open_store(), meta.get("source") or {})
    if reference is None:
        raise InvalidRequestError(
            f"{args.model}: its source is no longer on disk; pass --reference with an HF model "
            f"folder or a .gguf file of the same model", "reference")
    token_ids = None
    if args.token_ids:
        try:
            token_ids = [int(t) for t in args.token_ids.split(",") if t.strip()]
        except ValueError:
            raise InvalidRequestError(f"--token-ids: {args.token_ids!r} is not a comma-separated "
                                      f"list of integers", "token_ids") from None
    report = debug_model(model_dir, reference, prompt=args.prompt or DEBUG_PROMPT,
                         token_ids=token_ids, ops_layer=args.ops, device=args.device, log=log)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.render())
    return 0
