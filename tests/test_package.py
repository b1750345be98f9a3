"""Rules of the package's structure that the linters do not check.

import-linter (``lint-imports``, contracts in pyproject.toml) checks the layers and
cycles; ruff checks where imports stand. These check the use of private names: a
module uses another module's public names only (what is shared is public where it
lives), and the tests use petfunc's public names only.
"""

import ast
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


def _is_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module or package of the source tree."""
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private_imports(path: Path, package_only: bool):
    """``(line, "module.name")`` of each import of a private petfunc name in ``path``:
    a name starting with one underscore imported from another module (and, with
    ``package_only`` false, any private petfunc module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("petfunc"):
            parts = node.module.split(".")
            module_private = any(p.startswith("_") and not p.startswith("__") for p in parts)
            for alias in node.names:
                private_name = alias.name.startswith("_") and not alias.name.startswith("__")
                if package_only and private_name and _is_module(f"{node.module}.{alias.name}"):
                    continue  # a private module, imported where import-linter allows it
                if private_name or (module_private and not package_only):
                    found.append((node.lineno, f"{node.module}.{alias.name}"))
        elif isinstance(node, ast.Import) and not package_only:
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "petfunc" and any(p.startswith("_") and not p.startswith("__") for p in parts):
                    found.append((node.lineno, alias.name))
    return found


def test_no_module_imports_another_modules_private_name():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sorted((ROOT / "petfunc").rglob("*.py"))
        for line, name in _private_imports(path, package_only=True)
    ]
    assert not offenders, "private names imported across modules:\n" + "\n".join(offenders)


def test_no_test_imports_a_private_name():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for line, name in _private_imports(path, package_only=False)
    ]
    assert not offenders, "tests importing private petfunc names:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from petfunc.io.load import _cast", ["petfunc.io.load._cast"]),
        ("from petfunc._files import atomic_write", ["petfunc._files.atomic_write"]),
        ("import petfunc._torch.patch", ["petfunc._torch.patch"]),
        ("from petfunc.io import load_model\nimport petfunc.graph", []),
    ],
)
def test_the_checks_find_private_imports(tmp_path, source, expected):
    path = tmp_path / "example.py"
    path.write_text(source + "\n")
    assert [name for _, name in _private_imports(path, package_only=False)] == expected
