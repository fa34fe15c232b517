"""The reference side of `localchat debug`: the same prompt through HF `transformers` on the CPU
in float32, with a forward hook on every module a probe names (models/probes.py), so each of
our probes has the reference's value beside it.

A reference is an HF model folder, or a llama.cpp `.gguf` file (dequantized to a temporary HF
folder first, so the reference runs on the very weights the file holds), or a BlinkDL RWKV
`.pth` checkpoint, run by the `rwkv` package's reference model: it shows no block outputs, so
its layers are compared by their new state (and the logits as usual).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from localchat.engine.debug.compiled import STATE_PREFIX, ForwardTrace, ProbeValue
from localchat.errors import InvalidRequestError, LocalchatError

Log = Callable[[str], None]
EXTRA = "localchat-tvm[debug]"
# Fused projections some checkpoints have where others have one module per part: a probe of a
# part whose module is missing reads its slice of the fused module's output, in this order.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
PART_OF = {part: (fused, parts) for fused, parts in FUSED.items() for part in parts}
# transformers' RWKV returns its state as five [batch, channels, layers] tensors, in this order
RWKV_STATE = {"state.ffn_x": 0, "state.att_x": 1, "state.att_num": 2, "state.att_den": 3,
              "state.att_max": 4}


class MissingExtraError(LocalchatError):
    """The reference needs packages that are not installed."""


def require_torch() -> None:
    """Raise a one-line error naming the extra when torch or transformers is missing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(
            f"the reference model needs torch and transformers ({exc.name} is missing): "
            f"pip install '{EXTRA}'") from None


@contextmanager
def reference_folder(ref: Path, log: Log | None = None) -> Iterator[Path]:
    """An HF folder for `ref`: the folder itself, or a GGUF file dequantized into a temporary
    one (removed afterwards)."""
    ref = Path(ref).expanduser()
    if ref.is_dir():
        if not (ref / "config.json").is_file():
            raise InvalidRequestError(f"{ref}: not an HF model folder (no config.json)",
                                      "reference")
        yield ref
        return
    if ref.is_file() and ref.suffix.lower() == ".gguf":
        from localchat.engine.build.gguf import gguf_to_hf_folder

        with tempfile.TemporaryDirectory(prefix="localchat-debug-ref-") as tmp:
            if log:
                log(f"dequantizing {ref.name} to float32 for the reference")
            yield gguf_to_hf_folder(ref, Path(tmp), dtype="float32")
        return
    if ref.is_file() and ref.suffix.lower() == ".pth":
        yield ref
        return
    if not ref.exists():
        raise InvalidRequestError(f"reference {ref} does not exist", "reference")
    raise InvalidRequestError(
        f"{ref}: a reference is an HF model folder, a .gguf file or an RWKV .pth", "reference")


# the `rwkv` package's state per layer, in its order: RWKV-4 has five tensors, RWKV-6 and 7 three
BLINK_STATE = ("state.att_x", "state.att_num", "state.att_den", "state.att_max", "state.ffn_x")
BLINK_STATE_V7 = ("state.att_x", "state.att_kv", "state.ffn_x")


def _blink_model(pth: Path) -> Any:
    """The `rwkv` package's model of `pth` (cpu fp32): its `RWKV_x070` for an RWKV-7 file
    (chosen by the module-level switch RWKV_V7_ON, so the module is reloaded with it set and
    reloaded back afterwards), else its generic `RWKV` (RWKV-4 and 6; reloaded with the switch
    off where this process has it on)."""
    import contextlib
    import importlib
    import io
    import os

    os.environ.setdefault("RWKV_JIT_ON", "0")
    os.environ.setdefault("RWKV_CUDA_ON", "0")
    from localchat.engine.build.weights import open_checkpoint_file
    from localchat.engine.models.rwkv7_pth import checkpoint_version

    v7 = checkpoint_version(open_checkpoint_file(pth).names) == 7
    try:
        import rwkv.model as blink
    except ImportError:
        raise MissingExtraError("an RWKV .pth reference needs the rwkv package: "
                                "pip install rwkv") from None
    before = os.environ.get("RWKV_V7_ON")
    if not v7 and before != "1" and blink.RWKV.__name__ == "RWKV":
        return blink.RWKV(model=str(pth), strategy="cpu fp32", verbose=False)
    # it prints banners to stdout, which `--json` output owns
    with contextlib.redirect_stdout(io.StringIO()):
        if not v7:  # the switch is on in this process: the generic class needs it off
            try:
                os.environ.pop("RWKV_V7_ON", None)
                return importlib.reload(blink).RWKV(model=str(pth), strategy="cpu fp32",
                                                    verbose=False)
            finally:
                if before is not None:
                    os.environ["RWKV_V7_ON"] = before
                importlib.reload(blink)
        try:
            os.environ["RWKV_V7_ON"] = "1"
            blink = importlib.reload(blink)
            # RWKV_x070 appends ".pth" to the name it is given
            return blink.RWKV_x070(str(pth.with_suffix("")), "cpu fp32")
        finally:
            if before is None:
                os.environ.pop("RWKV_V7_ON", None)
            else:
                os.environ["RWKV_V7_ON"] = before
            importlib.reload(blink)


