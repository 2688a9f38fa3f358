"""Faults under load: one 2-replica app on real Ray and real Redis, shared by the package (conftest.py)."""
