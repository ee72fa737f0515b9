"""``pipec tune``: search the layouts, schedules and microbatch counts for the fastest plan that fits.

- :mod:`.space`: the candidates (layouts, schedules, microbatch counts, the kept keys) and their requests;
- :mod:`.search`: the search (compile, bound, prune, rank);
- :mod:`.bounds`: lower bounds on step time and memory that prune candidates unseen;
- :mod:`.report`: the ranked table, the frontier and ``why`` lines;
- :mod:`.measure`: ``--measure K``, the top candidates run here and re-ranked.

It sits above the compiler and may use the runtime.
"""
