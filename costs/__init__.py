"""The measured side: what a stage, a cut, a link and a host cost, and the cache that keeps it.

- :mod:`.costs`: stage costs and saved activations under ``costs unit|flops|profile``;
- :mod:`.profile`: how a stage is timed (a crowd of ranks at once, the stop rule, the host's load);
- :mod:`.timings`: the profile cache read, what it lacks timed (:mod:`.cache`: keys, kinds, the host);
- :mod:`.links`: the link probe (:mod:`pipec.runtime.linkprobe`, started as a torchrun job) read and kept;
- :mod:`.cutcost`: a cut's stages, edges, ties and costs read off the trace's nodes (``pipec tune``);
- :mod:`.pieces`: the pieces ``pipec tune`` times once and sums into any cut.
"""
