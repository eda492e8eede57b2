"""The machinery behind :mod:`attnnb.mods`: what a mask or score function reads, and
its compilation into the small functions the kernels inline."""
