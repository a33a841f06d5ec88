"""The chaos soak's short plan (e2e/cluster/soak.py; the long one is benchmarks/soak.py): under
Poisson load through a disaggregated and a colocated deployment (the latter's through its router
and through a Gateway's Envoy and Endpoint Picker), one fault of each kind (an
engine, a router and the operator SIGKILLed, a prefill pod's link cut, a pod frozen past its
probes, an engine Deployment rolled). Every request gets an answer, no answer is wrong, no KV
block stays held, and outside the seconds around each fault at least 99% succeed."""

from __future__ import annotations

from .conftest import open_lab
from .soak import lab_options, plan_short, run_soak, start_fleet


def test_a_short_chaos_soak_loses_nothing_and_answers_right(tmp_path, model_store, offline):
    with open_lab(tmp_path / "lab", **lab_options(model_store)) as lab:
        fleet = start_fleet(lab)
        report = run_soak(fleet, plan_short(), offline)
        print(report.table())
        counts = report.counts()
        assert counts["wrong"] == 0, report.table()
        assert counts["lost"] == 0, report.table()
        assert report.held_blocks == 0 and report.busy_engines == [], report.table()
        ok, calm = report.success_outside_faults()
        assert calm >= 20 and ok >= 0.99 * calm, report.table()
        assert [w.recovered is not None for w in report.windows] == [True] * 6, report.table()
