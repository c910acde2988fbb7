"""KV-cache events: vLLM's wire format, and following each backend's stream into the index."""
