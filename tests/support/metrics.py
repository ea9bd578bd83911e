"""Reading a /metrics scrape with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


def parse_metrics(text: str) -> Samples:
    """Every sample of a text exposition, keyed by (sample name, its labels)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric_types(text: str) -> dict[str, str]:
    """Family name -> type (counter, gauge, histogram, ...)."""
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample with exactly these labels; 0 when it is absent (a series not created yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def bucket_bounds(samples: Samples, name: str, **labels: str) -> list[float]:
    """The ``le`` bounds of a histogram's buckets, in order (+Inf last)."""
    bounds = []
    for (sample, sample_labels), _ in samples.items():
        found = dict(sample_labels)
        if sample == name + "_bucket" and {k: found.get(k) for k in labels} == labels:
            bounds.append(float(found["le"]))
    return sorted(bounds)
