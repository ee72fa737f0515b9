"""The torch layer that the compiler, ``pipec tune`` and the runtime share: a model found, built, traced and
cut into runnable stages, one module per job.

- :mod:`.lazy_dynamo`: torch._dynamo imported only when something uses it;
- :mod:`.load`: find the model (:func:`~.load.locate_model`: the search path, a model file) and build it on
  meta or fake tensors;
- :mod:`.trace`: trace it (fx or torch.export); :mod:`.fingerprint`: what plan.json's ``model.fingerprint`` hashes;
- :mod:`.annotate`: shapes, FLOPs and saved bytes on every node;
- :mod:`.tensors`: what they share (FrontendError, TensorSpec, dtypes);
- :mod:`.weights`: each module's init path, ``init auto`` resolved on meta, the initial values;
- :mod:`.partition`: where cuts can go, the partition, the split;
- :mod:`.stages`: a stage's runnable module built from the split graph;
- :mod:`.data`: the data a run trains on described and checked, the loss checked against its targets;
- :mod:`.deferred`: weight gradients held back for ``BWD_W`` (the zero-bubble split).

Nothing here imports the compiler's passes, the simulator, :mod:`pipec.costs`, :mod:`pipec.tp` or the runtime;
the compiler's front end (:mod:`pipec.compiler.frontend`) runs these in order.
"""
