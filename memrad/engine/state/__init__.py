"""Session state: KV slabs, snapshots and rebuilds, the disk tier."""
