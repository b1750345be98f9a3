"""Tests of petfunc.trainer, one file per module."""
