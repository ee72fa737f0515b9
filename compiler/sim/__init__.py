"""Simulation: the cost model, the event loop both comm models share, processor sharing, predicted Timelines."""
