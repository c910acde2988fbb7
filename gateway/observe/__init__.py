"""Observability: Prometheus metrics, structured logs, OpenTelemetry traces."""
