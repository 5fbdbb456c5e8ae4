"""Bringing a host to a stack: the stack files, the install steps, wheelhouses, host facts."""
