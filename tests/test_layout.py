"""The shape of the code, checked from the source: the packages' imports only point down the
layers below (no circles, no upward arrows), production code never imports benchmarks or
tests, every subpackage says what it is for, and modules stay small."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCTION = ("specsplit", "target_service", "draft_service", "gateway")
# lowest first: a unit imports only units of lower layers
LAYERS = [
    {"specsplit.v1", "specsplit.ops", "specsplit.heads", "specsplit.flags", "specsplit.ports", "specsplit.forced"},
    {"specsplit.models", "specsplit.sampling", "specsplit.transport", "specsplit.observability", "specsplit.placement"},
    {"specsplit.checkpoints", "specsplit.runner"},
    {"specsplit.tokenizer"},
    {"specsplit.training"},
    {"target_service", "draft_service"},
    {"gateway"},
    {"specsplit.cli", "specsplit.protogen"},
]
MAX_LINES = 400


def unit(module: str) -> str:
    """specsplit.<room> for the shared package, else the top-level package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "specsplit" and len(parts) > 1 else parts[0]


def layer(name: str) -> int:
    found = [i for i, units in enumerate(LAYERS) if name in units]
    assert found, f"{name} is in no layer of tests/test_layout.py: place it"
    return found[0]


def modules() -> list[tuple[str, Path]]:
    out = []
    for package in PRODUCTION:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("specsplit", "v1"):  # generated
                continue
            out.append((".".join(rel.with_suffix("").parts), path))
    return out


def imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_imports_point_down_the_layers() -> None:
    upward = []
    for module, path in modules():
        src = unit(module)
        for name in imports(path):
            top = name.split(".")[0]
            assert top not in ("bench", "tests", "conformance"), f"{module} imports {name}"
            if top not in PRODUCTION or unit(name) == src:
                continue
            if layer(unit(name)) >= layer(src):
                upward.append(f"{module} -> {name}")
    assert not upward, "imports that do not point down the layers:\n" + "\n".join(upward)


def test_every_package_says_what_it_is_for() -> None:
    for init in [*(ROOT / "specsplit").rglob("__init__.py"), *(ROOT / p / "__init__.py" for p in PRODUCTION[1:])]:
        if "v1" in init.relative_to(ROOT).parts:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(ROOT)} has no docstring"


def test_modules_stay_small() -> None:
    big = [f"{m}: {n}" for m, path in modules() if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not big, f"modules over {MAX_LINES} lines: {big}"
