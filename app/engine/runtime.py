"""Run a compiled model: load the library and weights on a device, own the KV cache or RNN state,
and expose prefill/decode over sequences (one or several at once).

The Python side owns the loop. A `Sequence` is an id in the model's KV/RNN state; prefill feeds
its new tokens (in chunks when long), decode advances several sequences by one token in one
batched call, fork copies a sequence's state, remove frees it.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from tvm.runtime import ShapeTuple
from tvm.runtime.vm import VirtualMachine

from localchat import model_dir as md
from localchat.engine.amx import request_amx
from localchat.engine.build.compile import (
    CompiledLibrary,
    model_library,
    prebuilt_library,
    quiet_native_output,
)
from localchat.engine.build.quantization import get_quant_mode
from localchat.engine.device import Device, runtime_target_key, select_device
from localchat.engine.memory import check_fits, weight_bytes_on_disk
from localchat.engine.models import Architecture, architecture_state, get_architecture
from localchat.engine.threads import ensure_threads
from localchat.engine.tokenizer import Tokenizer, load_tokenizer
from localchat.errors import (
    GenerationError,
    LocalchatError,
    ModelConfigError,
    ModelNotFoundError,
)

PAGE_SIZE = 16
# TVM's thread count (`threads`: --threads, LOCALCHAT_NUM_THREADS, else physical cores); set
# before any engine's scheduler thread creates its pool.
ensure_threads()
RNN_HISTORY = 1  # RNN-state slots kept per sequence (1: no rollback, popn unsupported)
_LOAD_LOCK = threading.Lock()  # the runtime's tensor cache is one per process


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def _global(name: str) -> Any:
    return tvm.get_global_func(name)


def load_params(model_dir: Path, names: list[str], dev: Any) -> Any:
    """A model directory's weights (TVM tensor cache) on device `dev`, in the packed order of
    `names` (its config's param_names)."""
    with _LOAD_LOCK:
        _global("vm.builtin.tensor_cache.load")(
            str(model_dir), dev.dlpack_device_type(), dev.index
        )
        try:
            params = _global("vm.builtin.param_array_from_cache_by_name")(names)
        finally:
            _global("vm.builtin.tensor_cache.clear")()
    return params


def prefill_chunk_for(meta: dict[str, Any], device_kind: str, chunk: int) -> int:
    """The prefill chunk a model runs with on `device_kind`: `chunk`, but on a GPU no longer
    than its layers' sliding window. TVM 0.27's GPU prefill applies a windowed layer's window
    to the keys of earlier chunks, not among a chunk's own tokens (on an H100, Gemma 3 ran
    exact token by token and wrong from its first prefill); a chunk no longer than the window
    has no key outside it."""
    window = int(meta.get("model_config", {}).get("sliding_window") or 0)
    return min(chunk, window) if window and device_kind != "cpu" else chunk


def forks_share_pages(meta: dict[str, Any], device_kind: str) -> bool:
    """Whether a fork may share its parent's KV pages: not for a model with sliding windows
    on a GPU. TVM 0.27's GPU kernels window a shared block by its own last positions, not by
    the query's (on an H200, Gemma 3 and gpt-oss forked past a page disagreed with the same
    sequence unforked; without windows, and on the CPU, they are equal), so there a fork
    recomputes the parent's prefix instead."""
    window = int(meta.get("model_config", {}).get("sliding_window") or 0)
    return not window or device_kind == "cpu"


@dataclass
class Sequence:
    """A sequence held in the model's state: its id and the tokens it has consumed."""

    seq_id: int
    tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)


