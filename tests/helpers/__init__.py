"""Helpers shared by test files in several folders (``from tests.helpers.NAME import ...``)."""
