"""The tests reach ember through its public interfaces (tests/README.md): no test reads a
private attribute of an ember object or imports a private name of an ember module.

A private name is one that starts with a single underscore. "Of ember" is decided by name:
the private names that `src/ember` defines (functions, classes, attributes and variables it
assigns, keyword arguments it passes). An AST walk of every file under tests/ finds the
private names a test reads (`obj._x`, `getattr(obj, "_x")`, `monkeypatch.setattr(obj, "_x",
...)`, `from ember.m import _x`); a read of one of ember's is an error unless `ALLOWED`
names the file and the name, with why. A test's own classes may read their own privates
(`self._x` where the test file defines `_x`). Where a test must look inside, ember gives it
its `debug_state()`, one documented inspection point per component (e.g. `Service.debug_state`).
Nor does a test drive a Service's state managers (`svc.store`, `svc.runs`, `svc.futures`),
nor monkeypatch ember: a test that replaces a function, method or constant of ember's
(`monkeypatch.setattr(module, "name", f)`, `monkeypatch.setattr("ember.m.name", f)`,
`module.name = f`, `obj.method = test_function`) makes it fail or behave through a documented
seam instead: a fail point (`ember.failpoints`) or a constructor or function argument.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src" / "ember"

# (test file, private name of ember's) -> why the test reads it: each is another
# library's object with a private of the same name, never ember's own.
ALLOWED = {
    ("tests/server/test_server_limits.py", "_sampling_session_id"):
        "the tinker SDK's SamplingClient (ember's has the same private name): the SDK has no public accessor for it",
    ("tests/server/test_server_tenants_sampling.py", "_sampling_session_id"):
        "the tinker SDK's SamplingClient (ember's has the same private name): the SDK has no public accessor for it",
    ("tests/helpers/zygote.py", "_shutdown"):
        "the standard library's threading._shutdown (ember has a `_shutdown` too): a forked child joins its "
        "threads as interpreter exit and multiprocessing's fork children do",
}


def _private(name: str) -> bool:
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))


def _defined(tree: ast.AST) -> set[str]:
    """The private names a module defines or assigns (anywhere in it)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)  # e.g. argparse's set_defaults(_x=...) makes a Namespace attribute
    return {n for n in names if _private(n)}


@functools.cache
def ember_private_names() -> frozenset[str]:
    return frozenset().union(*(_defined(ast.parse(p.read_text())) for p in SRC.rglob("*.py")))


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _string_args(call: ast.Call) -> list[str]:
    return [a.value for a in call.args[:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)]


