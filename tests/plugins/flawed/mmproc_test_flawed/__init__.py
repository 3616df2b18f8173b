"""Test plugins with the mistakes mmproc's conformance suite must catch (and one without)."""
