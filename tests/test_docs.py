"""The documentation site as a reader gets it.

What a user relies on:

- ``mkdocs build --strict`` (mkdocs.yml) builds the site with no warning: every page in the
  nav exists, every link between pages and every ``#anchor`` resolves (MkDocs' validation), and
  the API page renders from the docstrings.
- In the built HTML, every internal link and anchor leads somewhere (checked here, offline,
  over every page: the theme's own links too), and every link to a file of the repository
  (``../examples/...`` in a page, sent to ``repo_url``) names a file that exists.
- The reference page lists every option of ``OPTIONS``, every flag and command of the
  ``gpufleet`` parser (torchrun's unlisted spellings too), every workload-file field, every
  environment variable gpufleet reads or sets (and every ``GPUFLEET_`` name in the code is in
  the registry it is generated from), and every exit status of the ``gpufleet`` command.
- The API page documents everything ``gpufleet.__all__`` exports.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote, urlsplit

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 180  # about 10 s on an idle 2-core machine

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 60)


def repo_url() -> str:
    # mkdocs.yml holds no custom YAML tags, so plain YAML reads it
    return yaml.safe_load((REPO / "mkdocs.yml").read_text())["repo_url"].rstrip("/")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built from this checkout as ``mkdocs build --strict`` builds it."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail('mkdocs is not installed: pip install -e ".[docs]" (the test extra has it)',
                    pytrace=False)
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "GPUFLEET_HOME": str(tmp_path_factory.mktemp("home"))}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", REPO / "mkdocs.yml",
         "--site-dir", out],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{(proc.stdout + proc.stderr)[-8000:]}"
    return out


# ---------------------------------------------------------------------------- the HTML


class Page(HTMLParser):
    """What a built page holds: its ids, its links, the text of its headings and of the
    <code> in its tables."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.code: set[str] = set()  # in tables
        self.headings: list[str] = []
        self._open: list[tuple[str, list[str]]] = []  # (tag, text) of the <code> or <h*> being read
        self._tables = 0

    def handle_starttag(self, tag, attrs):
        found = dict(attrs)
        for name in ("id", "name" if tag == "a" else ""):
            if found.get(name):
                self.ids.add(found[name])
        for name in ("href", "src"):
            if found.get(name) is not None and tag in ("a", "link", "img", "script", "iframe"):
                self.links.append(found[name])
        self._tables += tag == "table"
        if (tag == "code" and self._tables) or re.fullmatch(r"h[1-6]", tag):
            self._open.append((tag, []))

    def handle_data(self, data):
        for _, text in self._open:
            text.append(data)

    def handle_endtag(self, tag):
        self._tables -= tag == "table"
        if self._open and self._open[-1][0] == tag:
            _, text = self._open.pop()
            text = "".join(text).strip()
            (self.code.add if tag == "code" else self.headings.append)(text.removesuffix("¶").strip())


def read_page(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def broken_links(site_dir: Path, base_url: str = "") -> list[str]:
    """Every internal link of the built site that leads nowhere: a missing file, or an anchor
    its page does not have; and every link under ``base_url`` (the repository on GitHub) that
    names a path the repository does not have."""
    pages = {p: read_page(p) for p in site_dir.rglob("*.html")}
    broken = []
    for path, page in pages.items():
        for link in page.links:
            problem = _link_problem(site_dir, path, link, pages, base_url)
            if problem:
                broken.append(f"{path.relative_to(site_dir)}: {link!r}: {problem}")
    return broken


def _link_problem(site_dir: Path, page: Path, link: str, pages: dict[Path, Page], base_url: str) -> str | None:
    if base_url and link.startswith(base_url + "/"):
        kind, _, rest = link[len(base_url) + 1:].partition("/")
        path = urlsplit(rest.partition("/")[2]).path
        if kind not in ("blob", "tree") or not (REPO / unquote(path)).exists():
            return "no such file in the repository"
        return None
    parts = urlsplit(link)
    if parts.scheme or parts.netloc or link.startswith("//"):
        return None  # another site: not checked offline
    if parts.path.startswith("/"):
        target = site_dir / unquote(parts.path).lstrip("/")
    else:
        target = page.parent / unquote(parts.path) if parts.path else page
    target = Path(os.path.normpath(target))
    if target.is_dir():
        target = target / "index.html"
    if not target.is_relative_to(site_dir) or not target.exists():
        return "no such file in the site"
    if parts.fragment and target.suffix == ".html":
        anchor = unquote(parts.fragment)
        if anchor not in pages[target].ids:
            return f"{target.relative_to(site_dir)} has no id {anchor!r}"
    return None


# ---------------------------------------------------------------------------- tests


def test_every_internal_link_and_anchor_of_the_site_resolves(site):
    assert (site / "index.html").is_file() and (site / "reference" / "index.html").is_file()
    broken = broken_links(site, repo_url())
    assert not broken, "broken links in the built site:\n" + "\n".join(broken)


def test_the_link_check_finds_a_missing_page_anchor_and_repository_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "index.html").write_text('<h2 id="here">x</h2><a href="#here">ok</a>')
    (tmp_path / "index.html").write_text(
        '<a href="a/">ok</a> <a href="a/#here">ok</a> <a href="https://example.org/x">other site</a>'
        '<a href="b/">missing page</a> <a href="a/#gone">missing anchor</a>'
        '<a href="https://github.com/o/r/blob/main/README.md">ok</a>'
        '<a href="https://github.com/o/r/blob/main/nope.py">missing file</a>')
    broken = broken_links(tmp_path, "https://github.com/o/r")
    assert [b.split(": ")[1] for b in broken] == ["'b/'", "'a/#gone'", "'https://github.com/o/r/blob/main/nope.py'"]


