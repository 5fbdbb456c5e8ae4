"""Reaching hosts: transport, one-round-trip host scripts, inventory, parallel runs, paths, output tables, the sandbox."""
