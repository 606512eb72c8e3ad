//! The KV-cache manager: block pool, reference counts, prefix hashing, eviction. No device types.
