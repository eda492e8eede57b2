"""Make asv's published site open without internet access.

``asv publish`` writes pages that load jQuery, flot, Bootstrap and a few
small plugins from public CDNs; on a machine that cannot reach them the
site shows only "Can not determine continental origin of swallow".  This
copies local copies of those files (from npm packages) into the site and
points its pages at them::

    npm install --prefix .asv/vendor jquery@3.3.1 flot@0.8.3 flot-orderbars@1.0.0 \\
        stupid-table-plugin@1.1.3 blueimp-md5@2.19.0 bootstrap@3.1.1
    asv publish
    python asv_benchmarks/offline_site.py .asv/vendor/node_modules .asv/html

Run it again after each ``asv publish`` (which rewrites the pages).
Standard library only.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

# The CDN file name asv 0.6 asks for -> its copy in the npm packages.  flot 0.8.3's
# package has no minified files; the plain ones are the same code.
LOCAL = {
    "jquery-3.3.1.min.js": "jquery/dist/jquery.min.js",
    "jquery.flot.min.js": "flot/jquery.flot.js",
    "jquery.flot.time.min.js": "flot/jquery.flot.time.js",
    "jquery.flot.selection.min.js": "flot/jquery.flot.selection.js",
    "jquery.flot.categories.min.js": "flot/jquery.flot.categories.js",
    "jquery.flot.orderBars.js": "flot-orderbars/js/jquery.flot.orderBars.js",
    "stupidtable.min.js": "stupid-table-plugin/stupidtable.min.js",
    "md5.min.js": "blueimp-md5/js/md5.min.js",
    "bootstrap.min.js": "bootstrap/dist/js/bootstrap.min.js",
    "bootstrap.min.css": "bootstrap/dist/css/bootstrap.min.css",
}
# A <script src=...> or <link href=...> tag whose address is on another host.
_TAG = re.compile(r'<(script|link)\b[^>]*?\b(src|href)="(https?://[^"]+)"[^>]*>')


def localise(html: str, vendor: str = "vendor") -> tuple[str, set[str]]:
    """``html`` with every remote script and stylesheet pointing at ``vendor/<name>``
    (integrity and CORS attributes dropped: they describe the CDN's bytes), and the
    names used.  A remote file this module has no copy of is a ``ValueError``."""
    used: set[str] = set()

    def swap(m: re.Match) -> str:
        kind, attr, url = m.groups()
        name = url.rsplit("/", 1)[1]
        if kind == "link" and not name.endswith(".css"):
            return m.group(0)  # a link to a page, not a stylesheet
        if name not in LOCAL:
            raise ValueError(f"no local copy of {url}")
        used.add(name)
        if kind == "script":
            return f'<script src="{vendor}/{name}" onerror="js_load_failure()">'
        return f'<link rel="stylesheet" href="{vendor}/{name}">'

    return _TAG.sub(swap, html), used


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[0] + "\nusage: offline_site.py NODE_MODULES HTML_DIR",
              file=sys.stderr)
        return 2
    modules, html_dir = argv
    os.makedirs(os.path.join(html_dir, "vendor"), exist_ok=True)
    used: set[str] = set()
    for page in sorted(os.listdir(html_dir)):
        if not page.endswith(".html"):
            continue
        path = os.path.join(html_dir, page)
        with open(path, encoding="utf-8") as f:
            text, names = localise(f.read())
        used |= names
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    for name in sorted(used):
        shutil.copyfile(os.path.join(modules, LOCAL[name]),
                        os.path.join(html_dir, "vendor", name))
    print(f"offline_site: {len(used)} files copied into {html_dir}/vendor")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
