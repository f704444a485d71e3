"""Running untrusted generated code against tests: the runner and its isolation (run), the program
started inside each sandbox (child), turning what it reported into a verdict (verdict), memory
cgroups (memory), and the process-wide policy of which sandboxes tests may run in (policy)."""
