"""See the package docstring: the list outlines imports, empty."""

AIRPORT_LIST: list[tuple[str, ...]] = []
