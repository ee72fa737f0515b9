"""Views: draw a plan or a Timeline (predicted, measured, or both overlaid).

- :mod:`.timeline`: the terminal timeline (rich);
- :mod:`.summary`: the summary table per rank (rich), and ``pipec show``'s print of both;
- :mod:`.picture`: the timeline as a picture (matplotlib, SVG/PNG);
- :mod:`.common`: what they share (kinds and colours, lanes, times and axes);
- :mod:`.stage_table`: ``pipec show``'s cost and memory table per stage and rank;
- :mod:`.graph`: the stage graph drawn with graphviz (``pipec show --graph``);
- :mod:`.perfetto`: a Chrome/Perfetto trace (``--trace``).
"""
