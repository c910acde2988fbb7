"""OpenTelemetry: a server span per request and a child span per upstream attempt.

Off unless an OTLP endpoint is configured (or a test hands in its own provider): with no
tracer the request path does no tracing work at all. The client's ``traceparent`` is honoured
as the parent, and each attempt's context is propagated to the backend (vLLM accepts it).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

from gateway.config.settings import TracingSettings
from gateway.request.record import RequestRecord


def provider_from_settings(settings: TracingSettings) -> TracerProvider | None:
    if not settings.otlp_endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(
        resource=Resource.create({"service.name": settings.service_name}),
        sampler=ParentBasedTraceIdRatio(settings.sample_ratio),
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(settings.otlp_endpoint)))
    return provider


def tracer_from(provider: TracerProvider | None) -> trace.Tracer | None:
    return None if provider is None else provider.get_tracer("llm-gateway")


def parent_context(headers: Mapping[str, str]) -> Context:
    return propagate.extract(headers)


def inject(headers: MutableMapping[str, str], context: Context) -> None:
    propagate.inject(headers, context=context)


def attempt_span(
    tracer: trace.Tracer | None, parent: trace.Span, backend: str, n: int
) -> trace.Span:
    assert tracer is not None
    return tracer.start_span(
        "upstream attempt",
        context=trace.set_span_in_context(parent),
        kind=trace.SpanKind.CLIENT,
        attributes={"llm_gateway.backend": backend, "llm_gateway.attempt": n},
    )


def end_attempt(span: trace.Span | None, status: int, error: BaseException | None) -> None:
    if span is None:
        return
    if status:
        span.set_attribute("http.response.status_code", status)
    if error is not None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
    span.end()


def annotate(span: trace.Span, record: RequestRecord) -> None:
    """Copy the request's outcome onto its server span."""
    span.set_attribute("gen_ai.request.model", record.model)
    span.set_attribute("http.response.status_code", record.status)
    span.set_attribute("llm_gateway.backend", record.backend)
    span.set_attribute("llm_gateway.attempts", len(record.backends))
    span.set_attribute("llm_gateway.ending", str(record.ending))
    if record.ttft is not None:
        span.set_attribute("llm_gateway.time_to_first_token_s", record.ttft)
    if record.events:
        span.set_attribute("llm_gateway.stream_events", record.events)
    if record.continuations:
        span.set_attribute("llm_gateway.continuations", record.continuations)
    if record.status >= 500 or record.status == 0:
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(record.ending)))
