"""Model builders and the meta-device tracer."""
