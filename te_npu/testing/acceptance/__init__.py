"""The acceptance run: cases Q3-01..Q3-11 (docs/a5.md, acceptance matrix) through the production
Trainer, their rules, verdicts and report. ``scripts/q3_acceptance.py`` parses its command line and
launches it; the acceptance system tests (``tests/system``) run the same phases and assert the same
rules.

One concept per module, bottom to top:

- ``rules``: every rule, stated once, as a function returning its problems;
- ``runs``: one phase through a Trainer with a ``PhaseProbe`` as plain results, and ``closing``
  (close on success, abandon on failure), the one place a Trainer's life ends;
- ``run_config``: the run's settings, the model it accepts, the overrides that make a recipe a run;
- ``matrix``: each case's jobs and phases, and the rules each phase answers;
- ``job_files``: the per-rank and per-phase files under ``--out``;
- ``evidence``: what a phase leaves as JSON, and its peak memory;
- ``rank_phases``: one rank's part of a job;
- ``verdicts``: a case's verdict from its phases;
- ``report``: ``report.md`` / ``report.json``, ``environment.json``, the curves;
- ``orchestration``: which jobs run, until their phases ended, then verdicts and report.
"""
