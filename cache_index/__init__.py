"""The global block-hash index and the block hashing every component shares."""
