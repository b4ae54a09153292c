"""The floors and rooms, arrows one way, read from the source with ``ast`` (not by
importing, so an import inside a function counts as much as one at the top).

passes/ (the ground floor, ``overlapc.passes``) imports nothing under ``overlapc``
but itself: not the product around it, not its config (the passes take
``ScheduleOptions``). The product above it is in rooms (``ROOMS``), each importing
only the rooms below it (``MAY_IMPORT``); the compile path reads the estimator
only through the ``overlapc.estimate`` package's names. No import cycle between
modules, no module reaching into another's private names, at most 8 modules
directly in ``overlapc/`` and none over 700 lines. And the public names the move
left behind are the passes' own objects."""
import ast
import copy
import dataclasses
import importlib
import pathlib
import sys

import pytest
import torch

import overlapc
import overlapc.passes
from graphs import ag, body, trace, wait

PASSES = pathlib.Path(__file__).resolve().parent.parent / "passes"


def _imported(package: list[str], tree: ast.AST):
    """(line, module) for every module ``tree`` imports: ``import a.b`` as ``a.b``,
    ``from a import x`` as ``a.x`` (x may be a module), relative imports resolved
    against ``package``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[:len(package) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def forbidden_imports(root: pathlib.Path = PASSES) -> list[str]:
    """"passes/file:line imports overlapc.X" for each import under ``overlapc`` outside
    ``overlapc.passes`` (``import overlapc`` itself included) in the files under
    ``root`` (the folder installed as ``overlapc.passes``)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        package = ["overlapc", "passes", *path.relative_to(root).parent.parts]
        for line, module in _imported(package, tree):
            parts = module.split(".")
            if parts[0] == "overlapc" and (len(parts) == 1 or parts[1] != "passes"):
                found.append(f"passes/{path.relative_to(root).as_posix()}:{line} imports {'.'.join(parts[:2])}")
    return sorted(set(found), key=lambda text: (text.split(":")[0], int(text.split(":")[1].split()[0]), text))


def test_passes_import_nothing_from_the_product():
    found = forbidden_imports()
    assert not found, "passes/ must import nothing under overlapc but overlapc.passes:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from overlapc import costmodel\n", ["1 imports overlapc.costmodel"]),
    ("def f():\n    from overlapc.report import summary\n", ["2 imports overlapc.report"]),
    ("import overlapc.simulate as s\n", ["1 imports overlapc.simulate"]),
    ("from ... import api\n", ["1 imports overlapc.api"]),   # relative, from passes/chunk/
    ("from overlapc.collectives import role\n", ["1 imports overlapc.collectives"]),
    ("def f():\n    from overlapc.config import OverlapConfig\n", ["2 imports overlapc.config"]),
    ("from overlapc import collectives, config\n", ["1 imports overlapc.collectives", "1 imports overlapc.config"]),
    ("import overlapc\n", ["1 imports overlapc"]),
    ("from overlapc.passes.collectives import role\nfrom overlapc.passes import memory\n"
     "from .. import options\nfrom . import plan\nimport overlapc.passes.meta\n", []),
])
def test_the_check_finds_each_form_of_import(tmp_path, source, expected):
    """The check itself can fail: every form of import is seen, allowed ones are not."""
    root = tmp_path / "passes"
    (root / "chunk").mkdir(parents=True)
    (root / "chunk" / "x.py").write_text(source)
    found = forbidden_imports(root)
    assert [text.removeprefix("passes/chunk/x.py:") for text in found] == expected


ROOT = PASSES.parent
PRODUCT = ROOT / "overlapc"

# Each module's room: the first prefix that matches its dotted name.
ROOMS = [("overlapc.passes", "passes"), ("overlapc.config", "base"), ("overlapc.collectives", "base"),
         ("overlapc.torch_compat", "base"), ("overlapc.launch", "base"), ("overlapc.estimate", "estimate"),
         ("overlapc.explain", "explain"), ("overlapc.api", "api"), ("overlapc.backend", "backend"),
         ("overlapc.fsdp", "sharding"), ("overlapc.integrations", "integrations"),
         ("overlapc.calibrate", "calibrate"), ("overlapc.cli", "cli"), ("overlapc", "api")]
