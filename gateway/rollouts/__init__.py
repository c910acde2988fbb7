"""Progressive rollout of an alias from its stable pool to a canary pool: the plan and its
gates (pure), judged on the fleet's figures for both pools over the same window."""
