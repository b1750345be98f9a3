"""Helpers shared by test files in several folders."""
