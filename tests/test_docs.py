"""The documentation site (docs/, Sphinx with MyST and myst-nb) builds without a warning, documents
every public name, links only to pages and anchors it has, and renders in a real browser; the
README stays short, and the pages include only README sections it has.

The guides hold their own text; tests/test_guides.py runs their code and tests/test_readme.py
the README's.
"""

import html.parser
import os
import pathlib
import re
import subprocess
import sys
import time
import urllib.parse

import pytest
from test_api import ATTENTION, MOE, PIPELINE, PUBLIC

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_LINES = 260  # the README is the front page; the guides hold the rest
CHROMIUM = pathlib.Path("/usr/bin/chromium")  # Debian's; .ci/run installs it
SPHINX_OPTIONS = ["-W", "--keep-going", "-b", "html"]  # the README's build command's
API_PAGES = {  # module -> (page, its public names)
    "replicator": ("api/replicator.html", PUBLIC),
    "replicator.pipeline": ("api/pipeline.html", PIPELINE),
    "replicator.attention": ("api/attention.html", ATTENTION),
    "replicator.moe": ("api/moe.html", MOE),
}


def build_env() -> dict:
    """This environment on the CPU, without settings that would change JAX's devices (the
    notebook sets its own), importing this checkout's replicator."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    """The site, built once with warnings as errors; returns its HTML directory."""
    out = tmp_path_factory.mktemp("docs")
    html_dir, warnings = out / "html", out / "warnings.txt"
    command = [sys.executable, "-m", "sphinx", *SPHINX_OPTIONS]
    command += ["-d", str(out / "doctrees"), "-w", str(warnings), str(DOCS), str(html_dir)]
    start = time.perf_counter()
    result = subprocess.run(
        command, cwd=ROOT, env=build_env(), capture_output=True, text=True, timeout=1800
    )
    print(f"\ndocs built in {time.perf_counter() - start:.1f} s into {html_dir}")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert warnings.read_text() == "", warnings.read_text()
    return html_dir


class Page(html.parser.HTMLParser):
    """One HTML file's ids and the links it makes (``href`` and ``src``)."""

    def __init__(self, path: pathlib.Path):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.feed(path.read_text(encoding="utf-8"))

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.ids.update(attrs[k] for k in ("id", "name") if attrs.get(k))
        for key in ("href", "src"):
            if attrs.get(key) is not None:
                self.links.append(attrs[key])


@pytest.mark.slow  # the build executes the quickstart notebook
def test_site_builds_without_warnings(site):
    for page in ["index", "getting_started", "coming_from", "design", "benchmarks"]:
        assert (site / f"{page}.html").exists(), page
    guides = {p.stem for p in (DOCS / "guides").glob("*.md")}
    assert {p.stem for p in (site / "guides").glob("*.html")} == guides
    # The build runs the Colab quickstart from top to bottom in a fresh kernel (myst-nb, which
    # fails the build on a cell's error): its checks, as the cells printed them.
    notebook = html.unescape((site / "notebooks" / "quickstart.html").read_text())
    for printed in [
        "8 devices: [CpuDevice(id=0)",
        "data parallel == single device: OK",
        "first run: 50 steps, resumed_from=None",
        "second run: resumed_from=50, now at step 100",
        "1F1B pipeline == sequential model: OK",
        "ZeRO-3 == single device: OK",
    ]:
        assert printed in notebook, printed
    assert re.search(r'<img [^>]*src="[^"]*\.png"', notebook)  # the loss curve
    benchmarks = (site / "benchmarks.html").read_text()  # figures drawn while building
    figures = re.findall(r'<img [^>]*src="(_images/[^"]*\.png)"', benchmarks)
    assert len(figures) == 7, figures
    assert all((site / figure).stat().st_size > 20_000 for figure in figures)


@pytest.mark.slow  # the build executes the quickstart notebook
def test_every_public_name_is_in_the_api_reference(site):
    for module, (page, names) in API_PAGES.items():
        ids = Page(site / page).ids
        missing = [n for n in names if f"{module}.{n}" not in ids]
        assert not missing, (page, missing)
    models = Page(site / "api" / "models.html").ids
    for module in ["replicator.models.gpt", "replicator.models.llama", "replicator.models.hf"]:
        assert f"module-{module}" in models, module
    assert "replicator.models.gpt.GPTConfig" in models
    assert "replicator.distributed.launch" in Page(site / "api" / "distributed.html").ids


def _viewcode_backlink(path, site, fragment: str, ids) -> bool:
    """A source page's "[docs]" link to an object that the target page documents under another
    namespace. sphinx.ext.viewcode names every object of a source module after the first
    namespace that documented one of them (`rp.fit` is ``replicator.fit``, its `FitResult` then
    ``replicator.FitResult`` on the page of ``replicator.training``): the page is right, the
    anchor is the same object's under the namespace that page documents."""
    if path.relative_to(site).parts[0] != "_modules":
        return False
    name = fragment.rsplit(".", 1)[-1]
    return any(i.startswith("replicator.") and i.endswith(f".{name}") for i in ids)


