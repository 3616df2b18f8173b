"""The 'future' test plugin targets plugin API 99; mmproc must never import this module."""

raise AssertionError("mmproc imported a plugin that declared an incompatible plugin API")
