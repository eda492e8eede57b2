"""What the framework bridges (:mod:`attnnb.torch`, :mod:`attnnb.jax`,
:mod:`attnnb.transformers`) share and need beyond their public modules."""
