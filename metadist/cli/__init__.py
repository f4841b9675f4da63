"""The ``metadist`` command line. It calls only the public API and the stage packages' entry points."""
