"""What `pip install .` ships (pyproject.toml): the folders cli/, core/ and loaders/ install as ggrun.cli,
ggrun.core and ggrun.loaders, and setuptools takes exactly the packages listed there, so a package folder
missing from the list would be missing from every non-editable install. scripts/setup/check_install.sh installs
a fresh clone that way and runs it."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("cli", "core", "loaders")


def setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_ggrun_is_the_only_top_level_name():
    config = setuptools_config()
    assert config["package-dir"] == {"ggrun": "."}
    assert all(p.startswith("ggrun.") for p in config["packages"])
    assert {p.split(".")[1] for p in config["packages"]} == set(TOP)


def test_every_package_folder_is_installed():
    folders = {"ggrun." + ".".join(init.parent.relative_to(ROOT).parts)
               for top in TOP for init in (ROOT / top).rglob("__init__.py")}
    assert set(setuptools_config()["packages"]) == folders
