"""The compiler: a compile request in, a verified, predicted plan out.

The passes, in the order :func:`pipec.compiler.driver.compile_request` runs them:

- :mod:`.request`: the frozen, torch-free :class:`~.request.CompileRequest`
  (schedule choice, mesh, links, model, training settings, each key's origin)
  that the language hands over; :mod:`.config` types the training settings and
  owns their defaults.
- :mod:`pipec.schedules` (a package of its own): the named schedule's rules
  and its per-rank compute order; a policy's or an explicit order's too.
- :mod:`.frontend` (the only part of the compiler that imports torch): trace,
  init, partition, cost and describe the model's data -> a
  :class:`~.graph.StageGraph`.
- :mod:`.lower`: compute order + placement + stage graph -> a
  :class:`~.ir.Program` of per-rank instructions (:mod:`.ir`: the instruction
  set and its text form).
- :mod:`.verify`: the four proofs, both comm models, over :mod:`.engine`'s
  event loop.
- :mod:`.simulate`: the same loop with durations -> the predicted
  :class:`~.timeline.Timeline`; :mod:`.memory`: what each rank holds, and the
  ``device_memory`` refusal.
- :mod:`.plan`: plan.json (``pipec.plan/1``), read and written through
  :mod:`.schema`'s field-naming reader; :mod:`.torch_csv`: torch's
  compute+comms CSV form.
- :mod:`.views`: terminal timeline and summary, stage table, graphviz drawing,
  Perfetto trace.

Complaints about a key are raised as :class:`pipec.errors.PipecError` with
``key=`` (or returned as :class:`pipec.errors.Diagnostic`); the language's
boundary locates them. The compiler never imports :mod:`pipec.dsl` or
:mod:`pipec.runtime` (tested).
"""
