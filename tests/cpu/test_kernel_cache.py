"""The on-disk kernel cache across installations (attnnb/cpu/_numba_patches/source_stamp.py,
docs/design.md).

* The package stamp is a hash of the files' contents: a reinstall of the
  same files (new modification times) keeps the cache, an edit does not.
* A read-only installation caches in the user's cache directory.
* A process that only loads kernels never refreshes Numba's target
  (attnnb/cpu/_numba_patches/cache_lookup.py), and a function of its own still
  compiles there.
* A cache written with the Numba patches on and one written with them off
  never serve each other (their entries differ in kind).

Each test installs a copy of the package in a temporary directory and runs
one small kernel (ToMe's unmerge gather, compiled in about a second) in
fresh processes, reading the dispatcher's cache statistics.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

import attnnb
from attnnb.cpu._numba_patches import ACTIVE

PACKAGE = os.path.dirname(os.path.abspath(attnnb.__file__))
TIMEOUT = 300

SCRIPT = """
import json
import numpy as np
import attnnb
from attnnb.cpu._numba_patches import ACTIVE
from attnnb.cpu.tome import unmerge, unmerge_kernel
from numba.core.registry import cpu_target
out = unmerge(np.arange(12, dtype=np.float32).reshape(1, 4, 3), np.array([[0, 1, 1, 3, 2]]))
stats = unmerge_kernel.stats
(sig,) = unmerge_kernel.signatures
registries = len(cpu_target.target_context._registries)  # 0: not refreshed
import numba
own = numba.njit(lambda x: np.sum(x * 2.0))(np.arange(4.0))  # a user's function compiles
print(json.dumps({"file": attnnb.__file__, "path": stats.cache_path, "out": out.tolist(),
                  "hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values()),
                  "patched": ACTIVE,
                  "registries": registries, "own": own}))
"""


def install_copy(site):
    """The package's sources (no caches) as an installation in ``site``."""
    shutil.copytree(PACKAGE, site / "attnnb",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return site / "attnnb"


COMPILED = {"hits": 0, "misses": 1}
LOADED = {"hits": 1, "misses": 0}


def made(report):
    return {key: report[key] for key in ("hits", "misses")}


def run_kernel(site, prefix=(), **env_extra):
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("ATTNNB_NUMBA_PATCHES", None)
    env.update(env_extra)
    env.pop("NUMBA_CACHE_DIR", None)  # Numba's own choice of place, as for a user
    proc = subprocess.run([*prefix, sys.executable, "-c", SCRIPT], cwd=str(site), env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["file"].startswith(str(site))  # the copy ran, not the source tree
    assert report["out"][0][2] == [3.0, 4.0, 5.0]
    assert report["own"] == 12.0
    return report


def test_reinstalling_the_same_files_keeps_the_cache_and_an_edit_does_not(tmp_path):
    site = tmp_path / "site"
    pkg = install_copy(site)
    first = run_kernel(site)
    assert made(first) == COMPILED
    assert first["registries"] > 0  # the compile refreshed Numba's target itself
    assert first["path"].startswith(str(pkg))  # __pycache__ of the installation
    # a reinstall: every file written again, same bytes, later modification times
    for path in pkg.rglob("*.py"):
        data = path.read_bytes()
        path.write_bytes(data)
        st = path.stat()
        os.utime(path, (st.st_atime + 100, st.st_mtime + 100))
    again = run_kernel(site)
    assert made(again) == LOADED
    # a loaded kernel needs none of Numba's lowering registries (cache_lookup)
    assert again["registries"] == 0
    # an edit to a module the kernel does not even use still makes it stale
    with open(pkg / "cpu" / "_tiles.py", "a") as f:
        f.write("\n# an edit\n")
    edited = run_kernel(site)
    assert made(edited) == COMPILED


@pytest.mark.skipif(not ACTIVE, reason="the Numba patches are off in this process")
def test_caches_written_with_and_without_the_numba_patches_never_serve_each_other(tmp_path):
    """A kernel cached with the patches on is an entry plain Numba cannot read; with
    them off the process finds it stale and compiles (and the other way round)."""
    site = tmp_path / "site"
    install_copy(site)
    assert made(run_kernel(site)) == COMPILED
    off = run_kernel(site, ATTNNB_NUMBA_PATCHES="0")
    assert not off["patched"] and made(off) == COMPILED
    assert made(run_kernel(site, ATTNNB_NUMBA_PATCHES="0")) == LOADED
    assert made(run_kernel(site)) == COMPILED


def _read_only_prefix(path):
    """A command prefix under which ``path`` cannot be written, or None.

    Permission bits bind an ordinary user; root ignores them, so there the
    directory is bind-mounted read-only in a private mount namespace.
    """
    if not os.access(path, os.W_OK):
        return ()
    if shutil.which("unshare") is None:
        return None
    prefix = ("unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"',
              str(path))
    probe = subprocess.run([*prefix, "sh", "-c", f'! touch "{path}/probe"'],
                           capture_output=True, timeout=60)
    return prefix if probe.returncode == 0 else None


def _chmod_tree(path, writable):
    """Set or clear every write bit of ``path`` and everything under it."""
    bits = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
    for root, dirs, files in os.walk(path):
        for p in [root] + [os.path.join(root, name) for name in dirs + files]:
            mode = os.stat(p).st_mode
            os.chmod(p, (mode | stat.S_IWUSR) if writable else (mode & ~bits))


def test_read_only_installation_caches_in_the_user_cache_directory(tmp_path):
    site = tmp_path / "site"
    pkg = install_copy(site)
    _chmod_tree(site, writable=False)
    try:
        prefix = _read_only_prefix(site)
        if prefix is None:
            pytest.skip("cannot make the copy read-only for this user (root without unshare)")
        user_cache = tmp_path / "xdg-cache"
        first = run_kernel(site, prefix, XDG_CACHE_HOME=str(user_cache))
        assert made(first) == COMPILED
        assert first["path"].startswith(str(user_cache / "numba"))
        assert any(name.endswith(".nbi") for _, _, files in os.walk(user_cache)
                   for name in files)
        again = run_kernel(site, prefix, XDG_CACHE_HOME=str(user_cache))
        assert made(again) == LOADED
        assert not (pkg / "cpu" / "__pycache__").exists()
    finally:
        _chmod_tree(site, writable=True)
