"""KV snapshots on disk."""
