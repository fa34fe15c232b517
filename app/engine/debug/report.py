"""The comparison `localchat debug` prints: per layer (and per operation of one layer) the
error of our value against the reference's, the first layer past the quantization's tolerance,
and the final logits' agreement; as a table or as one JSON object."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from localchat.engine.debug.compiled import STATE_PREFIX, ForwardTrace
from localchat.engine.models.probes import LAYER_OUTPUT

# Relative error ||ours - ref|| / ||ref|| of a layer's output past which it "diverges", by the
# precision of the weights: float32 differs from the reference only in summation order;
# float16/bfloat16 activations round every step; 4-bit weights are off by several percent per
# matrix, and errors add up through the layers.
TOLERANCES = {"f32": 1e-3, "f16": 3e-2, "bf16": 6e-2, "4bit": 0.35}
BAR_WIDTH = 12


def tolerance(quantization: str) -> tuple[float, str]:
    """The divergence tolerance for a quantization mode, and how it is described."""
    if quantization.startswith("q0"):
        kind = quantization[2:]
        value = TOLERANCES.get(kind, TOLERANCES["f16"])
        return value, f"{quantization}: {kind} weights and activations"
    return TOLERANCES["4bit"], f"{quantization}: 4-bit weights"


@dataclass
class Row:
    """Our value against the reference's: max |a - b|, ||a - b|| / ||b||, cosine similarity
    (None where the reference has no such value); `nonfinite`: ours holds NaN or Inf."""

    layer: int
    name: str
    max_abs_err: float | None
    rel_err: float | None
    cosine: float | None
    nonfinite: bool = False
    # a recurrent layer: the largest relative error of its new state's tensors
    state_rel_err: float | None = None

    def diverges(self, tol: float) -> bool:
        """Whether this value (or the layer's state) is off by more than `tol`."""
        return any(e is not None and e > tol for e in (self.rel_err, self.state_rel_err))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compare(layer: int, name: str, ours: np.ndarray, ref: np.ndarray | None) -> Row:
    """One row: `ours` against `ref` (same shape), flattened."""
    a = np.asarray(ours, np.float64).reshape(-1)
    nonfinite = not bool(np.isfinite(a).all())
    if ref is None:
        return Row(layer, name, None, None, None, nonfinite)
    b = np.asarray(ref, np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"layer {layer} {name}: ours has {a.size} values, the reference "
                         f"{b.size}")
    diff = a - b
    norm_b, norm_a = float(np.linalg.norm(b)), float(np.linalg.norm(a))
    rel = float(np.linalg.norm(diff) / norm_b) if norm_b else float(np.linalg.norm(diff))
    cos = float(a @ b / (norm_a * norm_b)) if norm_a and norm_b else float(norm_a == norm_b)
    return Row(layer, name, float(np.abs(diff).max()) if diff.size else 0.0, rel, cos, nonfinite)


@dataclass
class DebugReport:
    """The whole comparison of one prompt."""

    model: str
    reference: str
    quantization: str
    tolerance: float
    tolerance_note: str
    tokens: int
    layers: list[Row]
    logits: Row
    top1_agreement: float
    top5_agreement: float
    first_divergent_layer: int | None
    ops_layer: int | None = None
    ops: list[Row] = field(default_factory=list)
    first_divergent_op: str | None = None
    nonfinite: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The report as one JSON-ready object."""
        data = asdict(self)
        data["layers"] = [
            {"layer": r.layer, "max_abs_err": r.max_abs_err, "rel_err": r.rel_err,
             "cosine": r.cosine, "nonfinite": r.nonfinite,
             **({"state_rel_err": r.state_rel_err} if r.state_rel_err is not None else {})}
            for r in self.layers]
        data["logits"] = {"max_abs_err": self.logits.max_abs_err,
                          "rel_err": self.logits.rel_err, "cosine": self.logits.cosine}
        return data

    def render(self) -> str:
        """The report as the table `localchat debug` prints."""
        lines = [f"model {self.model} ({self.quantization}) against {self.reference}, "
                 f"{self.tokens} prompt tokens",
                 f"tolerance: relative error {self.tolerance:g} ({self.tolerance_note})", ""]
        lines += _table("layer", [(str(r.layer), r) for r in self.layers], self.tolerance)
        lines.append("")
        lg = self.logits
        lines.append(f"logits: max abs err {_num(lg.max_abs_err)}, rel err {_num(lg.rel_err)}, "
                     f"cosine {_cos(lg.cosine)}; top-1 agreement {self.top1_agreement:.0%}, "
                     f"top-5 {self.top5_agreement:.0%} over {self.tokens} positions")
        if self.first_divergent_layer is None:
            lines.append(f"no layer diverges (every relative error <= {self.tolerance:g})")
        else:
            row = self.layers[self.first_divergent_layer]
            lines.append(f"first divergent layer: {self.first_divergent_layer} (relative error "
                         f"{_num(row.rel_err)} > {self.tolerance:g}); see it op by op with "
                         f"--ops {self.first_divergent_layer}")
        if self.ops_layer is not None:
            lines += ["", f"layer {self.ops_layer}, operation by operation:"]
            lines += _table("operation", [(r.name, r) for r in self.ops], self.tolerance)
            if self.first_divergent_op:
                lines.append(f"first divergent operation: {self.first_divergent_op}")
            else:
                lines.append("no operation of this layer diverges")
        for where in self.nonfinite:
            lines.append(f"NaN/Inf: {where}")
        lines += self.notes
        return "\n".join(lines)


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def _cos(x: float | None) -> str:
    return "—" if x is None else f"{x:.6f}"


def _bar(rel: float | None, tol: float) -> str:
    """A log-scale bar of the relative error: empty at 1e-7, full at 1; `!` past tolerance."""
    if rel is None:
        return ""
    level = 0.0 if rel <= 1e-7 else min(1.0, (math.log10(rel) + 7) / 7)
    filled = round(level * BAR_WIDTH)
    return "█" * filled + "·" * (BAR_WIDTH - filled) + (" !" if rel > tol else "")


def _table(head: str, rows: list[tuple[str, Row]], tol: float) -> list[str]:
    width = max([len(head)] + [len(label) for label, _ in rows])
    states = any(r.state_rel_err is not None for _, r in rows)
    state_head = f"  {'state err':>9}" if states else ""
    out = [f"{head:<{width}}  {'max abs err':>11}  {'rel err':>9}  {'cosine':>9}{state_head}  "
           f"error"]
    for label, r in rows:
        missing = r.rel_err is None and r.state_rel_err is None
        flag = "  NaN/Inf" if r.nonfinite else ("  (no reference)" if missing else "")
        state = f"  {_num(r.state_rel_err):>9}" if states else ""
        worst = max((e for e in (r.rel_err, r.state_rel_err) if e is not None), default=None)
        out.append(f"{label:<{width}}  {_num(r.max_abs_err):>11}  {_num(r.rel_err):>9}  "
                   f"{_cos(r.cosine):>9}{state}  {_bar(worst, tol)}{flag}")
    return out


def build_report(model: str, reference: str, quantization: str, ours: ForwardTrace,
                 ref: ForwardTrace, ops_layer: int | None = None) -> DebugReport:
    """Compare our trace with the reference's."""
    tol, note = tolerance(quantization)
    refs = {(p.layer, p.name): p.value for p in ref.probes}
    layers = [compare(p.layer, p.name, p.value, refs.get((p.layer, p.name)))
              for p in ours.probes if p.name == LAYER_OUTPUT]
    notes: list[str] = []
    a, b = ours.logits, ref.logits
    if a.shape[-1] != b.shape[-1]:
        notes.append(f"note: vocabularies differ ({a.shape[-1]} and {b.shape[-1]} logits); "
                     f"the first {min(a.shape[-1], b.shape[-1])} are compared")
        v = min(a.shape[-1], b.shape[-1])
        a, b = a[:, :v], b[:, :v]
    logits = compare(-1, "logits", a, b)
    top1 = float(np.mean(a.argmax(-1) == b.argmax(-1)))
    ours_top5 = np.argsort(-a, axis=-1)[:, :5]
    top5 = float(np.mean([b[i].argmax() in ours_top5[i] for i in range(len(b))]))
    for row in layers:  # a recurrent layer's state: its worst tensor
        errs = [compare(p.layer, p.name, p.value, refs.get((p.layer, p.name))).rel_err
                for p in ours.probes if p.layer == row.layer and p.name.startswith(STATE_PREFIX)]
        errs = [e for e in errs if e is not None]
        row.state_rel_err = max(errs) if errs else None
    first = next((r.layer for r in layers if r.diverges(tol)), None)
    nonfinite = [f"layer {p.layer} {p.name}" for p in ours.probes
                 if not np.isfinite(p.value).all()]
    report = DebugReport(model, reference, quantization, tol, note, int(a.shape[0]), layers,
                         logits, top1, top5, first, nonfinite=nonfinite, notes=notes)
    if ops_layer is not None:
        report.ops_layer = ops_layer
        report.ops = [compare(p.layer, p.name, p.value, refs.get((p.layer, p.name)))
                      for p in ours.probes if p.layer == ops_layer]
        report.first_divergent_op = next(
            (r.name for r in report.ops if r.diverges(tol)), None)
    return report
