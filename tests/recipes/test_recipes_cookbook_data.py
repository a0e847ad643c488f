"""README's "Offline data for each recipe" table, checked: each local layout it documents,
built in a temporary directory, loads offline exactly as the table's call (the recipe's own)
is written.

The table is the test's input, so the documented layouts and the test cannot drift apart:
a row's first cell holds the calls (`load_dataset(...)`, `get_dataset_config_names(...)`,
where a bare `config` / `split` argument stands for each configuration / split the layout
has), its second the fields written into each row, its third the files (`{a,b}` is two
files, `CLASS` a directory per class, `org/name/README.md` the YAML `configs:` this test
writes by the rule the README states: one configuration per subdirectory, one split per
file). Each row of a stand-in carries its own file's name in every field, so a call that
read another configuration's or split's file fails.

The calls run in a fresh Python with `HF_HUB_OFFLINE=1`, `HF_DATASETS_OFFLINE=1` and an
empty `HF_DATASETS_CACHE` (`datasets` reads them at import, and keys a local directory's
cache by its name, not its path). The fast test covers the data sets the CI recipes and the
first recipes read; the slow one every other row (streamed, image folders included).
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTION = "### Offline data for each recipe"
FAST = ("HuggingFaceH4/no_robots", "openai/gsm8k", "Anthropic/hh-rlhf", "HuggingFaceH4/MATH-500",
        "zwhe99/DeepMath-103K")
CLASSES = ("red_panda", "sea_lion")  # what `CLASS` stands for in an image folder
ROWS = 2  # rows per JSON Lines file

pytest.importorskip("datasets", reason="the `datasets` package is not importable: the cookbook's data layouts "
                                       "cannot be loaded (`make test` installs it)")


@dataclass
class Row:
    calls: list[str]
    fields: list[str]
    files: list[str]


def section_text() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(SECTION)
    end = min((i for i in (text.find("\n## ", start), text.find("\n### ", start + 1)) if i >= 0), default=len(text))
    return text[start:end]


def expand(pattern: str) -> list[str]:
    """`a/{x,y}/b{1,2}` -> the four paths, in order."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def table_rows(section: str) -> list[Row]:
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not re.match(r"`(load_dataset|get_dataset_config_names)\(", cells[0]):
            continue
        ticks = [re.findall(r"`([^`]+)`", c) for c in cells]
        rows.append(Row(ticks[0], [f for t in ticks[1] for f in expand(t)],
                        [f for t in ticks[2] for f in expand(t)]))
    return rows


def repo_of(path: str) -> str:
    return "/".join(PurePosixPath(path).parts[:2])


class Layout:
    """One data set's documented files: its configurations, their splits and the files of each."""

    def __init__(self, repo: str, files: list[str]):
        self.repo = repo
        inner = [PurePosixPath(f).relative_to(repo) for f in files]
        self.configured = PurePosixPath("README.md") in inner
        self.files: dict[tuple[str, str], list[PurePosixPath]] = {}  # (config, split) -> files
        for rel in (r for r in inner if r.name != "README.md"):
            if self.configured:  # CONFIG/SPLIT.jsonl
                key = (rel.parts[0], PurePosixPath(rel.parts[-1]).stem)
            else:  # SPLIT.jsonl, or an image folder's SPLIT/CLASS/FILE
                key = ("default", rel.parts[0] if len(rel.parts) > 1 else rel.stem)
            self.files.setdefault(key, []).append(rel)

    def configs(self) -> list[str]:  # in the table's order, as the README.md lists them
        return list(dict.fromkeys(c for c, _ in self.files))

    def splits(self, config: str) -> list[str]:
        return [s for c, s in self.files if c == config]

    def readme(self) -> str:
        """The README.md front matter declaring each configuration's files by split."""
        lines = ["---", "configs:"]
        for config in self.configs():
            lines += [f"- config_name: {config}", "  data_files:"]
            for split in self.splits(config):
                for rel in self.files[(config, split)]:
                    lines += [f"  - split: {split}", f"    path: {rel}"]
        return "\n".join([*lines, "---"]) + "\n"


def stand_in_row(fields: list[str], marker: str) -> dict:
    row: dict = {}
    for field in fields:
        *outer, last = field.split(".")
        node = row
        for key in outer:
            node = node.setdefault(key, {})
        node[last] = marker
    return row


