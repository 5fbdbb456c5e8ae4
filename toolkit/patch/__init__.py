"""Patchsets: reading them, compiling them offline, applying/verifying/reverting on a host, authoring and porting."""
