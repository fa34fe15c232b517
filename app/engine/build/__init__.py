"""The engine's build steps, as `pull` and `convert` call them: check a source's architecture,
convert an HF folder or a GGUF file into a model directory, and compile its library for a device.

The orchestration around them (what to download, the store, locking, progress) is
`localchat.downloader.pull`'s; these steps know nothing of the hub or the store.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from localchat import model_dir as md
from localchat.errors import ModelConfigError

Log = Callable[[str], None]


def check_architecture(hf_config: dict[str, Any]) -> str:
    """The engine's architecture name for an HF config.json, or UnsupportedModelError."""
    from localchat.engine.models import detect_architecture

    return detect_architecture(hf_config).name


def gguf_weights_dtype(quantization: str) -> str:
    """Precision of the intermediate weights of a GGUF import: float32 for q0f32 and for the
    modes that hold a llama.cpp type (a Q4_1 block's d * q + m, a Q4_0 one's (q - 8) * d or a
    Q8_0 one's d * q is a float32 that float16 would round, and those modes are meant to hold
    them exactly), else float16."""
    from localchat.engine.build.quantization import QUANT_MODES

    mode = QUANT_MODES.get(quantization)
    if quantization == "q0f32" or (mode is not None and mode.gguf_type):
        return "float32"
    return "float16"


def gguf_default_quantization(path: Path, device_kind: str) -> str | None:
    """The quantization a .gguf file gets when none is asked for, if the file decides it: the
    mode that holds its weights exactly (`gguf.exact_quantization`: q4f32_asym for a Q4_1 file,
    q4f32_0 for a Q4_0 one), on the CPU; on a GPU only q4f32_mx (MXFP4 experts, decoded inline
    there too). None: the usual default applies (also for a file that cannot be read; the
    import reports that)."""
    from localchat.engine.build.gguf import exact_quantization
    from localchat.errors import LocalchatError

    try:
        exact = exact_quantization(path)
    except LocalchatError:
        return None
    return exact if device_kind == "cpu" or exact == "q4f32_mx" else None


def is_gguf(source: Path) -> bool:
    """Whether `source` is a GGUF file (by name)."""
    return source.is_file() and source.suffix.lower() == ".gguf"


def convert_source(
    source: Path,
    output_dir: Path,
    quantization: str,
    *,
    context_window_size: int | None = None,
    source_info: dict[str, Any] | None = None,
    scratch_dir: Path | None = None,
    log: Log | None = None,
    prefill_chunk_size: int | None = None,
    compile_for: Any = None,
) -> Path:
    """Build a model directory from an HF folder, a .gguf file (imported via a temporary HF
    folder under `scratch_dir`) or a BlinkDL RWKV .pth file (likewise); `compile_for`: as
    `convert.convert_model`'s."""
    from localchat.engine.build.convert import convert_model

    source = Path(source)
    if is_pth(source):
        return _convert_pth(source, output_dir, quantization, scratch_dir,
                            context_window_size=context_window_size,
                            prefill_chunk_size=prefill_chunk_size,
                            source_info=source_info or {"path": str(source.resolve())},
                            compile_for=compile_for, log=log)
    if not is_gguf(source):
        return convert_model(source, output_dir, quantization,
                             context_window_size=context_window_size,
                             prefill_chunk_size=prefill_chunk_size,
                             source_info=source_info, compile_for=compile_for, log=log)
    from localchat.engine.build.gguf import gguf_to_hf_folder

    if scratch_dir is not None:
        scratch_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-import-", dir=scratch_dir) as tmp:
        folder = gguf_to_hf_folder(source, Path(tmp), log=log,
                                   dtype=gguf_weights_dtype(quantization))
        return convert_model(folder, output_dir, quantization,
                             context_window_size=context_window_size,
                             prefill_chunk_size=prefill_chunk_size,
                             source_info=source_info or {"path": str(source.resolve())},
                             compile_for=compile_for, log=log)


def is_pth(source: Path) -> bool:
    """Whether `source` is a BlinkDL RWKV `.pth` checkpoint file (by name)."""
    return source.is_file() and source.suffix.lower() == ".pth"


def _convert_pth(source: Path, output_dir: Path, quantization: str, scratch_dir: Path | None,
                 **options: Any) -> Path:
    """A BlinkDL `.pth` (its RWKV version told by its tensor names, `rwkv4_pth`) through a
    temporary converter folder under `scratch_dir`."""
    from localchat.engine.build.convert import convert_model
    from localchat.engine.models.rwkv4_pth import prepare_pth_source

    if scratch_dir is not None:
        scratch_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pth-import-", dir=scratch_dir) as tmp:
        folder = prepare_pth_source(source, Path(tmp) / source.stem)
        return convert_model(folder, output_dir, quantization, **options)


def inspect_gguf(path: Path) -> dict[str, Any]:
    """The HF config.json a .gguf file amounts to (raises for what cannot be imported)."""
    from localchat.engine.build.gguf import inspect_gguf as inspect

    return inspect(path)


def model_parts(model_dir: Path) -> tuple[Any, Any, Any]:
    """(architecture, model config, quantization mode) of a model directory."""
    from localchat.engine.build.quantization import get_quant_mode
    from localchat.engine.models import get_architecture

    meta = md.read_config(model_dir)  # only these three keys matter; a pull may still be adding
    for key in ("architecture", "model_config", "quantization"):
        if key not in meta:
            raise ModelConfigError(f"{model_dir}: {md.CONFIG_FILE} has no {key!r}")
    arch = get_architecture(meta["architecture"])
    return arch, arch.config_from_dict(meta["model_config"]), get_quant_mode(meta["quantization"])


def library_stem(model_dir: Path, target: Any) -> str:
    """The file stem under `model_dir/lib/` of the library the runtime loads on `target`."""
    from localchat.engine.build.compile import library_file_name

    return Path(library_file_name(*model_parts(model_dir), target)).stem


def compile_model(model_dir: Path, target: Any, *, lib_dir: Path | None = None,
                  log: Log | None = None) -> Path:
    """Compile a model directory's library for `target` into the library cache (or `lib_dir`,
    a store's own cache); returns its path."""
    from localchat.engine.build.compile import compile_library

    return compile_library(*model_parts(model_dir), target, lib_dir, log=log).path
