"""KV caches behind one protocol: full precision, and the hierarchical INT4/INT8 cache."""
