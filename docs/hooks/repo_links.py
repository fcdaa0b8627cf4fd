"""MkDocs hook: links from a page to a file of the repository outside ``docs/``.

The pages are written to read well on GitHub too, so they link to ``../examples/mlp_ddp.py`` or
``../benchmarks/results/...``. The site holds only ``docs/``, and MkDocs (strict) refuses such a
link; this hook points each one at the file on ``repo_url`` instead (``blob/main/PATH`` for a
file, ``tree/main/PATH`` for a folder). A link to a repository path that does not exist is left
as written, so the build fails on it as on any other broken link. Links inside code (fenced
blocks, inline code spans) are text, and are left alone.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit

BRANCH = "main"

# the end of an inline link or image, ](target "title"): the target is group 1
_TARGET = re.compile(r"\]\(\s*<?([^)\s>]+)>?(\s+\"[^\"]*\")?\s*\)")
# [label]: target "title"
_DEFINITION = re.compile(r"^( {0,3}\[[^\]]+\]:\s*)<?([^\s>]+)>?", re.MULTILINE)
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs = Path(os.path.abspath(config["docs_dir"]))
    repo = Path(os.path.abspath(config["config_file_path"])).parent
    base = (config.get("repo_url") or "").rstrip("/")
    if not base:
        return markdown
    page_dir = (docs / page.file.src_path).parent

    def target(link: str) -> str:
        return _to_repo(link, page_dir, docs, repo, base)

    out: list[str] = []
    prose: list[str] = []  # the lines since the last fenced block
    fence = None
    for line in markdown.split("\n"):
        opening = _FENCE.match(line)
        if fence is None and opening:
            out += [_rewrite("\n".join(prose), target)] if prose else []
            prose, fence = [], opening.group(1)
            out.append(line)
        elif fence is not None:
            if opening and opening.group(1).startswith(fence[0] * len(fence)):
                fence = None
            out.append(line)
        else:
            prose.append(line)
    out += [_rewrite("\n".join(prose), target)] if prose else []
    return "\n".join(out)


def _rewrite(text: str, target) -> str:
    """``text``'s link targets through ``target``; what lies in a code span stays as it is (a
    link's text may hold code spans, and a link's text may run over several lines)."""
    code = [m.span() for m in _CODE_SPAN.finditer(text)]

    def link(m: re.Match) -> str:
        if any(start <= m.start() < end for start, end in code):
            return m.group(0)
        return f"]({target(m.group(1))}{m.group(2) or ''})"

    text = _TARGET.sub(link, text)
    return _DEFINITION.sub(lambda m: m.group(1) + target(m.group(2)), text)


def _to_repo(link: str, page_dir: Path, docs: Path, repo: Path, base: str) -> str:
    parts = urlsplit(link)
    if parts.scheme or parts.netloc or link.startswith(("#", "/")) or not parts.path:
        return link
    path = Path(os.path.normpath(page_dir / parts.path))  # by name: a symlink stays in the repository
    if path.is_relative_to(docs) or not path.is_relative_to(repo) or not path.exists():
        return link  # MkDocs judges it: a page, a file of the site, or a broken link
    kind = "tree" if path.is_dir() else "blob"
    url = f"{base}/{kind}/{BRANCH}/{path.relative_to(repo).as_posix()}"
    return url + (f"#{parts.fragment}" if parts.fragment else "")
