"""The engine's boundary, checked on the source: nodes drive their engine through its commands
only, its roles never see the core, the layers point one way, and no import circle exists.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("shared", "transfer", "prefill_node", "decode_node", "encode_node", "pdserve", "proto")

# What a node package may take from shared.engine: the door (commands, the thread, the engine's
# facts, the role settings it builds its engine with) and the plain values that cross it.
NODE_API: dict[str, set[str]] = {
    "shared.engine.commands": {"*"},
    "shared.engine.core": {"EngineCore"},  # built, handed to the thread, never dereferenced
    "shared.engine.thread": {"EngineThread", "EngineSnapshot"},
    "shared.engine.info": {"EngineInfo"},
    "shared.engine.config": {"EngineConfig"},
    "shared.engine.roles.decode_role": {"DecodeSettings"},
    "shared.engine.roles.prefill_role": {"PrefillSettings"},
    "shared.engine.connector.kv_push": {"KvAccess"},  # what a prefill node's push hook reads
    "shared.engine.events": {"*"},
    "shared.engine.scheduling.placement": {"PlacementPolicy"},
    "shared.engine.errors": {"*"},
    "shared.engine.sampling.sampling_params": {"*"},
    "shared.engine.scheduling.service_level": {"*"},
    "shared.engine.scheduling.slo": {"SloPolicy"},
    "shared.engine.requests.output": {"TokenDelta", "OutputProcessor"},
    "shared.engine.requests.multimodal": {"PromptImage"},  # a prompt's image, a plain value
    "shared.engine.requests.request": {
        "LlmRequest",
        "FinishReason",
    },  # a request's record, read-only
    "shared.engine.sampling.logprobs": {"TokenLogprobs"},
    "shared.engine.scheduling.scheduler": {
        "ScheduledRequest"
    },  # what a prefill node's layer hook sees
    "shared.engine.scheduling.transfer_admission": {"TransferGrant", "AdmissionClosed"},
    "shared.engine.resources.block_manager": {"BlockHash", "compute_block_hashes", "lora_seed"},
    # the offload tiers' settings, and the counters a node's /metrics reads
    "shared.engine.connector.offload_config": {"OffloadConfig"},
    "shared.engine.lora_updates": {"LoraUpdateError", "slots_of"},  # runtime adapter updates
    "shared.engine.connector.offload": {"OffloadStats"},
    "shared.engine.sampling.grammar_compiler": {"GrammarError", "compile_async", "compiler_for"},
}
ROLE_MODULES = (
    "shared/engine/roles/role.py",
    "shared/engine/roles/prefill_role.py",
    "shared/engine/roles/decode_role.py",
    "shared/engine/scheduling/placement.py",
    "shared/engine/scheduling/transfer_admission.py",
    "shared/engine/requests/fork.py",
    "shared/engine/requests/request_table.py",
    "shared/engine/runtime/model_runner.py",
)


def _files(*packages: str) -> Iterator[Path]:
    for package in packages:
        yield from sorted((ROOT / package).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST) -> Iterator[tuple[str, str | None]]:
    """(module, name) for every import at any depth (TYPE_CHECKING and function-level too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield from ((node.module, alias.name) for alias in node.names)


@pytest.mark.parametrize("package", ["decode_node", "prefill_node", "encode_node"])
def test_nodes_take_only_the_engines_public_api(package: str) -> None:
    bad = []
    for path in _files(package):
        for module, name in _imports(ast.parse(path.read_text())):
            if not module.startswith("shared.engine"):
                continue
            allowed = NODE_API.get(module, set())
            if name is None or ("*" not in allowed and name not in allowed):
                bad.append(f"{path.relative_to(ROOT)}: {module}.{name}")
    assert bad == [], "node code reaches into the engine; add a command instead"


@pytest.mark.parametrize("package", ["decode_node", "prefill_node", "encode_node"])
def test_nodes_never_dereference_their_engine(package: str) -> None:
    """`something.core.x` or `core.x`: the engine's state read or changed from a node."""
    bad = []
    for path in _files(package):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            value = node.value
            named = value.id if isinstance(value, ast.Name) else getattr(value, "attr", None)
            if named == "core" and node.attr != "info":  # the engine's facts: EngineInfo
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} .core.{node.attr}")
    assert bad == [], "nodes use commands (shared/engine/commands.py) and EngineInfo"


@pytest.mark.parametrize("module", ROLE_MODULES)
def test_roles_and_parts_never_import_the_core(module: str) -> None:
    imported = {m for m, _ in _imports(ast.parse((ROOT / module).read_text()))}
    assert "shared.engine.core" not in imported


def test_the_model_imports_nothing_from_the_engine() -> None:
    bad = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _files("shared/model")
        for module, _ in _imports(ast.parse(path.read_text()))
        if module.startswith("shared.engine")
    ]
    assert bad == [], "shared/model sits below shared/engine"


def _without_main_guard(tree: ast.Module) -> ast.Module:
    """The module without its `if __name__ == "__main__":` block: run as a script, it is
    `__main__`, a module of its own, so what that block imports cannot import it back."""
    body = [
        node
        for node in tree.body
        if not (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__"
        )
    ]
    return ast.Module(body=body, type_ignores=[])


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in _files(*SHIPPED) if not p.name.endswith("_pb2.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        tree = _without_main_guard(ast.parse(path.read_text()))
        for module, imported in _imports(tree):
            target = f"{module}.{imported}" if f"{module}.{imported}" in modules else module
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_a_main_guard_is_not_the_module() -> None:
    tree = ast.parse("import a\nif __name__ == '__main__':\n    import b\n")
    assert [m for m, _ in _imports(_without_main_guard(tree))] == ["a"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_shipped_packages() -> None:
    assert import_cycles(import_graph()) == []


# the roles and the KV connectors a node may give its engine: the core and its thread run any
ROLE_AND_CONNECTOR_NAMES = {
    "DecodeRole",
    "DecodeSettings",
    "PrefillRole",
    "PrefillSettings",
    "KvPushConnector",
    "KvLandingConnector",
    "shared.engine.roles.decode_role",
    "shared.engine.roles.prefill_role",
    "shared.engine.connector.kv_push",
    "shared.engine.connector.kv_landing",
}


def _names(path: Path) -> set[str]:
    """Every identifier, attribute and imported module or name the file's code uses."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("module", ["shared/engine/core.py", "shared/engine/thread.py"])
def test_the_core_and_its_thread_name_no_role_and_no_connector(module: str) -> None:
    assert _names(ROOT / module) & ROLE_AND_CONNECTOR_NAMES == set()
    assert "isinstance" not in _names(ROOT / module)  # extension points are interfaces


def test_the_role_finder_sees_a_role_named() -> None:
    assert "DecodeSettings" in _names(ROOT / "shared/engine/llm.py")
