"""Tests of petfunc.ops (one file per module)."""
