"""The layers, read from the code: who imports whom, with no cycle between modules or packages,
roles that know no model, and role servers that load no test oracle.

    proto, models              import nothing of ours (models.testing: only models)
    common (lower half)        config, process, log: nothing of ours
    connector                  the lower half of common
    common (upper half)        models, proto and the lower half
    encoder_worker, lm_worker, proxy    the layers above, never each other or epd
    epd                        the CLI, launcher, client and benchmarks: anything

Within the LM role, server.py is the only gRPC edge, and the step loop (engine.py) never
reaches back to it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("proto", "models", "common", "connector", "encoder_worker", "lm_worker", "proxy", "epd")
ROLES = ("encoder_worker", "lm_worker", "proxy")
COMMON_LOWER = ("common.config", "common.process", "common.log")

# What each layer may import (module-name prefixes), besides itself.
ALLOWED: dict[str, tuple[str, ...]] = {
    "proto": (),
    "models": (),
    "common.config": (),
    "common.process": (),
    "common.log": (),
    "connector": COMMON_LOWER,
    "common": ("common", "models", "proto"),
    "encoder_worker": ("common", "connector", "models", "proto"),
    "lm_worker": ("common", "connector", "models", "proto"),
    "proxy": ("common", "connector", "models", "proto"),
    "epd": PACKAGES,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere in its code (function bodies and
    TYPE_CHECKING blocks included: a cycle hidden there is still a cycle)."""
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from pkg import mod` names a submodule (the dependency) or a name of pkg.
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t for t in subs if t in modules] or [node.module]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def layer(module: str) -> str:
    for key in sorted(ALLOWED, key=len, reverse=True):
        if module == key or module.startswith(key + "."):
            return key
    raise AssertionError(f"{module} belongs to no layer")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_no_cycle_between_modules(graph):
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_no_cycle_between_packages(graph):
    packages: dict[str, set[str]] = {}
    for module, deps in graph.items():
        top = module.split(".")[0]
        packages.setdefault(top, set()).update(d.split(".")[0] for d in deps)
        packages[top].discard(top)
    assert find_cycle(packages) is None, " -> ".join(find_cycle(packages) or [])


def test_each_layer_imports_only_downward(graph):
    wrong = []
    for module, deps in sorted(graph.items()):
        own = layer(module)
        for dep in sorted(deps):
            if layer(dep) == own or module.startswith("models.testing"):
                continue
            if not any(dep == a or dep.startswith(a + ".") for a in ALLOWED[own]):
                wrong.append(f"{module} -> {dep}")
    assert wrong == []


def test_roles_name_no_model():
    """The roles ask the family: no model class, family name or family check in them."""
    pattern = re.compile(
        r"qwen|voxtral|whisper|VisionTower|LanguageModel\(|\.family ==|\barch\.|"
        r"image_token_id|video_token_id|mrope",
        re.IGNORECASE,
    )
    hits = []
    for role in ROLES:
        for path in sorted((ROOT / role).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and "LanguageModelServicer" not in line:
                    hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert hits == []


def test_role_servers_load_no_test_oracle():
    code = (
        "import sys\n"
        "import encoder_worker.server, lm_worker.server, proxy.server\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] == 'transformers'"
        " or m.startswith('models.testing')]\n"
        "print(loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


# gRPC and its generated messages: the wire (grpc, grpc_health, grpc_reflection, proto's stubs).
WIRE = re.compile(r"^(grpc|grpc_\w+)(\.|$)|^proto\.\w+_pb2(_grpc)?$")


def imported_names(path: Path) -> set[str]:
    """Every module `path` imports, ours or not, absolute; for `from m import n` both m and
    m.n (n may be a submodule)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
    return names


def test_only_the_lm_server_speaks_grpc():
    """lm_worker/server.py converts the wire's messages at the edge; no other module of the
    LM role imports grpc or a _pb2 module."""
    server = ROOT / "lm_worker" / "server.py"
    assert any(WIRE.match(n) for n in imported_names(server)), "the edge moved: update this test"
    hits = []
    for path in sorted((ROOT / "lm_worker").rglob("*.py")):
        if path == server:
            continue
        wire = sorted(n for n in imported_names(path) if WIRE.match(n))
        if wire:
            hits.append(f"{path.relative_to(ROOT)}: {', '.join(wire)}")
    assert hits == []


def import_chain(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A shortest chain of imports from `start` to `goal`, or None."""
    parents: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        node = queue.pop(0)
        if node == goal:
            chain = [node]
            while (parent := parents[chain[-1]]) is not None:
                chain.append(parent)
            return chain[::-1]
        for dep in sorted(graph.get(node, ())):
            if dep not in parents:
                parents[dep] = node
                queue.append(dep)
    return None


def test_the_step_loop_does_not_import_the_lm_server(graph):
    """engine.py (the step loop) does not import lm_worker.server, directly or through other
    modules: calls go one way, from the gRPC edge into the engine."""
    assert "lm_worker.engine" in graph and "lm_worker.server" in graph
    chain = import_chain(graph, "lm_worker.engine", "lm_worker.server")
    assert chain is None, " -> ".join(chain or [])
