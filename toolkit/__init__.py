"""toolkit: bring GPU hosts running SGLang to a known state and keep them there.

The engine. It never imports Invoke's task machinery; `tasks.py` and `toolkit_cli/`
are the thin command layer on top (like pyinfra's api/ vs pyinfra_cli/).
"""
__version__ = "0.1.0"
