"""The README's snippets run as written, in order, in a fresh directory.

Every fenced block of README.md is either run or checked:

* run (the default): ```bash blocks with `bash -e`, ```python blocks with the venv's python
  (one whose first line is `# file: NAME.py` is written to that file for later blocks),
  one after another in one empty scratch directory (nothing copied into it: a reader has
  only what the README's own commands make; `--config sft` is a packaged example), carrying the
  environment a bash block exports to the blocks after it. A background process a block
  starts (`ember serve ... &`) lives until the last block has run. The only edit is the
  port: `8000` becomes a free port, so that the suite never collides with a real server.
  The commands run as written; what starts them is spared the imports: `ember`, `tinker`
  and `python` are shims forking from a zygote started with the blocks' environment
  (helpers.zygote; EMBER_TEST_FORK=0 execs the venv's own executables instead).
* checked, when the line before the fence is `<!-- readme-test: check (REASON) -->` (a
  GPU, a Ray cluster, a PostgreSQL server, or a command that is this suite itself): every
  `ember ...` command in it is parsed by ember's real argument parser (and a recipe's
  overrides by its config loader), every `make TARGET` must exist in the Makefile, python
  must compile and TOML must parse. So a renamed flag breaks this test either way.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.zygote import FORK, Zygote, write_shims

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!-- readme-test: check \((.+)\) -->$")


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    check_reason: str | None


def readme_blocks(text: str) -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        marker = MARKER.match(lines[start - 1]) if start > 0 else None
        blocks.append(Block(m.group(1), "\n".join(body) + "\n", start + 1, marker.group(1) if marker else None))
        i += 1
    return blocks


def shell_commands(code: str) -> list[list[str]]:
    """Commands of a bash block: continuation lines joined, comments and `&` dropped."""
    joined = code.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[-1] == "&":
            words = words[:-1]
        if words:
            commands.append(words)
    return commands


def check_ember_command(argv: list[str], where: str) -> None:
    from ember.cli import SUBCOMMANDS, build_parser

    assert argv and argv[0] in SUBCOMMANDS, f"{where}: unknown ember subcommand in {argv}"
    args = build_parser(argv[0]).parse_args(argv)
    if argv[0] == "train":
        from ember.recipes.train_cli import load_recipe_config

        load_recipe_config(args.recipe, args.options)  # a packaged example by name, or a file path


def check_block(block: Block) -> None:
    where = f"README.md line {block.line}"
    if block.lang == "python":
        compile(block.code, where, "exec")
    elif block.lang == "toml":
        tomllib.loads(block.code)
    elif block.lang == "bash":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
        for argv in shell_commands(block.code):
            if argv[0] == "ember":
                try:
                    check_ember_command(argv[1:], where)
                except SystemExit as e:
                    raise AssertionError(f"{where}: `{shlex.join(argv)}` is refused by ember's parser") from e
            elif argv[0] == "make":
                missing = [t for t in argv[1:] if not t.startswith("-") and t not in targets]
                assert not missing, f"{where}: make targets {missing} are not in the Makefile"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runner:
    """Runs blocks in one directory and environment; remembers process groups to stop."""

    def __init__(self, work: Path, port: int, shims: Path | None = None) -> None:
        self.work, self.port, self.groups = work, port, []
        venv_bin = str(Path(sys.executable).parent)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "EMBER_"))}
        self.env.update(PATH=venv_bin + os.pathsep + self.env.get("PATH", ""), HOME=str(work / "home"),
                        PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        (work / "home").mkdir()
        self.python, self.zygote = sys.executable, None
        if shims is not None and FORK:  # the venv's executables, forked: ahead of venv_bin on PATH
            self.zygote = Zygote.start(self.env)
        if self.zygote is not None:
            write_shims(self.zygote, shims)
            self.python = str(shims / "python")
            self.env["PATH"] = str(shims) + os.pathsep + self.env["PATH"]

    def run(self, block: Block, index: int) -> None:
        code = block.code.replace("8000", str(self.port))
        out = self.work / f"block{index}.out"
        if block.lang == "bash":
            dump = self.work / f"block{index}.env"
            argv = ["bash", "-e", "-c", code + f"\nenv -0 > {shlex.quote(str(dump))}\n"]
        elif code.startswith("# file: "):  # a script the next blocks run: written, not run
            name = code.split("\n", 1)[0].removeprefix("# file: ").strip()
            assert "/" not in name, f"README.md line {block.line}: {name!r} is not a plain file name"
            (self.work / name).write_text(code)
            return
        else:
            script = self.work / f"block{index}.py"
            script.write_text(code)
            argv = [self.python, str(script)]
        with out.open("w") as f:
            proc = subprocess.Popen(argv, cwd=self.work, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            self.groups.append(proc.pid)
            try:
                rc = proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                rc = "timeout"
        assert rc == 0, f"README.md line {block.line} ({block.lang}) failed ({rc}):\n{out.read_text()[-4000:]}"
        if block.lang == "bash":
            pairs = (kv.split("=", 1) for kv in dump.read_text().split("\0") if "=" in kv)
            self.env = dict(pairs)

    def stop(self) -> None:
        for pgid in self.groups:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        if self.zygote is not None:  # after the SIGTERMs: a shim forwards its own to its command
            self.zygote.close()


def test_every_readme_block_is_run_or_checked():
    blocks = readme_blocks(README.read_text())
    assert len(blocks) >= 8
    unknown = [b.line for b in blocks if b.lang not in ("bash", "python", "toml", "text", "")]
    assert not unknown, f"README blocks of an unknown language at lines {unknown}"
    for block in blocks:
        if block.check_reason is not None:
            check_block(block)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # every snippet in turn, the cookbook recipe included: over the suite's 600 s
def test_readme_snippets_run_as_written(tmp_path, tmp_path_factory):
    blocks = [b for b in readme_blocks(README.read_text()) if b.check_reason is None]
    assert sum(b.lang == "python" for b in blocks) >= 3, "the README lost its runnable python examples"
    runner = Runner(tmp_path, free_port(), shims=tmp_path_factory.mktemp("readme-shims"))
    try:
        for i, block in enumerate(blocks):
            if block.lang in ("bash", "python"):
                runner.run(block, i)
    finally:
        runner.stop()
    assert (tmp_path / "tiny-model" / "config.json").is_file()
    assert_grpo_examples_learn(tmp_path, blocks)


def assert_grpo_examples_learn(work: Path, blocks: list[Block]) -> None:
    """Every block that runs `ember train grpo` trained at some step: a group's rewards differed
    (`frac_groups_constant` below 1), and the no-signal warning never came."""
    for i, block in enumerate(blocks):
        if "ember train grpo" not in block.code:
            continue
        out = (work / f"block{i}.out").read_text()
        fracs = [float(x) for x in re.findall(r"frac_groups_constant ([\d.e-]+)", out)]
        assert fracs and min(fracs) < 1, f"README.md line {block.line}: GRPO learned nothing: {fracs}"
        assert "no learning signal" not in out, f"README.md line {block.line}: {out[-2000:]}"


@pytest.mark.parametrize("text,expected", [
    ("a\n<!-- readme-test: check (gpu) -->\n```bash\nember serve --port 1\n```\n", [("bash", "gpu")]),
    ("```python\nprint(1)\n```\n```\nplain\n```\n", [("python", None), ("", None)]),
])
def test_block_parser(text, expected):
    assert [(b.lang, b.check_reason) for b in readme_blocks(text)] == expected


def test_a_renamed_flag_fails_the_check():
    bad = Block("bash", "ember serve --no-such-flag 1\n", 1, "gpu")
    with pytest.raises(AssertionError, match="refused by ember's parser"):
        check_block(bad)
    with pytest.raises(AssertionError, match="not in the Makefile"):
        check_block(Block("bash", "make no-such-target\n", 1, "x"))


def test_the_not_supported_list_matches_the_code():
    """README's "Not supported" section names exactly the SDK calls and losses ember refuses."""
    from ember.losses.registry import UNSUPPORTED as LOSSES_REFUSED
    from ember.service.unsupported import UNSERVED_ROUTES, UNSUPPORTED

    text = README.read_text()
    start = text.index("## Not supported")
    section = text[start:text.index("\n## ", start + 1)]
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `([\w.:]+)` \| .*? \| (.*) \|$", section, re.M)}
    code = {**UNSUPPORTED, **{f"route:{name}": why for name, why in UNSERVED_ROUTES.items()},
            **{f"loss_fn:{name}": why for name, why in LOSSES_REFUSED.items()}}
    assert set(rows) == set(code)
    assert rows == code  # each reason is the one the error gives (it cannot say more or less)
