"""Developer scripts (``python -m scripts.<name>``); not part of the wheel."""
