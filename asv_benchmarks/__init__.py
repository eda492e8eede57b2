"""asv benchmarks (``asv.conf.json``: ``benchmark_dir``); one ``bench_<feature>.py`` each."""
