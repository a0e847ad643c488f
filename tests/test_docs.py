"""Everything the code and the docs cite is in the repository: a file path (`docs/...`,
`src/...`, `tests/...`, `examples/...`, `benchmarks/...`, or a package path such as
`service/store.py`, read under `src/ember/`), a section of `docs/protocol.md` (`§3.3`,
`§2.2-2.3`, `§2.4, §3`), an anchor (`docs/architecture.md#contracts`, or a Markdown link's
`#anchor`) or a contract (`docs/architecture.md contract 2`) must exist; nothing may cite
the design notes kept outside the repository (`DESIGN.md`, `tinker-protocol.md`)."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("README.md", "docs/**/*.md", "src/**/*.py", "tests/**/*.py", "tests/**/*.md", "examples/**/*",
           "benchmarks/**/*", "Makefile", "pyproject.toml")
PACKAGES = ("client", "engine", "losses", "metrics", "models", "recipes", "sampling", "server", "service", "workers")
# the notes outside the repository (assembled so that this file does not cite them itself)
OUTSIDE = ("DESIGN" + ".md", "tinker-protocol" + ".md")
_OUTSIDE = re.compile(r"\b(?:DESIGN(?:\.md)?|tinker-protocol(?:\.md)?)(?=[\s,.:;)\"']|$)")

_PATH = re.compile(r"(?<![\w/.<-])((?:docs|src|tests|examples|benchmarks)/[\w./*<>{}-]*[\w*>}]"
                   r"|(?:ember/)?(?:" + "|".join(PACKAGES) + r")/[\w./*<>{}-]*\.(?:py|md|toml|json|ini))")
_SECTIONS = re.compile(r"docs/protocol\.md\s*((?:§\s*\d+(?:\.\d+)*(?:\s*-\s*\d+(?:\.\d+)*)?(?:\s*,\s*)?)+)")
_ANCHOR = re.compile(r"((?:docs/)?[\w-]+\.md)#([\w-]+)")
_CONTRACTS = re.compile(r"docs/architecture\.md,?\s+contracts?\s+(\d+(?:\s*(?:,|and|-)\s*\d+)*)")


def repository_files() -> list[Path]:
    files: set[Path] = set()
    for pattern in SCANNED:
        files.update(p for p in ROOT.glob(pattern) if p.is_file() and "__pycache__" not in p.parts)
    return sorted(files)


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(md: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    return [m.group(1) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M)]


def section_numbers(md: Path) -> set[str]:
    return {m.group(1) for h in headings(md) if (m := re.match(r"(\d+(?:\.\d+)*)\.?\s", h))}


def contract_numbers(md: Path) -> set[int]:
    text = md.read_text()
    start = text.find("## Contracts")
    body = text[start:text.find("\n## ", start + 1)] if start >= 0 else ""
    return {int(n) for n in re.findall(r"^(\d+)\. \*\*", body, flags=re.M)}


def _path_exists(ref: str, root: Path) -> bool:
    ref = ref.rstrip(".")
    if not ref.startswith(("docs/", "src/", "tests/", "examples/", "benchmarks/")):
        ref = "src/" + ref if ref.startswith("ember/") else "src/ember/" + ref
    pattern = re.sub(r"<[^>]*>|\{[^}]*\}", "*", ref)
    if "*" in pattern:
        return bool(glob.glob(str(root / pattern)))
    return (root / pattern).exists()


def _numbers(spec: str) -> list[str]:
    """`§2.2-2.3, §3` -> ["2.2", "2.3", "3"] (a range names both ends)."""
    return re.findall(r"\d+(?:\.\d+)*", spec)


def bad_references(path: Path, root: Path = ROOT) -> list[str]:
    """Every reference in `path` to a file, section, anchor or contract that does not exist,
    and every citation of the notes outside the repository, as 'file:line: what'."""
    problems: list[str] = []
    protocol, architecture = root / "docs" / "protocol.md", root / "docs" / "architecture.md"
    shown = path.relative_to(root) if path.is_relative_to(root) else path  # once per file: it is most of the time
    for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        where = f"{shown}:{lineno}"
        for m in _OUTSIDE.finditer(line):
            problems.append(f"{where}: cites {m.group(0)}, which is not in the repository (cite docs/)")
        for m in _PATH.finditer(line):
            if not _path_exists(m.group(1), root):
                problems.append(f"{where}: {m.group(1)} does not exist")
        for m in _SECTIONS.finditer(line):
            known = section_numbers(protocol) if protocol.is_file() else set()
            problems += [f"{where}: docs/protocol.md has no §{n}" for n in _numbers(m.group(1)) if n not in known]
        for m in _ANCHOR.finditer(line):
            target = _markdown_target(m.group(1), path, root)
            if target is not None and m.group(2) not in {slug(h) for h in headings(target)}:
                problems.append(f"{where}: {m.group(1)} has no heading #{m.group(2)}")
        for m in _CONTRACTS.finditer(line):
            known_c = contract_numbers(architecture) if architecture.is_file() else set()
            problems += [f"{where}: docs/architecture.md has no contract {n}"
                         for n in _numbers(m.group(1)) if int(n) not in known_c]
    return problems


def _markdown_target(name: str, path: Path, root: Path) -> Path | None:
    """The Markdown file an anchor reference names: from the repository root, or beside a
    Markdown file that links it relatively (None when neither exists: the path check reports it)."""
    for candidate in (root / name, path.parent / name):
        if candidate.is_file():
            return candidate
    return None


def test_every_citation_in_the_repository_exists():
    problems = [p for f in repository_files() if f != Path(__file__).resolve() for p in bad_references(f)]
    assert not problems, "\n".join(problems)


def test_the_docs_the_code_cites_are_there():
    assert {"1.4", "2.2", "3.3", "4.6", "5", "8", "9"} <= section_numbers(ROOT / "docs" / "protocol.md")
    assert set(range(1, 8)) <= contract_numbers(ROOT / "docs" / "architecture.md")


@pytest.mark.parametrize("planted, expected", [
    ("see docs/nowhere.md", "docs/nowhere.md does not exist"),
    ("# in src/ember/server/nothing_here.py", "src/ember/server/nothing_here.py does not exist"),
    ("`service/not_a_module.py` holds it", "service/not_a_module.py does not exist"),
    ("tests/engine/test_engine_nothing*.py", "tests/engine/test_engine_nothing*.py does not exist"),
    ("(docs/protocol.md §3.9)", "docs/protocol.md has no §3.9"),
    ("(docs/protocol.md §2.2-2.9)", "docs/protocol.md has no §2.9"),
    ("[x](docs/architecture.md#no-such-heading)", "docs/architecture.md has no heading #no-such-heading"),
    ("docs/architecture.md contract 12", "docs/architecture.md has no contract 12"),
    ("(" + OUTSIDE[0] + " contract 2)", "cites " + OUTSIDE[0]),
    ("(" + OUTSIDE[1] + " §3.3)", "cites " + OUTSIDE[1]),
    ("losses are sums (" + "DESIGN contract 1)", "cites DESIGN,"),
])
def test_a_planted_bad_reference_is_reported(tmp_path, planted, expected):
    bad = tmp_path / "planted.py"
    bad.write_text(f'"""A module.\n\n{planted}\n"""\n')
    problems = bad_references(bad)
    assert len(problems) == 1 and expected in problems[0] and ":3:" in problems[0], problems


def test_good_references_pass(tmp_path):
    good = tmp_path / "good.py"
    good.write_text('"""docs/protocol.md §2.2-2.3, §3 and §8 item 13; docs/architecture.md contracts 1, 2, 6, 7;\n'
                    "docs/architecture.md#contracts; `service/store.py`; src/ember/models/families/olmo2.py;\n"
                    'tests/engine/test_engine_parallel*.py; tests/<package>/test_<package>_<topic>.py."""\n')
    assert bad_references(good) == []
