"""pdserve installs as ONE import name: each top-level folder of the repository becomes a subpackage
(server/ -> pdserve.server, ...), so `pip install` takes no top-level name but `pdserve`. Everything else
is in pyproject.toml."""

from setuptools import find_packages, setup

FOLDERS = ("protocol", "settings", "server", "workers", "client", "bench")

setup(
    packages=["pdserve"] + [f"pdserve.{name}" for name in find_packages(include=[f"{f}*" for f in FOLDERS])
                            if name.partition(".")[0] in FOLDERS],
    package_dir={"pdserve": "pdserve", **{f"pdserve.{f}": f for f in FOLDERS}},
)
