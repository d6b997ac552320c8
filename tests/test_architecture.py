"""The package's import graph: no cycles, and every stage imports only the stages before it.

Every ``import`` of a kvjax module counts, including imports inside functions: a lazy import hides a cycle from
Python's loader, not from a reader.
"""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kvjax")


def modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of the package (a package's ``__init__`` as the package)."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = os.path.join(folder, f)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the kvjax modules it imports (``from kvjax.x import y`` is an edge to ``kvjax.x.y`` when that
    is a module, else to ``kvjax.x``)."""
    mods = modules()

    def owner(name):
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in mods else None

    graph = {}
    for name, path in mods.items():
        deps = set()
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names if a.name.startswith("kvjax")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvjax"):
                deps |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else owner(node.module)
                    for a in node.names
                }
        graph[name] = deps - {None, name}
    return graph


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The pipeline's stages in data-flow order (README, "Layout"); a module may import its own stage and earlier ones.
STAGES = [
    ("kvjax.errors", "kvjax.validate", "kvjax.layout", "kvjax.machine"),  # what every stage shares
    ("kvjax.ops",),  # attention ops: plan + kernel + reference, and the dispatch
    ("kvjax.models",),  # config, transformer, rope, the Model class (its full forward runs ops' references)
    ("kvjax.compression",),  # calibration, rank plans, folding (head order through the decode op's cost model)
    ("kvjax.parallel",),  # tensor parallelism: which device holds each KV head
    ("kvjax.eviction",),  # which cached tokens each KV head keeps: metrics, budgets, the teacher-forced reference
    ("kvjax.io",),  # checkpoints in and out
    ("kvjax.runtime",),  # cache, engine, generate
    ("kvjax.serving",),  # the HTTP API and the engine's thread behind it
    ("kvjax.cli", "kvjax"),  # console scripts and the public API
]
# Upward edges allowed, each with its reason.
ALLOWED = {("kvjax.models.model", "kvjax.io.saved"): "Model.save is the user's handle on saving"}


def stage(module: str) -> int:
    """The index of the stage a module belongs to (the longest matching prefix)."""
    best, found = -1, None
    for i, prefixes in enumerate(STAGES):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, found = len(p), i
    assert found is not None, f"{module} belongs to no stage: add it to STAGES"
    return found


def test_every_module_imports_only_its_stage_and_earlier_ones():
    upward = [
        (name, dep)
        for name, deps in import_graph().items()
        for dep in deps
        if stage(dep) > stage(name) and (name, dep) not in ALLOWED
    ]
    assert upward == []


def test_the_models_know_no_kernel_and_the_ops_no_model():
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("kvjax.models"):
            ops = [d for d in deps if d.startswith("kvjax.ops")]
            assert all(d.endswith(".reference") for d in ops), name
        if name.startswith("kvjax.ops"):
            assert not [d for d in deps if stage(d) > stage(name)], name
