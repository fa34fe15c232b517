"""Import a GGUF file as an HF model folder that `convert_model` reads.

The reading is the same for every architecture; what differs is data each architecture declares
in its module (`models.GgufMap`, found in the registry by the file's `general.architecture`): its
tensor names, the rows llama.cpp reordered, and the config.json its metadata makes. The weights
are dequantized with the `gguf` package and written as one safetensors file, with reordered rows
put back into HF's order; config.json, the tokenizer (tokenizer.json built from the GGUF
vocabulary and merges, giving llama.cpp's token ids) and the chat template come from the GGUF
metadata.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localchat.engine.models import GgufMap, gguf_architectures, gguf_map
from localchat.engine.models.llama import Q6_K_LAYERS_KEY
from localchat.errors import ModelConfigError, UnsupportedModelError, WeightsError

GGUF_MAGIC = b"GGUF"
Log = Callable[[str], None]

# llama.cpp's name of a block's tensor: blk.<layer>.<part>.<weight|bias>
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_ST_DTYPES = {"float32": ("F32", np.float32), "float16": ("F16", np.float16)}

# llama.cpp's token types (tokenizer.ggml.token_type)
_CONTROL = 3
_USER_DEFINED = 4

# Pre-tokenizer splits by `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp applies them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-4o, gpt-oss): Tekken's case-aware words with English contractions kept on the
# word, numbers in runs of up to three digits
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx",
                     "pixtral", "lfm2"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
}
# GPT-2's regex after splitting off every digit (StarCoder-style vocabularies, SmolLM)
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r")


# -- reading ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its name, HF-order shape and the raw (memory-mapped) data."""

    name: str
    shape: tuple[int, ...]  # numpy / HF order (rows first)
    type_name: str
    data: np.ndarray
    tensor_type: Any


@dataclass
class GGUFFile:
    """A GGUF file's metadata (as Python values) and its tensors."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped key such as `llama.block_count`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor_shape(self, name: str) -> tuple[int, ...] | None:
        """A tensor's shape, rows first (None: no such tensor)."""
        t = self.tensors.get(name)
        return None if t is None else t.shape

    def tensor_values(self, name: str) -> np.ndarray:
        """A tensor's values, dequantized to float32 in its shape."""
        return _dequantize(self.tensors[name])


def _field_value(field: Any) -> Any:
    """A reader field as a Python value (string, number, bool or list of them)."""
    from gguf import GGUFValueType

    def scalar(part: np.ndarray, vtype: Any) -> Any:
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part.tolist()[0] if len(part) == 1 else part.tolist()
        return bool(value) if vtype == GGUFValueType.BOOL else value

    types = list(field.types)
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        inner = types[-1]
        return [scalar(field.parts[i], inner) for i in field.data]
    return scalar(field.parts[field.data[0]], types[0])


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file starting with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_gguf(path: Path) -> GGUFFile:
    """Open a GGUF file: metadata parsed, tensor data memory-mapped (not read)."""
    from gguf import GGUFReader

    path = Path(path)
    if not is_gguf(path):
        raise ModelConfigError(f"{path}: not a GGUF file (no GGUF magic)")
    try:
        reader = GGUFReader(str(path), "r")
    except (ValueError, OSError, struct.error, IndexError) as exc:
        raise WeightsError(f"{path.name}: cannot read the GGUF file ({exc})") from None
    metadata = {name: _field_value(field) for name, field in reader.fields.items()}
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        tensors[t.name] = GGUFTensor(t.name, shape, t.tensor_type.name, t.data, t.tensor_type)
    return GGUFFile(path, metadata, tensors)


# Tensors llama.cpp keeps at a higher precision than the rest in its quantized files (Q8_0 or
# Q6_K for Q4_1 files): the token embedding and the output head.
_HEAD_TENSORS = ("token_embd.weight", "output.weight")


def matrix_types(gf: GGUFFile) -> set[str]:
    """The GGUF types of the file's weight matrices (MoE experts' stacked ones too) other than
    the embedding and output head (e.g. {"Q4_1"} for a llama.cpp Q4_1 file)."""
    return {t.type_name for t in gf.tensors.values()
            if len(t.shape) >= 2 and t.name not in _HEAD_TENSORS}


