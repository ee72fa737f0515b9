"""The runtime: one process per rank under torchrun executes a verified plan.

- :mod:`.launch`: the rank's entry point (``torchrun -m pipec.runtime plan.json``); verifies the plan and the
  model's fingerprint before the network, parses the run's options (:class:`~.launch.RunOptions`) once;
- :mod:`.transport`: P2P and collectives over torch.distributed (NCCL, gloo), or an in-process fake;
- :mod:`.executor`: the rank's program through a dispatch table (the zero-bubble weight-grad split is
  :mod:`pipec.model.deferred`, which ``costs profile`` times; :mod:`.clock`: instruction timing,
  host clock or CUDA events);
- :mod:`.trainer`: the training loop around it; :mod:`.training`: optimizer, lr schedule, loss, autocast, data;
  :mod:`.data`: synthetic batches from the plan's data description, memory-mapped token files;
- :mod:`.accounting`: events -> the measured Timeline and report.json; :mod:`.goodput`: where wall time went;
- :mod:`.checkpoint`: DCP checkpoints by canonical names, resume, reshard; :mod:`.checkpoint_export`: one state
  dict of the unpartitioned model;
- :mod:`.failures`: every rank's error reaches the user, once per distinct message.
"""
