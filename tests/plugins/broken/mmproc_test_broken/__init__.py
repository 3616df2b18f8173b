"""Test plugin package."""
