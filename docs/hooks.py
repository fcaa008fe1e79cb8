"""mkdocs hook: pages included from outside docs/, and links that work on GitHub made to work in
the site too.

``docs/index.md`` stands for the README and ``docs/conformance.md`` for the suite's README: their
text is read here, with their links (relative to the repository root or to ``conformance/``)
rewritten to point into the site. Pages under docs/ link to the suite's README as
``../conformance/README.md``, outside the docs: those links go to its page. So ``mkdocs build
--strict`` checks every link like any other.
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

#: page -> (the file whose text it shows, relative to the repo; its link prefixes -> the site's)
INCLUDED = {
    "index.md": ("README.md", {"](docs/": "]("}),
    "conformance.md": ("conformance/README.md", {"](../docs/": "]("}),
}
#: the suite's README, as docs/ pages link to it, and its page in the site
SUITE_README = "conformance/README.md"
SUITE_PAGE = "conformance.md"


def on_page_markdown(markdown: str, page: Any, config: Any, **_: Any) -> str:
    src = page.file.src_uri
    if src in INCLUDED:
        path, rewrites = INCLUDED[src]
        markdown = (Path(config.config_file_path).parent / path).read_text(encoding="utf-8")
        for written, meant in rewrites.items():
            markdown = markdown.replace(written, meant)
    here = posixpath.dirname(src)
    outside = posixpath.relpath(SUITE_README, posixpath.join("docs", here))
    inside = posixpath.relpath(SUITE_PAGE, here or ".")
    return markdown.replace(f"]({outside}", f"]({inside}")
