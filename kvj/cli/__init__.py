"""The ``kvj`` command line: a thin typer layer over the library (entry points in ``main``)."""