@pytest.mark.slow  # the build executes the quickstart notebook
def test_internal_links_resolve(site):
    # The site's pages; _static holds the theme's Jinja templates, copied as they are.
    pages = {p: Page(p) for p in site.rglob("*.html") if "_static" not in p.relative_to(site).parts}
    broken = []
    for path, page in pages.items():
        for link in page.links:
            url = urllib.parse.urlsplit(link)
            if url.scheme or url.netloc:  # external (not checked: no network) or data:
                continue
            target = (path.parent / urllib.parse.unquote(url.path)).resolve() if url.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{path.relative_to(site)}: {link} (no file)")
            elif url.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else Page(target).ids
                fragment = urllib.parse.unquote(url.fragment)
                if fragment not in ids and not _viewcode_backlink(path, site, fragment, ids):
                    broken.append(f"{path.relative_to(site)}: {link} (no anchor)")
    assert not broken, "\n".join(broken)
    assert sum(len(p.links) for p in pages.values()) > 1000  # the check saw the site's links


def chromium(*args: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    """Headless Chromium, offline and with a profile of its own."""
    assert CHROMIUM.exists(), "the docs tests need Debian's chromium: apt-get install chromium"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
    flags += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
    flags += [f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,1600"]
    return subprocess.run(
        [str(CHROMIUM), *flags, *args], capture_output=True, text=True, timeout=180, check=True
    )


@pytest.mark.slow
@pytest.mark.parametrize("page", ["index.html", "api/replicator.html"])
def test_pages_render_in_a_browser(site, page, tmp_path):
    from PIL import Image

    url = (site / page).as_uri()
    png = tmp_path / (page.replace("/", "_") + ".png")
    chromium(f"--screenshot={png}", "--virtual-time-budget=5000", url, tmp_path=tmp_path)
    print(f"\nscreenshot of {page}: {png}")
    with Image.open(png) as image:
        assert image.size == (1280, 1600)
        rgb = image.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 24)
        assert len(colours) > 100, len(colours)  # text, the theme's sidebar and its colours
        white = max(count for count, colour in colours if colour == (255, 255, 255))
        assert white < 0.95 * 1280 * 1600  # not a blank page

    dom = chromium("--dump-dom", "--virtual-time-budget=5000", url, tmp_path=tmp_path).stdout
    title = re.search(r"<title>(.*?)</title>", dom, re.S).group(1)
    assert "replicator" in title, title
    assert "bd-sidebar" in dom  # the book theme's navigation, laid out by its scripts
    if page.startswith("api/"):
        assert 'class="autosummary' in dom  # the table of names
        for name in ["Replicator", "wrap_optimizer", "all_reduce", "fit", "Checkpoints"]:
            assert name in dom, name
        assert 'id="replicator.Replicator"' in dom


def pages() -> dict[pathlib.Path, str]:
    return {p: p.read_text() for p in DOCS.rglob("*.md") if "_build" not in p.parts}


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines (at most {README_LINES})"


def test_pages_include_only_readme_sections_it_has():
    """Each README marker pair is included by exactly one page, and no page includes a section
    the README no longer has (an include of a missing marker would take the whole file)."""
    readme = (ROOT / "README.md").read_text()
    markers = re.findall(r"<!-- docs:([\w-]+):start -->", readme)
    assert len(set(markers)) == len(markers)
    for name in markers:
        assert readme.count(f"<!-- docs:{name}:end -->") == 1, name
        start, end = (
            readme.index(f"<!-- docs:{name}:start -->"),
            readme.index(f"<!-- docs:{name}:end -->"),
        )
        assert start < end, name
    included = []
    for path, text in pages().items():
        for m in re.finditer(r"```\{include\} ([^\n]*README\.md)\n(.*?)```", text, re.S):
            assert (path.parent / m.group(1)).resolve() == ROOT / "README.md", path
            after = re.search(r":start-after: <!-- docs:([\w-]+):start -->", m.group(2))
            before = re.search(r":end-before: <!-- docs:([\w-]+):end -->", m.group(2))
            assert after and before and after.group(1) == before.group(1), (path, m.group(0))
            assert after.group(1) in markers, (
                f"{path} includes docs:{after.group(1)}, not in README"
            )
            included.append(after.group(1))
    assert sorted(included) == sorted(markers)


def test_the_readme_builds_the_site_as_these_tests_do():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"## Documentation.*?```bash\n(.*?)```", readme, re.S).group(1).strip()
    install, build = command.split(" && ")
    assert install == 'pip install -e ".[docs]"'
    assert build.split() == ["python", "-m", "sphinx", *SPHINX_OPTIONS, "docs", "docs/_build/html"]
