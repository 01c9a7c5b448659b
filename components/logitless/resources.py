"""Files shipped inside the package (bundled assets, configs) and the OmegaConf resolver that finds them.

Configs name bundled files as ``${logitless_asset:SUBPACKAGE/NAME}``, which resolves to the absolute
path of ``logitless/SUBPACKAGE/assets/NAME`` wherever the package is installed, so a config runs
from any working directory (``tune run grpo_single_device --config /abs/path/tiny_grpo.yaml``).
Paths that are not interpolated keep their meaning: a relative ``output_dir`` is the cwd's, as in
torchtune. The resolver is registered when ``logitless`` is imported, which every recipe module does
before torchtune's ``config.parse`` builds the config, so it exists before anything is resolved.
"""

from __future__ import annotations

import warnings
from pathlib import Path, PurePosixPath

import omegaconf
from omegaconf import OmegaConf

PACKAGE_DIR = Path(__file__).resolve().parent
CONFIGS_DIR = PACKAGE_DIR / "configs"
ASSET_RESOLVER = "logitless_asset"
#: Subpackages renamed since configs were written: old name -> new name (still resolved, with a warning).
RENAMED_SUBPACKAGES = {"data": "datasets"}


def package_asset(name: str) -> str:
    """Absolute path of a file or folder bundled with a subpackage.

    Args:
        name (str): ``"SUBPACKAGE/PATH"``, e.g. ``"rl/tiny_grpo_warmstart"`` for
            ``logitless/rl/assets/tiny_grpo_warmstart`` or ``"datasets/tokenizer/vocab.json"``.

    Returns:
        str: the absolute path.

    Raises:
        FileNotFoundError: naming the asset, what was expected and the folder searched.

    Example:
        >>> package_asset("datasets/qwen2_5_tiny")
        '/.../logitless/datasets/assets/qwen2_5_tiny'
    """
    parts = PurePosixPath(str(name)).parts
    if parts and parts[0] in RENAMED_SUBPACKAGES:
        new = RENAMED_SUBPACKAGES[parts[0]]
        warnings.warn(f"{ASSET_RESOLVER}:{name}: the '{parts[0]}/' assets moved to '{new}/'; "
                      f"write {ASSET_RESOLVER}:{'/'.join((new,) + parts[1:])}", FutureWarning, stacklevel=2)
        parts = (new,) + parts[1:]
    if len(parts) < 2 or ".." in parts or PurePosixPath(str(name)).is_absolute():
        raise FileNotFoundError(
            f"{ASSET_RESOLVER}:{name}: expected 'SUBPACKAGE/PATH' inside the package, "
            f"e.g. 'rl/tiny_grpo_warmstart' or 'datasets/qwen2_5_tiny'")
    folder = PACKAGE_DIR.joinpath(parts[0], "assets")
    path = folder.joinpath(*parts[1:])
    if not path.exists():
        found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        raise FileNotFoundError(
            f"{ASSET_RESOLVER}:{name}: no bundled asset {'/'.join(parts[1:])!r} in {folder}"
            f"{' (it holds ' + ', '.join(found) + ')' if found else ' (no such asset folder)'}")
    return str(path)


def register_resolvers() -> None:
    """Registers ``${logitless_asset:...}`` with OmegaConf (idempotent; done on ``import logitless``).

    Example:
        >>> OmegaConf.create({"d": "${logitless_asset:rl/tiny_grpo_warmstart}"}).d
        '/.../logitless/rl/assets/tiny_grpo_warmstart'
    """
    if OmegaConf.has_resolver(ASSET_RESOLVER):
        return
    # omegaconf 2.4 renamed register_new_resolver (now deprecated) to register_resolver, whose 2.3
    # meaning was the old string-only API
    new_api = tuple(int(x) for x in omegaconf.__version__.split(".")[:2]) >= (2, 4)
    register = OmegaConf.register_resolver if new_api else OmegaConf.register_new_resolver
    register(ASSET_RESOLVER, package_asset)


__all__ = ["ASSET_RESOLVER", "CONFIGS_DIR", "PACKAGE_DIR", "package_asset", "register_resolvers"]
