"""Two floors, arrows one way: passes/ (the ground floor, ``overlapc.passes``) imports
nothing from the product around it. Read from the source with ``ast``, not by
importing, so an import inside a function counts as much as one at the top."""
import ast
import pathlib

import pytest

PASSES = pathlib.Path(__file__).resolve().parent.parent / "passes"

# overlapc modules the passes must not import: the product around them
PRODUCT = ("report", "cli", "backend", "costmodel", "simulate", "analyze", "calibrate", "demo",
           "html_report", "rankcheck", "fsdp", "launch", "api", "integrations", "inductor_order", "torch_compat")


def _imported(package: list[str], tree: ast.AST):
    """(line, module) for every module ``tree`` imports, with ``from overlapc import x``
    read as ``overlapc.x`` and relative imports resolved against ``package``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[:len(package) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def forbidden_imports(root: pathlib.Path = PASSES) -> list[str]:
    """"passes/file:line imports overlapc.X" for each import of a product module in the
    files under ``root`` (the folder installed as ``overlapc.passes``)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        package = ["overlapc", "passes", *path.relative_to(root).parent.parts]
        for line, module in _imported(package, tree):
            parts = module.split(".")
            if len(parts) >= 2 and parts[0] == "overlapc" and parts[1] in PRODUCT:
                found.append(f"passes/{path.relative_to(root).as_posix()}:{line} imports {'.'.join(parts[:2])}")
    return sorted(set(found), key=lambda text: (text.split(":")[0], int(text.split(":")[1].split()[0])))


def test_passes_import_nothing_from_the_product():
    found = forbidden_imports()
    assert not found, "passes/ must not import the product around it:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from overlapc import costmodel\n", ["1 imports overlapc.costmodel"]),
    ("def f():\n    from overlapc.report import summary\n", ["2 imports overlapc.report"]),
    ("import overlapc.simulate as s\n", ["1 imports overlapc.simulate"]),
    ("from ... import api\n", ["1 imports overlapc.api"]),   # relative, from passes/chunk/
    ("from overlapc.collectives import role\nfrom overlapc.passes import memory\n", []),
])
def test_the_check_finds_each_form_of_import(tmp_path, source, expected):
    """The check itself can fail: every form of import is seen, allowed ones are not."""
    root = tmp_path / "passes"
    (root / "chunk").mkdir(parents=True)
    (root / "chunk" / "x.py").write_text(source)
    found = forbidden_imports(root)
    assert [text.removeprefix("passes/chunk/x.py:") for text in found] == expected
