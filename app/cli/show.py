"""`localchat show NAME`: a stored model's config, template, source and revision, libraries and
files (or one JSON document)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from localchat.cli.common import human_size, open_store
from localchat.errors import LocalchatError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="show a stored model: config, template, source, files")
    p.add_argument("model", metavar="NAME", help="name, name:quantization or model directory")
    p.add_argument("--template", action="store_true",
                   help="print the chat template and an example prompt")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=cmd_show)


def _stored_model(store: Any, ref: str) -> Any:
    from localchat import model_dir as md
    from localchat.store import StoredModel, dir_size

    path = store.resolve(ref)
    config = md.read_config(path)
    return StoredModel(
        name=str(config.get("name") or path.name), quantization=str(config.get("quantization")),
        path=path, targets=md.library_targets(path), size_bytes=dir_size(path), config=config,
        libraries=md.library_files(path),
    )


def _template_info(model_dir: Path, meta: dict[str, Any]) -> tuple[str, Any]:
    """(description, template or None) of the template `run` uses for this model."""
    from localchat.engine import resolve_template

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
    store = open_store()
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
        ("size", human_size(model.size_bytes)),
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
        print(f"  {path:<{name_width}}  {human_size(size):>9}")
    if args.template and template is not None:
        own = model.path / "chat_template.jinja"
        if own.exists():
            print("chat_template.jinja")
            print(own.read_text(encoding="utf-8"))
        print("example prompt")
        print(template.render([{"role": "system", "content": "You are helpful."},
                               {"role": "user", "content": "Hi!"}], add_generation_prompt=True))
    return 0
