"""autopar's modules import one way, all at the top of each module: the module graph has no
cycle, nothing imports autopar inside a function or under `if TYPE_CHECKING` to break one, and
the phases from tracing to lowering never import a phase above them. Read from the source
alone (nothing is imported)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "autopar"
# Lower phases first; a module of one imports only modules of its phase or one below it. The
# API's modules above them (api, planner, stepper, applying, fitting, the plan's views, the
# plan cache, checkpoints) are not ordered among themselves.
PHASES = (("autopar.errors", "autopar.mesh", "autopar.progress", "autopar.collector"),
          ("autopar.trace",),
          ("autopar.rules",), ("autopar.primitives",),
          ("autopar.decisions", "autopar.schedule", "autopar.plan_stats"),
          ("autopar.cost",),
          ("autopar.placement",), ("autopar.distributed",), ("autopar.calling",),
          ("autopar.rewrite",),
          # the plan's record, its views (text, JSON, explanation, page) that read it, and
          # autopar.Plan, the record with the views as its methods
          ("autopar.plan", "autopar.plan_record", "autopar.plan_text", "autopar.plan_json",
           "autopar.plan_check", "autopar.plan_html", "autopar.explain", "autopar.name_ranges"),
          ("autopar.planning",), ("autopar.lower", "autopar.lower_loop"))
LAZY: set[tuple[str, str]] = set()  # no autopar module is imported inside a function


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("autopar", *path.relative_to(ROOT).with_suffix("").parts))
        found[name.removesuffix(".__init__")] = ast.parse(path.read_text(), str(path))
    return found


def imported(node: ast.AST, names: set[str]) -> list[str]:
    """The autopar modules an import statement names (a name imported from a package counts
    as that module where it is one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in names:
        return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names
                else node.module for a in node.names]
    return []


def graph(tree: dict[str, ast.Module], top_only: bool) -> dict[str, set[str]]:
    names = set(tree)
    return {m: {t for node in (module.body if top_only else ast.walk(module))
                for t in imported(node, names) if t != m}
            for m, module in tree.items()}


def test_no_autopar_import_inside_a_function_or_under_type_checking():
    tree = modules()
    top, every = graph(tree, True), graph(tree, False)
    inside = {(m, t) for m in tree for t in every[m] - top[m]}
    assert inside == LAZY, sorted(inside ^ LAZY)
    guarded = [m for m, module in tree.items() for node in ast.walk(module)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)]
    assert not guarded, guarded


def test_the_module_graph_has_no_cycle():
    top = graph(modules(), True)
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(top[m]):
            assert state.get(t) != 1, " -> ".join(path[path.index(t):] + [m, t]) \
                if t in path else f"{m} -> {t}"
            if t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(top):
        if m not in state:
            visit(m, [])


def test_lower_phases_import_nothing_above_them():
    def phase(m: str) -> int | None:
        return next((i for i, names in enumerate(PHASES)
                     if any(m == n or m.startswith(n + ".") for n in names)), None)

    top = graph(modules(), True)
    checked = [m for m in top if phase(m) is not None]
    assert len(checked) > 60  # the phases' modules were found
    upward = [(m, t) for m in checked for t in top[m]
              if phase(t) is None or phase(t) > phase(m)]
    assert not upward, upward
