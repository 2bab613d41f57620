"""What operators see of a request and of the fleet: latency buckets, a request's stage timeline, traces.

Torch-free and imported by the router and the workers alike: ``buckets.py`` (histogram bucket edges),
``timeline.py`` (stage names and one request's wall-clock stamps), ``tracing.py`` (OpenTelemetry spans,
off unless an OTLP endpoint is configured).
"""
