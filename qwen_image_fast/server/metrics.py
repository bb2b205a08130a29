"""The server's counters, gauges and histograms, and GET /metrics in Prometheus' text format (0.0.4)."""

import threading

PREFIX = "qwen_image_fast_"
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300)
ENCODE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


class Histogram:
    def __init__(self, buckets: tuple):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float):
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{bound:g}"}} {count}' for bound, count in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                      f"{name}_count {self.count}"]


class Metrics:
    """What /metrics reports. requests: (endpoint, outcome) -> count; outcome one of OUTCOMES."""

    OUTCOMES = ("ok", "bad_request", "unauthorized", "queue_full", "timeout", "disconnected", "engine_error",
                "unavailable")

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.images = 0
        self.engine_restarts = 0
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.queue_wait = Histogram(SECONDS_BUCKETS)
        self.compute = Histogram(SECONDS_BUCKETS)
        self.encode = Histogram(ENCODE_BUCKETS)

    def request(self, endpoint: str, outcome: str):
        with self.lock:
            self.requests[endpoint, outcome] = self.requests.get((endpoint, outcome), 0) + 1

    def render(self, queue_requests: int, queue_images: int, engines_ready: int, engines_busy: int,
               batches_encoding: int, engines: int) -> str:
        with self.lock:
            lines = [f"# HELP {PREFIX}requests_total Requests answered, by endpoint and outcome.",
                     f"# TYPE {PREFIX}requests_total counter"]
            lines += [f'{PREFIX}requests_total{{endpoint="{e}",outcome="{o}"}} {n}'
                      for (e, o), n in sorted(self.requests.items())]
            for name, kind, about, value in (
                    ("queue_requests", "gauge", "Requests waiting for an engine.", queue_requests),
                    ("queue_images", "gauge", "Images of those requests not yet sent to an engine.", queue_images),
                    ("engines_ready", "gauge", "Engines loaded, warmed up and serving.", engines_ready),
                    ("engines_busy", "gauge", "Engines running a batch.", engines_busy),
                    ("batches_encoding", "gauge", "Batches computed whose images are being encoded.",
                     batches_encoding),
                    ("engines", "gauge", "Engines configured.", engines),
                    ("images_total", "counter", "Images rendered and returned.", self.images),
                    ("engine_restarts_total", "counter", "Engines started again after they stopped.",
                     self.engine_restarts)):
                lines += [f"# HELP {PREFIX}{name} {about}", f"# TYPE {PREFIX}{name} {kind}", f"{PREFIX}{name} {value}"]
            for name, about, histogram in (
                    ("batch_size", "Images per pipeline call.", self.batch_size),
                    ("queue_wait_seconds", "From a request's arrival to its first image's batch starting.",
                     self.queue_wait),
                    ("compute_seconds", "One pipeline call (its images' encoding, which overlaps the next call, "
                                        "not included).", self.compute),
                    ("encode_seconds", "From a pipeline call's end to its images encoded (PNG / WebP / JPEG, on "
                                       "threads, while the engine computes the next call).", self.encode)):
                lines += [f"# HELP {PREFIX}{name} {about}", f"# TYPE {PREFIX}{name} histogram"]
                lines += histogram.lines(PREFIX + name)
            return "\n".join(lines) + "\n"
