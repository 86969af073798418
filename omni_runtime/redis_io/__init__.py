"""The Redis control-plane kit: clients, stream reads and writes, and the Redis stage client."""
