"""The README's examples run as written (the bridges' blocks are run by their own tests,
``test_readme_*_block_runs``), and the README stays short (docs/guide.md has the rest)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
MARKED = ("gradients", "mods", "inspection", "torch", "jax", "dask")


def _unmarked_blocks():
    text = README.read_text()
    for name in MARKED:  # those have tests of their own
        text = re.sub(rf"<!-- usage:{name} -->.*?<!-- /usage:{name} -->", "", text, flags=re.S)
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.parametrize("index", range(4))
def test_readme_examples_run(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (an example may save a picture)
    blocks = _unmarked_blocks()
    assert len(blocks) == 4, "the README's dense, ToMe, differential and sparse examples"
    namespace: dict = {}
    exec(compile(blocks[index], f"README.md:example {index}", "exec"), namespace)
    assert namespace["out"].ndim == 4


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 300
