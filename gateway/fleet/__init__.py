"""The fleet: replicas that share a Redis act as one gateway (the change log they all apply)."""
