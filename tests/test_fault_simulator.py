"""The fault simulator (harness.simulate): generated scenarios through the real failure policy, checked against
issue 36's invariants; a scenario per defect that the simulator found on the code it was built against.

A failing scenario prints as one line; replay it with `python -m harness.simulate "<line>"`, or add it to REPLAY
below so that it runs on every test run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import simulate
from harness.simulate import BACKENDS, FAULTS, Fault, Scenario, check, describe

# One scenario per defect of issue 36, each found by the simulator on the code it was built against, before the
# fixes merged (what it broke there, and which invariant, is in the words): kept as regular tests, so that the
# fixes stay fixed.
DEFECTS = {
    "1": ("k8s n=4 s=1 | nic_flap@1.a0.r0.s5",
          "defect 1: watch-stopped pods' ends read as their own failures: healthy n0 blamed, tainted and its pod "
          "moved, once per attempt (innocent, budget)"),
    "2": ("k8s n=4 s=1 | health0_absent.a0.r0.s5",
          "defect 2: rank 0's health node never starts: every other node fails pair_busbw (innocent, cap)"),
    "3": ("k8s n=4 s=0 | pair_absent@2.a0.r0.s5",
          "defect 3: a missing pair partner hangs its partner on NCCL, which then fails (innocent)"),
    "5": ("k8s n=4 s=1 | lost@1.a0.r0.s5; node_403.a0.r0.s5",
          "defect 5: a 403 on the Node stops the job's exclusion patch, retried for ever (told)"),
    "6": ("slurm n=4 s=1 | oom@1.a0.r0.s5",
          "defect 6: CUDA out of memory blamed on its node, then the next, until the budget is spent (program)"),
    "7": ("slurm n=4 s=1 runs=2 | lost@1.a0.r1.s5",
          "defect 7: a node lost in run 2 of a Slurm campaign is not blamed (told)"),
    "8": ("k8s n=4 s=1 | lost@1.a0.r0.s5; api_down.a0.r0.s5",
          "defect 8: the API server unreachable: urllib3's MaxRetryError is a traceback (traceback)"),
    "10-cap": ("slurm n=8 s=2 | gpu_xid@1.a0.r0.s5; gpu_xid@2.a0.r0.s5",
               "defect 10: one decision drains 2 of 10 nodes, above the cap of 1 (cap)"),
    "10-back": ("k8s n=4 s=1 again=1 | lost@1.a0.r0.s5",
                "defect 10: a tainted node is never checked again, nor untainted (unmarked)"),
}
# Scenarios that once broke an invariant, replayed on every run (the property test's failures go here).
REPLAY: list[str] = [
    "k8s n=4 s=1 | lost@1.a0.r0.s5",
    "k8s n=4 s=1 skew=3,-3,0,0,0 | lost@2.a0.r0.s5",
    "slurm n=4 s=1 | stale_nfs@2.a0.r0.s5; stale_nfs@2.a1.r0.s5; stale_nfs@2.a2.r0.s5; stale_nfs@2.a3.r0.s5",
    "k8s n=4 s=1 | workload@1.a0.r0.s5",
    "k8s n=4 s=1 mark=0 again=1 | lost@1.a0.r0.s5",
    "local n=1 | config.a0.r0.s5",
    "slurm n=4 s=1 runs=2 | gpu_xid@3.a0.r1.s7",
    # after issue 36's fixes: a GPU off the bus failed its only pair partner's pair_busbw (preflight.unrun_pair_ranks)
    "slurm n=2 s=0 g=1 runs=1 budget=1 mark=0 again=0 | api_down@0.a0.r0.s0; gpu_offbus@0.a0.r0.s0",
    "slurm n=3 s=0 | gpu_offbus@0.a0.r0.s5",
    # after issue 36's fixes: the watcher marked both nodes one attempt blamed, above the cap (its verdict uncapped)
    "k8s n=8 s=2 | gpu_xid@1.a0.r0.s5; gpu_xid@2.a0.r0.s5",
    # a real straggler blamed in an attempt a configuration error ended: its own fault, not the program's
    "k8s n=2 s=0 g=1 runs=2 budget=1 mark=0 again=0 | api_down@0.a0.r0.s0; config@0.a0.r1.s0; slow@0.a0.r0.s0",
    # a model error: a GPU fault at step 0 fired beside a configuration error (a refused command never starts)
    "k8s n=2 s=0 g=1 runs=1 budget=1 mark=0 again=0 | api_down@0.a0.r0.s0; config@0.a0.r0.s0; gpu_offbus@0.a0.r0.s0",
    # every node of the attempt lost: no end tells them from a shared cause (the told invariant leaves it out)
    "slurm n=2 s=0 g=1 runs=1 budget=1 mark=0 again=0 | api_down@0.a0.r0.s0; lost@0.a0.r0.s0; lost@1.a0.r0.s0",
    # a node lost in the attempt that spent the budget: no next attempt to keep it out of
    "k8s n=2 s=0 g=1 runs=1 budget=1 mark=0 again=0 | api_down@0.a0.r0.s0; lost@0.a1.r0.s0; lost@1.a0.r0.s0",
]


def _holds(spec: str) -> None:
    scenario = Scenario.parse(spec)
    outcome = simulate.simulate(scenario)
    assert not check(scenario, outcome), f"replay: python -m harness.simulate {scenario.spec()!r}\n" + \
        describe(scenario, outcome)


@pytest.mark.parametrize("defect", DEFECTS)
def test_defect_scenario_holds_the_invariants(defect):
    """What the simulator found on the code before issue 36's fixes (DEFECTS: the defect, and the invariants it
    broke there) holds every invariant now."""
    _holds(DEFECTS[defect][0])


@pytest.mark.parametrize("spec", REPLAY)
def test_replayed_scenario_holds_the_invariants(spec):
    _holds(spec)


@st.composite
def scenarios(draw) -> Scenario:
    backend = draw(st.sampled_from(BACKENDS))
    nodes = 1 if backend == "local" else draw(st.integers(2, 8))
    spares = 0 if backend == "local" else draw(st.integers(0, 2))
    runs, cluster = draw(st.integers(1, 3)), nodes + spares + 2
    fault = st.builds(Fault, st.sampled_from(sorted(FAULTS)), st.integers(0, cluster - 1), st.integers(0, 3),
                      st.integers(0, runs - 1), st.integers(0, simulate.STEPS - 1))
    return Scenario(backend, nodes, spares, draw(st.integers(1, 4)), runs, draw(st.integers(0, 4)),
                    draw(st.booleans()), draw(st.booleans()),
                    skew=tuple(draw(st.lists(st.integers(-3, 3), max_size=cluster))),
                    pull=tuple(draw(st.lists(st.integers(0, 60), max_size=cluster))) if backend == "k8s" else (),
                    faults=tuple(draw(st.lists(fault, max_size=3))))


def _property(scenario: Scenario) -> None:
    assert Scenario.parse(scenario.spec()).spec() == scenario.spec()
    _holds(scenario.spec())


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_generated_scenarios_hold_the_invariants(scenario):
    _property(scenario)


@pytest.mark.slow
@settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_ten_thousand_generated_scenarios_hold_the_invariants(scenario):
    _property(scenario)


def test_the_docs_table_is_the_simulators():
    text = (Path(__file__).parent.parent / "docs" / "failures.md").read_text()
    found = re.search(r"<!-- fault-table -->\n(.*?)<!-- /fault-table -->", text, re.S)
    assert found and found.group(1) == simulate.fault_table()


def test_a_scenario_line_round_trips_and_replays(capsys):
    line = "k8s n=4 s=1 g=2 runs=1 budget=3 mark=1 again=0 skew=1,-2 | lost@1.a0.r0.s5"
    assert Scenario.parse(line).spec() == line
    assert simulate.main([line]) == 0
    assert "every invariant holds" in capsys.readouterr().out
    with pytest.raises(ValueError):
        Scenario.parse("k8s n=4 | meteor@1")
