"""rlhpc/patches/registry.py: every change rlhpc makes to a library's internals is listed with the versions it was
checked against; the installed libraries have what each touches, the pins in setup.cfg are those versions, and a
library that lacks an internal is named at once."""

import configparser
import importlib.util
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from rlhpc.patches import registry
from rlhpc.patches.registry import PATCHES, Patch

REPO = Path(__file__).resolve().parents[1]
INSTALL = {"vllm": "bash .ci/install-vllm.sh", "verifiers": "pip install -e '.[verifiers]'"}


@pytest.mark.parametrize("name", sorted(PATCHES))
def test_each_patch_finds_what_it_touches_in_the_installed_library_within_its_checked_versions(name):
    p = PATCHES[name]
    if importlib.util.find_spec(p.library) is None:
        pytest.skip(f"{p.library} is not installed ({INSTALL.get(p.library, f'pip install {p.library}')})")
    registry.check(name)  # raises, naming what is missing
    version = registry._version(p.library)
    assert registry._within(version, SpecifierSet(p.versions)), \
        f"{p.library} {version} is installed, but rlhpc's patch `{name}` was checked against {p.library}{p.versions}"


def _requirements():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for extra in cfg["options.extras_require"]:
        lines += cfg["options.extras_require"][extra].splitlines()
    reqs = [Requirement(line.strip()) for line in lines if line.strip() and not line.strip().startswith("#")]
    return {r.name: r.specifier for r in reqs}


@pytest.mark.parametrize("library", ["vllm", "submitit"])
def test_setup_cfg_admits_only_the_versions_whose_internals_were_checked(library):
    checked = {p.versions for p in PATCHES.values() if p.library == library}
    assert checked and {str(_requirements()[library])} == {str(SpecifierSet(v)) for v in checked}


def test_a_library_without_an_internal_is_named_with_its_version_and_the_versions_checked(monkeypatch):
    monkeypatch.setitem(PATCHES, "gone", Patch("gone", "packaging", ">=1", ("packaging.version:NoSuchThing",),
                                               "a test", "a test", "tests/test_patches.py"))
    registry._checked.cache_clear()
    with pytest.raises(RuntimeError, match=r"^packaging \S+ lacks internals rlhpc's patch `gone` relies on "
                                           r"\(packaging.version:NoSuchThing\): a test. rlhpc was checked against "
                                           r"packaging>=1: install such a version"):
        registry.check("gone")
    registry._checked.cache_clear()
