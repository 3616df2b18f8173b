"""The 'broken' test plugin fails while being imported."""

raise RuntimeError("broken plugin exploded on import")
