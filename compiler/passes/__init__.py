"""Passes over a Program: lowering a compute order, the verifier's proofs, per-rank memory."""
