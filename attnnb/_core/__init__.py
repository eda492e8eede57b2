"""Shared numerics the backends compile in (codes, scalar formulas, selection rules, the
dropout generator, block layouts) and the one way to specialise a kernel."""
