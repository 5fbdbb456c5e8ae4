"""Invoke collection: `invoke --list` shows the commands; each lives in toolkit_cli/.

Thin by design: tasks parse arguments, call the `toolkit` engine and print.
"""
from invoke import Collection

from toolkit_cli.bench import bench
from toolkit_cli.demo import demo
from toolkit_cli.patch import patch
from toolkit_cli.provision import facts, provision, wheelhouse
from toolkit_cli.rollout import rollout
from toolkit_cli.sandbox import sandbox
from toolkit_cli.server import server_task
from toolkit_cli.smoke import smoke

ns = Collection(bench, demo, facts, patch, provision, rollout, sandbox, server_task, smoke, wheelhouse)
