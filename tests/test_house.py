"""The house's walls, read from the source: no import circles anywhere, which package may import which,
no room over 450 lines, and one import name (`pdserve`) when installed."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("protocol", "settings", "server", "workers", "client", "bench")
# of pdserve's packages, what each may import (besides itself); bench measures everything
WALLS = {
    "protocol": (),
    "settings": ("protocol",),
    "client": ("protocol", "settings"),
    "server": ("protocol", "settings"),
    "workers": ("protocol", "settings"),
    "bench": FOLDERS,
}
MAX_LINES = 450


def modules(root: Path = ROOT, folders=FOLDERS) -> dict[str, Path]:
    """Every module of ours, by dotted name (pdserve.server.app -> server/app.py)."""
    out = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(("pdserve", *parts))] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours that `path` imports, anywhere in it (inside functions and TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # pdserve.x.y.Name -> pdserve.x.y
                name = name.rpartition(".")[0]
            if name and name.count(".") >= 1:
                found.add(name)
    return found


def graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules it imports; a package's face (__init__.py) stands for the package only."""
    return {m: imports(p, known) - {m} for m, p in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts with more than one module (Tarjan's algorithm, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    top = stack.pop()
                    on.discard(top)
                    part.append(top)
                    if top == node:
                        break
                if len(part) > 1:
                    out.append(sorted(part))
    return out


def test_no_import_circles_anywhere():
    found = circles(graph(modules()))
    assert found == [], "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_circle_finder_finds_a_circle(tmp_path):
    """The check above can fail: a three-file loop planted in a scratch tree is found, a chain is not."""
    pkg = tmp_path / "server"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pdserve.server.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from pdserve.server import c\n")
    (pkg / "c.py").write_text("import pdserve.server.a\n")
    (pkg / "d.py").write_text("from pdserve.server.a import y\n")
    known = modules(tmp_path, ("server",))
    assert circles(graph(known)) == [["pdserve.server.a", "pdserve.server.b", "pdserve.server.c"]]
    (pkg / "c.py").write_text("x = 1\n")
    assert circles(graph(modules(tmp_path, ("server",)))) == []


def test_each_package_imports_only_below_it():
    known = modules()
    crossed = []
    for module, targets in graph(known).items():
        package = module.split(".")[1]
        allowed = (package, *WALLS[package])
        crossed += [(str(known[module].relative_to(ROOT)), t) for t in targets if t.split(".")[1] not in allowed]
    assert crossed == [], f"imports across the walls: {crossed}"


def test_no_room_over_450_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in modules().values()}
    over = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert over == {}, f"rooms over {MAX_LINES} lines: {over}"


@pytest.mark.timeout(180)
def test_installs_as_one_import_name(tmp_path):
    """`pip install` puts one top-level package, pdserve, and every folder of ours under it."""
    # the venv's own setuptools when it has one (no download); else pip builds in isolation (a registry)
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=170)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("pdserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"pdserve"}, tops
    shipped = {n for n in names if n.endswith(".py")}
    expected = {"pdserve/" + str(p.relative_to(ROOT)) for p in modules().values()} | {"pdserve/__init__.py"}
    assert expected <= shipped, sorted(expected - shipped)[:10]
