"""The ``reference`` backend: plain NumPy in float64, written for clarity.

It materialises every score matrix and is the oracle that every other
backend is tested against.  One module per public operation.
"""
