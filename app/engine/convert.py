"""Convert an HF model folder into a localchat model directory.

HF weights -> our parameters (fused q/k/v, fused gate/up) -> quantized -> TVM tensor-cache
shards, plus `localchat-config.json` and the tokenizer files. Everything is checked before the
first byte is written, built in a temporary sibling directory and renamed into place at the end,
so a failed conversion leaves the output path as it was.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from localchat.engine.models import Architecture, detect_architecture
from localchat.engine.quantization import QuantMode, get_quant_mode, quantize_q4
from localchat.engine.templates import load_chat_template
from localchat.engine.tokenizer import WORLD_VOCAB_FILE, read_json
from localchat.engine.weights import WeightSource, open_weights
from localchat.errors import ModelConfigError, WeightsError

MODEL_CONFIG_FILE = "localchat-config.json"
FORMAT_VERSION = 1
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


def _eos_token_ids(source_dir: Path, hf: dict[str, Any]) -> list[int]:
    ids: Any = None
    gen = source_dir / "generation_config.json"
    if gen.exists():
        ids = read_json(gen).get("eos_token_id")
    if ids is None:
        ids = hf.get("eos_token_id")
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
        scale_name = name[: -len("weight")] + "scale"
        if scale_name in expected:
            words, scale = quantize_q4(value, mode.dtype)
            pairs = [(name, words), (scale_name, scale)]
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
    log: Callable[[str], None] | None = None,
) -> Path:
    """Build a model directory at `output_dir` from the HF folder `source_dir`."""
    source_dir, output_dir = Path(source_dir), Path(output_dir)
    hf = read_hf_config(source_dir)
    arch = detect_architecture(hf)
    mode = get_quant_mode(quantization)
    config = arch.config_from_hf(hf)
    if prefill_chunk_size:
        config.prefill_chunk_size = int(prefill_chunk_size)
    if context_window_size:
        config.context_window_size = int(context_window_size)
    if output_dir.exists() and not (output_dir / MODEL_CONFIG_FILE).exists():
        if any(output_dir.iterdir()):
            raise ModelConfigError(f"{output_dir}: exists and is not a localchat model directory")

    with ExitStack() as stack:
        weights = stack.enter_context(open_weights(source_dir))
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
            "format": FORMAT_VERSION,
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
        (tmp / MODEL_CONFIG_FILE).write_text(json.dumps(meta, indent=2))
        _replace_dir(tmp, output_dir)
    return output_dir


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
