"""The dependency rule, checked on every import statement in the packages (module level and inside functions).

Between packages: `runner -> engines <- builder`, both may use `plugins`; `engines` and `plugins` import neither
`builder` nor `runner`; `training` (drafter distillation) is the one package that may import both.

Inside the runner, layers from the bottom up; a module imports its own layer or lower ones only:
sampling < speculative < core < llm (the Python API) < serving, tools < cli. `runner/__init__.py` is the public
surface and may import any layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("builder", "engines", "plugins", "runner", "training")
ALLOWED = {
    "engines": {"engines"},
    "plugins": {"plugins"},
    "builder": {"builder", "engines", "plugins"},
    "runner": {"runner", "engines", "plugins"},
    "training": set(PACKAGES),
}
RUNNER_LAYERS = {"sampling": 0, "speculative": 1, "core": 2, "llm": 3, "serving": 4, "tools": 4, "cli": 5}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def runner_layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "runner" else None


def violations(path: Path) -> list[str]:
    module_parts = path.relative_to(ROOT).with_suffix("").parts
    package = module_parts[0]
    own_layer = module_parts[1] if package == "runner" and len(module_parts) > 1 else None
    found = []
    for line, module in imported_modules(path):
        top = module.split(".")[0]
        if top in PACKAGES and top not in ALLOWED[package]:
            found.append(f"{path.relative_to(ROOT)}:{line} imports {module}: {package} may not import {top}")
        if own_layer in RUNNER_LAYERS and top == "runner":
            layer = runner_layer(module)
            if layer is None or layer == own_layer:
                continue
            if layer not in RUNNER_LAYERS or RUNNER_LAYERS[layer] >= RUNNER_LAYERS[own_layer]:
                found.append(
                    f"{path.relative_to(ROOT)}:{line} imports {module}: runner.{own_layer} may not import "
                    f"runner.{layer}"
                )
    return found


def package_files() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def test_every_runner_module_is_in_a_layer():
    loose = [path.name for path in (ROOT / "runner").glob("*.py") if path.stem not in ("__init__", *RUNNER_LAYERS)]
    packages = [path.name for path in (ROOT / "runner").iterdir() if (path / "__init__.py").exists()]
    assert loose == []
    assert sorted(packages) == sorted(name for name in RUNNER_LAYERS if name != "llm")


@pytest.mark.parametrize("path", package_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_imports_follow_the_dependency_rule(path):
    assert violations(path) == []


def test_the_rule_catches_a_violation(monkeypatch):
    offender = ROOT / "runner" / "core" / "x_offender.py"
    monkeypatch.setattr(
        Path, "read_text", lambda self, *a, **k: "from runner.serving.app import create_app\nimport builder.build\n"
    )
    assert violations(offender) == [
        "runner/core/x_offender.py:1 imports runner.serving.app: runner.core may not import runner.serving",
        "runner/core/x_offender.py:2 imports builder.build: runner may not import builder",
    ]
