"""`ember train sft|grpo|ppo|reward_model|vlm_sft --config file.toml [--key value ...]`: a recipe from a typed config.

The TOML file fills the recipe's config (`SFTConfig`, `GRPOConfig`, `PPOConfig`, `RMConfig`, `VLMSFTConfig`;
tables for nested sections such as `[client]` and `[metrics]`); `--section.key value` (or
`--key=value`) overrides it. A bad key, a wrong type, a missing file or an invalid value
prints one clear message naming the key and exits with status 2. Outputs (config, metrics JSONL, TensorBoard) go to
`run_dir` (default `runs/<recipe>-<timestamp>`).

`--config NAME` with a recipe's name (`sft`, `grpo`, `ppo`, `reward_model`) and no such file
in the directory is the example config packaged with ember (`ember/recipes/examples/`, the
files `examples/*.toml` of the repository link to): a reader of the README who has only
`pip install`ed ember has no `examples/` directory, and a name that works anywhere is what
they expect. `ember train RECIPE --help` prints the packaged file's path to copy and edit.

Where the recipe trains: `client.base_url` when set; else `$TINKER_BASE_URL` when set (the
variable the SDK and the cookbook read, so `ember train` follows the server a shell points
at); else in process. The first line printed says which.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

from ember.config import ConfigError, load_config

# name -> ("module:ConfigClass", "module:run_function"); imported only when that recipe runs
RECIPES: dict[str, tuple[str, str]] = {
    "sft": ("ember.recipes.sft:SFTConfig", "ember.recipes.sft:run_sft"),
    "grpo": ("ember.recipes.grpo:GRPOConfig", "ember.recipes.grpo:run_grpo"),
    "ppo": ("ember.recipes.ppo:PPOConfig", "ember.recipes.ppo:run_ppo"),
    "reward_model": ("ember.recipes.reward_model:RMConfig", "ember.recipes.reward_model:run_reward_model"),
    "vlm_sft": ("ember.recipes.vlm_sft:VLMSFTConfig", "ember.recipes.vlm_sft:run_vlm_sft"),
}
EXAMPLES = Path(__file__).resolve().parent / "examples"  # package data: <recipe>.toml
USAGE = "ember train {" + ",".join(RECIPES) + "} [--config FILE.toml] [--section.key VALUE ...]"


def _load(ref: str) -> Any:
    from ember.registry import load

    return load(ref)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = USAGE
    parser.add_argument("recipe", choices=list(RECIPES), help="which recipe to run")
    # Everything after the recipe is parsed by ember.config (keys are only known per recipe).
    parser.add_argument("options", nargs=argparse.REMAINDER,
                        help="--config FILE.toml and overrides such as --learning_rate 3e-4 --metrics.tensorboard false")


def split_config_path(options: list[str]) -> tuple[str | None, list[str]]:
    """Take `--config PATH` / `--config=PATH` out of the option list."""
    path, rest, i = None, [], 0
    while i < len(options):
        opt = options[i]
        if opt == "--config":
            if i + 1 >= len(options):
                raise ConfigError("--config needs a file path")
            path, i = options[i + 1], i + 2
            continue
        if opt.startswith("--config="):
            path = opt.split("=", 1)[1]
        else:
            rest.append(opt)
        i += 1
    return path, rest


def resolve_config_path(path: str) -> Path:
    """A file path as given, or, when no such file exists, the packaged example of that name."""
    given = Path(path)
    packaged = EXAMPLES / f"{path}.toml"
    if not given.exists() and path in RECIPES and packaged.is_file():
        return packaged
    if not given.exists():
        raise ConfigError(f"config file not found: {path!r} (a TOML path, or a packaged example: "
                          f"{', '.join(RECIPES)})")
    return given


def config_class(recipe: str) -> type:
    if recipe not in RECIPES:
        raise ConfigError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
    return _load(RECIPES[recipe][0])


def load_recipe_config(recipe: str, options: list[str]):
    path, overrides = split_config_path(options)
    path = resolve_config_path(path) if path else None  # a missing file fails before the recipe's imports
    return load_config(config_class(recipe), path, overrides)


def help_text(recipe: str) -> str:
    """Usage plus every key of the recipe's config (TOML key = the flag without `--`;
    a dotted key is a key of that TOML table), and where the packaged example is."""
    from ember.config import describe_keys

    cls = config_class(recipe)
    keys = "\n".join("  " + line for line in describe_keys(cls))
    return (f"usage: ember train {recipe} [--config FILE.toml] [--section.key VALUE ...]\n\n"
            f"keys of {cls.__name__} (in the TOML file: `key = value`, `[section]` tables for dotted keys;\n"
            f"on the command line they override the file); example: `--config {recipe}` is\n"
            f"{EXAMPLES / (recipe + '.toml')} (copy it to edit)\n{keys}")


def run(args: argparse.Namespace) -> int:
    if any(o in ("-h", "--help") for o in args.options):
        print(help_text(args.recipe))
        return 0
    try:
        config = load_recipe_config(args.recipe, args.options)
    except ConfigError as e:
        print(f"ember train {args.recipe}: config error: {e}", file=sys.stderr)
        return 2
    return run_recipe(args.recipe, config)


def run_recipe(recipe: str, config) -> int:
    from ember.config import to_dict
    from ember.metrics import MetricsLogger, build_sinks, use_logger
    from ember.recipes.common import ServerUnreachable
    from ember.recipes.demo import write_json

    config = with_env_base_url(config)
    print(f"ember train {recipe}: {where_it_trains(config.client)}", flush=True)
    run_dir = Path(config.run_dir or Path("runs") / time.strftime(f"{recipe}-%Y%m%d-%H%M%S"))
    run_dir.mkdir(parents=True, exist_ok=True)
    config = dataclasses.replace(config, run_dir=str(run_dir))  # the recipe writes its checkpoints there
    write_json(run_dir / "config.json", to_dict(config))
    logger = MetricsLogger(build_sinks(config.metrics, run_dir))
    try:
        with use_logger(logger):
            saved = _load(RECIPES[recipe][1])(config)
    except (ValueError, FileNotFoundError, ServerUnreachable) as e:
        print(f"ember train {recipe}: {e}", file=sys.stderr)
        return 1
    finally:
        logger.close()
    print(f"ember train {recipe}: done; metrics in {run_dir}" + (f"; saved {saved}" if saved else ""))
    return 0


def with_env_base_url(config):
    """`client.base_url` from `$TINKER_BASE_URL` when the config leaves it empty."""
    env_url = os.environ.get("TINKER_BASE_URL", "")
    if config.client.base_url or not env_url:
        return config
    return dataclasses.replace(config, client=dataclasses.replace(config.client, base_url=env_url))


def where_it_trains(client) -> str:
    """The first line `ember train` prints: the server it uses, or in process."""
    if client.base_url:
        source = " (from $TINKER_BASE_URL)" if client.base_url == os.environ.get("TINKER_BASE_URL") else ""
        return f"training on the server at {client.base_url}{source}"
    data = client.data_dir or os.environ.get("EMBER_DATA_DIR") or "~/.ember"
    return f"training in process (no client.base_url, no $TINKER_BASE_URL); data in {data}"
