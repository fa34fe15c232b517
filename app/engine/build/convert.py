"""Convert an HF model folder into a localchat model directory.

HF weights -> our parameters (fused q/k/v, fused gate/up) -> quantized -> TVM tensor-cache
shards, plus `localchat-config.json` and the tokenizer files. Everything is checked before the
first byte is written, built in a temporary sibling directory and renamed into place at the end,
so a failed conversion leaves the output path as it was. Given a device (`compile_for`), the
library is compiled into the temporary directory too, so a failed compile also leaves nothing.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from localchat import model_dir as md
from localchat.engine.build.pooling import is_sentence_transformers
from localchat.engine.build.q6_k import quantize_q6_k
from localchat.engine.build.quantization import (
    QuantMode,
    get_quant_mode,
    quantize_q8,
    quantize_weight,
)
from localchat.engine.build.weights import WeightSource, open_weights
from localchat.engine.kernels.gemm import weight_panels
from localchat.engine.models import Architecture, detect_architecture
from localchat.engine.templates import load_chat_template
from localchat.engine.tokenizer import WORLD_VOCAB_FILE, read_json
from localchat.errors import ModelConfigError, QuantizationError, WeightsError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    WORLD_VOCAB_FILE,
)


def read_hf_config(source_dir: Path) -> dict[str, Any]:
    """config.json of an HF folder, with a clear error when the folder is not a model."""
    source_dir = Path(source_dir)
    if not source_dir.is_dir():
        raise ModelConfigError(f"{source_dir}: not a directory")
    if not (source_dir / "config.json").exists():
        raise ModelConfigError(f"{source_dir}: no config.json (is this an HF model folder?)")
    return read_json(source_dir / "config.json")


TOKENIZER_MAIN_FILES = ("tokenizer.json", "tokenizer.model", WORLD_VOCAB_FILE)
_POSITIVE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim")
# a multimodal checkpoint's parts besides its language model (converted without them)
_NOT_TEXT_MODEL = ("vision_tower.", "multi_modal_projector.")
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|blocks|h)\.(\d+)\.")


def has_tokenizer(source_dir: Path) -> bool:
    """Whether an HF folder carries a tokenizer localchat can load."""
    return any((Path(source_dir) / f).is_file() for f in TOKENIZER_MAIN_FILES)


def check_hf_config(hf: dict[str, Any], where: Path) -> None:
    """Clear errors for sizes that cannot be: zero, negative or not integers."""
    for key in _POSITIVE_KEYS:
        value = hf.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelConfigError(f"{where / 'config.json'}: {key} must be a positive integer, "
                                   f"got {value!r}")


def check_layer_count(config: Any, names: Any, where: Path) -> None:
    """The checkpoint's layers must be the ones config.json counts."""
    layers = {int(m.group(1)) for n in names if (m := _LAYER_INDEX.search(n))
              and not any(part in n for part in _NOT_TEXT_MODEL)}
    want = getattr(config, "num_hidden_layers", None)
    if layers and isinstance(want, int) and max(layers) + 1 != want:
        raise ModelConfigError(
            f"{where / 'config.json'} says num_hidden_layers={want} but the checkpoint has "
            f"{max(layers) + 1} layers"
        )


def _eos_token_ids(source_dir: Path, hf: dict[str, Any]) -> list[int]:
    ids: Any = None
    gen = source_dir / "generation_config.json"
    if gen.exists():
        ids = read_json(gen).get("eos_token_id")
    if ids is None:  # a multimodal config keeps its language model's ids in text_config
        ids = hf.get("eos_token_id", (hf.get("text_config") or {}).get("eos_token_id"))
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def _model_params(
    arch: Architecture, config: Any, mode: QuantMode, weights: WeightSource
) -> Iterator[tuple[str, np.ndarray]]:
    """Our parameters, converted and quantized, checked against the compiled model's shapes."""
    from localchat.engine.device import cpu_target

    model = arch.build(config, mode, cpu_target())
    expected = {name: p for name, p in model.named_parameters()}
    produced: set[str] = set()
    for name, value in arch.hf_params(config, weights.get, weights.names):
        if name not in expected:
            raise WeightsError(f"internal: converter produced unknown parameter {name}")
        value = np.asarray(value, dtype=np.float32)
        prefix = name[: -len("weight")]
        if prefix + "scale" in expected and str(expected[name].dtype) == "uint8":
            # the Q6_K embedding / LM head of q4f32_k
            q, params = quantize_q6_k(value)
            pairs = [(name, q), (prefix + "scale", params)]
        elif prefix + "scale" in expected and str(expected[name].dtype) == "int8":
            # the 8-bit embedding / LM head of the asymmetric modes
            q, scale = quantize_q8(value)
            pairs = [(name, q), (prefix + "scale", scale)]
        elif prefix + "scale" in expected:
            pairs = [(prefix + part, array) for part, array in quantize_weight(value, mode).items()]
        elif len(expected[name].shape) == 3 and value.ndim == 2:
            # a float weight the model stores as the CPU GEMM reads it (the encoders')
            pairs = [(name, weight_panels(value).astype(str(expected[name].dtype)))]
        else:
            pairs = [(name, value.astype(str(expected[name].dtype)))]
        for pname, array in pairs:
            want = tuple(int(d) for d in expected[pname].shape)
            if tuple(array.shape) != want:
                raise WeightsError(
                    f"weight {pname} has shape {tuple(array.shape)}, the config implies {want}"
                )
            produced.add(pname)
            yield pname, np.ascontiguousarray(array)
    missing = sorted(set(expected) - produced)
    if missing:
        raise WeightsError(f"weights missing for: {', '.join(missing[:5])}")


