"""Print a copy of asv.conf.json for CI's quick asv pass (``.ci/run``).

The copy keeps the benchmarks and the repository (as absolute paths, since asv
reads a configuration relative to its own folder) and sends results, html and
environments to ``OUT_DIR``, so that CI never writes into the committed history
in ``asv_benchmarks/results``.

    python .ci/asv_conf.py OUT_DIR > OUT_DIR/asv.conf.json
"""

import json
import os
import sys

from asv.util import load_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(out_dir: str) -> None:
    conf = load_json(os.path.join(ROOT, "asv.conf.json"), js_comments=True)
    out_dir = os.path.abspath(out_dir)
    conf.update(
        repo=ROOT,
        benchmark_dir=os.path.join(ROOT, conf["benchmark_dir"]),
        results_dir=os.path.join(out_dir, "results"),
        html_dir=os.path.join(out_dir, "html"),
        env_dir=os.path.join(out_dir, "env"),
    )
    json.dump(conf, sys.stdout, indent=4)
    sys.stdout.write("\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    main(sys.argv[1])
