"""asv_benchmarks/offline_site.py: asv's pages pointed at local copies of their libraries."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "offline_site", os.path.join(ROOT, "asv_benchmarks", "offline_site.py"))
site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(site)

PAGE = """<head>
<script src="https://code.jquery.com/jquery-3.3.1.min.js" integrity="sha256-x" crossorigin="anonymous" onerror="js_load_failure()"></script>
<script language="javascript" type="text/javascript" src="jquery.flot.axislabels.js"></script>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/bootstrap@3.1.1/dist/css/bootstrap.min.css" integrity="sha256-y" crossorigin="anonymous">
</head><body><a href="https://github.com/airspeed-velocity/asv/" class="navbar-link">asv</a></body>
"""  # noqa: E501


def test_remote_libraries_become_local_and_other_links_stay():
    text, used = site.localise(PAGE)
    assert used == {"jquery-3.3.1.min.js", "bootstrap.min.css"}
    assert '<script src="vendor/jquery-3.3.1.min.js" onerror="js_load_failure()">' in text
    assert '<link rel="stylesheet" href="vendor/bootstrap.min.css">' in text
    assert "integrity" not in text and "code.jquery.com" not in text
    assert 'src="jquery.flot.axislabels.js"' in text  # already local
    assert 'href="https://github.com/airspeed-velocity/asv/"' in text  # a link, not a library


def test_unknown_remote_library_is_an_error():
    with pytest.raises(ValueError, match="no local copy of https://example.org/x.js"):
        site.localise('<script src="https://example.org/x.js"></script>')
