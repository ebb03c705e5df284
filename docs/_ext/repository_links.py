"""The site's pages are markdown files that also read well on GitHub, a few of which include
parts of the repository's markdown files (README.md's introduction, quickstart and tour;
BENCHMARKS.md), and the quickstart notebook is referenced where it lives. Three small mechanisms
make that work:

- A page's link to a repository file that the site shows as a page (``repository_pages`` in
  conf.py), written as GitHub resolves it (``../../BENCHMARKS.md#slug`` from docs/guides/),
  is read as a link to that page (``../benchmarks.md#slug``) when the page is built.
- Every MyST heading anchor (GitHub's slug, ``myst_heading_anchors``) becomes a project-wide
  label. A link such as ``[Checkpoints](#checkpoints)`` then resolves to whichever page has that
  heading, and ``BENCHMARKS.md#slug`` or ``README.md#slug`` to the page that includes that
  file's section.
- A ``.nblink`` file holds ``{"path": "<notebook, relative to docs/>"}``; myst-nb reads (and
  executes) the notebook it names (``nb_custom_formats``), so the notebook is not copied here.
"""

import inspect
import json
import os
import pathlib
import re

import nbformat

DOCS = pathlib.Path(__file__).resolve().parents[1]
ROOT = DOCS.parent
PREFIXES = ("", "readme.md#", "benchmarks.md#")  # how a slug is written in the repository
# A markdown link's destination: a relative path, and an optional #anchor.
LINK = re.compile(r"\]\((?![a-z][\w+.-]*:|/|#)([^)\s#]+)(#[^)\s]*)?\)")


def notebook_path(text: str) -> pathlib.Path:
    """The notebook a ``.nblink`` file names."""
    return (DOCS / json.loads(text)["path"]).resolve()


def read_notebook_link(text: str) -> nbformat.NotebookNode:
    """myst-nb's reader for ``.nblink`` files: the notebook they name."""
    return nbformat.reads(notebook_path(text).read_text(), as_version=4)


def _link_repository_pages(app, docname, source) -> None:
    """Links to repository files that are pages here (``../../BENCHMARKS.md#slug``, as GitHub
    resolves them) become links to those pages."""
    here = pathlib.Path(app.env.doc2path(docname)).parent
    pages = {(ROOT / name).resolve(): page for name, page in app.config.repository_pages.items()}

    def to_page(match: re.Match) -> str:
        page = pages.get((here / match.group(1)).resolve())
        if page is None:
            return match.group(0)
        target = os.path.relpath(DOCS / f"{page}.md", here)
        return f"]({target}{match.group(2) or ''})"

    source[0] = LINK.sub(to_page, source[0])


def _add_label(std, name: str, docname: str, labelid: str, title: str) -> None:
    if name not in std.anonlabels:  # the first page to define a name keeps it
        std.anonlabels[name] = (docname, labelid)
        std.labels[name] = (docname, labelid, title)


def _register_labels(app, doctree) -> None:
    env = app.env
    std = env.domains.standard_domain
    docname = env.docname
    for slug, (_, labelid, title) in env.metadata[docname].get("myst_slugs", {}).items():
        for prefix in PREFIXES:
            _add_label(std, prefix + slug, docname, labelid, title)
    for name, page in app.config.repository_pages.items():
        if page == docname:
            _add_label(std, name.lower(), docname, "", env.titles[docname].astext())


def _drop_type_docstring(app, what, name, obj, options, lines) -> None:
    """A constant (``rp.planner.HARDWARE_PROFILES``, a dict) has no docstring of its own: show none, rather than
    the one of its type (``dict``'s)."""
    if what == "data" and lines and inspect.getdoc(type(obj)) == "\n".join(lines).strip():
        lines.clear()


def _note_notebook(app, docname, source) -> None:
    """Rebuild a ``.nblink`` page when its notebook changes."""
    path = app.env.doc2path(docname)
    if str(path).endswith(".nblink"):
        app.env.note_dependency(str(notebook_path(source[0])))


def setup(app):
    app.add_config_value("repository_pages", {}, "env")
    app.connect("source-read", _note_notebook)
    app.connect("source-read", _link_repository_pages)
    app.connect("doctree-read", _register_labels)
    app.connect("autodoc-process-docstring", _drop_type_docstring)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
