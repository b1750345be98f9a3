"""Tests of petfunc.compile and of its patches of torch internals (petfunc.compile.patches())."""