def write_layout(work: Path, layout: Layout, fields: list[str]) -> None:
    for rels in layout.files.values():
        for rel in rels:
            path = work / layout.repo / str(rel).replace("CLASS", "{" + ",".join(CLASSES) + "}")
            for concrete in expand(str(path)):
                Path(concrete).parent.mkdir(parents=True, exist_ok=True)
                if concrete.endswith(".png"):
                    from PIL import Image

                    Image.new("RGB", (4, 4), (200, 30, 30)).save(concrete)
                else:
                    name = f"{layout.repo}/{rel}"
                    Path(concrete).write_text("".join(json.dumps(stand_in_row(fields, f"{name}#{i}")) + "\n"
                                                      for i in range(ROWS)))
    if layout.configured:
        (work / layout.repo / "README.md").write_text(layout.readme())


def bound(arg: ast.expr, binding: dict[str, str | None]) -> object:
    """A call's argument: a literal as written, or the value a bare `config`/`split` stands for."""
    return binding[arg.id] if isinstance(arg, ast.Name) else ast.literal_eval(arg)


def concrete_calls(call: str, layouts: dict[str, Layout]) -> list[tuple[dict, dict]]:
    """The call as written, with a bare `config`/`split` bound to each of the layout's, and
    what each should return."""
    node = ast.parse(call, mode="eval").body
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name), call
    repo = ast.literal_eval(node.args[0])
    layout = layouts[repo]
    if node.func.id == "get_dataset_config_names":
        return [({"func": node.func.id, "args": [repo], "kwargs": {}}, {"configs": layout.configs()})]
    named = {k.arg: k.value for k in node.keywords} | ({"name": node.args[1]} if len(node.args) > 1 else {})
    out = []
    for config in layout.configs() if isinstance(named.get("name"), ast.Name) else [
            ast.literal_eval(named["name"]) if "name" in named else "default"]:
        for split in layout.splits(config) if isinstance(named.get("split"), ast.Name) else [
                ast.literal_eval(named["split"]) if "split" in named else None]:
            binding = {"config": config, "split": split}
            wanted = [split] if split is not None else layout.splits(config)
            out.append(({"func": node.func.id, "args": [bound(a, binding) for a in node.args],
                         "kwargs": {k.arg: bound(k.value, binding) for k in node.keywords}, "split": split},
                        {"splits": {s: [f"{repo}/{r}" for r in layout.files.get((config, s), [])] for s in wanted}}))
    return out


# Runs in a fresh interpreter (offline switches are read at import): each call as written,
# and what came back, split by split: its columns, the first field of each row, class names.
LOADER = r"""
import json, sys
import datasets
spec = json.loads(sys.stdin.read())
def summary(ds, first):
    rows = list(ds)
    label = ds.features.get("label") if ds.features else None
    return {"columns": sorted(rows[0]) if rows else [],
            "first": [r[first] if isinstance(r[first], str) else None for r in rows],
            "labels": list(getattr(label, "names", []) or [])}
out = []
for call in spec["calls"]:
    try:
        first = spec["first"][call["args"][0]]
        result = getattr(datasets, call["func"])(*call["args"], **call["kwargs"])
        if call["func"] == "get_dataset_config_names":
            out.append({"configs": sorted(result)})
        elif call["split"] is None:  # a DatasetDict
            out.append({"splits": {s: summary(d, first) for s, d in result.items()}})
        else:
            out.append({"splits": {call["split"]: summary(result, first)}})
    except Exception as e:
        out.append({"error": f"{type(e).__name__}: {e}"})
print(json.dumps(out))
"""


