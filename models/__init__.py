"""Models built from te_npu's public API."""