class Model:
    """A model directory loaded on a device, with its compiled functions and its state."""

    def __init__(
        self,
        model_dir: Path,
        device: Device | str = "auto",
        *,
        max_batch_size: int = 8,
        max_total_tokens: int | None = None,
        prefill_chunk_size: int | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        model_dir = Path(model_dir)
        if not md.is_model_dir(model_dir):
            raise ModelNotFoundError(f"{model_dir}: not a localchat model directory")
        self.model_dir = model_dir
        self.meta = md.load_config(model_dir)
        self.state_kind = architecture_state(self.meta["architecture"])
        self.mode = get_quant_mode(self.meta["quantization"])
        self.device = select_device(device) if isinstance(device, str) else device
        self.dev = self.device.tvm_device
        self.context_window_size = int(self.meta["context_window_size"])
        self.prefill_chunk_size = prefill_chunk_for(
            self.meta, self.device.kind, int(prefill_chunk_size or self.meta["prefill_chunk_size"]))
        self.forks_share_pages = forks_share_pages(self.meta, self.device.kind)
        self.max_batch_size = max_batch_size
        self.max_total_tokens = int(max_total_tokens or self.context_window_size)
        self.eos_token_ids: list[int] = list(self.meta.get("eos_token_ids") or [])
        if self.device.kind == "cpu" and self.device.target is not None:
            # refused before compiling or loading anything (a runtime-only TVM cannot import
            # the architecture that counts its cache)
            check_fits(model_dir.name, weight_bytes_on_disk(model_dir), self.kv_cache_bytes())

        t0 = time.perf_counter()
        self.library: CompiledLibrary = model_library(
            model_dir, self.arch, self.config, self.mode, self.device.target, log=log
        ) if self.device.target is not None else prebuilt_library(
            model_dir, runtime_target_key(self.device.kind), log=log)
        t1 = time.perf_counter()
        if self.device.kind == "cpu":
            request_amx()  # a library with AMX kernels needs the tiles before its first call
        try:
            with quiet_native_output():
                module = tvm.runtime.load_module(str(self.library.path))
            self.vm = VirtualMachine(module, self.dev)
        except Exception as exc:  # a library that passed its hash but does not load
            raise ModelConfigError(
                f"cannot load the compiled library {self.library.path}: {_first_line(exc)}"
            ) from None
        try:
            self.params = self._load_params()
        except Exception as exc:  # TVM's errors from C++ for unreadable or garbage shards
            raise ModelConfigError(
                f"cannot load the weights of {model_dir}: {_first_line(exc)}; check them with "
                f"`localchat doctor --verify`, repair with `{md.repair_command(model_dir)}`"
            ) from None
        self.load_seconds = time.perf_counter() - t1
        self.compile_seconds = t1 - t0 if self.library.compiled else 0.0
        self._f = {name: self.vm[name] for name in self._function_names()}
        self._kv_add = _global("vm.builtin.kv_state_add_sequence")
        self._kv_remove = _global("vm.builtin.kv_state_remove_sequence")
        self._kv_fork = _global("vm.builtin.kv_state_fork_sequence")
        self._kv_begin = _global("vm.builtin.kv_state_begin_forward")
        self._kv_end = _global("vm.builtin.kv_state_end_forward")
        self._kv_popn = _global("vm.builtin.kv_state_popn")
        self.state = self._create_state()
        self._next_id = 0
        self._sequences: dict[int, Sequence] = {}
        self._lock = threading.RLock()
        self._tokenizer: Tokenizer | None = None
        # Callbacks that free an idle sequence (an engine's prefix cache) when a slot is short.
        self._reclaimers: list[Callable[[], bool]] = []

    # -- loading ---------------------------------------------------------------------------
    @functools.cached_property
    def arch(self) -> Architecture:
        """The model's architecture (imported on use: its module needs TVM's compiler)."""
        return get_architecture(self.meta["architecture"])

    @functools.cached_property
    def config(self) -> Any:
        """The architecture's config of this model."""
        return self.arch.config_from_dict(self.meta["model_config"])

    def _function_names(self) -> list[str]:
        if self.is_encoder:
            return ["encode"]  # models/export.py's encoder_spec
        return ["embed", "prefill", "decode", "batch_prefill", "batch_decode"]

    @property
    def is_encoder(self) -> bool:
        """Whether this is a text encoder (embeddings, `engine.embedding`), not a decoder."""
        return self.state_kind == "encoder"

    def function(self, name: str) -> Any:
        """One of the library's exported functions, by name (called with `self.params` last)."""
        return self._f[name]

    def _load_params(self) -> Any:
        return load_params(self.model_dir, self.meta["param_names"], self.dev)

    def _create_state(self) -> Any:
        if self.is_encoder:
            return None  # an encoder keeps nothing between calls
        if self.state_kind == "rnn":
            return self.vm["create_rnn_state"](
                ShapeTuple([self.max_batch_size]), ShapeTuple([RNN_HISTORY])
            )
        # The scheduler budgets tokens, the cache hands out pages of PAGE_SIZE: a sequence's
        # last page is part-filled, so the cache holds one page per sequence more than the
        # token budget (as kv_cache_bytes counts), or overlapping requests beside a prefix-cache
        # entry found it full ("No page can be allocated").
        return self.vm["create_paged_kv_cache"](
            ShapeTuple([self.max_batch_size]),
            ShapeTuple([self._cache_pages() * PAGE_SIZE]),
            ShapeTuple([self.prefill_chunk_size]),
            ShapeTuple([PAGE_SIZE]),
            ShapeTuple([0]),
        )

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            try:
                self._tokenizer = load_tokenizer(self.model_dir)
            except LocalchatError:
                raise
            except Exception as exc:  # the tokenizers library's own errors on a garbage file
                raise ModelConfigError(
                    f"cannot load the tokenizer of {self.model_dir}: {_first_line(exc)}; "
                    f"repair with `{md.repair_command(self.model_dir)}`"
                ) from None
        return self._tokenizer

    # -- sequences -------------------------------------------------------------------------
    def new_sequence(self) -> Sequence:
        """A new, empty sequence in the model state."""
        with self._lock:
            if len(self._sequences) >= self.max_batch_size:
                raise GenerationError(
                    f"at most {self.max_batch_size} sequences can be held at once"
                )
            seq = Sequence(self._next_id)
            self._next_id += 1
            self._kv_add(self.state, seq.seq_id)
            self._sequences[seq.seq_id] = seq
            return seq

    @property
    def supports_rollback(self) -> bool:
        """Whether a sequence can drop its last tokens (`popn`) and be forked at any position:
        a paged KV cache can; an RNN state (one history slot) only forks at its end."""
        return self.state_kind != "rnn"

    def fork(self, parent: Sequence, at: int | None = None) -> Sequence:
        """A new sequence whose state is a copy of `parent`'s first `at` tokens (None: all).

        A paged KV cache shares the parent's whole pages with the child (copy-on-write of the
        partial last page only), so the parent may be removed while the child lives; where
        `forks_share_pages` is False the child runs the parent's first `at` tokens again."""
        n = len(parent) if at is None else at
        if not 0 <= n <= len(parent) or (n != len(parent) and not self.supports_rollback):
            raise GenerationError(f"cannot fork a {len(parent)}-token sequence at {n}")
        if not self.forks_share_pages and self.state_kind != "rnn":
            child = self.new_sequence()
            if n:
                try:
                    self.prefill(child, parent.tokens[:n])
                except BaseException:
                    self.remove(child)
                    raise
            return child
        with self._lock:
            if len(self._sequences) >= self.max_batch_size:
                raise GenerationError(
                    f"at most {self.max_batch_size} sequences can be held at once"
                )
            child = Sequence(self._next_id, parent.tokens[:n])
            self._next_id += 1
            self._kv_fork(self.state, parent.seq_id, child.seq_id, -1 if n == len(parent) else n)
            self._sequences[child.seq_id] = child
            return child

    def popn(self, seq: Sequence, n: int) -> None:
        """Drop the last `n` tokens of a sequence (KV cache only: an RNN state cannot)."""
        if n == 0:
            return
        if not self.supports_rollback or not 0 < n <= len(seq):
            raise GenerationError(f"cannot roll back {n} of a {len(seq)}-token sequence")
        with self._lock:
            self._kv_popn(self.state, seq.seq_id, n)
            del seq.tokens[-n:]

    def add_reclaimer(self, reclaim: Callable[[], bool]) -> None:
        """Register a callback that frees one idle sequence it keeps (True) or cannot."""
        with self._lock:
            self._reclaimers.append(reclaim)

    def remove_reclaimer(self, reclaim: Callable[[], bool]) -> None:
        """Unregister a callback added with `add_reclaimer`."""
        with self._lock:
            if reclaim in self._reclaimers:
                self._reclaimers.remove(reclaim)

    def reclaim(self, exclude: Callable[[], bool] | None = None) -> bool:
        """Ask the registered callbacks (but `exclude`) to free one idle sequence: several
        engines may share one model, each keeping sequences the others cannot see."""
        with self._lock:
            reclaimers = [r for r in self._reclaimers if r != exclude]
        return any(r() for r in reclaimers)

    def remove(self, seq: Sequence) -> None:
        """Free a sequence's state."""
        with self._lock:
            if self._sequences.pop(seq.seq_id, None) is not None:
                self._kv_remove(self.state, seq.seq_id)

    def reset(self, seq: Sequence) -> None:
        """Forget everything a sequence consumed, keeping its id."""
        with self._lock:
            self._kv_remove(self.state, seq.seq_id)
            self._kv_add(self.state, seq.seq_id)
            seq.tokens.clear()

    # -- forward ---------------------------------------------------------------------------
    def _check_room(self, seq: Sequence, extra: int) -> None:
        if len(seq) + extra > self.context_window_size:
            raise GenerationError(
                f"sequence would hold {len(seq) + extra} tokens; the context window is "
                f"{self.context_window_size}"
            )

    def _embed(self, token_ids: list[int]) -> Any:
        ids = tvm.runtime.tensor(np.asarray(token_ids, dtype=np.int32), self.dev)
        return self._f["embed"](ids, self.params)

    def prefill(self, seq: Sequence, token_ids: list[int]) -> np.ndarray:
        """Feed `token_ids` to `seq` (in chunks) and return the logits after the last one."""
        if not token_ids:
            raise GenerationError("prefill needs at least one token")
        with self._lock:
            self._check_room(seq, len(token_ids))
            chunk = self.prefill_chunk_size
            logits = None
            for start in range(0, len(token_ids), chunk):
                part = token_ids[start : start + chunk]
                self._kv_begin(self.state, ShapeTuple([seq.seq_id]), ShapeTuple([len(part)]))
                out = self._f["prefill"](self._embed(part), self.state, self.params)
                self._kv_end(self.state)
                logits = out[0]
                seq.tokens.extend(part)
            return logits.numpy().reshape(-1)

    def batch_prefill(self, seqs: list[Sequence], token_lists: list[list[int]]) -> np.ndarray:
        """Prefill several sequences in one call; returns logits [len(seqs), vocab]."""
        if len(seqs) != len(token_lists) or any(not t for t in token_lists):
            raise GenerationError("batch_prefill needs one non-empty token list per sequence")
        total = sum(len(t) for t in token_lists)
        if total > self.prefill_chunk_size:
            # Too long for one call: run the sequences one by one (each chunked).
            return np.stack([self.prefill(s, t) for s, t in zip(seqs, token_lists)])
        with self._lock:
            for s, t in zip(seqs, token_lists):
                self._check_room(s, len(t))
            flat = [tok for t in token_lists for tok in t]
            positions = np.cumsum([len(t) for t in token_lists]).astype(np.int32) - 1
            self._kv_begin(
                self.state,
                ShapeTuple([s.seq_id for s in seqs]),
                ShapeTuple([len(t) for t in token_lists]),
            )
            out = self._f["batch_prefill"](
                self._embed(flat), tvm.runtime.tensor(positions, self.dev), self.state, self.params
            )
            self._kv_end(self.state)
            for s, t in zip(seqs, token_lists):
                s.tokens.extend(t)
            return out[0].numpy()

    def decode(self, seqs: list[Sequence], token_ids: list[int]) -> np.ndarray:
        """Advance each sequence by its one token in one batched call; logits [len(seqs), vocab]."""
        if len(seqs) != len(token_ids) or not seqs:
            raise GenerationError("decode needs one token per sequence")
        with self._lock:
            for s in seqs:
                self._check_room(s, 1)
            self._kv_begin(
                self.state, ShapeTuple([s.seq_id for s in seqs]), ShapeTuple([1] * len(seqs))
            )
            if len(seqs) == 1:
                out = self._f["decode"](self._embed(token_ids), self.state, self.params)
            else:
                out = self._f["batch_decode"](self._embed(token_ids), self.state, self.params)
            self._kv_end(self.state)
            for s, t in zip(seqs, token_ids):
                s.tokens.append(t)
            return out[0].numpy().reshape(len(seqs), -1)

    def _cache_pages(self) -> int:
        """Pages of the KV cache: the token budget's, plus one part-filled page per sequence."""
        return -(-self.max_total_tokens // PAGE_SIZE) + self.max_batch_size

    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache (or RNN state) holds for its full capacity."""
        dtype = self.mode.state_dtype(self.state_kind)
        return int(self.arch.cache_bytes(self.config, dtype, self.max_batch_size,
                                         self._cache_pages() * PAGE_SIZE))

    def weight_bytes(self) -> int:
        """Bytes of the parameters as loaded on the device."""
        return sum(int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize for p in self.params)
