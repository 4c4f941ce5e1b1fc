"""Traces and metrics: OpenTelemetry setup and the trace report."""
