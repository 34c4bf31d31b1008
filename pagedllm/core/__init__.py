"""Scheduling and KV-block bookkeeping: pure Python, no torch."""