def _reads(tree: ast.AST, own: set[str]) -> Iterator[tuple[int, str]]:
    """(line, name) of each name a test module reads off another object or module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if not (on_self and node.attr in own):
                yield node.lineno, node.attr
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ember":
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.Call) and _callee(node) in ("getattr", "setattr", "hasattr", "delattr"):
            for text in _string_args(node):  # getattr(obj, "_x"); monkeypatch.setattr("ember.m._x", v)
                parts = text.split(".")
                if len(parts) == 1 or parts[0] == "ember":
                    yield from ((node.lineno, part) for part in parts)


def violations(source: str | ast.AST, rel: str, ember_names: frozenset[str]) -> list[str]:
    """`rel:line: name` for each private name of ember that `source` (text or its parsed
    tree) reads and `ALLOWED` does not list."""
    tree = ast.parse(source) if isinstance(source, str) else source
    own = _defined(tree)
    return [f"{rel}:{line}: {name}" for line, name in sorted(_reads(tree, own))
            if _private(name) and name in ember_names and (rel, name) not in ALLOWED]


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.name != Path(__file__).name)


@functools.cache
def scan_test_files() -> tuple[list[str], list[str]]:
    """(`violations`, `manager_reads`) over every file under tests/ but this one: each file
    is parsed once for both checks, and its tree dropped (keeping ~170 trees alive makes
    the garbage collector's passes cost more than a second parse)."""
    names = ember_private_names()
    private, managers = [], []
    for p in _test_files():
        rel, tree = p.relative_to(TESTS.parent).as_posix(), ast.parse(p.read_text())
        private += violations(tree, rel, names)
        managers += manager_reads(tree, rel)
    return private, managers


def test_no_test_reads_a_private_attribute_of_ember():
    found = scan_test_files()[0]
    assert not found, ("tests read private names of ember; use a public interface or add a documented "
                       "read-only accessor (or, for an object that is not ember's, an ALLOWED entry):\n"
                       + "\n".join(found))


def test_every_allowed_entry_is_still_read_and_says_why():
    """A stale entry would let a new read of the same name through unnoticed."""
    for (rel, name), why in ALLOWED.items():
        tree = ast.parse((TESTS.parent / rel).read_text())
        assert name in ember_private_names(), f"ALLOWED[{rel!r}, {name!r}]: ember has no such private name"
        assert any(n == name for _, n in _reads(tree, set())), f"ALLOWED[{rel!r}, {name!r}] is no longer read"
        assert len(why) > 20, (rel, name)


def test_the_check_finds_each_form_of_read():
    names = ember_private_names()
    assert {"_scheduler", "_context", "_ctx", "_service"} <= names  # ember's privates that tests once read
    source = """
from ember.server.routes_openai import _dumps
class Mine:
    def __init__(self):
        self._mine = 1
    def f(self, sampler, monkeypatch):
        self._mine, self._scheduler
        sampler._scheduler
        getattr(sampler, "_ctx")
        monkeypatch.setattr("ember.client.rest._now", None)
        monkeypatch.setattr(sampler, "_service", None)
        sampler.__class__, sampler.scheduler
"""
    got = violations(source, "x.py", names)
    assert [v.split(": ")[1] for v in got] == ["_dumps", "_scheduler", "_scheduler", "_ctx", "_now", "_service"], got


# A Service's managers of state: a test that drives them makes states no request can make.
# Tests reach such states through requests, fail points (`ember.failpoints`, e.g. `run.op`
# held with `hold`) or the database file itself, as another process would write it.
MANAGERS = ("store", "runs", "futures")


def manager_reads(source: str | ast.AST, rel: str) -> list[str]:
    """`rel:line: svc.<manager>` for each read of a Service's state manager (`svc.store`,
    `service.runs`, `client.service.futures`, ...) in `source` (text or its parsed tree)."""
    found = []
    for node in ast.walk(ast.parse(source) if isinstance(source, str) else source):
        if isinstance(node, ast.Attribute) and node.attr in MANAGERS:
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in ("svc", "service")) or \
                    (isinstance(owner, ast.Attribute) and owner.attr == "service"):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_test_drives_a_services_state_managers():
    found = scan_test_files()[1]
    assert not found, "tests drive a Service's managers; go through a request, a fail point or the database:\n" + \
        "\n".join(found)
    sample = "svc.runs.submit_op(1)\nsc.service.store.update(x)\nsvc.retrieve(1)\nother.runs\n"
    assert [v.split(": ")[1] for v in manager_reads(sample, "x.py")] == ["svc.runs", "sc.service.store"]


def test_every_test_file_the_readme_names_exists():
    """tests/README.md is where a feature's tests are found: each file it names is there."""
    text = (TESTS / "README.md").read_text()
    named = set(re.findall(r"\btest_\w+\.py\b", text))
    present = {p.name for p in TESTS.rglob("test_*.py")}
    assert named and not named - present, sorted(named - present)


# Monkeypatching. A third-party object (torch, the standard library) may be patched: ember does
# not own its seams (e.g. `torch.cuda.empty_cache`, to count calls on a CPU host). Everything
# else a test patches is ember's: a module, a class, or an object a fixture made, and none is
# allowed: a test makes ember fail through a fail point or passes the behaviour in.


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _imported(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names bound by importing ember, names bound by importing anything else)."""
    ember, other = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            for alias in node.names:
                source = module or alias.name
                bound = alias.asname or alias.name.split(".")[0]
                (ember if source.split(".")[0] == "ember" else other).add(bound)
    return ember, other


def _patched(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, target) of each monkeypatch of ember's in a test module."""
    ember, other = _imported(tree)
    own_functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and \
                node.func.attr in ("setattr", "delattr") and _root(node.func.value) == "monkeypatch":
            target = node.args[0]
            if isinstance(target, ast.Constant) and isinstance(target.value, str):
                if target.value.split(".")[0] == "ember":
                    yield node.lineno, target.value
            elif _root(target) not in other:
                name = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)]
                yield node.lineno, ".".join([ast.unparse(target), *map(str, name)])
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            replaces = isinstance(node.value, ast.Lambda) or \
                (isinstance(node.value, ast.Name) and node.value.id in own_functions)
            for t in targets:  # a test's own class sets its own attributes (`self.x = ...`)
                if isinstance(t, ast.Attribute) and _root(t) not in ("self", "cls") and (_root(t) in ember or replaces):
                    yield node.lineno, ast.unparse(t)


