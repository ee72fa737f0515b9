"""The compiler: a compile request in, a verified, predicted plan out.

Folders follow the compiler's stages; :func:`pipec.compiler.driver.compile_request` runs them in
this order:

- :mod:`.request` (the frozen, torch-free :class:`~.request.CompileRequest` the language hands
  over), :mod:`.config` (training settings and their defaults), :mod:`.limits` (the one table of
  size limits), :mod:`.progress` (the slow parts' progress line).
- :mod:`pipec.schedules` (a package of its own): the named schedule's rules and its per-rank
  compute order; a policy's or an explicit order's too.
- :mod:`.frontend` (the only module of the compiler that imports torch at module level): runs
  :mod:`pipec.model` (trace, init, partition, the data), :mod:`pipec.costs` and, at tp > 1,
  :mod:`pipec.tp` -> a :class:`~.ir.graph.StageGraph`.
- :mod:`.ir`: the instruction set and its text form (:mod:`.ir.program`), the plan's types
  (:mod:`.ir.plan`), plan.json (:mod:`.ir.plan_json`, read through :mod:`.ir.schema`), the
  :class:`~.ir.timeline.Timeline`, the stage graph, torch's compute+comms CSV form.
- :mod:`.passes`: :mod:`~.passes.lower` (compute order + placement + stage graph -> Program),
  :mod:`~.passes.verify` (the four proofs, both comm models), :mod:`~.passes.memory` (what each
  rank holds, and the ``device_memory`` refusal).
- :mod:`.sim`: the cost model, the event loop (:mod:`~.sim.engine`), processor sharing
  (:mod:`~.sim.contention`) and :mod:`~.sim.simulate` (durations -> the predicted Timeline).

Complaints about a key are raised as :class:`pipec.errors.PipecError` with ``key=`` (or returned
as :class:`pipec.errors.Diagnostic`); the language's boundary locates them. The compiler never
imports :mod:`pipec.dsl`, :mod:`pipec.runtime`, :mod:`pipec.tune` or :mod:`pipec.views` (tested).
"""
