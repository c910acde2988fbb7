"""A ``/metrics`` page as the benches read it: the samples of a few families, summed by label.

Only the lines of the wanted families are parsed (a page of the gateway's is long, and the
bench's client loop measures TTFTs meanwhile)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Families = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> (labels, value)


def families(text: str | None, wanted: tuple[str, ...]) -> Families:
    """The samples of the families whose names start with one of ``wanted`` (none for None:
    the page could not be read)."""
    out: Families = {}
    if text is None:
        return out
    kept = "\n".join(line for line in text.splitlines() if line.startswith(wanted))
    for family in text_string_to_metric_families(kept):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def total(fam: Families, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels have the values given."""
    return sum(v for ls, v in fam.get(name, []) if all(ls.get(k) == x for k, x in labels.items()))
