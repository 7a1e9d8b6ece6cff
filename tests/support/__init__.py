"""Fixtures the tests share: clusters with their conservation checks, model checkpoints."""
