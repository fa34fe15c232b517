"""`localchat doctor`: TVM and its backends, devices, store paths and free space, the hub."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

from localchat.cli.common import auto_device_reason, human_size, open_store

HUB_CHECK_TIMEOUT_S = 3.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check TVM, devices, the store and the hub")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--verify", action="store_true",
                   help="check every stored file against its sha256 (reads the whole store)")
    p.set_defaults(handler=cmd_doctor)


def _hub_reachable(endpoint: str, timeout: float = HUB_CHECK_TIMEOUT_S) -> tuple[bool, str]:
    """Whether the hub answers at all (any HTTP status counts), within `timeout` seconds."""
    import urllib.error
    import urllib.request

    from localchat.downloader import hub_offline

    if hub_offline():
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


def _doctor_report(verify: bool = False) -> dict[str, Any]:
    import platform

    from huggingface_hub import constants

    from localchat import __version__
    from localchat.downloader import free_bytes

    report: dict[str, Any] = {"localchat": __version__, "python": platform.python_version()}
    from localchat.engine import (
        ThreadCountError,
        configure_threads,
        ensure_threads,
        physical_cores,
    )

    try:
        count, error = configure_threads(), None
    except ThreadCountError as exc:
        count, error = ensure_threads(), str(exc)
    report["threads"] = {"count": count, "physical_cores": physical_cores(),
                         "error": error}
    try:
        import tvm

        from localchat.engine import (
            DEVICE_KINDS,
            backend_supported,
            device_present,
            select_device,
            target_key,
        )

        report["tvm"] = tvm.__version__
        report["backends"] = {k: backend_supported(k) for k in DEVICE_KINDS}
        report["devices"] = {k: report["backends"][k] and device_present(k) for k in DEVICE_KINDS}
        chosen = select_device("auto")
        report["auto_device"] = {"kind": chosen.kind, "target": target_key(chosen.target),
                                 "why": auto_device_reason()}
    except Exception as exc:  # a broken TVM install is exactly what doctor reports
        report["tvm"] = None
        report["tvm_error"] = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
    store = open_store()
    paths = {"models": store.models_dir, "downloads": store.downloads_dir,
             "libraries": store.libs_dir}
    report["store"] = {
        name: {"path": str(p), "free_bytes": free_bytes(p)} for name, p in paths.items()
    }
    models = store.models()
    report["store"]["models"]["count"] = len(models)
    if verify:
        models = [store.verify(m) for m in models]
    report["damaged"] = [{"model": m.ref, "path": str(m.path), "problem": str(m.problems[0]),
                          "repair": m.repair, "message": m.damage_message()}
                         for m in models if m.damaged]
    report["leftovers"] = [{"path": str(p), "size_bytes": n}
                           for p, n in store.remove_stale_leftovers()]
    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    ok, detail = _hub_reachable(endpoint)
    report["hub"] = {"endpoint": endpoint, "reachable": ok, "detail": detail,
                     "token": "set" if os.environ.get("HF_TOKEN") else "not set"}
    return report


def cmd_doctor(args: argparse.Namespace) -> int:
    """`localchat doctor`: TVM and its backends, devices, store paths and space, the hub."""
    report = _doctor_report(verify=args.verify)
    code = 1 if report["damaged"] else 0
    if args.json:
        print(json.dumps(report, indent=2))
        return code
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
    th = report["threads"]
    note = th["error"] or (f"{th['physical_cores']} physical cores; --threads N or "
                           "LOCALCHAT_NUM_THREADS to change")
    print(f"threads    {th['count']} ({note})")
    for name, info in report["store"].items():
        extra = f", {info['count']} model(s)" if "count" in info else ""
        print(f"{name:<10} {info['path']} ({human_size(info['free_bytes'])} free{extra})")
    hub = report["hub"]
    print(f"hub        {hub['endpoint']}: {hub['detail']}; HF_TOKEN {hub['token']}")
    if not hub["reachable"]:
        print("           pull still works for local folders, .gguf files, and models with an "
              "offline source (smollm2-135m-instruct, fetched with pip)")
    for left in report["leftovers"]:
        print(f"leftover   removed {left['path']} ({human_size(left['size_bytes'])}), left by an "
              f"interrupted pull")
    checked = "verified (sha256)" if args.verify else "checked (sizes; --verify reads them all)"
    if not report["damaged"]:
        print(f"models     {report['store']['models']['count']} {checked}, none damaged")
    for bad in report["damaged"]:
        print(f"damaged    {bad['message']}")
    return code
