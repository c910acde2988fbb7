"""The soak: a long run with faults, its invariants and its report."""
