"""Fixtures of tests/test_train_step.py (its dataset and fitted baselines), for the
compiled training steps of tests/ops/test_fused_attention.py."""

from test_train_step import dataset, fitted  # noqa: F401 - fixtures
