"""Helpers shared by test files (import as ``from tests.helpers.NAME import ...``)."""
