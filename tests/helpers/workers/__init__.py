"""The scripts a test launches on its ranks (``launchers.forkrun`` or torchrun), one per kind of multi-process
check; each writes what its ranks saw to an output folder for the test to read."""
