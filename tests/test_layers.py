"""The layers of the code base: each package imports only those below it.

launcher/ above router/ and worker/, which import nothing of each other, above kernels/ and
common/; common/ imports neither side (kernels/ is the worker's, so common/ stays torch-free).
Read from the source with `ast`, imports inside functions included.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What each package may import of the project's packages.
ALLOWED = {
    "launcher": {"launcher", "router", "worker", "kernels", "common"},
    "router": {"router", "common"},
    "worker": {"worker", "kernels", "common"},
    "kernels": {"kernels"},
    "common": {"common"},
}


def project_imports(path: Path) -> set[str]:
    """The project packages a file imports (the first piece of each imported module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_layers_below_it(package):
    wrong = {str(path.relative_to(REPO)): sorted(project_imports(path) - ALLOWED[package])
             for path in sorted((REPO / package).rglob("*.py")) if "generated" not in path.parts}
    assert {file: packages for file, packages in wrong.items() if packages} == {}
