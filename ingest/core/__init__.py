"""Pure logic: no client imports, no I/O, time passed in."""