def load_offline(work: Path, cache: Path, calls: list[dict], first: dict[str, str]) -> list[dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache),
           "HF_HOME": str(cache / "hf-home"), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.run([sys.executable, "-c", LOADER], input=json.dumps({"calls": calls, "first": first}),
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_rows(rows: list[Row], tmp_path: Path) -> None:
    """Build the rows' layouts in one fresh working directory (each data set is one row's),
    run every call in one fresh interpreter, compare."""
    work, cache = tmp_path / "work", tmp_path / "cache"
    pairs, first = [], {}
    for row in rows:
        layouts = {repo: Layout(repo, [f for f in row.files if repo_of(f) == repo])
                   for repo in dict.fromkeys(repo_of(f) for f in row.files)}
        for layout in layouts.values():
            write_layout(work, layout, row.fields)
            first[layout.repo] = row.fields[0]
        pairs += [(c, e, row.fields) for call in row.calls for c, e in concrete_calls(call, layouts)]
    results = load_offline(work, cache, [c for c, _, _ in pairs], first)
    for (call, expected, fields), got in zip(pairs, results, strict=True):
        where = f"{call['func']}(*{call['args']}, **{call['kwargs']})"
        assert "error" not in got, f"{where} failed offline: {got['error']}"
        if "configs" in expected:
            assert got["configs"] == sorted(expected["configs"]), where
            continue
        assert sorted(got["splits"]) == sorted(expected["splits"]), (where, got["splits"].keys())
        for split, files in expected["splits"].items():
            check_split(where, split, files, fields, got["splits"][split])


def check_split(where: str, split: str, files: list[str], fields: list[str], got: dict) -> None:
    image_folder = any("CLASS" in f for f in files)
    if image_folder:  # one image per class, labelled by its directory
        assert got["labels"] == sorted(CLASSES) and len(got["first"]) == len(CLASSES), (where, split, got)
    else:  # exactly the rows of that split's files, each with every documented field
        assert sorted(got["first"]) == sorted(f"{f}#{i}" for f in files for i in range(ROWS)), (where, split, got)
    top = {f.split(".")[0] for f in fields}
    assert top <= set(got["columns"]), (where, split, got["columns"])


def documented_rows() -> list[Row]:
    rows = table_rows(section_text())
    assert len(rows) >= 15, f"README's data table lost rows: {len(rows)} found"
    return rows


def fast_rows() -> list[Row]:
    return [r for r in documented_rows() if {repo_of(f) for f in r.files} <= set(FAST)]


def test_the_first_recipes_data_sets_load_offline_as_documented(tmp_path):
    rows = fast_rows()
    assert {repo_of(f) for r in rows for f in r.files} == set(FAST), "a data set of the CI recipes lost its row"
    check_rows(rows, tmp_path)


@pytest.mark.slow
def test_every_other_documented_layout_loads_offline(tmp_path):
    check_rows([r for r in documented_rows() if r not in fast_rows()], tmp_path)


def test_the_documented_readme_configs_are_the_ones_checked():
    """The README's example front matter is what this test writes for gsm8k's layout."""
    section = section_text()
    example = re.search(r"```text\n(---\n.*?---\n)```", section, re.S)
    assert example, "the README lost its configs example"
    gsm8k = next(r for r in table_rows(section) if any(f.startswith("openai/gsm8k/") for f in r.files))
    assert example.group(1) == Layout("openai/gsm8k", gsm8k.files).readme()


def cookbook_package() -> Path:
    cookbook = pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (`make test` installs it)")
    return Path(cookbook.__file__).parent


def test_each_documented_data_set_is_one_the_cookbook_reads():
    """Each data set id in the table occurs, quoted, in tinker-cookbook 0.6.1's sources."""
    package = cookbook_package()
    files = [*(package / "recipes").rglob("*.py"), package / "distillation" / "datasets.py"]
    sources = "\n".join(p.read_text() for p in files)
    calls = [c for r in documented_rows() for c in r.calls]
    missing = [c for c in calls if f'"{ast.literal_eval(ast.parse(c, mode="eval").body.args[0])}"' not in sources]
    assert not missing, f"not read by the installed tinker-cookbook: {missing}"


def test_every_recipe_entry_point_has_a_row():
    """Every module of the cookbook's recipes that runs as `python -m` is in the recipe table
    (itself or its package), and every module the table names exists."""
    recipes = cookbook_package() / "recipes"
    named = set()
    for line in section_text().splitlines():
        cells = line.strip().strip("|").split("|")
        if len(cells) == 4:
            named |= {t for t in re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+)*)`", cells[0])}
    assert len(named) >= 30, f"README's recipe table lost rows: {sorted(named)}"
    exists = {m for m in named if (recipes / m.replace(".", "/")).with_suffix(".py").is_file()
              or (recipes / m.replace(".", "/")).is_dir()}
    assert exists == named, f"not a module of tinker_cookbook.recipes: {sorted(named - exists)}"
    entry = {".".join(p.relative_to(recipes).with_suffix("").parts) for p in recipes.glob("**/*.py")
             if re.search(r'^if __name__ == "__main__":', p.read_text(), re.M)}
    unlisted = [m for m in sorted(entry) if not any(m == n or m.startswith(n + ".") for n in named)]
    assert not unlisted, f"recipe entry points missing from README's table: {unlisted}"
