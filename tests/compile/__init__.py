"""Tests of petfunc.compile and of its patches of torch internals (patches() of petfunc.compile)."""
