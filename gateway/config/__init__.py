"""Configuration: the settings file and environment, read once, and what they build."""
