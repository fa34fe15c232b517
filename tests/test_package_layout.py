"""The package's shape: the public names, which layer may import which (read from the sources),
no import cycles, and a `localchat --help` that loads no heavy module."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import types
from pathlib import Path

import localchat

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "app"
# Packages installed under localchat from outside app/ (pyproject's package-dir).
DATA_PACKAGES = {"localchat.recipes": ROOT / "recipes", "localchat.prebuilt": ROOT / "prebuilt"}
FRONT_ENDS = ("localchat.cli", "localchat.server", "localchat.tui")
# The CLI launches the other two front ends, each from one launcher module.
LAUNCHERS = {"localchat.cli.tui": "localchat.tui", "localchat.cli.serve": "localchat.server"}
# Besides its own package (and a launcher, its front end), a front end imports only `localchat`
# (the public API) and these facades; each one's docstring lists what it offers.
FACADES = {
    "localchat", "localchat.errors", "localchat.store", "localchat.paths", "localchat.recipes",
    "localchat.prebuilt", "localchat.model_dir", "localchat.engine", "localchat.downloader",
}
LAZY_FACADES = ("localchat", "localchat.engine", "localchat.downloader")
HEAVY = ("tvm", "numpy", "torch", "huggingface_hub", "rich", "tokenizers")
PUBLIC = {
    "Engine", "Conversation", "GenerationConfig", "ReplyStream", "Reply", "ReplyStats",
    "TokenEvent", "FinishEvent", "Event", "LocalchatError", "InvalidRequestError",
    "ContextWindowError", "ModelNotFoundError", "EngineBusyError", "ModelFailureError",
    "GenerationError", "ModelConfigError", "UnsupportedModelError", "CompileError",
    "DeviceError", "DownloadError", "StoreError", "__version__",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(APP).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["localchat", *parts])


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in APP.rglob("*.py")}


def data_package_modules() -> dict[str, Path]:
    found = {}
    for package, folder in DATA_PACKAGES.items():
        for p in folder.rglob("*.py"):
            parts = [package, *p.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return found


def imports_of(path: Path, modules: dict[str, Path], top_level_only: bool) -> set[str]:
    """The localchat modules `path` imports (at module level only, or anywhere)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # include imports under `if`/`try` at module level, not TYPE_CHECKING
        expanded = []
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            expanded.extend(ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node])
        nodes = expanded
    found: set[str] = set()
    package = module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("localchat"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if not base.startswith("localchat"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                # a name the package exports is that name, not its submodule of the same name
                # (`from localchat.downloader import pull` is the function)
                is_module = sub in modules and alias.name not in exported_names(modules.get(base))
                found.add(sub if is_module else base)
    return {m for m in found if m in modules}


def exported_names(path: Path | None) -> set[str]:
    """The names in a module's literal `__all__` (none without one)."""
    if path is None:
        return set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def test_public_names() -> None:
    assert set(localchat.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(localchat, name) is not None, name


def test_engine_imports_no_downloader_or_front_end() -> None:
    modules = all_modules()
    for name, path in modules.items():
        if not name.startswith("localchat.engine"):
            continue
        bad = {m for m in imports_of(path, modules, top_level_only=False)
               if m.startswith(("localchat.downloader", *FRONT_ENDS))}
        assert not bad, f"{name} imports {sorted(bad)}"


def test_only_a_front_end_imports_itself() -> None:
    modules = all_modules()
    for name, path in modules.items():
        for front in FRONT_ENDS:
            if name == front or name.startswith(front + "."):
                continue
            if LAUNCHERS.get(name) == front:
                continue
            bad = {m for m in imports_of(path, modules, top_level_only=False)
                   if m == front or m.startswith(front + ".")}
            assert not bad, f"{name} imports the front end {front}: {sorted(bad)}"


def test_no_import_cycles_at_module_level() -> None:
    modules = all_modules()
    graph = {name: imports_of(path, modules, top_level_only=True) - {name}
             for name, path in modules.items()}
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            # a package importing its own submodule is how packages re-export; not a cycle
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_help_loads_no_heavy_module() -> None:
    code = (
        "import sys\n"
        "from localchat.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('tvm', 'numpy', 'torch', 'huggingface_hub', 'rich', 'tokenizers')"
        " if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "usage: localchat" in out
    assert out.strip().endswith("HEAVY []")


def test_front_ends_import_only_the_facades() -> None:
    modules = {**all_modules(), **data_package_modules()}
    bad = []
    for name, path in sorted(modules.items()):
        front = next((f for f in FRONT_ENDS if name == f or name.startswith(f + ".")), None)
        if front is None:
            continue
        own = [front] + ([LAUNCHERS[name]] if name in LAUNCHERS else [])
        for imported in sorted(imports_of(path, modules, top_level_only=False)):
            if imported in FACADES or any(imported == p or imported.startswith(p + ".")
                                          for p in own):
                continue
            bad.append(f"{name} imports {imported}")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module in FACADES and not node.level:
                bad.extend(f"{name} imports the private {node.module}.{a.name}"
                           for a in node.names
                           if a.name.startswith("_") and not a.name.endswith("__"))
    assert not bad, ("a front end imports only its own package, `localchat` and the facades "
                     f"{sorted(FACADES)}:\n" + "\n".join(bad))


def test_facade_names_resolve() -> None:
    for facade in LAZY_FACADES:
        module = importlib.import_module(facade)
        assert module.__all__, facade
        for name in module.__all__:
            value = getattr(module, name)  # loads the defining module
            # a submodule of the same name (localchat.downloader.pull) must not hide the name
            assert not isinstance(value, types.ModuleType), f"{facade}.{name} is a module"
            if facade != "localchat":  # its docstring names the groups, not every error class
                assert f"`{name}`" in (module.__doc__ or ""), f"{facade}'s docstring: no {name}"
    importlib.import_module("localchat.downloader.pull")  # the submodule, loaded
    from localchat.downloader import pull

    assert callable(pull) and not isinstance(pull, types.ModuleType)


def test_facades_load_no_heavy_module() -> None:
    code = (
        "import sys\n"
        f"import {', '.join(sorted(FACADES))}\n"
        f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip().endswith("HEAVY []")
