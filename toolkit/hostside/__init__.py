"""Standard-library-only scripts that run on a host (see toolkit.hostrun)."""
