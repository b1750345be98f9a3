"""Tests of petfunc.cli, one file per module."""