def convert_model(
    source_dir: Path,
    output_dir: Path,
    quantization: str,
    *,
    prefill_chunk_size: int | None = None,
    context_window_size: int | None = None,
    source_info: dict[str, Any] | None = None,
    compile_for: Any = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Build a model directory at `output_dir` from the HF folder `source_dir`; with
    `compile_for` (a device name such as "cpu", or a `device.Device`), also compile its library
    for that device before the directory is put in place."""
    source_dir, output_dir = Path(source_dir), Path(output_dir)
    hf = read_hf_config(source_dir)
    check_hf_config(hf, source_dir)
    # a sentence-transformers folder of a chat architecture is its embedding model (Qwen3 ->
    # Qwen3-Embedding: the same config.json, only modules.json tells them apart)
    arch = detect_architecture(hf, sentence_transformers=is_sentence_transformers(source_dir))
    mode = get_quant_mode(quantization)
    config = arch.config_from_hf(hf)
    if getattr(config, "q6_k_layers", None) and mode.head_format != "Q6_K":
        # a Q4_K_M file's Q6_K attn_v / ffn_down stay apart only in the modes holding Q6_K
        config.q6_k_layers = {}
    if mode.experts and not getattr(config, "num_experts", 0):
        raise QuantizationError(
            f"{mode.name} keeps mixture-of-experts models' experts in {mode.experts}; "
            f"{arch.name} has no experts (use q4f32_1, or q8f32_0 for 8-bit weights)")
    if prefill_chunk_size:
        config.prefill_chunk_size = int(prefill_chunk_size)
    if context_window_size:
        config.context_window_size = int(context_window_size)
    if output_dir.exists() and not output_dir.is_dir():
        raise ModelConfigError(f"{output_dir}: is a file, not a model directory")
    if output_dir.exists() and not md.is_model_dir(output_dir):
        if any(output_dir.iterdir()):
            raise ModelConfigError(f"{output_dir}: exists and is not a localchat model directory")

    with ExitStack() as stack:
        weights = stack.enter_context(open_weights(source_dir))
        check_layer_count(config, weights.names, source_dir)
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=output_dir.parent, prefix=f".{output_dir.name}.tmp-"))
        stack.callback(lambda: shutil.rmtree(tmp, ignore_errors=True))
        if log:
            log(f"converting {arch.name} weights to {mode.name}")
        _write_params(_model_params(arch, config, mode, weights), tmp)
        for fname in TOKENIZER_FILES:
            if (source_dir / fname).exists():
                shutil.copy2(source_dir / fname, tmp / fname)
        meta = {
            "format": md.format_for(mode.name),
            "architecture": arch.name,
            "quantization": mode.name,
            "model_config": config.to_dict(),
            "context_window_size": config.context_window_size,
            "prefill_chunk_size": config.prefill_chunk_size,
            "vocab_size": config.vocab_size,
            "eos_token_ids": _eos_token_ids(source_dir, hf),
            "bos_token_id": hf.get("bos_token_id"),
            "param_names": param_names(arch, config, mode),
            "source": source_info or {"path": str(source_dir.resolve())},
        }
        if arch.default_template and load_chat_template(tmp) is None:
            meta["template"] = arch.default_template
        if arch.state == "encoder":
            _add_embedding(meta, source_dir, config, tmp)
        md.write_config(tmp, meta)
        md.write_manifest(tmp, repair=f"localchat convert {source_dir.resolve()} --quant "
                          f"{mode.name} --output {output_dir.resolve()} --force")
        if compile_for is not None:
            # inside the temporary directory: a compile that fails takes it away with it
            _compile_into(tmp, arch, config, mode, compile_for, log)
        md.share_modes(tmp)
        _replace_dir(tmp, output_dir)
    return output_dir


def _add_embedding(meta: dict[str, Any], source_dir: Path, config: Any, out: Path) -> None:
    """An encoder's pooling and normalization (from its sentence-transformers files) into its
    config, and those files beside it for reference."""
    from localchat.engine.build.pooling import (
        SENTENCE_TRANSFORMERS_FILES,
        pooling_files,
        read_pooling,
        read_prompts,
    )

    settings = read_pooling(source_dir, config.context_window_size, config.hidden_size)
    meta[md.EMBEDDING_KEY] = {**settings.to_dict(), **read_prompts(source_dir)}
    for rel in (*SENTENCE_TRANSFORMERS_FILES, *pooling_files(source_dir)):
        if (source_dir / rel).is_file():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source_dir / rel, out / rel)


def _compile_into(
    model_dir: Path, arch: Architecture, config: Any, mode: QuantMode, device: Any,
    log: Callable[[str], None] | None,
) -> None:
    """Compile (or find in a library cache) the library for `device` and link it into the
    model directory's lib/, where the runtime looks first."""
    from localchat.engine.build.compile import model_library
    from localchat.engine.device import select_device

    dev = select_device(device) if isinstance(device, str) else device
    model_library(model_dir, arch, config, mode, dev.target, log=log)


def param_names(arch: Architecture, config: Any, mode: QuantMode) -> list[str]:
    """Parameter names in the order the compiled functions take them (packed)."""
    from localchat.engine.device import cpu_target

    return [name for name, _ in arch.build(config, mode, cpu_target()).named_parameters()]


def _write_params(params: Iterator[tuple[str, np.ndarray]], out: Path) -> None:
    import tvm.contrib.tvmjs as tvmjs

    with contextlib.redirect_stdout(io.StringIO()):  # it prints progress lines of its own
        tvmjs.dump_tensor_cache(params, str(out), encode_format="raw", show_progress=False)


def _replace_dir(new: Path, dest: Path) -> None:
    """Move `new` to `dest`, replacing an existing model directory only after it succeeded."""
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{new.name[-8:]}")
        dest.rename(old)
        new.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        new.rename(dest)
