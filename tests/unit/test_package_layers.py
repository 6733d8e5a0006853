"""``import te_npu`` is one-way: every import (module level or inside a function) points to the
same or a lower layer of the table below, the README's "Architecture" section, which refines
DESIGN.md's ``modules -> functional -> quantizers/tensor -> numerics/ops``; inside
``te_npu.training`` and ``te_npu.distributed`` the rooms and top modules are sub-layers of their
own (``SUB_LAYERS``), so a room never imports the modules above it; and no set of modules
imports each other in a cycle, however the imports are placed."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import te_npu

PACKAGE_DIR = Path(te_npu.__file__).parent

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "compat", "numerics", "process_tree"),  # pure codecs; private torch names; owned child processes
    ("formats",),                      # each format's rules, declared once
    ("events",),                       # the one event stream
    ("ops",),                          # backends: emulation (+ its kernels), npu wrappers, GEMM dispatch
    ("quantizers",),
    ("recipe", "tensor"),              # recipes build quantizers; quantized tensors use them
    ("autocast", "moe"),
    ("functional", "activation_checkpoint"),
    ("modules",),
    ("quantize_weights", "observer"),  # observer: per-GEMM quantization statistics over the event stream
    ("distributed",),                  # FSDP2 extension, master-weight optimizer, DCP / HF checkpoints
    ("__init__",),                     # te_npu's public API
    ("training",),                     # the generic trainer
    ("testing", "selfcheck"),          # test instruments and the Q3 rules (no production import); the self-check
)
"""Bottom to top. A unit is a top-level module or subpackage of ``te_npu``."""

RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}

SUB_LAYERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "training": (
        ("data", "metrics", "guards", "schema", "schedule", "recompute", "mapped_files", "task_step"),  # the rooms
        ("config", "launch_report", "runtime"),  # the YAML sections; the launcher's summary; launch env, stop request
        ("job", "hf", "launch"),              # the entry point; HF start / export / conversion (over config); the launcher
        ("checkpointer",),                    # the Trainer's on-disk side: a part it holds, not a base class
        ("trainer",),
        ("capacity", "__init__"),             # the estimate runs the Trainer; the package's names
    ),
    "distributed": (
        ("mesh", "process_group", "fsdp"),
        ("sharding", "optim"),
        ("storage",),                         # everything on disk (DCP, folder, lock, manifest, HF)
        ("__init__",),
    ),
}
"""Bottom to top inside a unit. A sub-unit is a room (subpackage) or a top module of the unit."""

SUB_RANK = {unit: {sub: rank for rank, subs in enumerate(table) for sub in subs} for unit, table in SUB_LAYERS.items()}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The te_npu module an imported dotted name lives in (``te_npu.ops.QuantizedOperand`` -> ``te_npu.ops``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """Every te_npu module ``module`` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("te_npu"):
            found |= {_resolve(f"{node.module}.{alias.name}") for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {_resolve(alias.name) for alias in node.names if alias.name.startswith("te_npu")}
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{module}: relative import (the layer walk reads absolute ones)")
    return {m for m in found if m and m != module}


GRAPH = {module: _imports(module) for module in MODULES}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _sub_unit(module: str) -> str:
    """The room or top module of its unit (``te_npu.training.data.blend`` -> ``data``)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def test_every_unit_of_the_package_has_a_layer():
    missing = sorted({_unit(m) for m in MODULES} - set(RANK))
    assert not missing, f"te_npu units not in LAYERS (add them to the table and the README): {missing}"
    missing = sorted({f"{_unit(m)}.{_sub_unit(m)}" for m in MODULES if _unit(m) in SUB_LAYERS
                      and _sub_unit(m) not in SUB_RANK[_unit(m)]})
    assert not missing, f"rooms / modules not in SUB_LAYERS (add them to the table and the README): {missing}"


def _upward(module: str, targets: set[str]) -> list[str]:
    """The imports of ``module`` that reach its own layer (another unit) or a higher one; inside a
    unit with sub-layers, those that reach another sub-unit of its own sub-layer or a higher one."""
    unit, bad = _unit(module), []
    for target in sorted(targets):
        if _unit(target) != unit:
            if RANK[_unit(target)] >= RANK[unit]:
                bad.append(f"{target} ({_unit(target)}, layer {RANK[_unit(target)]})")
        elif unit in SUB_LAYERS and _sub_unit(target) != _sub_unit(module):
            ranks = SUB_RANK[unit]
            if ranks[_sub_unit(target)] >= ranks[_sub_unit(module)]:
                bad.append(f"{target} ({unit}.{_sub_unit(target)}, sub-layer {ranks[_sub_unit(target)]})")
    return bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan). A submodule importing its
    own package (``from te_npu.ops import x`` inside ``te_npu.ops.y``) reads a name the package
    has already bound, so ancestor edges are left out."""
    graph = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_to_the_same_or_a_lower_layer(module):
    bad = _upward(module, GRAPH[module])
    assert not bad, f"{module} ({_unit(module)}, layer {RANK[_unit(module)]}) imports upward or sideways: {bad}"


def test_no_import_cycle_between_modules():
    assert _cycles(GRAPH) == []


def test_the_walk_sees_the_edges_it_checks():
    """The walk is not vacuous: edges the code is known to have (a function-level one included)."""
    assert "te_npu.numerics.hif8" in GRAPH["te_npu.formats"]
    assert "te_npu.ops.kernels" in GRAPH["te_npu.ops.emulation"]
    assert "te_npu.training.metrics.plots" in GRAPH["te_npu.training.trainer"]  # imported inside a method
    assert RANK["modules"] > RANK["functional"] > RANK["tensor"] > RANK["ops"] > RANK["numerics"]
    assert "te_npu.training.data.blend" in GRAPH["te_npu.training.data.megatron.gpt_samples"]  # inside a room
    assert "te_npu.distributed.storage.folder" in GRAPH["te_npu.training.checkpointer"]
    assert "te_npu.training.runtime" in GRAPH["te_npu.training.trainer"]
    assert "te_npu.training.job" not in GRAPH["te_npu.training.trainer"]  # the runtime sits below both


def test_the_checks_reject_an_upward_import_a_sideways_one_and_a_cycle():
    assert _upward("te_npu.numerics.mxfp8", {"te_npu.modules.linear"})  # up
    assert _upward("te_npu.recipe", {"te_npu.tensor.weight"})  # a peer unit on the same layer
    assert not _upward("te_npu.modules.linear", {"te_npu.modules.base", "te_npu.functional.linear"})
    assert _upward("te_npu.training.data.blend", {"te_npu.training.trainer"})  # a room up to the top modules
    assert _upward("te_npu.training.guards.stall", {"te_npu.training.metrics.log"})  # a peer room
    assert _upward("te_npu.distributed.storage.dcp", {"te_npu.distributed"})  # up to the package's names
    assert not _upward("te_npu.training.trainer", {"te_npu.training.data", "te_npu.training.hf.weights"})
    assert not _upward("te_npu.training.data.hf_data", {"te_npu.training.data.splits"})  # inside a room
    cycle = {"te_npu.a": {"te_npu.b"}, "te_npu.b": {"te_npu.c"}, "te_npu.c": {"te_npu.a"}, "te_npu.d": {"te_npu.a"}}
    assert _cycles(cycle) == [["te_npu.a", "te_npu.b", "te_npu.c"]]
    assert _cycles({"te_npu.ops.y": {"te_npu.ops"}, "te_npu.ops": {"te_npu.ops.y"}}) == []  # package <-> its own submodule


def _dependents() -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for module, targets in GRAPH.items():
        for target in targets:
            out[target].add(module)
    return out


def test_nothing_in_the_library_imports_the_test_instruments_or_models():
    users = _dependents()
    testing = {m for m in MODULES if _unit(m) == "testing"}
    production_users = sorted(u for t in testing for u in users[t] if _unit(u) != "testing")
    assert not production_users, f"production modules importing te_npu.testing: {production_users}"
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        models = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                  and any((getattr(n, "module", None) or a.name).startswith("models") for a in n.names)]
        assert not models, f"{module} imports models/ (te_npu never does)"
