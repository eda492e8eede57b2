"""The ``cuda`` backend: numba.cuda kernels, imported by the dispatcher on first use.

Kernels are compiled lazily (on first launch), so importing these modules
needs numba-cuda but neither a GPU nor a driver.
"""
