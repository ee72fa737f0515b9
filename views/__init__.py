"""Views: draw a plan or a Timeline (predicted, measured, or both overlaid).

- :mod:`.terminal`: the terminal timeline and summary (rich), and pictures (matplotlib, SVG/PNG);
- :mod:`.stage_table`: ``pipec show``'s cost and memory table per stage and rank;
- :mod:`.graph`: the stage graph drawn with graphviz (``pipec show --graph``);
- :mod:`.perfetto`: a Chrome/Perfetto trace (``--trace``).
"""
