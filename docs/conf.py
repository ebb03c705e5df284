"""Sphinx configuration of replicator's documentation site.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
"""

import os
import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # this checkout's replicator, for autodoc
sys.path.insert(0, str(DOCS / "_ext"))
# Autodoc imports replicator (and so JAX), and the notebook's kernel inherits this environment.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The benchmarks page draws its figures with benchmarks/plots.py from this checkout.
os.environ["REPLICATOR_REPOSITORY"] = str(DOCS.parent)

import replicator  # noqa: E402

project = "replicator"
author = "the replicator authors"
copyright = "the replicator authors"
release = version = replicator.__version__

extensions = [
    "myst_nb",  # MyST markdown (myst_parser) and notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "repository_links",  # docs/_ext: README links across pages, and the notebook by reference
]

exclude_patterns = ["_build", "_ext", "**/.ipynb_checkpoints"]
html_theme = "sphinx_book_theme"
html_title = "replicator"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}

# MyST: the README's headings get GitHub's anchors, so that its `#section` links resolve.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]

# Notebooks: executed on every build, in a fresh kernel, in a temporary directory; a failing cell
# fails the build. The quickstart notebook sets its own 8 emulated CPU devices.
nb_execution_mode = "force"
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_in_temp = True
nb_custom_formats = {".nblink": "repository_links.read_notebook_link"}

# Autodoc and napoleon: Google-style docstrings, whose `name`s link to the objects they name.
default_role = "py:obj"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_default_options = {"show-inheritance": False}
autosummary_generate = False  # the API pages list their names; nothing is generated in docs/
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # NamedTuple fields: one entry each, not a second attribute directive

# Repository files whose links (written for GitHub) name a whole file: the page that includes it.
repository_pages = {"README.md": "index", "BENCHMARKS.md": "benchmarks"}
myst_ref_domains = ["std"]  # markdown links name pages and sections, never Python objects