def patches(source: str | ast.AST, rel: str) -> list[str]:
    """`rel:line: target` for each monkeypatch of ember's in `source`."""
    tree = ast.parse(source) if isinstance(source, str) else source
    return [f"{rel}:{line}: {target}" for line, target in sorted(_patched(tree))]


def test_no_test_monkeypatches_ember():
    found = [v for p in _test_files() for v in patches(p.read_text(), p.relative_to(TESTS.parent).as_posix())]
    assert not found, ("tests monkeypatch ember; make it fail through a fail point (ember.failpoints) or pass "
                       "the behaviour in (a constructor or function argument):\n" + "\n".join(found))


def test_the_patch_check_finds_each_form():
    source = """
import torch
from ember.sampling import scheduler
from ember.sampling.runner import ModelRunner
def flaky(ids):
    raise ValueError
def t(monkeypatch, sampler):
    monkeypatch.setattr(scheduler, "top_logprobs", flaky)
    monkeypatch.setattr("ember.sampling.jobs.prompt_scores", flaky)
    monkeypatch.setattr(ModelRunner, "unembed", flaky)
    monkeypatch.setattr(sampler, "config", None)
    scheduler.ROW_CHUNK = 5
    sampler.scheduler.decode_text = flaky
    sampler.other = lambda: 1
    monkeypatch.setattr(torch.cuda, "empty_cache", flaky)
    monkeypatch.setattr("os.getpid", flaky)
    sampler.count = 3
    self.returncode = flaky
"""
    got = [v.split(": ")[1] for v in patches(source, "x.py")]
    assert got == ["scheduler.top_logprobs", "ember.sampling.jobs.prompt_scores", "ModelRunner.unembed",
                   "sampler.config", "scheduler.ROW_CHUNK", "sampler.scheduler.decode_text", "sampler.other"], got


# Words that mark an accessor kept only so tests can look inside ("for inspection", "for tests",
# "for fault-injection tests", "(tests)", "exposed for tests", "used by tests").
TEST_ONLY_WORDING = re.compile(r"for inspection|\bfor (?:[\w-]+ )?tests\b|\(tests\)|\bused by tests\b", re.I)


def wording_violations(source: str, rel: str) -> list[str]:
    """`rel:line: name` for each function or class docstring in `source` that says it exists for tests,
    except a `debug_state` method's (the one inspection point per component, tests/README.md)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name != "debug_state":
            doc = ast.get_docstring(node) or ""
            if TEST_ONLY_WORDING.search(" ".join(doc.split())):
                found.append(f"{rel}:{node.lineno}: {node.name}")
    return found


def test_no_production_docstring_says_it_exists_for_tests():
    found = [v for p in sorted(SRC.rglob("*.py"))
             for v in wording_violations(p.read_text(), p.relative_to(SRC).as_posix())]
    assert not found, ("an accessor that exists for tests: fold it into its component's `debug_state()`, use a "
                       "public stat or a fail point, or say what production uses it for:\n" + "\n".join(found))


def test_the_wording_check_finds_each_form():
    source = '''
class A:
    def a(self):
        """The rows, for inspection."""
    def b(self):
        """Pids (for fault-injection
        tests)."""
    def c(self):
        """The cache; exposed for tests."""
    def debug_state(self):
        """The one inspection point, for inspection and for tests."""
    def d(self):
        """What /metrics reports; a test reads it too."""
'''
    assert [v.split(": ")[1] for v in wording_violations(source, "x.py")] == ["a", "b", "c"]
