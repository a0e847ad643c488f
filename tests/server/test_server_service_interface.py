"""The console and `/metrics` read the service through `ServiceAPI` only (docs/architecture.md,
"Service"): they import nothing of `ember.service` but its interface modules, and every
attribute they read off a service is a `ServiceAPI` member. Pure: reads the sources."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ember
from ember.service.api import ServiceAPI

SERVER = Path(ember.__file__).parent / "server"
CHECKED = sorted(SERVER.joinpath("console").glob("*.py")) + [SERVER / "metrics.py"]
# the interface modules; metric_history only for its pure series arithmetic (no manager, no state)
ALLOWED_MODULES = {"ember.service.api", "ember.service.requests", "ember.errors"}
ALLOWED_NAMES = {"ember.service.metric_history": {"COMPLETION", "SAMPLED", "SEQUENCES", "TOKENS", "derived",
                                                   "series", "target_tokens"}}
SERVICE_NAMES = {"service", "_service"}  # how these modules name a ServiceAPI


def _imports(tree: ast.AST) -> list[tuple[str, set[str]]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, {a.name for a in node.names}))
        elif isinstance(node, ast.Import):
            out += [(a.name, set()) for a in node.names]
    return out


def _service_reads(tree: ast.AST) -> set[str]:
    """Attribute names read off a name (or attribute) called `service`/`_service`."""
    reads = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            if name in SERVICE_NAMES:
                reads.add(node.attr)
    return reads


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: p.name)
def test_imports_only_the_service_interface(path):
    for module, names in _imports(ast.parse(path.read_text())):
        if not (module == "ember.service" or module.startswith("ember.service.")):
            continue
        if module in ALLOWED_MODULES:
            continue
        extra = names - ALLOWED_NAMES.get(module, set())
        assert module in ALLOWED_NAMES and not extra, (
            f"{path.name} imports {sorted(extra) or module} from {module}: read the service through ServiceAPI")


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: p.name)
def test_reads_only_service_api_members(path):
    members = {name for name in dir(ServiceAPI) if not name.startswith("_")}
    foreign = _service_reads(ast.parse(path.read_text())) - members
    assert not foreign, f"{path.name} reads {sorted(foreign)} off the service: not ServiceAPI members"


def test_the_check_sees_a_manager_read():
    """The check itself: a read of a manager and an import of one are caught."""
    tree = ast.parse("from ember.service.runs import RunManager\nx = app.state.service.runs.queue_depths()\n")
    assert ("ember.service.runs", {"RunManager"}) in _imports(tree)
    assert _service_reads(tree) == {"runs"}
