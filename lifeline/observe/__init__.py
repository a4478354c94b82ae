"""Stage 11, account: one record per request feeds timings, Prometheus, traces and the log."""
from lifeline.observe.access_log import AccessLog
from lifeline.observe.metrics import Metrics
from lifeline.observe.record import STAGES, RequestRecord, ServerStamps, combine_timelines
from lifeline.observe.tracing import Tracer

__all__ = ["STAGES", "AccessLog", "Metrics", "RequestRecord", "ServerStamps", "Tracer",
           "combine_timelines"]
