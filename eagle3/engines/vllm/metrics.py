"""vLLM's ``GET /metrics``: the speculative-decoding counters and the config info gauges.

Names read from vLLM 0.32 (``vllm/v1/spec_decode/metrics.py``, ``vllm/v1/metrics/
loggers.py``), in the Prometheus text exposition (a counter's samples carry the
``_total`` suffix; labels such as ``engine`` and ``model_name`` vary):

* ``vllm:spec_decode_num_drafts_total``: verify passes that carried drafts;
* ``vllm:spec_decode_num_draft_tokens_total``: draft tokens proposed;
* ``vllm:spec_decode_num_accepted_tokens_total``: draft tokens accepted;
* ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}``: accepted at
  draft position ``i`` (0-based);
* ``vllm:cache_config_info``: a gauge fixed at 1 whose labels are the cache config.

Tokens per verify pass tau = 1 + accepted / drafts (the bonus token counted), acceptance
rate = accepted / draft tokens, per-position acceptance = accepted_at_i / drafts; read
as deltas around requests that run alone (the counters are server-wide).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
CACHE_CONFIG_INFO = "vllm:cache_config_info"

_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition as ``(name, labels, value)``.

    Comment lines (``# HELP``, ``# TYPE``) and blank lines are skipped; label values
    are unescaped (``\\"``, ``\\\\``, ``\\n``); ``NaN`` / ``+Inf`` parse as floats.
    A malformed line is skipped.
    """
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
                  for k, v in _LABEL.findall(m.group(3) or "")}
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        out.append((m.group(1), labels, value))
    return out


@dataclass
class SpecCounters:
    """The speculative counters of one ``/metrics`` read (summed over engines and models).

    ``present`` is False when the server exposes none of them (no speculation running,
    or a vLLM that does not report them). ``per_position[i]``: accepted at draft position i.
    """

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: list[float] = field(default_factory=list)
    present: bool = False

    def __sub__(self, before: "SpecCounters") -> "SpecCounters":
        n = max(len(self.per_position), len(before.per_position))
        pad = lambda v: list(v) + [0.0] * (n - len(v))  # noqa: E731
        return SpecCounters(
            self.drafts - before.drafts, self.draft_tokens - before.draft_tokens, self.accepted - before.accepted,
            [a - b for a, b in zip(pad(self.per_position), pad(before.per_position))], self.present,
        )

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        n = max(len(self.per_position), len(other.per_position))
        pad = lambda v: list(v) + [0.0] * (n - len(v))  # noqa: E731
        return SpecCounters(
            self.drafts + other.drafts, self.draft_tokens + other.draft_tokens, self.accepted + other.accepted,
            [a + b for a, b in zip(pad(self.per_position), pad(other.per_position))], self.present or other.present,
        )

    @property
    def tau(self) -> Optional[float]:
        """Tokens per verify pass, 1 + accepted / drafts (None without drafts)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    @property
    def acceptance_rate(self) -> Optional[float]:
        """Accepted / proposed draft tokens (None without drafts)."""
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    def per_position_acceptance(self, depth: Optional[int] = None) -> Optional[list[float]]:
        """Fraction of verify passes whose draft position i was accepted, i = 0 .. depth-1."""
        if not self.drafts:
            return None
        pp = list(self.per_position) + [0.0] * max(0, (depth or 0) - len(self.per_position))
        return [v / self.drafts for v in pp]


def spec_counters(text: str) -> SpecCounters:
    """The :class:`SpecCounters` in a ``/metrics`` text (all label sets but ``position`` summed)."""
    c = SpecCounters()
    per: dict[int, float] = {}
    for name, labels, value in parse_prometheus(text):
        if math.isnan(value):
            continue
        if name == DRAFTS:
            c.drafts += value
        elif name == DRAFT_TOKENS:
            c.draft_tokens += value
        elif name == ACCEPTED:
            c.accepted += value
        elif name == ACCEPTED_PER_POS and labels.get("position", "").isdigit():
            per[int(labels["position"])] = per.get(int(labels["position"]), 0.0) + value
        else:
            continue
        c.present = True
    c.per_position = [per.get(i, 0.0) for i in range(max(per) + 1)] if per else []
    return c


def info_labels(text: str, name: str = CACHE_CONFIG_INFO) -> Optional[dict[str, str]]:
    """The labels of the first sample of the info gauge ``name`` (e.g. the cache config), or None."""
    for n, labels, _ in parse_prometheus(text):
        if n == name:
            return labels
    return None