def run_blink_reference(pth: Path, token_ids: list[int], num_layers: int) -> ForwardTrace:
    """The `rwkv` package's reference model (cpu fp32) on a BlinkDL RWKV-4, 6 or 7 `.pth`:
    logits at every position and each layer's new state (the layout told by its length: RWKV-6
    has RWKV-7's three tensors per layer, its matrix state also [heads, N, N])."""
    require_torch()
    import torch

    model = _blink_model(pth)
    if getattr(model, "version", None) == 6:
        # the generic class folds blocks.0.ln0 into the embedding in the file's dtype (bfloat16
        # as published: a rounding of its own, ~1e-3 of the logits; its RWKV_x070 folds in
        # float32); localchat folds in float32, so the reference does too
        raw = torch.load(str(pth), map_location="cpu")
        emb = raw["emb.weight"].float()
        model.w["emb.weight"] = torch.nn.functional.layer_norm(
            emb, (emb.shape[1],), weight=raw["blocks.0.ln0.weight"].float(),
            bias=raw["blocks.0.ln0.bias"].float())
        del raw
    with torch.no_grad():
        logits, state = model.forward(list(token_ids), None, full_output=True)
    names = {5 * num_layers: BLINK_STATE, 3 * num_layers: BLINK_STATE_V7}.get(len(state))
    if names is None:
        raise InvalidRequestError(f"{pth.name}: its state has {len(state)} tensors, not the "
                                  f"5 (RWKV-4) or 3 (RWKV-6/7) per layer of {num_layers} "
                                  f"layers",
                                  "reference")
    per = len(names)
    probes = [ProbeValue(layer, name, state[per * layer + i].to(torch.float32).numpy()
                         .reshape(1, -1))
              for layer in range(num_layers) for i, name in enumerate(names)]
    return ForwardTrace(logits.to(torch.float32).numpy().reshape(len(token_ids), -1), probes)


def _blocks(model: Any, count: int) -> Any:
    """The model's list of decoder blocks: its ModuleList of `count` modules."""
    import torch

    found = [m for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == count
             and name.rsplit(".", 1)[-1] in ("layers", "blocks", "h")]
    if not found:
        raise InvalidRequestError(f"the reference has no list of {count} blocks", "reference")
    return found[0]


def run_reference(folder: Path, token_ids: list[int], wanted: list[tuple[int, str]],
                  num_layers: int) -> ForwardTrace:
    """Run the HF model in `folder` over `token_ids` (float32, CPU) and return its logits at
    every position and the value of each (layer, probe name) in `wanted` that it has a module
    for (the others are left out)."""
    require_torch()
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, attn_implementation="eager")
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"transformers cannot load {folder}: "
                                  f"{str(exc).strip().splitlines()[0]}", "reference") from None
    model.eval()
    blocks = _blocks(model, num_layers)
    captured: dict[tuple[int, str], np.ndarray] = {}
    hooks = []

    n = len(token_ids)

    def as_array(value: Any) -> np.ndarray:
        if isinstance(value, (tuple, list)):
            value = value[0]
        if value.ndim == 4 and value.shape[1] != n and value.shape[2] == n:
            value = value.transpose(1, 2)  # [batch, heads, tokens, d] (a norm after transpose)
        return value.detach().to(torch.float32).numpy().reshape(n, -1)

    def add_hook(layer: int, path: str) -> bool:
        """Hook the module `path` names (`:in`: its input) in block `layer`; False: none."""
        module_path, _, where = path.partition(":")
        block = blocks[layer]
        module = block if module_path == "output" else _submodule(block, module_path)
        if module is None:
            return False

        def hook(_mod: Any, args: Any, output: Any) -> None:
            captured[(layer, path)] = as_array(args if where == "in" else output)

        hooks.append(module.register_forward_hook(hook))
        return True

    states = [(layer, name) for layer, name in wanted if name.startswith(STATE_PREFIX)]
    for layer, name in sorted(set(wanted) - set(states)):
        if layer < 0 or add_hook(layer, name) or name not in PART_OF:
            continue
        fused = PART_OF[name][0]  # the checkpoint fuses this projection: split it afterwards
        if (layer, fused) not in captured and add_hook(layer, fused):
            captured[(layer, fused)] = np.empty(0)  # a placeholder: hooked once per block
    try:
        with torch.no_grad():
            out = model(torch.tensor([token_ids], dtype=torch.long), use_cache=bool(states))
    finally:
        for h in hooks:
            h.remove()
    for layer, name in states:
        index = RWKV_STATE.get(name)
        hf_state = getattr(out, "state", None)
        if index is not None and hf_state is not None:  # [batch, channels, layers] each
            captured[(layer, name)] = hf_state[index][0, :, layer].to(torch.float32).numpy() \
                .reshape(1, -1)
    logits = out.logits[0].to(torch.float32).numpy()
    return ForwardTrace(logits, [ProbeValue(layer, name, value)
                                 for (layer, name), value in captured.items()])


def _submodule(block: Any, path: str) -> Any:
    try:
        return block.get_submodule(path)
    except AttributeError:
        return None


def split_fused(reference: ForwardTrace, ours: ForwardTrace) -> None:
    """Replace each fused module's value in `reference` by its parts, cut at the widths of our
    probes of those parts (q/k/v, gate/up)."""
    widths = {(p.layer, p.name): p.value.shape[-1] for p in ours.probes}
    kept: list[ProbeValue] = []
    for p in reference.probes:
        if p.name not in FUSED:
            kept.append(p)
            continue
        start = 0
        for part in FUSED[p.name]:
            width = widths.get((p.layer, part))
            if width is None:
                break
            kept.append(ProbeValue(p.layer, part, p.value[:, start:start + width]))
            start += width
    reference.probes = kept
