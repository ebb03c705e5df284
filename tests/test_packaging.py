"""What a user installs: the license, type information, the changelog and dependency bounds."""

from __future__ import annotations

import importlib.metadata
import pathlib
import tomllib

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import replicator
from replicator._src.core import compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_license_file_is_the_license_the_metadata_names():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a stub


def test_the_package_says_it_is_typed():
    assert (pathlib.Path(replicator.__file__).parent / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["replicator"]
    assert "Typing :: Typed" in PYPROJECT["project"]["classifiers"]


def test_the_changelog_has_the_current_version():
    assert f"({replicator.__version__})" in (ROOT / "CHANGELOG.md").read_text()


def test_jax_is_bounded_to_the_minor_release_ci_tests_and_the_installed_versions_fit():
    """The code reads HLO text and a private jax module: a new jax minor release must pass the
    suite before the bounds allow it. What CI installed is what the bounds allow."""
    requirements = {
        Requirement(r).name: Requirement(r) for r in PYPROJECT["project"]["dependencies"]
    }
    for name in ("jax", "jaxlib"):
        assert any(s.operator == "<" for s in requirements[name].specifier), name
    assert requirements["numpy"].specifier.contains("2.0.0")
    assert not requirements["numpy"].specifier.contains("1.26.4")  # jax 0.10 needs NumPy 2
    for name, req in requirements.items():
        installed = importlib.metadata.version(name)
        assert req.specifier.contains(installed, prereleases=True), (
            f"{name} {installed} is installed, outside the bound {name}{req.specifier} that "
            f"pyproject.toml gives (the releases CI tests)"
        )


def test_the_jax_bounds_compat_names_are_pyprojects():
    """compat.TESTED_JAX (the import-time warning's bounds) and pyproject.toml agree, and the
    installed jax is inside them: no warning at import."""
    low, high = compat.TESTED_JAX
    spec = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
    for name in ("jax", "jaxlib"):
        [req] = [
            Requirement(r)
            for r in PYPROJECT["project"]["dependencies"]
            if Requirement(r).name == name
        ]
        assert req.specifier == SpecifierSet(spec), (name, str(req.specifier), spec)
    assert compat.untested_jax() is None, compat.untested_jax()
    message = compat.untested_jax((*high, 0))
    assert spec in message and "is installed" in message
    assert compat.untested_jax((0, 10, 1)) is not None


def test_the_built_in_text_ships_with_its_license_and_reads_the_same_everywhere():
    """The quickstart's text is a file of the package (the same bytes on every Python), with
    the license of the sources it holds; its hash is the one its README states."""
    import hashlib
    import re

    from replicator.models import text

    corpus = text.CORPUS.parent
    assert "models/corpus/*" in PYPROJECT["tool"]["setuptools"]["package-data"]["replicator"]
    license_text = (corpus / "LICENSE-PYTHON.txt").read_text()
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in license_text
    stated = re.search(
        r"SHA-256, uncompressed: `([0-9a-f]{64})`", (corpus / "README.md").read_text()
    )
    data = text.stdlib_text()
    assert len(data) == text.CORPUS_BYTES == 2_000_000
    assert hashlib.sha256(data).hexdigest() == stated[1]
