"""benchmarks/agreement_by_confidence.py's binning, by hand: shares of rows, agreement per bin
and the share of all misses each bin holds."""

from __future__ import annotations

import pytest
import torch

from benchmarks.agreement_by_confidence import binned


def test_bins_by_hand():
    p = torch.tensor([0.1, 0.2, 0.4, 0.6, 0.95, 1.0, 0.99, 0.5])
    ok = torch.tensor([False, True, False, True, True, True, False, False])
    b = binned(ok, p, edges=(0.0, 0.3, 0.5, 0.9, 1.0 + 1e-6))
    assert [x["rows"] for x in b] == [2, 1, 2, 3]  # 0.5 falls in [0.5, 0.9); 1.0 in the last bin
    assert [x["share"] for x in b] == pytest.approx([2 / 8, 1 / 8, 2 / 8, 3 / 8])
    assert [x["agreement"] for x in b] == pytest.approx([0.5, 0.0, 0.5, 2 / 3])
    # four misses: one in each bin
    assert [x["miss_share"] for x in b] == pytest.approx([0.25, 0.25, 0.25, 0.25])
    assert b[-1]["bin"] == [0.9, 1.0]


def test_an_empty_bin_has_no_agreement_and_no_misses():
    b = binned(torch.tensor([True, True]), torch.tensor([0.95, 0.99]), edges=(0.0, 0.5, 1.0 + 1e-6))
    assert b[0]["rows"] == 0 and b[0]["agreement"] is None and b[0]["miss_share"] == 0.0
    assert b[1]["agreement"] == 1.0 and b[1]["miss_share"] == 0.0
