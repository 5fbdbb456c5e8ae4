"""The Invoke command layer (like pyinfra_cli beside pyinfra/api): parse, call the engine, print.

Nothing here does host work; every task body is a few lines that call `toolkit`.
"""
