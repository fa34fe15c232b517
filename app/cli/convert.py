"""`localchat convert`: build a model directory from an HF folder, a .gguf file or a BlinkDL
RWKV .pth file (and compile it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from localchat.cli.common import log
from localchat.errors import LocalchatError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="build a model directory from an HF folder, a .gguf or "
                       "an RWKV .pth")
    p.add_argument("source", help="HF model folder (config.json + weights + tokenizer), a "
                   ".gguf file (llama.cpp's layout) or a BlinkDL RWKV-4/6/7 .pth file")
    # the modes are spelled out rather than read from the engine: --help stays import-free
    p.add_argument("--quant", default=None,
                   help="q0f32, q0f16, q4f32_1, q4f16_1, q4f32_asym, q4f16_asym, q4f32_0, "
                   "q4f16_0, q4f32_k, q8f32_0, q8f16_0 or q4f32_mx (MoE models: MXFP4 experts) "
                   "(default: q4f32_1; on the CPU, for a .gguf of Q4_1, Q4_0, Q4_K(_M) or Q8_0, "
                   "q4f32_asym, q4f32_0, q4f32_k or q8f32_0, which hold its blocks exactly; "
                   "for MXFP4 experts, a .gguf or a folder, q4f32_mx on any device)")
    p.add_argument("--output", "-o", required=True, help="model directory to create")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, metal or vulkan; "
                   "cuda:sm_90 (any sm_NN) compiles for a GPU on another machine, to copy the "
                   "directory there, cpu:sapphirerapids (an LLVM CPU name) for another "
                   "machine's x86-64 CPU")
    p.add_argument("--context-window", type=int, default=None)
    p.add_argument("--prefill-chunk-size", type=int, default=None)
    p.add_argument("--no-compile", action="store_true", help="convert only; compile on first run")
    p.add_argument("--force", action="store_true", help="replace an existing model directory")
    p.set_defaults(handler=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    from localchat import model_dir as md
    from localchat.engine import (
        convert_source,
        get_quant_mode,
        gguf_default_quantization,
        has_tokenizer,
        inspect_gguf,
        is_gguf,
        read_hf_config,
    )

    source, output = Path(args.source), Path(args.output)
    if output.exists() and not output.is_dir():
        raise LocalchatError(f"--output {output} is a file; it names the model directory to "
                             f"create")
    if md.is_model_dir(output) and not args.force:
        raise LocalchatError(f"{output} is already a model directory; add --force to replace it")
    quant = args.quant

    def device_kind() -> str:
        from localchat.engine import select_device

        return args.device.partition(":")[0] if ":" in args.device else \
            select_device(args.device).kind

    if is_gguf(source):
        inspect_gguf(source)  # a file that cannot be imported fails on that first
        if quant is None:
            quant = gguf_default_quantization(source, device_kind())
    elif source.is_file() and source.suffix.lower() == ".pth":
        pass  # a BlinkDL RWKV checkpoint: its version is told (or refused) by convert_source
    else:
        hf = read_hf_config(source)  # a folder that is no model fails on that first
        method = (hf.get("quantization_config") or {}).get("quant_method")
        if quant is None and method == "mxfp4":
            quant = "q4f32_mx"  # OpenAI's MXFP4 experts (gpt-oss), held as they are
        if not has_tokenizer(source):
            raise LocalchatError(f"{source} has no tokenizer (tokenizer.json, tokenizer.model "
                                 f"or the RWKV World vocabulary); `localchat run` needs one")
    quant = quant or "q4f32_1"
    get_quant_mode(quant)  # an unknown mode fails before any work
    from localchat.engine import cross_compile_device

    elsewhere = cross_compile_device(args.device)  # cuda:sm_90: for a GPU not on this machine
    if args.quant is None and quant != "q4f32_1":
        what = "the MXFP4 experts" if quant == "q4f32_mx" else "this file's weights"
        log(f"quantization {quant}: it holds {what} exactly")
    out = convert_source(
        source,
        output,
        quant,
        prefill_chunk_size=args.prefill_chunk_size,
        context_window_size=args.context_window,
        scratch_dir=output.parent,
        # compiled before the directory is put in place: a failed compile leaves nothing
        compile_for=None if args.no_compile else (elsewhere or args.device),
        log=log,
    )
    if elsewhere is not None and not args.no_compile:
        log(f"compiled for {args.device}: copy {out} to the machine with that GPU")
    elif not args.no_compile:
        from localchat.engine import Model

        model = Model(out, args.device, log=log)
        done = "compiled" if model.library.compiled else "found compiled"
        log(f"{done} {model.library.path.name} ({model.compile_seconds:.1f} s)")
    print(out)
    return 0
