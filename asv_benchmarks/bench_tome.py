"""asv benchmarks for attnnb.tome: one ToMe step (matching + mean merge), unmerge.

Sizes: a ViT-B layer (B = 32, N = 197, C = 64, r = 16, class token) and a
Stable Diffusion 64 x 64 latent (B = 2, N = 4096, C = 320, r = 2048).
``TomeVsTorch`` times the same step written with PyTorch CPU tensors
(``attnnb.benches.tome.torch_step``) in the same run, where torch imports.
"""

from __future__ import annotations

from attnnb.benches.tome import SIZES, attnnb_step, data, torch_available, torch_step


class TomeStep:
    """Matching + mean merge, and unmerge, per backend."""

    params = (["cpu", "reference"], ["vit", "sd"])
    param_names = ["backend", "size"]

    def setup(self, backend, size):
        from attnnb import tome

        if backend == "reference" and size == "sd":
            raise NotImplementedError("the float64 oracle is not timed at Stable Diffusion size")
        B, N, C, r, cls = SIZES[size]
        self.metric, self.x = data(B, N, C)
        self.r, self.cls = r, cls
        self.matching = tome.bipartite_soft_matching(self.metric, r, class_token=cls,
                                                     backend=backend)
        self.merged = self.matching.merge(self.x)
        self.backend = backend
        attnnb_step(self.metric, self.x, r, cls, backend)  # compile / load the kernels
        self.matching.unmerge(self.merged)

    def time_match_merge(self, backend, size):
        attnnb_step(self.metric, self.x, self.r, self.cls, backend)

    def time_unmerge(self, backend, size):
        self.matching.unmerge(self.merged)


class TomeVsTorch:
    """attnnb cpu against the reference algorithm in PyTorch (CPU), same data."""

    params = (["attnnb-cpu", "torch"], ["vit", "sd"])
    param_names = ["impl", "size"]

    def setup(self, impl, size):
        B, N, C, r, cls = SIZES[size]
        metric, x = data(B, N, C)
        if impl == "torch":
            if not torch_available():
                raise NotImplementedError("torch is not installed")
            import torch

            tm, tx = torch.from_numpy(metric), torch.from_numpy(x)
            self.step = lambda: torch_step(tm, tx, r, cls)
        else:
            self.step = lambda: attnnb_step(metric, x, r, cls)
        self.step()

    def time_match_merge(self, impl, size):
        self.step()


class TomeRandom2d:
    """tomesd's matching at Stable Diffusion size (2 x 2 cells, ratio 0.5)."""

    def setup(self):
        from attnnb import tome

        self.tome = tome
        self.metric, self.x = data(2, 4096, 320)
        self.run()

    def run(self):
        m = self.tome.bipartite_soft_matching_random2d(self.metric, 64, 64, 2, 2, 2048, seed=0)
        return m.merge(self.x)

    def time_match_merge(self):
        self.run()
