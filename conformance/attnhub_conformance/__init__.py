"""attnhub's conformance suite: one pytest plugin that proves any backend against the reference.

    pytest --pyargs attnhub_conformance --attnhub-backend NAME
    attnhub conformance --backend NAME          # the same, with a progress bar and the matrix

Cases are generated from each backend's declared ``Capabilities`` (``cases.py``), run and
compared with ``attnhub.reference`` (``harness.py``), and summarized as a features x backends
matrix (``report.py``).
"""

__version__ = "0.1.0"
