"""Read checkpoint tensors as numpy: safetensors (sharded or not) and PyTorch zip checkpoints.

Both readers are our own, so neither torch nor arbitrary pickled code is needed at run time:
the safetensors reader checks every tensor lies inside the file (a truncated download is caught
before conversion starts), and the PyTorch reader unpickles with an allow-list that admits only
tensors, storages and plain containers — weights only, never objects that run code.
"""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from localchat.errors import WeightsError

_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,  # widened to float32 on read
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) to float32: the top half of a float32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


class WeightSource:
    """Tensors by HF name from one checkpoint folder; `get` returns float arrays."""

    def __init__(self) -> None:
        self._where: dict[str, Any] = {}

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise WeightsError(f"the checkpoint has no tensor {name!r}")
        return self._read(name)

    def _read(self, name: str) -> np.ndarray:
        raise NotImplementedError


class _SafetensorsSource(WeightSource):
    def __init__(self, files: list[Path]) -> None:
        super().__init__()
        self._maps: list[np.memmap] = []
        for path in files:
            self._index(path)

    def _index(self, path: Path) -> None:
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > size - 8:
                    raise ValueError("header longer than the file")
                header = json.loads(f.read(header_len))
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            raise WeightsError(f"{path.name}: not a valid safetensors file ({exc})") from None
        data_start = 8 + header_len
        mm = np.memmap(path, dtype=np.uint8, mode="r") if size > 0 else None
        self._maps.append(mm)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            if data_start + end > size:
                raise WeightsError(
                    f"{path.name} is truncated: tensor {name} ends at byte {data_start + end} "
                    f"but the file has {size} bytes (re-download it)"
                )
            if info["dtype"] not in _ST_DTYPES:
                raise WeightsError(
                    f"{path.name}: tensor {name} has unsupported dtype {info['dtype']}"
                )
            self._where[name] = (mm, data_start + begin, data_start + end, info)

    def _read(self, name: str) -> np.ndarray:
        mm, begin, end, info = self._where[name]
        raw = np.frombuffer(mm[begin:end], dtype=_ST_DTYPES[info["dtype"]])
        raw = raw.reshape(info["shape"])
        return bf16_to_f32(raw) if info["dtype"] == "BF16" else raw


class _Storage:
    """A reference to a storage record inside a PyTorch zip checkpoint."""

    def __init__(self, dtype: Any, key: str) -> None:
        self.dtype = dtype
        self.key = key


_TORCH_STORAGES = {
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": "bfloat16",
    "DoubleStorage": np.float64,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


def _rebuild_tensor(storage: _Storage, offset: int, size: tuple, stride: tuple, *_: Any):
    return ("tensor", storage, offset, tuple(size), tuple(stride))


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data


class _WeightsOnlyUnpickler(pickle.Unpickler):
    """Resolves only the names a state dict needs; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _rebuild_parameter
        if module == "torch" and name in _TORCH_STORAGES:
            return _TORCH_STORAGES[name]
        if module == "torch" and name in ("float32", "float16", "bfloat16"):
            return {"float32": np.float32, "float16": np.float16, "bfloat16": "bfloat16"}[name]
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} (weights only)")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        _, dtype, key, _location, _numel = pid[:5]
        return _Storage(dtype, str(key))


class _TorchZipSource(WeightSource):
    def __init__(self, files: list[Path]) -> None:
        super().__init__()
        self._zips: list[zipfile.ZipFile] = []
        for path in files:
            self._index(path)

    def _index(self, path: Path) -> None:
        try:
            zf = zipfile.ZipFile(path)
        except zipfile.BadZipFile:
            raise WeightsError(
                f"{path.name}: not a PyTorch zip checkpoint (truncated, or the legacy format, "
                "which is not supported)"
            ) from None
        self._zips.append(zf)
        pkl = next((n for n in zf.namelist() if n.endswith("data.pkl")), None)
        if pkl is None:
            raise WeightsError(f"{path.name}: no data.pkl inside (not a PyTorch checkpoint)")
        prefix = pkl[: -len("data.pkl")]
        try:
            state = _WeightsOnlyUnpickler(zf.open(pkl)).load()
        except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile) as exc:
            raise WeightsError(f"{path.name}: cannot read ({exc})") from None
        if (
            isinstance(state, dict)
            and "state_dict" in state
            and isinstance(state["state_dict"], dict)
        ):
            state = state["state_dict"]
        if not isinstance(state, dict):
            raise WeightsError(f"{path.name}: does not hold a state dict")
        for name, entry in state.items():
            if isinstance(entry, tuple) and entry and entry[0] == "tensor":
                self._where[name] = (zf, prefix, entry)

    def _read(self, name: str) -> np.ndarray:
        zf, prefix, (_, storage, offset, size, stride) = self._where[name]
        try:
            raw = zf.read(f"{prefix}data/{storage.key}")
        except (KeyError, zipfile.BadZipFile, EOFError) as exc:
            raise WeightsError(f"cannot read tensor {name}: {exc}") from None
        is_bf16 = storage.dtype == "bfloat16"
        flat = np.frombuffer(raw, dtype=np.uint16 if is_bf16 else storage.dtype)
        itemsize = flat.itemsize
        count = int(np.prod(size)) if size else 1
        if size and offset + sum((s - 1) * st for s, st in zip(size, stride)) >= flat.size:
            raise WeightsError(f"tensor {name} lies outside its storage (corrupt checkpoint)")
        view = (
            np.lib.stride_tricks.as_strided(
                flat[offset:],
                shape=size,
                strides=tuple(st * itemsize for st in stride),
                writeable=False,
            )
            if size
            else flat[offset : offset + count].reshape(())
        )
        arr = np.ascontiguousarray(view)
        return bf16_to_f32(arr) if is_bf16 else arr


@contextmanager
def open_weights(folder: Path) -> Iterator[WeightSource]:
    """The weights of an HF folder: *.safetensors preferred, else pytorch_model*.bin / *.pth."""
    folder = Path(folder)
    st = sorted(folder.glob("*.safetensors"))
    if st:
        yield _SafetensorsSource(st)
        return
    pt = sorted(folder.glob("pytorch_model*.bin")) or sorted(folder.glob("*.pth"))
    if pt:
        yield _TorchZipSource(pt)
        return
    raise WeightsError(f"{folder}: no weights found (*.safetensors, pytorch_model*.bin or *.pth)")


def open_checkpoint_file(path: Path) -> WeightSource:
    """One checkpoint file of either kind (used for BlinkDL .pth files)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return _SafetensorsSource([path])
    return _TorchZipSource([path])
