"""Tests of the cpu backend's internals, mirroring attnnb/cpu."""
