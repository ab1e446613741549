"""Workflow tools: profile, bench, amdahl, demo, train, verify."""