# The rooms each room may import besides itself: every arrow points down.
MAY_IMPORT = {
    "passes": set(),
    "base": {"passes"},
    "estimate": {"base", "passes"},
    "explain": {"estimate", "base", "passes"},
    "api": {"explain", "estimate", "base", "passes"},
    "sharding": {"base", "passes"},
    "backend": {"api", "explain", "estimate", "base", "passes"},
    "integrations": {"api", "base", "passes"},
    "calibrate": {"backend", "sharding", "api", "explain", "estimate", "base", "passes"},
    "cli": {"calibrate", "integrations", "backend", "sharding", "api", "explain", "estimate", "base", "passes"},
}
# Rooms that read the estimator only through the names of the overlapc.estimate package.
THROUGH_INTERFACE = {"api", "backend"}


def room_of(module: str) -> str:
    return next(room for prefix, room in ROOMS if module == prefix or module.startswith(prefix + "."))


def module_files(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Dotted name -> file for every module under ``root``'s overlapc/ and passes/
    (``passes`` installs as ``overlapc.passes``; a package is its ``__init__``)."""
    found = {}
    for folder, prefix in ((root / "overlapc", ["overlapc"]), (root / "passes", ["overlapc", "passes"])):
        for path in sorted(folder.rglob("*.py")):
            parts = prefix + list(path.relative_to(folder).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(files: dict[str, pathlib.Path]) -> dict[str, list[tuple[int, str]]]:
    """Module -> [(line, module it imports)], among ``files``' modules only: ``from a
    import x`` is ``a.x`` when that is a module, else ``a``."""
    graph = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = []
        for line, target in _imported(package, ast.parse(path.read_text(encoding="utf-8"))):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.append((line, target))
        graph[name] = edges
    return graph


def cycles(graph: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly
    connected group of modules that import each other."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for _, target in graph.get(node, []):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"
    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def wrong_arrows(graph: dict[str, list[tuple[int, str]]], files: dict[str, pathlib.Path]) -> list[str]:
    """"module:line imports target (room -> room)" for every import ``MAY_IMPORT`` does not
    allow, and for every import of an estimate module (not the package) from a room in
    ``THROUGH_INTERFACE``."""
    found = []
    for name, edges in sorted(graph.items()):
        mine = room_of(name)
        for line, target in edges:
            theirs = room_of(target)
            if theirs != mine and theirs not in MAY_IMPORT[mine]:
                found.append(f"{name}:{line} imports {target} ({mine} -> {theirs})")
            elif mine in THROUGH_INTERFACE and theirs == "estimate" and target != "overlapc.estimate":
                found.append(f"{name}:{line} imports {target} (the estimator's interface is overlapc.estimate)")
    return found


def private_reaches(files: dict[str, pathlib.Path]) -> list[str]:
    """"module:line name" for each private name (``_x``) of another overlapc module that a
    module imports (``from m import _x``) or reads (``m._x`` on an imported module)."""
    found = []
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("overlapc"):
                for alias in node.names:
                    if alias.name.startswith("_") and node.module != name:
                        found.append(f"{name}:{node.lineno} {node.module}.{alias.name}")
                    if f"{node.module}.{alias.name}" in files:
                        modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("overlapc"):
                        bound = alias.asname or alias.name.split(".")[0]
                        modules[bound] = alias.name if alias.asname else bound
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{name}:{node.lineno} {modules[node.value.id]}.{node.attr}")
    return sorted(found)


def test_no_import_cycle_between_modules():
    found = cycles(import_graph(module_files()))
    assert not found, "import cycles (imports inside functions count):\n" + "\n".join(" -> ".join(c) for c in found)


def test_rooms_import_only_the_rooms_below_them():
    files = module_files()
    assert {room_of(name) for name in files} == set(MAY_IMPORT)
    found = wrong_arrows(import_graph(files), files)
    assert not found, "imports against the rooms' arrows (tests/test_layers.py MAY_IMPORT):\n" + "\n".join(found)


def test_no_module_reaches_into_another_modules_private_names():
    found = private_reaches(module_files())
    assert not found, "private names used from another module (give them a public name):\n" + "\n".join(found)


def test_module_count_and_size():
    top = sorted(path.name for path in PRODUCT.glob("*.py"))
    assert len(top) <= 8, f"at most 8 modules directly in overlapc/: {top}"
    long = [f"{path.relative_to(ROOT)}: {n}" for path in sorted(module_files().values())
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > 700]
    assert not long, "modules over 700 lines (split by responsibility):\n" + "\n".join(long)


def _tree(tmp_path, sources: dict[str, str]) -> dict[str, pathlib.Path]:
    for relative, text in sources.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return module_files(tmp_path)


def test_the_room_checks_can_fail(tmp_path):
    """Each check finds what it is for in a small made-up tree: a cycle through an import
    inside a function and a relative one, an arrow upwards, a compile-path import of an estimate module,
    and private names read both ways."""
    files = _tree(tmp_path, {
        "overlapc/__init__.py": "", "overlapc/config.py": "def f():\n    from overlapc.explain import report\n",
        "overlapc/explain/__init__.py": "", "overlapc/estimate/__init__.py": "",
        "overlapc/estimate/costmodel.py": "_x = 1\n",
        "overlapc/explain/report.py": "from .. import config\nfrom overlapc.estimate.costmodel import _x\n",
        "overlapc/backend/__init__.py": "from overlapc.estimate import costmodel\nprint(costmodel._x)\n",
        "passes/__init__.py": ""})
    graph = import_graph(files)
    assert cycles(graph) == [["overlapc.config", "overlapc.explain.report", "overlapc.config"]]
    assert wrong_arrows(graph, files) == [
        "overlapc.backend:1 imports overlapc.estimate.costmodel (the estimator's interface is overlapc.estimate)",
        "overlapc.config:2 imports overlapc.explain.report (base -> explain)"]
    assert private_reaches(files) == ["overlapc.backend:2 overlapc.estimate.costmodel._x",
                                      "overlapc.explain.report:2 overlapc.estimate.costmodel._x"]


def test_the_public_names_are_the_passes_objects():
    """``overlapc.collectives`` is the module ``passes/collectives.py`` under its public
    name (one object: patching either name reaches both); ``overlapc.collectives(gm)``
    stays the function; the config and schedule names stay where they were."""
    from overlapc import collectives as listed
    from overlapc.collectives import Collective, role
    from overlapc.config import OverlapConfig
    from overlapc.passes import collectives as module
    assert importlib.import_module("overlapc.collectives") is module is sys.modules["overlapc.collectives"]
    assert module.__file__ == str(PASSES / "collectives.py")
    assert listed is overlapc.collectives is module.collectives
    assert (Collective, role) == (module.Collective, module.role) and overlapc.Collective is Collective
    assert overlapc.OverlapConfig is OverlapConfig
    assert overlapc.schedule is importlib.import_module("overlapc.api").schedule
    assert overlapc.ScheduleError is overlapc.passes.ScheduleError
    for name in overlapc.passes.__all__:
        home = overlapc.passes.options if name == "ScheduleOptions" else overlapc.passes.pipeline
        assert getattr(overlapc.passes, name) is getattr(home, name)


def test_the_passes_take_the_scheduling_fields_of_the_config():
    """``OverlapConfig.scheduling()`` carries each field the passes read, under its name,
    with the same defaults; the product's fields stay out."""
    from overlapc.passes.options import ScheduleOptions
    names = [f.name for f in dataclasses.fields(ScheduleOptions)]
    assert set(names) < {f.name for f in dataclasses.fields(overlapc.OverlapConfig)}
    assert {"profile", "inner", "dump_dir", "check_ranks"}.isdisjoint(names)
    assert overlapc.OverlapConfig().scheduling() == ScheduleOptions()
    changed = dict(max_in_flight=1, max_in_flight_bytes="serial-peak", bucket=None, regather="auto", chunks=2,
                   on_error="raise", enabled=False, narrow_gathers=False, issue="per-kernel", bucket_op="coalesced")
    assert set(changed) == set(names)
    assert overlapc.OverlapConfig(profile="cpu:ethernet", **changed).scheduling() == ScheduleOptions(**changed)


def _two_gathers(x, w0, w1):
    first, second = ag(w0), ag(w1)
    x = torch.relu(x @ wait(first).t())
    return torch.relu(x @ wait(second).t())


def test_options_and_config_schedule_alike_and_a_dict_goes_through_the_product(fake_pg):
    """The passes schedule the same from ScheduleOptions as from the OverlapConfig that
    gives them (and the options are read: another bound, another order); an options
    dict is validated by the product (``overlapc.verify``, ``overlapc.schedule``), and
    the passes refuse it, saying how to build a config."""
    from overlapc.passes.options import ScheduleOptions
    gm = trace(_two_gathers, (4, 16), (2, 16), (2, 16))
    orders, graphs = {}, {}
    for name, config in [("options", ScheduleOptions(max_in_flight=1, on_error="raise")),
                         ("config", overlapc.OverlapConfig(max_in_flight=1, on_error="raise", profile="cpu:ethernet")),
                         ("unbounded", ScheduleOptions(max_in_flight=None, max_in_flight_bytes=None))]:
        scheduled = copy.deepcopy(gm)
        overlapc.passes.schedule(scheduled, config)
        orders[name], graphs[name] = body(scheduled), scheduled
    assert orders["options"] == orders["config"] != orders["unbounded"]
    overlapc.verify(graphs["options"], {"max_in_flight": 1})
    with pytest.raises(overlapc.ScheduleError, match="limit 1"):
        overlapc.verify(graphs["unbounded"], {"max_in_flight": 1})
    with pytest.raises(ValueError, match="max_in_flight"):
        overlapc.verify(graphs["options"], {"max_in_flight": 0})
    with pytest.raises(TypeError, match="OverlapConfig.from_options"):
        overlapc.passes.verify(graphs["options"], {"max_in_flight": 1})



@pytest.mark.parametrize("field, value, expected", [
    ("max_in_flight", 0, "max_in_flight must be an int >= 1 or None, got 0"),
    ("max_in_flight_bytes", "serial", "did you mean 'serial-peak'"),
    ("bucket", "modul", "did you mean 'module'"),
    ("regather", "sometimes", "regather must be one of"),
    ("chunks", 0, 'chunks must be an int >= 1 (1 = off) or "auto"'),
    ("on_error", "ignore", "on_error must be one of"),
    ("enabled", 1, "enabled must be a bool"),
])
def test_both_configs_check_the_scheduling_fields_in_one_place(field, value, expected):
    """ScheduleOptions and OverlapConfig refuse the same bad values with the same words, each
    naming itself; so do the passes' helpers that take bare limits."""
    from overlapc.passes.options import ScheduleOptions
    for owner in (ScheduleOptions, overlapc.OverlapConfig):
        with pytest.raises(ValueError) as raised:
            owner(**{field: value})
        assert str(raised.value).startswith(f"{owner.__name__}.{field}") and expected in str(raised.value)


def test_the_bare_limit_helpers_refuse_bad_limits(fake_pg):
    gm = trace(_two_gathers, (4, 16), (2, 16), (2, 16))
    with pytest.raises(ValueError, match="ScheduleOptions.max_in_flight must be an int >= 1"):
        overlapc.passes.limit_in_flight(gm, 0)
    with pytest.raises(ValueError, match="did you mean 'serial-peak'"):
        overlapc.passes.limit_in_flight(gm, 2, "serial")
