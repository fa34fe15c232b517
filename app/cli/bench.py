"""`localchat bench MODEL`: how fast a model runs here (prefill and decode tok/s per batch size,
time to first token, peak memory, load time, decode against the memory-read roofline), as a
small table or one JSON object (--json). Progress goes to stderr; the measuring is
`localchat.engine.run_benchmark`'s."""

from __future__ import annotations

import argparse
import json
from typing import Any

from localchat.engine import add_threads_argument
from localchat.errors import InvalidRequestError, LocalchatError

FLAGS = {"prompt_tokens": "--prompt-tokens", "gen_tokens": "--gen-tokens", "batch": "--batch"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure a model's speed here: prefill, decode, TTFT, memory, roofline",
        description="Prefill a synthetic prompt of N tokens from the model's vocabulary (no "
        "template), then decode with 1, 4, 16… sequences together; report prefill and decode "
        "tok/s, time to first token, peak memory (RSS), load time, and decode as a fraction of "
        "this machine's memory-read bandwidth (measured in the same run).",
    )
    p.add_argument("model", help="model name (pulled first when missing), name:quant, or "
                   "model directory")
    p.add_argument("--prompt-tokens", type=int, default=512, metavar="N",
                   help="prompt length in tokens (default 512)")
    p.add_argument("--gen-tokens", type=int, default=128, metavar="N",
                   help="decode steps per batch size (default 128)")
    p.add_argument("--batch", default="1,4,16", metavar="B[,B...]",
                   help="sequences decoded together, comma-separated (default 1,4,16)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, metal or vulkan")
    add_threads_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_bench)


def parse_batches(text: str) -> list[int]:
    """`--batch 1,4,16` as integers, or a LocalchatError naming the bad item."""
    sizes = []
    for item in text.split(","):
        try:
            sizes.append(int(item.strip()))
        except ValueError:
            raise LocalchatError(f"--batch: {item.strip()!r} is not a whole number (give sizes "
                                 "like 1,4,16)") from None
    return sizes


def _flagged(exc: InvalidRequestError) -> LocalchatError:
    """The library's error about an option, naming the command-line flags instead."""
    if exc.param not in FLAGS:
        return exc
    text = str(exc)
    for param, flag in FLAGS.items():
        text = text.replace(param, flag)
    return LocalchatError(text)


def cmd_bench(args: argparse.Namespace) -> int:
    """`localchat bench MODEL [options]`."""
    from localchat.cli.common import log
    from localchat.cli.pull import ensure_local_model
    from localchat.engine import check_bench_options, configure_threads, run_benchmark

    try:
        batches = check_bench_options(args.prompt_tokens, args.gen_tokens,
                                      parse_batches(args.batch))
        threads = configure_threads(args.threads)  # before any kernel runs in this process
        model = ensure_local_model(args.model, args.device)
        result = run_benchmark(model, prompt_tokens=args.prompt_tokens,
                               gen_tokens=args.gen_tokens, batches=batches, device=args.device,
                               threads=threads, progress=lambda line: log(f"bench: {line}"))
    except InvalidRequestError as exc:
        raise _flagged(exc) from None
    except KeyboardInterrupt:
        log("localchat: bench interrupted")
        return 130
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(format_table(result))
    return 0


def format_table(result: Any) -> str:
    """The result as a small aligned table, then the roofline's terms in a note."""
    from localchat.cli.common import human_size

    rows = [
        ("load", f"{result.load_s:.2f} s"
         + (f" (+ compile {result.compile_s:.1f} s)" if result.compile_s else "")),
        ("prefill", f"{result.prefill_tok_s:,.1f} tok/s"),
        ("time to first token", f"{result.ttft_s * 1000:,.1f} ms"),
    ]
    rows += [(f"decode, batch {d.batch}", f"{d.tok_s:,.1f} tok/s") for d in result.decode]
    rows.append(("peak memory (RSS)", human_size(result.peak_rss_bytes)))
    if result.bandwidth_gb_s is not None:
        rows.append(("read bandwidth", f"{result.bandwidth_gb_s:.1f} GB/s"))
    rows.append(("bytes read per token", human_size(int(result.bytes_per_token))))
    if result.roofline_fraction is not None:
        fraction = result.roofline_fraction
        rows.append(("of roofline", f"{fraction:.0%}" if fraction >= 0.1 else f"{fraction:.1%}"
                     + f" (decode, batch {result.decode[0].batch})"))
    width = max(len(name) for name, _ in rows) + 2
    head = (f"{result.model}:{result.quantization} on {result.device}, "
            f"{result.threads} thread{'s' if result.threads != 1 else ''}; prompt "
            f"{result.prompt_tokens} tokens, {result.gen_tokens} decode steps per batch size")
    lines = [head, ""] + [f"  {name:<{width}}{value}" for name, value in rows]
    first = result.decode[0]
    note = (f"bytes read per token: the weights as stored "
            f"({human_size(result.weight_bytes_per_step)} a step; an untied input embedding "
            f"counts one row) + the KV cache or state of each sequence at its mean length "
            f"({human_size(int(result.state_bytes_per_sequence))}), over the batch "
            f"({first.batch}); activations left out.")
    if result.bandwidth_gb_s is not None:
        note += (" Bandwidth: a compiled streaming sum, sampled before and after the run "
                 "(the mean).")
    return "\n".join([*lines, "", note])

