"""What each step runs, following the plan.

``phases`` (one batch: prepare, compute, finish; an AdamW chunk), ``pipeline`` (chunks in
the schedule's order, and the one driver of the state stager, for ``step()`` and
``step_chunk()`` alike), ``state`` (where the optimizer state lives, its step counters),
``offload`` (the stager), ``exchange`` (the all-to-alls), ``agreement`` (the check that
every group's ranks planned alike), ``telemetry`` (``StepStats``).
"""