# The CPU mode holding each llama.cpp block type exactly (`quantization.QuantMode.gguf_type`).
_EXACT_MODES = {"Q4_1": "q4f32_asym", "Q4_0": "q4f32_0", "Q4_K": "q4f32_k", "Q8_0": "q8f32_0"}


def exact_quantization(path: Path) -> str | None:
    """The CPU quantization mode that holds the file's weights exactly, if one does: "q4f32_asym"
    when every weight matrix but the embedding / output head is Q4_1, "q4f32_0" when every one is
    Q4_0 (llama.cpp's Q4_1 and Q4_0 files; a Q8_0 or Q4_0 embedding / head is held exactly too, a
    Q6_K one to 8 bits), "q4f32_k" when they are Q4_K, or Q4_K and Q6_K as in Q4_K_M files (both
    exactly: the Q6_K head, attn_v and ffn_down in Q6_K, `q6_k`), "q8f32_0" when they are Q8_0,
    "q4f32_mx" when experts are MXFP4 (held exactly, Q8_0 matrices too, others to 8 bits). The
    import dequantizes to float32 and the mode's quantizer finds each group's block parameters again
    (`quantization`). None otherwise."""
    types = matrix_types(read_gguf(path))
    if "Q4_K" in types and types <= {"Q4_K", "Q6_K"}:
        return "q4f32_k"
    if "MXFP4" in types:  # gpt-oss: MXFP4 experts, the rest Q8_0 (llama.cpp's MXFP4_MOE)
        return "q4f32_mx"
    return _EXACT_MODES.get(types.pop()) if len(types) == 1 else None


# -- config ----------------------------------------------------------------------------------
def architecture_map(gf: GGUFFile) -> GgufMap:
    """How to read this file, from the architecture that declares its `general.architecture`;
    UnsupportedModelError naming it and the supported ones when none does."""
    found = gguf_map(gf.architecture) if gf.architecture else None
    if found is None:
        raise UnsupportedModelError(
            f"{gf.path.name}: GGUF architecture {gf.architecture or 'unknown'!r} is not "
            f"supported (GGUF import supports {', '.join(gguf_architectures())}; for others "
            f"pull the HF repo instead)"
        )
    return found


def _special_ids(gf: GGUFFile) -> dict[str, int]:
    ids = {}
    for key in ("bos", "eos", "unknown", "padding", "eot", "eom"):
        value = gf.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            ids[key] = int(value)
    return ids


def hf_config(gf: GGUFFile) -> dict[str, Any]:
    """The HF config.json described by a GGUF file's metadata and tensor shapes: the keys its
    architecture's `GgufMap.config_keys` name, the vocabulary size (the token embedding's rows),
    the rest from `GgufMap.config`, then the special token ids."""
    gmap = architecture_map(gf)
    read: dict[str, Any] = {}
    for key, (hf_key, kind, default) in gmap.config_keys.items():
        value = gf.arch_key(key)
        if value is None and default is None:
            raise ModelConfigError(f"{gf.path.name}: GGUF metadata has no {gf.architecture}.{key}")
        read[hf_key] = kind(value if value or default is None else default)
    embed = gf.tensor_shape("token_embd.weight")
    if embed is None:
        raise WeightsError(f"{gf.path.name}: no token_embd.weight tensor")
    read["vocab_size"] = int(embed[0])
    config = {**read, **gmap.config(gf, read)}
    ids = _special_ids(gf)
    if "bos" in ids:
        config["bos_token_id"] = ids["bos"]
    if "eos" in ids:
        config["eos_token_id"] = ids["eos"]
    if "padding" in ids:
        config["pad_token_id"] = ids["padding"]
    return config


def inspect_gguf(path: Path) -> dict[str, Any]:
    """The HF config.json a GGUF file amounts to (raises for what localchat cannot import)."""
    return hf_config(read_gguf(path))


# -- tokenizer -------------------------------------------------------------------------------
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _merges(tokens: list[str], merges: list[str] | None,
            scores: list[float] | None) -> list[tuple[str, str]]:
    """The merges the file lists, or (sentencepiece vocabularies) those its scores imply."""
    if merges:
        out = []
        for m in merges:
            left, _, right = m.partition(" ")
            out.append((left, right))
        return out
    vocab = {t: i for i, t in enumerate(tokens)}
    if scores is None:
        scores = [-float(i) for i in range(len(tokens))]
    pairs: list[tuple[str, str, float]] = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:k], piece[k:], float(score)) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        pairs.extend(local)
    pairs.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
    return [(a, b) for a, b, _ in pairs]


