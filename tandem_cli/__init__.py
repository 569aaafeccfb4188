"""The `tandem` command line: thin wrappers over router, pools and engine."""
