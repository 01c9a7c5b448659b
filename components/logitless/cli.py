"""The ``logitless`` command: list, copy and run the bundled recipes and configs (like ``tune ls/cp/run``).

    logitless ls                                     # recipe -> its configs
    logitless cp tiny_grpo my_grpo.yaml              # copy a config (or a recipe) out to edit it
    logitless cp grpo_single_device my_grpo.py [--force]
    logitless run grpo_single_device --config tiny_grpo [key=value ...]
    logitless run --nproc_per_node 2 grpo_distributed --config my_grpo.yaml

``logitless run`` is ``tune run`` with two conveniences: ``--config`` takes a bundled config's name
when no such file exists, and the recipe may be a path to a ``.py`` file (``./my_grpo.py``; torchtune
0.6.1 takes ``my_grpo.py`` only from the cwd and no ``./`` prefix). It runs in this process and imports
``logitless`` before torchtune, so torchao's import-time cpp-extension notice is not printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from logitless import recipe_registry as registry


def _ls(args: argparse.Namespace) -> int:
    width = max(len(r.name) for r in registry.RECIPES) + 2
    print(f"{'RECIPE':<{width}}CONFIG")
    for recipe in registry.RECIPES:
        for i, name in enumerate(recipe.configs):
            print(f"{recipe.name if i == 0 else '':<{width}}{name}")
    print("\nRun one with:  tune run RECIPE --config PATH   (from the repo: --config configs/NAME.yaml)")
    print("          or:  logitless run RECIPE --config NAME")
    print("Distributed:   tune run --nproc_per_node N full_sft_distributed|lora_sft_distributed|grpo_distributed "
          "--config ...")
    print("Copy one out:  logitless cp NAME DEST")
    loops = sorted({r.loop for r in registry.RECIPES if r.loop is not None})
    print(f"Loops live in: {' and '.join(loops)}; the other recipes run one of them with LoRA and/or FSDP2 "
          f"(copy it to change the loop)")
    return 0


def _how_to_run(src_kind: str, name: str, dest: Path) -> str:
    if src_kind == "config":
        recipes = [r.name for r in registry.RECIPES if name in r.configs]
        return f"Run it with:  tune run {recipes[0]} --config {dest}" + (
            f"   (also runs with {', '.join(recipes[1:])})" if len(recipes) > 1 else "")
    recipe = registry.get_recipe(name)
    config = recipe.configs[0] if recipe is not None and recipe.configs else "CONFIG"
    nproc = "--nproc_per_node 2 " if recipe is not None and recipe.distributed else ""
    folder = dest.parent.resolve()
    target = dest.name if folder == Path.cwd().resolve() else str(dest)
    # tune run takes a custom recipe as a module of the cwd: its file name, no folder, no './'
    how = (f"Run it from {folder}:  tune run {nproc}{dest.name} --config {registry.config_path(config)}\n"
           f"or from anywhere:  logitless run {nproc}{target} --config {config}")
    if registry.get_recipe(dest.stem) is not None:
        # tune run appends the cwd to sys.path: the installed module of that name would win
        how += f"\nRename it first: tune run would import the installed recipe {dest.stem!r}, not this copy."
    if recipe is not None and recipe.loop is not None:
        how += (f"\nThis file runs the loop of {recipe.loop} (it imports it); to change the loop, copy that one:  "
                f"logitless cp {recipe.loop} DEST")
    return how


def _cp(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    name = args.name
    if registry.get_recipe(name) is not None:
        kind, src = "recipe", registry.recipe_path(name)
    elif name.removesuffix(".yaml") in registry.config_names():
        name = name.removesuffix(".yaml")
        kind, src = "config", registry.config_path(name)
    else:
        parser.error(f"cp: {args.name!r} is neither a recipe nor a config; `logitless ls` lists them")
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / src.name
    elif dest.suffix != src.suffix:  # as tune cp: a recipe must end in .py for tune run to import it
        dest = dest.with_name(dest.name + src.suffix)
    if dest.exists() and not args.force:
        parser.error(f"cp: {dest} already exists; not overwriting it (pass --force to overwrite)")
    if not dest.parent.is_dir():
        parser.error(f"cp: the folder {dest.parent} does not exist")
    shutil.copyfile(src, dest)
    print(f"Copied {kind} {name} to {dest}")
    print(_how_to_run(kind, name, dest))
    return 0


def tune_run_argv(args: Sequence[str]) -> List[str]:
    """``tune`` arguments for ``logitless run ARGS``: config names become paths, recipe files become modules.

    A ``--config`` value that is not an existing file but names a bundled config becomes that
    config's path. A recipe given as an existing ``.py`` file becomes its module name, its folder
    going first on ``sys.path`` and ``PYTHONPATH`` (so torchrun's worker processes find it too).

    Args:
        args (Sequence[str]): what follows ``logitless run``.

    Returns:
        List[str]: ``["run", ...]`` for torchtune's CLI.

    Example:
        >>> tune_run_argv(["grpo_single_device", "--config", "tiny_grpo"])
        ['run', 'grpo_single_device', '--config', '/.../logitless/configs/tiny_grpo.yaml']
    """
    from torch.distributed.run import get_args_parser  # tune run's own split: torchrun options, recipe, its args

    args = list(args)
    try:
        recipe_args = get_args_parser().parse_args(args).training_script_args
    except SystemExit:  # no recipe given: tune run reports it
        return ["run", *args]
    r = len(args) - len(recipe_args) - 1  # the recipe's index
    if "--config" in recipe_args and recipe_args.index("--config") + 1 < len(recipe_args):
        i = r + 1 + recipe_args.index("--config") + 1
        if not os.path.isfile(args[i]) and args[i].removesuffix(".yaml") in registry.config_names():
            args[i] = str(registry.config_path(args[i]))
    if args[r].endswith(".py") and os.path.isfile(args[r]):
        folder = str(Path(args[r]).resolve().parent)
        sys.path.insert(0, folder)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
        args[r] = Path(args[r]).stem
    return ["run", *args]


def _run(args: argparse.Namespace) -> int:
    from torchtune._cli.tune import TuneCLIParser

    sys.argv = ["tune", *tune_run_argv(args.tune_args)]
    parser = TuneCLIParser()
    parser.run(parser.parse_args())
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``logitless`` argument parser (subcommands ``ls``, ``cp``, ``run``)."""
    parser = argparse.ArgumentParser(prog="logitless", description="List, copy and run logitless recipes and configs.")
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list the recipes and their configs")
    ls.set_defaults(func=lambda a: _ls(a))
    cp = sub.add_parser("cp", help="copy a recipe or config to edit it")
    cp.add_argument("name", help="a recipe or config name from `logitless ls`")
    cp.add_argument("dest", help="destination file, or an existing folder")
    cp.add_argument("-f", "--force", action="store_true", help="overwrite an existing file")
    cp.set_defaults(func=lambda a: _cp(a, cp))
    run = sub.add_parser("run", help="tune run, taking bundled config names and recipe files",
                         usage="logitless run [TORCHRUN-OPTIONS] RECIPE --config CONFIG [key=value ...]")
    run.add_argument("tune_args", nargs=argparse.REMAINDER)
    run.set_defaults(func=_run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``logitless`` console script.

    Args:
        argv (Optional[Sequence[str]]): arguments (default ``sys.argv[1:]``).

    Returns:
        int: the exit status.

    Example:
        >>> main(["ls"])
    """
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