def _byte_level_tokenizer(meta: dict[str, Any]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        key = tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab[key] = i
    merges = _merges(tokens, meta.get("tokenizer.ggml.merges"), None)
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre")
    if pre in _PRE_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def _sentencepiece_tokenizer(meta: dict[str, Any]) -> Any:
    """Sentencepiece-style BPE (merges from the scores), tokenizing as llama.cpp does.

    The space prefix is a normalizer, as in the `tokenizer.json` of Llama 2 repos, rather than
    the `Metaspace` pre-tokenizer that transformers' GGUF loader uses: it also marks a leading
    space (" hi" -> "▁▁hi") and the text after each special token, like llama.cpp and
    sentencepiece, where `Metaspace` drops a space in both places.
    """
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges(tokens, meta.get("tokenizer.ggml.merges"), meta.get("tokenizer.ggml.scores"))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                        byte_fallback=True, dropout=None))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", "▁")]
    if prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = None
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        decode.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(decode)
    return tok, None


def build_tokenizer(meta: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A `tokenizers.Tokenizer` from GGUF metadata, and the tokenizer_config.json to go with it.

    Byte-level BPE (`gpt2`) and sentencepiece-style BPE (`llama`) vocabularies are supported;
    control tokens become special tokens and user-defined ones added tokens, so both are matched
    whole in text as llama.cpp does.
    """
    from tokenizers import AddedToken

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelConfigError("the GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    if kind == "gpt2":
        tok, alphabet = _byte_level_tokenizer(meta)
    elif kind == "llama":
        tok, alphabet = _sentencepiece_tokenizer(meta)
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer type {kind!r} is not supported (supported: gpt2, llama)"
        )

    def spelled(token: str) -> bool:
        return alphabet is None or set(token) <= alphabet

    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    specials = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token",
                "padding": "pad_token"}
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "clean_up_tokenization_spaces": False}
    named = []
    for key, field in specials.items():
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            config[field] = tokens[int(token_id)]
            named.append(tokens[int(token_id)])
    control = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
    special = list(dict.fromkeys(t for t in [*control, *named] if spelled(t)))
    if special:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    vocab = tok.get_vocab()
    user = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    for flag in ("add_bos_token", "add_eos_token"):
        value = meta.get(f"tokenizer.ggml.{flag}")
        if value is None and flag == "add_bos_token":
            value = kind == "llama"  # llama.cpp's default for sentencepiece vocabularies
        config[flag] = bool(value)
    return tok, config


# -- weights ---------------------------------------------------------------------------------
def hf_tensor_name(name: str, gmap: GgufMap) -> str | None:
    """The HF name of a GGUF tensor under `gmap`; None for tensors the HF model does not have."""
    if name in gmap.tensors:
        return gmap.tensors[name]
    if name in gmap.ignored:
        return None
    match = _LAYER_RE.match(name)
    if match and match.group(2) in gmap.layer_tensors:
        i, part, kind = match.groups()
        return f"{gmap.layer_prefix.format(i)}{gmap.layer_tensors[part]}.{kind}"
    raise UnsupportedModelError(
        f"unexpected tensor {name!r} in the GGUF file (not one its architecture has)"
    )


def unpermute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its rope pairs adjacent dims, HF's pairs halves)."""
    rows = weight.shape[0]
    half = rows // n_head // 2
    w = weight.reshape(n_head, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def _dequantize(t: GGUFTensor) -> np.ndarray:
    from gguf import quants

    try:
        value = quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"tensor {t.name} has GGUF type {t.type_name}, which the gguf package cannot "
            f"dequantize"
        ) from None
    return np.asarray(value, dtype=np.float32).reshape(t.shape)


def _hf_value(t: GGUFTensor, gmap: GgufMap, config: dict[str, Any]) -> np.ndarray:
    """A tensor's values in HF's layout: dequantized, reordered rows put back, a constant the
    converter added (`GgufMap.shifted`) taken away."""
    value = _dequantize(t)
    match = _LAYER_RE.match(t.name)
    part = match.group(2) if match else t.name
    if match and part in gmap.permuted:
        value = unpermute_rope_rows(value, config[gmap.permuted[part]])
    if part in gmap.shifted:
        value = value - np.float32(gmap.shifted[part])
    return value


def _write_safetensors(path: Path, items: list[tuple[str, tuple[int, ...]]], dtype: str,
                       arrays: Iterator[np.ndarray]) -> None:
    """Write tensors one at a time (memory stays at one tensor) into a safetensors file."""
    st_dtype, np_dtype = _ST_DTYPES[dtype]
    itemsize = np.dtype(np_dtype).itemsize
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in items:
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for (name, shape), array in zip(items, arrays):
            array = np.ascontiguousarray(array, dtype=np_dtype)
            if tuple(array.shape) != tuple(shape):  # pragma: no cover - guards the header
                raise WeightsError(f"tensor {name}: shape {array.shape}, expected {shape}")
            f.write(array.tobytes())


@contextmanager
def _atomic_file(path: Path) -> Iterator[Path]:
    part = path.with_name(path.name + ".part")
    try:
        yield part
        os.replace(part, path)
    finally:
        if part.exists():
            part.unlink()


_Q6_K_PART = re.compile(r"model\.layers\.(\d+)\.(?:self_attn\.(v)_proj|mlp\.(down)_proj)\.weight$")


def _q6_k_layers(items: list[tuple[str, GGUFTensor]]) -> dict[str, list[int]]:
    """The layers whose v or MLP down projection is Q6_K in the file (a Q4_K_M file's attn_v
    and ffn_down in some layers), by part ("v", "down"), for `llama.LlamaConfig.q6_k_layers`."""
    found: dict[str, list[int]] = {}
    for hf_name, t in items:
        m = _Q6_K_PART.match(hf_name)
        if m and t.type_name == "Q6_K":
            found.setdefault(m.group(2) or m.group(3), []).append(int(m.group(1)))
    return {part: sorted(layers) for part, layers in found.items()}


def gguf_to_hf_folder(path: Path, out_dir: Path, *, dtype: str = "float32",
                      log: Log | None = None) -> Path:
    """Write an HF model folder for the GGUF file `path` into `out_dir` (created if needed).

    `dtype` ("float32" or "float16") is the precision of the dequantized weights written; the
    folder has config.json, generation_config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json and, when the file has one, chat_template.jinja.
    """
    if dtype not in _ST_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_ST_DTYPES)}")
    gf = read_gguf(path)
    gmap = architecture_map(gf)
    config = hf_config(gf)
    tokenizer, tok_config = build_tokenizer(gf.metadata)
    if tokenizer.get_vocab_size(with_added_tokens=True) > config["vocab_size"]:
        raise ModelConfigError(
            f"{gf.path.name}: the tokenizer has more tokens than the embedding has rows"
        )
    if "max_position_embeddings" in config:
        tok_config["model_max_length"] = config["max_position_embeddings"]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    items = []
    for t in gf.tensors.values():
        hf_name = hf_tensor_name(t.name, gmap)
        if hf_name is not None:
            items.append((hf_name, t))
    q6_k = _q6_k_layers(items)
    if q6_k:
        config[Q6_K_LAYERS_KEY] = q6_k
    if log:
        log(f"dequantizing {len(items)} GGUF tensors ({gf.path.name})")
    with _atomic_file(out_dir / "model.safetensors") as part:
        _write_safetensors(part, [(n, t.shape) for n, t in items], dtype,
                           (_hf_value(t, gmap, config) for _, t in items))

    ids = _special_ids(gf)
    eos = [ids[k] for k in ("eos", "eot", "eom") if k in ids]
    generation = {"bos_token_id": ids.get("bos"),
                  "eos_token_id": list(dict.fromkeys(eos)) if len(set(eos)) > 1 else
                  (eos[0] if eos else None)}
    files = {
        "config.json": json.dumps(config, indent=2),
        "generation_config.json": json.dumps(
            {k: v for k, v in generation.items() if v is not None}, indent=2),
        "tokenizer_config.json": json.dumps(tok_config, indent=2, ensure_ascii=False),
    }
    template = gf.metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template.strip():
        files["chat_template.jinja"] = template
    for name, text in files.items():
        with _atomic_file(out_dir / name) as part:
            part.write_text(text, encoding="utf-8")
    with _atomic_file(out_dir / "tokenizer.json") as part:
        tokenizer.save(str(part))
    return out_dir