def _repo_links_hook():
    spec = importlib.util.spec_from_file_location("repo_links", REPO / "docs" / "hooks" / "repo_links.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_links_to_repository_files_outside_docs_go_to_the_repository():
    hook = _repo_links_hook()
    base = "https://github.com/o/r"
    config = {"docs_dir": str(REPO / "docs"), "config_file_path": str(REPO / "mkdocs.yml"), "repo_url": base}
    page = SimpleNamespace(file=SimpleNamespace(src_path="usage.md"))
    markdown = "\n".join([
        "See [mlp](../examples/mlp_ddp.py#L3), [hf](../examples/hf/) and [options](options.md#values).",
        "Not a link: `[x](../examples/mlp_ddp.py)`; broken: [gone](../examples/gone.py).",
        "```python", "[y](../examples/mlp_ddp.py)", "```",
        "[ref]: ../README.md",
        "[`train()` on two",
        "lines](../examples/mlp_ddp.py)",
    ])
    assert hook.on_page_markdown(markdown, page, config, None).split("\n") == [
        f"See [mlp]({base}/blob/main/examples/mlp_ddp.py#L3), [hf]({base}/tree/main/examples/hf) "
        "and [options](options.md#values).",
        "Not a link: `[x](../examples/mlp_ddp.py)`; broken: [gone](../examples/gone.py).",
        "```python", "[y](../examples/mlp_ddp.py)", "```",
        f"[ref]: {base}/blob/main/README.md",
        "[`train()` on two",
        f"lines]({base}/blob/main/examples/mlp_ddp.py)",
    ]


def _every_flag(parser: argparse.ArgumentParser, command: str = "gpufleet") -> dict[str, list[str]]:
    """{command: its flags}, for the top parser and every command under it."""
    found = {command: [s for a in parser._actions for s in a.option_strings]}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_every_flag(sub, f"{command} {name}"))
    return found


def test_the_reference_lists_every_option_command_flag_field_variable_and_exit_status(site):
    from gpufleet import _environ, cli
    from gpufleet.options import OPTIONS

    page = read_page(site / "reference" / "index.html")
    for name in OPTIONS:
        assert f"option-{name}" in page.ids and f"{name}=" in page.code, f"option {name} is not in the reference"

    flags = _every_flag(cli._parser())
    assert len(flags) > 10 and "--nproc_per_node" in flags["gpufleet run"], flags
    for command, names in flags.items():
        assert command in page.headings, f"the reference has no section for `{command}`"
        missing = [n for n in names if n not in page.code]
        assert not missing, f"`{command}` flags missing from the reference: {missing}"

    schema = json.loads((REPO / "docs" / "workload.schema.json").read_text())
    missing = [f for f in schema["properties"] if f"field-{f}" not in page.ids]
    assert not missing, f"workload fields missing from the reference: {missing}"

    variables = [name for name, _ in _environ.VARIABLES]
    missing = [v for v in variables if v not in page.code or f"env-{v}" not in page.ids]
    assert not missing, f"environment variables missing from the reference: {missing}"

    codes = {0} | {v for k, v in vars(cli).items() if k.startswith("EXIT_") and isinstance(v, int)}
    codes |= set(cli.EXIT_OF_STATUS.values())
    epilog = {int(c) for c in re.findall(r"\b(\d+) [a-z]", cli._parser().epilog.partition("exit status:")[2])}
    assert epilog == codes, f"`gpufleet --help` lists exit statuses {sorted(epilog)}, the code has {sorted(codes)}"
    missing = [c for c in sorted(codes) if f"exit-{c}" not in page.ids or str(c) not in page.code]
    assert not missing, f"exit statuses missing from the reference: {missing}"


def test_every_gpufleet_variable_the_code_names_is_in_the_registry():
    from gpufleet import _environ

    named = set()
    for path in (REPO / "src" / "gpufleet").rglob("*.py"):
        named |= set(re.findall(r"(?<![\w$])GPUFLEET_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    registered = {name for name, _ in _environ.VARIABLES}
    assert "GPUFLEET_HOME" in named and "GPUFLEET_RUN_DIR" in named, sorted(named)
    assert not named - registered, (f"GPUFLEET_ variables missing from gpufleet._environ's registry "
                                    f"(USER_VARIABLES, RANK_VARIABLES or INTERNAL_VARIABLES): "
                                    f"{sorted(named - registered)}")
    for group in (_environ.USER_VARIABLES, _environ.RANK_VARIABLES, _environ.INTERNAL_VARIABLES):
        names = [name for name, _ in group]
        assert len(names) == len(set(names)), f"a variable listed twice in one group: {names}"
        assert all(meaning.strip() for _, meaning in group)


def test_the_api_page_documents_everything_gpufleet_exports(site):
    import gpufleet

    html = (site / "api" / "index.html").read_text(encoding="utf-8")
    page = read_page(site / "api" / "index.html")
    documented = {i.rpartition(".")[2] for i in page.ids if i.startswith("gpufleet.") and i.count(".") <= 2}
    missing = sorted(set(gpufleet.__all__) - documented)
    assert not missing, f"gpufleet.__all__ names missing from the API page: {missing}"
    # distributed()'s docstring is made at run time, from OPTIONS: its text is there too
    assert gpufleet.distributed.__doc__.splitlines()[0] in html
    assert "straggler_threshold: a rank is named a straggler" in " ".join(html.split())
