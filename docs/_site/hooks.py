"""mkdocs hook: pages link to files outside docs/ (spec/SPEC.md, CHANGELOG.md, a source file) with
the relative paths that also work when the Markdown is read in the repository.  This hook adds
each such target to the site under `repo/<path>` (a Markdown target becomes a page, any other
file a static copy), following the added pages' own links, and rewrites those links to the added
copies, so `mkdocs build --strict` checks every link and none of them leaves the site."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

#: A Markdown link's target: `](target)` or `](target#anchor)`, no scheme.
LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:)([^)#\s]+)(#[^)\s]*)?\)")
PREFIX = "repo"


def _root(config) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def _source(page_uri: str, docs: Path, root: Path) -> Path:
    """The real file a site path comes from."""
    if page_uri.startswith(PREFIX + "/"):
        return root / page_uri[len(PREFIX) + 1:]
    return docs / page_uri


def _site_uri(target: Path, docs: Path, root: Path):
    """The site path of a real file: docs/ files keep theirs, other repository files go under
    repo/; None outside the repository."""
    target = target.resolve()
    if target.is_relative_to(docs):
        return target.relative_to(docs).as_posix()
    if target.is_relative_to(root):
        return f"{PREFIX}/{target.relative_to(root).as_posix()}"
    return None


def _links(text: str):
    # Fenced code is not Markdown: a `](...)` inside it is no link.
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return [m.group(1) for m in LINK.finditer(text)]


def on_files(files, config):
    docs, root = Path(config["docs_dir"]).resolve(), _root(config)
    queue = [f.src_uri for f in files if f.src_uri.endswith(".md")]
    while queue:
        uri = queue.pop()
        source = _source(uri, docs, root)
        for link in _links(source.read_text()):
            target = source.parent / link
            site = _site_uri(target, docs, root)
            if site is None or not site.startswith(PREFIX + "/") or files.get_file_from_path(site):
                continue
            if not target.is_file():
                continue  # left as is: mkdocs --strict reports it as a broken link
            added = File.generated(config, site, abs_src_path=str(target))
            added.inclusion = InclusionLevel.NOT_IN_NAV  # reached through its links, not the nav
            files.append(added)
            if site.endswith(".md"):
                queue.append(site)
    return files


def on_page_markdown(markdown, page, config, files):
    """Rewrite each link that leaves docs/ to the copy on_files added."""
    docs, root = Path(config["docs_dir"]).resolve(), _root(config)
    source = _source(page.file.src_uri, docs, root)
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(match):
        link, anchor = match.group(1), match.group(2) or ""
        site = _site_uri(source.parent / link, docs, root)
        if site is None or not files.get_file_from_path(site):
            return match.group(0)
        return f"]({posixpath.relpath(site, here or '.')}{anchor})"

    return LINK.sub(rewrite, markdown)
